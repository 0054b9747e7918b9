"""Reusable host buffers for disk reads, bounded by what was ever out at once.

The store reads disk units into buffers taken from one :class:`BufferPool` (CPU: the buffer is
the unit's device copy; CUDA: a pinned staging buffer), and gives each back when the unit is
dropped or its host->device copy is done, so that steady-state decoding allocates nothing.
"""

from __future__ import annotations

import math
import threading

import torch


class BufferPool:
    """Reusable read buffers keyed by (shape, dtype): steady-state disk reads allocate nothing.

    CPU device: the buffer a unit was read into *is* its device copy and comes back when the
    unit is dropped. CUDA: buffers are pinned staging areas; one comes back with the event of
    the host->device copy that read it, and is handed out again only after that event (the
    wait happens on the disk worker thread, never on the compute stream).

    Idle buffers are bounded: the pool keeps at most as many idle bytes as were ever out at once
    (:attr:`peak_out`), the oldest shapes given back first to go. Why: landing slabs are ``[n, ...]``
    buffers whose ``n`` changes with every batch of reads, so a pool keeping every shape it saw
    grew without bound (a 4-layer model with 9.4 MB experts reached 12 GB of idle buffers)."""

    def __init__(self, pin: bool):
        self.pin = pin
        self._free: dict[tuple, list] = {}
        self._lock = threading.Lock()
        self.allocated = 0
        self.out = 0                 # bytes handed out and not given back
        self.peak_out = 0
        self.idle_bytes = 0

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        key = (tuple(shape), dtype)
        with self._lock:
            free = self._free.get(key)
            item = free.pop() if free else None
            if free is not None and not free:
                del self._free[key]
            n = math.prod(key[0]) * dtype.itemsize
            if item is not None:
                self.idle_bytes -= n
            else:
                self.allocated += 1
            self.out += n
            self.peak_out = max(self.peak_out, self.out)
        if item is None:
            return torch.empty(key[0], dtype=dtype, pin_memory=self.pin)
        buf, event = item
        if event is not None:
            event.synchronize()
        return buf

    @property
    def idle(self) -> int:
        """Buffers in the pool now (equal to :attr:`allocated` when no unit holds one)."""
        with self._lock:
            return sum(len(free) for free in self._free.values())

    def give(self, buf: torch.Tensor, event=None) -> None:
        key, n = (tuple(buf.shape), buf.dtype), buf.numel() * buf.element_size()
        with self._lock:
            self.out = max(0, self.out - n)
            self._free.setdefault(key, []).append((buf, event))
            self.idle_bytes += n
            victims = []
            for k in list(self._free):                  # oldest shapes first; this one last
                if self.idle_bytes <= self.peak_out:
                    break
                free = self._free[k]
                while free and self.idle_bytes > self.peak_out and not (k == key and len(free) == 1):
                    b, ev = free.pop(0)
                    victims.append((b, ev))
                    self.idle_bytes -= b.numel() * b.element_size()
                    self.allocated -= 1
                if not free:
                    del self._free[k]
        for _, ev in victims:       # CUDA: each buffer is freed only after the copy that read it (its event)
            if ev is not None:
                ev.synchronize()
        victims.clear()             # (held until here: buffers freed while their copies could still read them)
