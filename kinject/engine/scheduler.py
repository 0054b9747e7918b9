"""The shared pipeline scheduler: one per model, serving every operator.

It learns the operators' execution order on the first forward, and whenever an operator
starts computing it prefetches the weights of the next ``lookahead`` operators that have
offloaded weights (``op.offloads()``; resident ones are skipped, so with only the experts
offloaded, lookahead 1 from layer L's experts reaches layer L+1's experts, not the resident
attention in between), cyclic, so the last layer of a decode step prefetches the first of
the next. Operators talk to it through three calls, a lifecycle with exact inverses
(DESIGN §10.6):

    scheduler.enter(op)           # I am about to compute: prefetch what comes after me
    tensors = scheduler.acquire(unit)   # my weights on the device (waits on their event)
    scheduler.release(unit)       # done with them (freed per the store's policy)

Once every operator ahead of a position says it is *settled* (``op.prefetch_settled()``: all
the units it could ask for are on the device or on their way), that position asks no more
until the store forgets a device copy (``store.drops`` moves): with every weight there
(resident, or used in place on a CPU) the scheduler's per-call work is one comparison.

Nothing here knows a model family: an operator says which units it wants prefetched
ahead of it through ``op.prefetch_units()`` (default: all its static units).
"""

from __future__ import annotations

import logging
from typing import Protocol

from kinject.engine.store import TensorStore, Unit
from kinject.trace import Tracer

logger = logging.getLogger(__name__)


class Scheduled(Protocol):
    """What the scheduler asks of an operator (``operators.base.Operator`` is one): the units to
    prefetch ahead of it, whether they are all settled, whether it offloads anything."""

    key: str

    def prefetch_units(self) -> list: ...

    def prefetch_settled(self) -> bool: ...

    def offloads(self) -> bool: ...


class Scheduler:
    def __init__(self, store: TensorStore, tracer: Tracer, *, lookahead: int = 1):
        self.store = store
        self.tracer = tracer
        self.lookahead = lookahead
        self.order: list["Scheduled"] = []      # learned execution order
        self.learning = True                   # until the first full step has been seen
        self.step = 0
        self._position: dict[int, int] = {}    # id(op) -> index in order
        self._ahead: dict[int, list] = {}      # index in order -> the operators it prefetches for
        self._settled: dict[int, int] = {}     # index in order -> store.drops when all ahead were settled
        self._in_step = False
        self._step_start = 0.0

    # ---------------------------------------------------------------- steps

    def begin_step(self) -> None:
        self._in_step = True
        self._step_start = self.tracer.now()

    def end_step(self) -> None:
        """A forward finished: the order seen so far is the order from now on."""
        if self._in_step and self.learning and self.order:
            self.learning = False
            logger.info("scheduler: learned order of %d operators", len(self.order))
        self._in_step = False
        self.step += 1
        self.tracer.mark_step(self._step_start, self.tracer.now())

    def relearn(self) -> None:
        """Forget the order (e.g. after operators were added or removed)."""
        self.order, self._position, self._ahead, self._settled, self.learning = [], {}, {}, {}, True

    # ---------------------------------------------------------------- operator protocol

    def enter(self, op: "Scheduled") -> None:
        """``op`` is about to compute: record the order (first step), prefetch ahead of it."""
        if self.learning:
            if id(op) not in self._position:
                self._position[id(op)] = len(self.order)
                self.order.append(op)
            return
        i = self._position.get(id(op))
        if i is None or not self.lookahead:
            return
        store = self.store
        if self._settled.get(i) == store.drops:
            return                             # all ahead settled, and the store forgot no device copy since
        ahead = self._next_offloading(i)
        if ahead:                              # in order; stops at the first that does not fit the budget
            store.prefetch_many([u for nxt in ahead for u in nxt.prefetch_units()])
            drops = store.drops                # read before the checks: a transfer thread may drop a copy during them
            if all(nxt.prefetch_settled() for nxt in ahead):
                self._settled[i] = drops

    def _next_offloading(self, i: int) -> list["Scheduled"]:
        """The ``lookahead`` operators with offloaded weights after position ``i`` (cyclic)."""
        ahead = self._ahead.get(i)
        if ahead is None:
            n, ahead = len(self.order), []
            for d in range(1, n):
                nxt = self.order[(i + d) % n]
                if nxt.offloads():
                    ahead.append(nxt)
                    if len(ahead) == self.lookahead:
                        break
            self._ahead[i] = ahead
        return ahead

    def acquire(self, unit: Unit, channel: str = "ondemand"):
        """The unit's device tensors; on-demand transfer if it was not prefetched."""
        h = unit.handle                        # a stall only when its transfer is still on its way
        if unit.device is not None or h is None or not unit.offloaded or h.done():
            return self.store.acquire(unit, channel)
        with self.tracer.span("stall", f"wait {unit.name}", kind="wait", layer=unit.layer):
            return self.store.acquire(unit, channel)

    def release(self, unit: Unit) -> None:
        self.store.release(unit)

    def acquire_many(self, units: list[Unit], channel: str = "ondemand") -> list:
        """Device tensors of several units in one store call (the ready ones under one lock);
        a unit that still has to arrive is waited for as in :meth:`acquire` (a ``stall`` span)."""
        late = [u for u in units if u.device is None and u.offloaded          # not TensorStore.ready (inlined:
                and (u.handle is None or not u.handle.done())]                # asked per expert per layer-step)
        if not late:
            return self.store.acquire_many(units, channel)
        out = []
        try:
            for u in units:
                out.append(self.acquire(u, channel))
        except BaseException:
            self.store.release_many(units[:len(out)])     # all or nothing
            raise
        return out

    def release_many(self, units: list[Unit]) -> None:
        self.store.release_many(units)

    def position(self, op: "Scheduled") -> int | None:
        return self._position.get(id(op))
