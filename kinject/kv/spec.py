"""Where one layer's KV lives (``KVSpec``: tier + policy), the operators' ``kv_cache`` kwarg parser,
and the device-KV accounting shared by every layer of a cache."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Literal

from kinject.kv.streaming import StreamingKV

STORES_IN_FLIGHT = 2
"""KV stores (one micro-batch of one layer each, device -> tier) a cache lets be in flight before a
commit waits, on the host, for the oldest (:meth:`kinject.kv.arena.KVArena.wait_for_store_room`). That wait
syncs the host with the device: a store lands only after the compute that produced its entries, so at 1 the compute
thread could never queue work more than one micro-batch ahead of the device, and any hiccup (a slow
store, a slow launch) would idle the device. Each store in flight holds its micro-batch's outgoing
entries on the device until it lands, so the bound is also one of device memory (the planner's
memory model counts them: :func:`kinject.plan.planner.memory_usage`)."""

Tier = Literal["device", "host", "disk"]
TIERS = ("device", "host", "disk")
Compute = Literal["device", "host"]
COMPUTES = ("device", "host")

@dataclass(frozen=True)
class KVSpec:
    """Where one layer's KV lives, which policy it follows, and where its attention reads it:
    ``compute="host"`` (MoE-Lightning's CGOPipe) -- once the layer holds entries, the attention
    runs on the host against the stored KV in place, which then never crosses the link."""

    tier: Tier = "device"
    streaming: StreamingKV | None = None
    compute: Compute = "device"

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"KV tier must be one of {', '.join(TIERS)}, got {self.tier!r}")
        if self.compute not in COMPUTES:
            raise ValueError(f"attention compute must be one of {', '.join(COMPUTES)}, got {self.compute!r}")
        if self.compute == "host" and self.tier != "host":
            raise ValueError(f"compute: host runs the attention where the KV lives, so it needs kv_cache "
                             f"tier host (rule files: vars.kv=host), got {self.tier!r}")


def parse_kv_cache(value: Any) -> KVSpec:
    """An operator's ``kv_cache`` kwarg -> :class:`KVSpec`: ``"host"``, or a mapping
    ``{tier: host, policy: full|streaming, sink: 4, window: 1024}``."""
    if isinstance(value, str):
        return KVSpec(tier=value)
    if not isinstance(value, dict):
        raise ValueError(f"kv_cache must be a tier name or a mapping, got {value!r}")
    known = {"tier", "policy", "sink", "window"}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"kv_cache: unknown key {unknown[0]!r}; keys are {', '.join(sorted(known))}")
    policy = value.get("policy", "full")
    if policy not in ("full", "streaming"):
        raise ValueError(f"kv_cache.policy must be 'full' or 'streaming', got {policy!r}")
    if policy == "full" and ({"sink", "window"} & set(value)):
        raise ValueError("kv_cache: 'sink' and 'window' need policy: streaming")
    streaming = None
    if policy == "streaming":
        streaming = StreamingKV(**{k: value[k] for k in ("sink", "window") if k in value})
    return KVSpec(tier=value.get("tier", "host"), streaming=streaming)


# ---------------------------------------------------------------------------------------- accounting


class KVStats:
    """Device bytes of KV held by kinject for offloaded tiers (working buffers + outgoing entries),
    and transfer counters. Thread-safe: stores land on engine threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self.resident = 0
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.peak = self.resident
            self.counts = {"loads": 0, "load_bytes": 0, "stores": 0, "store_bytes": 0, "micro_batches": 0,
                           "prefetch_hits": 0, "prefetch_stale": 0, "store_waits": 0, "load_stalls": 0}

    def hold(self, nbytes: int) -> None:
        with self._lock:
            self.resident += nbytes
            self.peak = max(self.peak, self.resident)

    def free(self, nbytes: int) -> None:
        with self._lock:
            self.resident -= nbytes

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def summary(self) -> dict:
        with self._lock:
            return {"resident": self.resident, "peak": self.peak, **self.counts}
