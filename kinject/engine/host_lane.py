"""The host-compute lane: activations between the compute device and work done on the host.

Compute placed on the host (attention over a host-tier KV cache: MoE-Lightning's CGOPipe) needs
its inputs on the host and its output back on the device; the data it works on (the KV) stays
where it is. The lane moves only those activations -- a decode step's query, new key / value
entries and mask in, the attention output back: kilobytes per layer where the KV is megabytes.

CUDA: one dedicated stream. :meth:`HostLane.to_host` makes the lane stream wait (by event) for
the work queued so far on the caller's stream (what produced the tensors), queues ``non_blocking``
copies into pinned host memory there, records an event and returns a :class:`Pending` the host
waits on -- on that event alone, never a device-wide synchronize. :meth:`HostLane.to_device`
stages a host result in pinned memory, copies it on the lane stream (after the caller's stream's
queued work, which may still read the memory the caching allocator hands the result) and makes
the caller's stream wait on the copy's event; the host does not wait at all. Source tensors are ``record_stream``-ed on
the lane stream so the caching allocator cannot reuse them before the copies have read them.

CPU: device and host are one memory; both directions hand the tensors through (copying into the
given ``out`` slots). The bytes that would cross a link are counted either way (:attr:`stats`).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

WORKERS = 8
"""Host-lane worker threads: micro-batches whose host compute may be in flight at once."""


class Pending:
    """Copies queued on the lane: :meth:`wait` blocks the host until they have landed (one event)."""

    __slots__ = ("tensors", "_event")

    def __init__(self, tensors: list, event=None):
        self.tensors = tensors
        self._event = event

    def wait(self) -> list:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self.tensors


class HostLane:
    """Moves activations between ``device`` and host compute (see the module docstring)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None
        self._lock = threading.Lock()
        self.stats = {"to_host": 0, "to_host_bytes": 0, "to_device": 0, "to_device_bytes": 0}
        self._pool: ThreadPoolExecutor | None = None

    def workers(self) -> ThreadPoolExecutor:
        """The lane's worker threads (made on first use): host compute of one micro-batch each while
        the caller goes on to the next."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="kinject-host-lane")
            return self._pool

    def close(self) -> None:
        """Stop the worker threads (idempotent; the lane stays usable, a later use makes new ones)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def __repr__(self) -> str:
        return f"HostLane(device={self.device})"

    def _count(self, direction: str, tensors) -> None:
        n = 0
        for t in tensors:                  # (a loop: once per module computed on the host per step)
            if isinstance(t, torch.Tensor):
                n += t.numel() * t.element_size()
        with self._lock:
            self.stats[direction] += 1
            self.stats[direction + "_bytes"] += n

    def to_host(self, tensors: list, out: list | None = None) -> Pending:
        """Copies of ``tensors`` (None and non-tensors pass through) on the host, into ``out[i]``
        where given (a pinned slice of host storage of the same shape): queued after the work the
        caller's stream has queued so far; :meth:`Pending.wait` before reading them on the host."""
        out = list(out) if out is not None else [None] * len(tensors)
        self._count("to_host", tensors)
        if not self.cuda:
            for i, t in enumerate(tensors):
                if isinstance(t, torch.Tensor) and out[i] is not None:
                    out[i].copy_(t)
                elif out[i] is None:
                    out[i] = t
            return Pending(out)
        produced = torch.cuda.Event()
        produced.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(produced)
            for i, t in enumerate(tensors):
                if not (isinstance(t, torch.Tensor) and t.device.type == "cuda"):
                    if out[i] is None:
                        out[i] = t
                    continue
                dst = out[i] if out[i] is not None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                dst.copy_(t, non_blocking=True)
                t.record_stream(self.stream)
                out[i] = dst
            landed = torch.cuda.Event()
            landed.record(self.stream)
        return Pending(out, landed)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a host result) on the device, ordered before whatever the caller's stream queues
        next; the host does not wait."""
        self._count("to_device", [t])
        if not self.cuda:
            return t
        stage = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)   # the caching host allocator keeps
        stage.copy_(t)                                                  # it until the copy has read it
        current = torch.cuda.current_stream(self.device)
        dev = torch.empty(t.shape, dtype=t.dtype, device=self.device)   # the caller's stream's memory:
        free = torch.cuda.Event()                  # reused once the work queued there so far is done,
        free.record(current)                       # so the lane writes it only after that work
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(free)
            dev.copy_(stage, non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(self.stream)
        current.wait_event(landed)
        return dev
