"""What ``pipeline.host_budget: auto`` and ``pipeline.device_budget: auto`` choose, and the watch
that keeps the host cache from ever making the machine swap (docs/architecture.md, Memory).

Why automatic: a user who starts from a shipped rule file sets no budget. Without a host budget
the disk tier had no host cache, and every routed expert was read (and, on a CPU, copied) again
at every decode step although the machine had the RAM to keep the whole checkpoint. ``auto``
gives the disk tier's host cache what the machine can spare -- ``MemAvailable`` less a safety
margin, less what the host tier will hold -- read once, when the runtime is built (the process
starts); :class:`MemoryWatch` re-reads ``MemAvailable`` while the model runs and the cache gives
entries back when other processes need the memory.

On CUDA, ``device_budget: auto`` is the free device memory less what the KV cache and the
activations need beside the weights (:func:`auto_device_budget`); on a CPU the device and the
host are the same memory, so no separate device budget is kept (the host budget governs).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from kinject.formatting import format_bytes

MEMINFO = "/proc/meminfo"

#: The margin the host cache leaves free: a tenth of the machine's memory, at least 512 MiB, at most
#: 4 GiB (page cache the kernel needs for the checkpoint reads, other processes' growth, the
#: allocator's slack).
MARGIN_SHARE, MARGIN_MIN, MARGIN_MAX = 0.10, 512 << 20, 4 << 30

#: ``device_budget: auto`` on CUDA: the share of the free device memory left to activations and the
#: allocator's fragmentation (at least :data:`DEVICE_RESERVE_MIN`), beside ``pipeline.kv_budget``.
DEVICE_RESERVE_SHARE, DEVICE_RESERVE_MIN = 0.10, 1 << 30


def read_meminfo(path: str = MEMINFO) -> dict[str, int] | None:
    """``/proc/meminfo`` as ``{field: bytes}`` (None where there is no such file: not Linux)."""
    try:
        with open(path, "rb") as fh:
            text = fh.read().decode("ascii", "replace")
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return out


def mem_available(path: str = MEMINFO) -> int | None:
    """Bytes the kernel says can be allocated without swapping (``MemAvailable``), or None."""
    info = read_meminfo(path)
    return None if info is None else info.get("MemAvailable")


def mem_total(path: str = MEMINFO) -> int | None:
    info = read_meminfo(path)
    return None if info is None else info.get("MemTotal")


def safety_margin(total: int | None) -> int:
    """Bytes the host cache leaves free of ``total`` (:data:`MARGIN_SHARE`, clamped)."""
    if not total:
        return MARGIN_MAX
    return int(min(MARGIN_MAX, max(MARGIN_MIN, total * MARGIN_SHARE)))


@dataclass(frozen=True)
class Choice:
    """What an ``auto`` setting chose (bytes, None: unbounded) and why, in words for ``report()``."""

    key: str
    value: int | None
    why: str

    def line(self) -> str:
        return f"pipeline.{self.key}: auto -> {_fmt(self.value)} ({self.why})"


class MemoryWatch:
    """``MemAvailable`` re-read at most every ``interval`` seconds (one ``/proc/meminfo`` read is
    ~20 us; a decode step asks once per batch of disk reads): :meth:`spare` is what can still be
    taken without going under the margin (negative: that much should be given back).

    ``reader`` is injectable (tests fake memory pressure); ``clock`` too."""

    def __init__(self, margin: int, reader: Callable[[], int | None] = mem_available, *, interval: float = 0.2,
                 clock: Callable[[], float] = time.monotonic):
        self.margin = margin
        self.reader = reader
        self.interval = interval
        self.clock = clock
        self._at = -float("inf")
        self._available: int | None = None
        self.lowest: int | None = None        # the lowest MemAvailable seen (for the report)

    def available(self) -> int | None:
        now = self.clock()
        if now - self._at >= self.interval:
            self._at = now
            self._available = self.reader()
            if self._available is not None:
                self.lowest = self._available if self.lowest is None else min(self.lowest, self._available)
        return self._available

    def spare(self) -> int | None:
        """Bytes above the margin (negative: under it), None where memory cannot be read."""
        available = self.available()
        return None if available is None else available - self.margin


def auto_host_budget(host_tier_bytes: int = 0, *, reader: Callable[[], int | None] = mem_available,
                     total: int | None = None) -> tuple[Choice, MemoryWatch | None]:
    """``host_budget: auto``: ``MemAvailable`` now, less :func:`safety_margin`, plus the host tier's
    bytes ``host_tier_bytes`` if they are already counted in use (the store subtracts the host tier
    from the budget: what is left caches the disk tier). Returns the choice and the watch that
    shrinks the cache later; no ``/proc/meminfo``: no cache (None), and the report says so."""
    available = reader()
    if available is None:
        return Choice("host_budget", None, "MemAvailable unknown on this system: no host cache of the disk tier"), None
    total = total if total is not None else mem_total()
    margin = safety_margin(total)
    budget = max(0, available - margin) + host_tier_bytes
    why = (f"MemAvailable {_fmt(available)} less a safety margin of {_fmt(margin)}"
           f"{' (a tenth of ' + _fmt(total) + ', clamped to 512 MiB..4 GiB)' if total else ''}; what the host tier "
           "holds comes out of it, the rest caches the disk tier, which gives memory back when MemAvailable drops "
           "under the margin")
    return Choice("host_budget", budget, why), MemoryWatch(margin, reader)


def auto_device_budget(device, kv_budget: int | None = None, *,
                       free_memory: Callable[[], tuple[int, int]] | None = None) -> Choice:
    """``device_budget: auto``. CPU: None (the device is host memory; ``host_budget`` governs it).
    CUDA: the free device memory now, less ``pipeline.kv_budget`` (the KV working buffers the
    attention sizes) and an activation reserve (:data:`DEVICE_RESERVE_SHARE` of the free memory, at
    least :data:`DEVICE_RESERVE_MIN`)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return Choice("device_budget", None, f"a {device.type} device is host memory: no separate device budget "
                                             "(host_budget governs it; units in host memory are used in place)")
    if free_memory is None:
        def free_memory():
            return torch.cuda.mem_get_info(device)
    free, total = free_memory()
    kv = kv_budget or 0
    activations = max(DEVICE_RESERVE_MIN, int(free * DEVICE_RESERVE_SHARE))
    budget = max(0, free - kv - activations)
    return Choice("device_budget", budget,
                  f"free device memory {_fmt(free)} of {_fmt(total)} less pipeline.kv_budget {_fmt(kv)} less an "
                  f"activation reserve {_fmt(activations)} (a tenth of the free memory, at least 1 GiB)")


def _fmt(n: int | None) -> str:
    """Bytes as kinject prints them; None: an auto choice that sets no bound."""
    return "unbounded" if n is None else format_bytes(n)
