"""The shared pipeline scheduler: one per model, serving every operator.

It learns the operators' execution order on the first forward, and whenever an operator
starts computing it prefetches the weights of the next ``lookahead`` operators that have
offloaded weights (``op.offloads()``; resident ones are skipped, so with only the experts
offloaded, lookahead 1 from layer L's experts reaches layer L+1's experts, not the resident
attention in between), cyclic, so the last layer of a decode step prefetches the first of
the next, except in the last forward of a ``generate`` (:attr:`Scheduler.forwards_left`, set by the
runtime from ``max_new_tokens``): there the first layers of a step that never comes would be read and
moved for nothing, while the disk or link could still serve this step's last layers. Operators talk to it through three
calls, a lifecycle with exact inverses
(docs/architecture.md, "The scheduler"):

    scheduler.enter(op)           # I am about to compute: prefetch what comes after me
    tensors = scheduler.acquire(unit)   # my weights on the device (waits on their event)
    scheduler.release(unit)       # done with them (freed per the store's policy)

An operator that computes in sub-steps, each behind a transfer of its own (attention: one KV load
per micro-batch), enters *paced* (``enter(op, paced=True)``, then ``pace_parts(n)``): what it
prefetches ahead is booked a share at each :meth:`pace` (one per sub-step, after that sub-step's
own load) instead of all at once. Why: a link serves transfers in the order they were issued, so
a layer's expert weights booked in one block ahead of the micro-batches' KV loads make the second
micro-batch wait for all of them while compute idles; booked a share per micro-batch, each KV
load waits for one share at most and the weights still land before the micro-batches end.

Once every operator ahead of a position says it is *settled* (``op.prefetch_settled()``: all
the units it could ask for are on the device or on their way), that position asks no more
until the store forgets a device copy or a host cache entry (``store.drops`` moves). What is settled is kept per input
shape (an operator may be settled at one token count and not at another: host experts that are
never worth moving at a decode step's rows may be at a prefill's), for the last few shapes seen, so
the first decode step after a prefill finds the decode shape settled from the previous request: with
every weight there (resident, used in place on a CPU, or computed where it lives) the per-call work
is one comparison.

Nothing here knows a model family: an operator says which units it wants prefetched
ahead of it through ``op.prefetch_units()`` (default: all its static units).
"""

from __future__ import annotations

import logging
from typing import Protocol

from kinject.engine.store import TensorStore
from kinject.engine.unit import Unit
from kinject.trace import Tracer

logger = logging.getLogger(__name__)

SETTLED_SHAPES = 8                       # input shapes whose settled positions are remembered (prefill, decode, ...)


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
        self._position: dict = {}              # op -> index in order (ops hash by identity)
        self._ahead: dict[int, list] = {}      # index in order -> the operators it prefetches for
        self._settled: dict = {}               # op -> store.drops when all ahead of its position were settled
        self._settled_by_shape: dict[tuple | None, dict] = {None: self._settled}   # (this shape's)
        self._in_step = False
        self._step_start = 0.0
        self._shape = None                     # input shape of the running forward (a new one unsettles all)
        self.pacing: _Paced | None = None       # the prefetch a paced operator books share by share (None: none;
                                               # read by operators to skip pace calls when nothing is paced)
        # forwards left in the running generate (None: not known); at 1 the lookahead stops at the end of
        # the order instead of wrapping around to the next step's first layers
        self.forwards_left: int | None = None
        self._ahead_last: dict[int, list] = {}  # index in order -> what it prefetches for in a last forward
        # inside a ``generate`` (set by the runtime): every forward after the first decodes one token per row
        self.generating = False

    # ---------------------------------------------------------------- steps

    def begin_step(self, shape: tuple | None = None) -> None:
        """A forward begins; ``shape``: its input's (a forward of another shape forgets which
        positions were settled)."""
        if shape != self._shape:
            self._shape = shape
            by_shape = self._settled_by_shape
            settled = by_shape.pop(shape, None)
            if settled is None:
                settled = {}
                if len(by_shape) >= SETTLED_SHAPES:            # the least recently used shape goes
                    del by_shape[next(iter(by_shape))]
            by_shape[shape] = self._settled = settled
        self._in_step = True
        self._step_start = self.tracer.now()

    def forward_tokens(self) -> int | None:
        """Tokens of the running forward (rows x positions of its input; None: not known)."""
        shape = self._shape
        if not shape:
            return None
        return shape[0] * shape[1] if len(shape) >= 2 else shape[0]

    def next_forward_tokens(self) -> int | None:
        """Tokens of the forward after this one, as far as it can be told: inside a ``generate``, one per
        row of this one (a prefill's next forward decodes one token per sequence); else this one's
        (a loop of forwards of one shape). What a prefetch made now for the next step sizes itself by."""
        shape = self._shape
        if self.generating and shape:
            return shape[0]
        return self.forward_tokens()

    def end_step(self) -> None:
        """A forward finished: the order seen so far is the order from now on."""
        if self._in_step and self.learning and self.order:
            self.learning = False
            logger.info("scheduler: learned order of %d operators", len(self.order))
        self._in_step = False
        self.step += 1
        if self.forwards_left is not None:
            self.forwards_left -= 1
        self.tracer.mark_step(self._step_start, self.tracer.now())

    def follow(self, order: list["Scheduled"]) -> None:
        """Take ``order`` as the learned execution order (what the first forward would have taught)."""
        self.relearn()
        self.order = list(order)
        self._position = {op: i for i, op in enumerate(self.order)}
        self.learning = False

    def relearn(self) -> None:
        """Forget the order (e.g. after operators were added or removed)."""
        self.order, self._position, self._ahead, self._settled, self.learning = [], {}, {}, {}, True
        self._settled_by_shape = {self._shape: self._settled}
        self._ahead_last = {}
        self.pacing = None

    # ---------------------------------------------------------------- operator protocol

    def enter(self, op: "Scheduled", *, paced: bool = False) -> None:
        """``op`` is about to compute: record the order (first step), prefetch ahead of it (``paced``:
        share by share at its :meth:`pace` calls, all of it at the first unless :meth:`pace_parts`)."""
        if self.pacing is not None:
            self.pace_end()                    # an operator that paced fewer sub-steps than it said
        if self.learning:
            if op not in self._position:
                self._position[op] = len(self.order)
                self.order.append(op)
            return
        if self._settled.get(op) == self.store.drops:
            return                             # all ahead settled, and the store forgot no device copy since
        i = self._position.get(op)
        if i is None or not self.lookahead:
            return
        last = self.forwards_left == 1         # (all ahead settled: those ahead in this step too)
        ahead = self._next_offloading(i, wrap=not last)
        if ahead:
            units = [u for nxt in ahead for u in nxt.prefetch_units()]
            if paced:
                self.pacing = _Paced(i, ahead, units, settles=not last)
            else:
                self._prefetch(i, ahead, units, settles=not last)

    def _prefetch(self, i: int, ahead: list["Scheduled"], units: list[Unit], settles: bool = True) -> bool:
        """Prefetch ``units`` for the operators ``ahead`` of position ``i``, in order; stops at the first
        that does not fit the budget (returns False). Marks ``i`` settled when all ahead are (only for
        the full, cyclic lookahead: ``settles``)."""
        fitted = self.store.prefetch_many(units)
        drops = self.store.drops               # read before the checks: a transfer thread may drop a copy during them
        if settles and all(nxt.prefetch_settled() for nxt in ahead):
            self._settled[self.order[i]] = drops
        return fitted

    def pace_parts(self, parts: int) -> None:
        """The paced operator that entered last runs ``parts`` sub-steps: each :meth:`pace` books
        ``1/parts`` of its prefetch (rounded up)."""
        if self.pacing is not None:
            self.pacing.share = max(1, -(-len(self.pacing.units) // max(parts, 1)))

    def pace(self) -> None:
        """A sub-step of the paced operator is about to compute (its own transfers issued): book the
        next share of the prefetch ahead of it."""
        p = self.pacing
        if p is None:
            return
        share, p.units = p.units[:p.share], p.units[p.share:]
        if not self._prefetch(p.i, p.ahead, share, p.settles) or not p.units:
            self.pacing = None                 # what did not fit stops the rest, as in one call

    def pace_end(self) -> None:
        """Book whatever the paced operator left (fewer sub-steps than it said, or an error)."""
        p, self.pacing = self.pacing, None
        if p is not None and p.units:
            self._prefetch(p.i, p.ahead, p.units, p.settles)

    def _next_offloading(self, i: int, wrap: bool = True) -> list["Scheduled"]:
        """The ``lookahead`` operators with offloaded weights after position ``i`` (cyclic, unless not
        ``wrap``: then only those later in this step)."""
        cache = self._ahead if wrap else self._ahead_last
        ahead = cache.get(i)
        if ahead is None:
            n, ahead = len(self.order), []
            for d in range(1, n if wrap else n - i):
                nxt = self.order[(i + d) % n]
                if nxt.offloads():
                    ahead.append(nxt)
                    if len(ahead) == self.lookahead:
                        break
            cache[i] = ahead
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
        return self._position.get(op)


class _Paced:
    """A paced operator's prefetch: position ``i``, the operators ``ahead`` of it, the ``units`` not
    booked yet, how many each :meth:`Scheduler.pace` books, whether booking it all may mark ``i`` settled."""

    __slots__ = ("i", "ahead", "units", "share", "settles")

    def __init__(self, i: int, ahead: list, units: list, settles: bool = True):
        self.i, self.ahead, self.units, self.share, self.settles = i, ahead, units, len(units), settles
