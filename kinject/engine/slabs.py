"""Landing slabs: the units of one stack that land together share one allocation per role.

An operator that computes several units in one grouped call (the experts of a MoE layer: one
grouped GEMM over an ``[n, ...]`` stack) registers them with a *stack* ``(key, index)``
(:meth:`~kinject.engine.store.TensorStore.add`). When the store moves a batch of such units (host
copies, disk reads) or dequantizes a group of them, it gives the batch one :class:`Slab`: per role
one ``[n, *shape]`` tensor, unit ``i`` (the ``i``-th smallest index of the batch) writing and
owning slot ``i``. Every unit's tensors are then equally spaced views of one storage, which the
grouped compute recognises by their addresses (``operators.expert_compute``).

Budget: a slab holds exactly the bytes of its units (those the batch reserved), and each unit is
counted and given back in the device budget as before. The allocation itself goes when the last of
its units is dropped: a unit released before the others of its batch (its group computed first)
leaves its slot allocated until then -- at most one batch's bytes beyond the budget's count, for
the time the rest of its layer computes (the ``free`` policy drops them all by the layer's end).
On a CPU, slabs of disk reads come from (and go back to) the store's read buffer pool.

CUDA: the slab is allocated on the stream of its first writer (a transfer worker) and an event
is recorded there; every later writer, on whatever stream, waits for that event and records its
stream on the slab's tensors, so the caching allocator neither hands the slab out before earlier
work on its memory ended nor reuses it while a copy into it is pending.
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable, Protocol

import torch

#: role -> (shape, dtype) of one unit's tensors in a slab
Specs = dict[str, tuple[tuple[int, ...], torch.dtype]]


class Stacked(Protocol):
    """What a slab asks of a unit (:class:`~kinject.engine.unit.Unit` is one): the stack it belongs to,
    ``(key, index)`` or None, and the slab it landed in, if any. Slabs take units by identity otherwise."""

    stack: tuple[str, int] | None
    slab: "Slab | None"


class Slab:
    """One ``[n, *shape]`` tensor per role holding ``units``' tensors, unit ``units[i]`` in slot ``i``.

    ``alloc(shape, dtype)`` makes each role's tensor on first use (:meth:`views`); ``release``
    (optional) takes them back once every unit has left (:meth:`leave`: a pool reuses them)."""

    def __init__(self, units: list["Stacked"], specs: Specs, device: torch.device,
                 alloc: Callable[[tuple, torch.dtype], torch.Tensor],
                 release: Callable[[torch.Tensor], None] | None = None):
        self.units = units
        self.specs = specs
        self.device = device
        self._slot = {id(u): i for i, u in enumerate(units)}
        self._alloc, self._release = alloc, release
        self._tensors: dict[str, torch.Tensor] | None = None
        self._event = None                       # CUDA: recorded on the allocating stream
        self._live = len(units)
        self._lock = threading.Lock()

    def views(self, unit: "Stacked") -> dict[str, torch.Tensor]:
        """Role -> ``unit``'s slot (allocating the slab on first use); on CUDA ordered after the
        allocation on the current stream, which is recorded on the slab's tensors."""
        with self._lock:
            if self._tensors is None:
                n = len(self.units)
                self._tensors = {role: self._alloc((n, *shape), dtype) for role, (shape, dtype) in self.specs.items()}
                if self.device.type == "cuda":
                    self._event = torch.cuda.Event()
                    self._event.record()
            tensors = self._tensors
        if self._event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(self._event)
            for t in tensors.values():
                t.record_stream(stream)
        i = self._slot[id(unit)]
        return {role: t[i] for role, t in tensors.items()}

    def leave(self) -> None:
        """A unit of the slab was dropped; the last one gives the allocation back (``release``)."""
        with self._lock:
            self._live -= 1
            done = self._live == 0
            tensors, self._tensors = (self._tensors, None) if done else (None, self._tensors)
        if tensors and self._release is not None:
            for t in tensors.values():
                self._release(t)


def specs_of(tensors: dict, dtype: torch.dtype | None) -> Specs:
    """Role -> (shape, dtype) of a unit's tensors as they will be on the device (``dtype``: the
    unit's compute dtype, None: each tensor's own)."""
    return {k: (tuple(int(s) for s in t.shape), dtype or t.dtype) for k, t in tensors.items()}


def stacks(units: Iterable["Stacked"], specs: Callable[["Stacked"], Specs | None]) -> list[tuple[list["Stacked"], Specs]]:
    """The units that can share a slab, as (units ordered by their stack index, their specs): those of
    one stack with equal specs, at least two of them. ``specs(unit)`` None: the unit takes no slot."""
    found: dict[tuple, list] = {}
    for u in units:
        if u.stack is None or u.slab is not None:
            continue
        s = specs(u)
        if s is None:
            continue
        found.setdefault((u.stack[0], tuple(sorted(s.items(), key=lambda kv: kv[0]))), []).append(u)
    return [(sorted(group, key=lambda u: u.stack[1]), dict(key[1])) for key, group in found.items() if len(group) > 1]
