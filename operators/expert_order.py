"""Which experts run when: Klotski's expert-centric order (§5) for :class:`~operators.experts.GroupedExperts`.

:class:`ExpertOrder` decides, for the experts a batch group routed to, in which groups and in which
order their units are acquired, computed and released:

* ``order="hot_first"`` (Klotski): experts already on the device (resident, or prefetched while the
  attention ran) in one group first; then cold ones as their transfers land (done-callbacks feed a
  queue, the compute thread blocks on it, it never polls), every expert landed by the time the
  previous group is done joining the next group (:meth:`ExpertOrder._hot_then_landed`);
* ``order="index"`` (strawman): expert index order, waiting for each (:meth:`ExpertOrder._index_groups`);
* ``block`` layouts (the block's code calls its experts modules): hot first, then as they land, one
  expert at a time, units held until the block returns (:meth:`ExpertOrder.block_order`).

It says nothing about *how* a group computes (the caller's ``run_group``: the interception of the
layout, :mod:`operators.expert_interception`, over a compute site, :mod:`operators.expert_sites`)
nor how a block's call is intercepted. It is composed into the operator with what it reads: the
experts (:class:`~operators.expert_step.ExpertSet`), the compute sites
(:class:`~operators.expert_placement.ExpertSites`: which experts the host computes) and ``enter``
(the operator's "about to compute" hook: the scheduler's lookahead); the layer-step state it reads
and writes (:class:`~operators.expert_step.LayerStep`) is passed to each call.
"""

from __future__ import annotations

import itertools
import queue
from typing import TYPE_CHECKING

from kinject.errors import BudgetError

if TYPE_CHECKING:
    from kinject.engine.store import Unit
    from operators.expert_placement import ExpertSites
    from operators.expert_step import ExpertSet, LayerStep


class ExpertOrder:
    """The order and grouping of a layer's expert computes, and the loads they wait for.

    ``experts``: what is scheduled; ``order``: ``hot_first`` or ``index``; ``sites``: where each expert
    computes (the host's experts leave the device's order); ``enter(step)``: called once per layer-step
    before the first compute (the scheduler prefetches ahead)."""

    def __init__(self, experts: "ExpertSet", order: str, sites: "ExpertSites", enter):
        self.experts, self.order, self.sites, self.enter = experts, order, sites, enter

    def schedule(self, step: "LayerStep", counts: list[int], run_group, run_zero, keep: bool = False,
                 start_host=None) -> None:
        """Klotski's expert-centric order over the experts with tokens, in groups:
        ``run_group(group, tensors, site)`` is called with experts ``group`` (ascending) whose weights
        are ready for compute site ``site`` (``tensors[i]``: expert ``group[i]``'s); ``run_zero(e)`` for a
        zero-compute expert (no weights). ``keep``: units stay acquired (in ``step.kept``) until
        :meth:`release_kept`. The experts the host site chose (:meth:`ExpertSites.host_first`) compute
        there first, while the device's cold experts are still on the link; ``start_host``: how this call
        shape starts host experts on CUDA (none given: they compute on the device there)."""
        experts = self.experts
        rt, units, layer = experts.runtime, experts.units, experts.layer
        self.enter(step)                          # after queueing cold experts: they go first
        used = [e for e, n in enumerate(counts) if n]
        if step.prefetched:
            self._discard_unused(step, used)      # predicted but not chosen: free their room now
        now = rt.scheduler.step
        if step.predicted_at == now:
            experts.routing.stats.record(layer if layer is not None else -1, step.predicted, counts)
        step.kept = []
        tracer = rt.tracer
        device = self.sites.device

        def compute(group: list[int], hot: bool, held: dict | None = None) -> None:
            units_ = [units[e] for e in group]
            rest = [u for u in units_ if held is None or u.name not in held]
            try:
                got = iter(rt.scheduler.acquire_many(rest))
            except BaseException:
                rt.scheduler.release_many([u for u in units_ if held is not None and u.name in held])
                raise
            tensors = [held[u.name] if held is not None and u.name in held else next(got) for u in units_]
            try:
                if tracer.enabled:
                    with tracer.span("compute", _group_name(experts.key, group), layer=layer,
                                     args={"experts": group, "tokens": sum(counts[e] for e in group),
                                           "hot": hot, "step": now}):
                        run_group(group, tensors, device)
                else:
                    run_group(group, tensors, device)
            finally:
                if keep:
                    step.kept.extend(units_)
                else:
                    rt.scheduler.release_many(units_)

        stored = experts.stored
        stored_used = [e for e in used if e < stored]
        for e in used:
            if e >= stored:                       # zero-compute expert: the module's own path, no weights
                run_zero(e)
        finish_host = None
        if self.sites.host is not None:
            stored_used, finish_host = self.sites.host_first(stored_used, counts, run_group, start_host)
        if not stored_used:                       # (every expert computed on the host)
            pass
        elif self.order == "index":
            self._index_groups(stored_used, compute)
        else:                                     # hot: on the device now
            self._hot_then_landed(stored_used, counts, rt.store.ready_ids(units, stored_used), compute)
        if finish_host is not None:
            finish_host()
        self.after_layer(step, used)

    def release_kept(self, step: "LayerStep") -> None:
        self.experts.runtime.scheduler.release_many(step.kept)
        step.kept = []

    def _index_groups(self, used: list[int], compute) -> None:
        """Strawman order: expert index order, waiting for each expert that is not there yet;
        the ones after it that are already on the device join its group (order unchanged)."""
        rt, units, i = self.experts.runtime, self.experts.units, 0
        while i < len(used):
            head = units[used[i]]
            held = {head.name: rt.scheduler.acquire(head)}     # waits (a stall) if not landed yet
            group = [used[i]]
            i += 1
            while i < len(used) and rt.store.ready(units[used[i]]):
                group.append(used[i])
                i += 1
            compute(group, True, held)             # releases (or keeps) the head with its group

    def _hot_then_landed(self, used: list[int], counts: list[int], ready: list[int], compute) -> None:
        """Ready experts first, in one group; then cold ones as their transfers land, every
        expert that has landed by the time the previous group is done joining the next group.

        Every expert of the step is claimed (``TensorStore.claim``) until its group has computed: a
        landed expert waiting for its turn looks idle to the store (no transfer, no reference), and
        under ``release_policy: cache`` the loads of the step's other experts would evict it, then
        find no room to load it again (a prefill larger than the budget failed with BudgetError)."""
        if len(ready) == len(used):               # every chosen expert is there: one group, nothing to wait for
            if ready:
                compute(ready, True)
            return
        units, store = self.experts.units, self.experts.runtime.store
        claimed = set(used)
        store.claim([units[e] for e in used])

        def compute_claimed(group: list[int], hot: bool) -> None:
            try:
                compute(group, hot)
            finally:
                claimed.difference_update(group)
                store.release_many([units[e] for e in group])

        try:
            self._landed_order(used, counts, ready, compute_claimed)
        finally:
            if claimed:                           # (an error: what was not computed is given back)
                store.release_many([units[e] for e in sorted(claimed)])

    def _landed_order(self, used: list[int], counts: list[int], ready: list[int], compute) -> None:
        """:meth:`_hot_then_landed`'s order, its experts claimed."""
        landed: queue.SimpleQueue = queue.SimpleQueue()
        deferred, waiting = [], 0
        hot = set(ready)
        for e in sorted([e for e in used if e not in hot], key=counts.__getitem__, reverse=True):  # ties: ids up
            if self._watch(e, landed, strict=False):
                waiting += 1
            else:
                deferred.append(e)                # no room on the device yet
        if ready:
            compute(ready, True)
        while waiting or deferred:
            still = []
            for e in deferred:                    # room freed by released experts?
                if self._watch(e, landed, strict=waiting == 0 and not still):
                    waiting += 1
                else:
                    still.append(e)
            deferred = still
            group = [self._next_landed(landed)]
            while True:
                try:
                    group.append(landed.get_nowait())
                except queue.Empty:
                    break
            waiting -= len(group)
            compute(sorted(group), False)

    def _next_landed(self, landed: queue.SimpleQueue) -> int:
        """The next expert whose transfer landed; when none has yet, the compute thread blocks on the
        done-callbacks, and that wait is a ``stall`` span like every other wait for weights (a
        bubble the report, the bench and the planner's profile must see)."""
        try:
            return landed.get_nowait()
        except queue.Empty:
            pass
        experts = self.experts
        with experts.runtime.tracer.span("stall", f"wait {experts.key} (cold experts)", kind="wait",
                                         layer=experts.layer):
            return landed.get()                   # blocks until a transfer lands (done-callback)

    def _watch(self, e: int, landed: queue.SimpleQueue, *, strict: bool) -> bool:
        """Make sure expert ``e`` is on its way and put it on ``landed`` when it is there.
        False when it could not be started (budget) and ``strict`` is off."""
        unit, store = self.experts.units[e], self.experts.runtime.store
        if not store.placed(unit):
            if strict:
                store.fetch(unit, "ondemand")     # BudgetError if it can never fit
            elif not self._try_fetch(unit):
                return False
        if not store.on_landing(unit, lambda _h, e=e: landed.put(e)):
            landed.put(e)                         # there already
        return True

    def _discard_unused(self, step: "LayerStep", used: list[int]) -> None:
        """Policy ``free``: drop prefetched experts the router did not choose (in flight: when they land)."""
        if not step.prefetched:
            return
        prefetched = step.take_prefetched()
        store = self.experts.runtime.store
        if store.policy == "free":
            keep, units = set(used), self.experts.units
            for e in prefetched - keep:
                store.discard(units[e])

    def after_layer(self, step: "LayerStep", used: list[int]) -> None:
        """Count this step's expert loads for the report (the store counts them per owner)."""
        experts = self.experts
        loads, nbytes = experts.runtime.store.owner_loads.get(experts.key, (0, 0))
        last_loads, last_bytes = step.last_loads
        if loads < last_loads:                    # the store's statistics were reset
            last_loads = last_bytes = 0
        step.last_loads = (loads, nbytes)
        experts.routing.count_io(experts.layer, loads - last_loads, nbytes - last_bytes, len(used))

    def _try_fetch(self, unit: "Unit") -> bool:
        store = self.experts.runtime.store
        if not store.fits(unit.nbytes) and store.policy != "cache":
            return False
        try:
            store.fetch(unit, "ondemand")
        except BudgetError:
            return False
        return True

    def block_order(self, step: "LayerStep", counts: list[int]):
        """The experts with rows, their units acquired into ``step.held``: on the block's first
        experts-module call, units on the device first (most tokens first), then the others in the
        order their transfers land (the gate queued them when it routed); on later calls every
        unit is held already, in expert order. When the device budget cannot hold every chosen
        expert at once, each module call instead takes them one at a time in expert order, each
        released right after its compute (every expert is then loaded once per module call)."""
        experts = self.experts
        rt, units, held = experts.runtime, experts.units, step.held
        used = [e for e, n in enumerate(counts[: experts.stored]) if n]
        if step.used is not None and not step.hold_all:
            yield from self._one_at_a_time(step, used)
            return
        if step.used is not None:
            for e in used:
                if e not in held:
                    held[e] = rt.scheduler.acquire(units[e])
                yield e
            return
        step.used = used
        self.enter(step)
        self._discard_unused(step, used)
        if step.predicted_at == rt.scheduler.step:
            experts.routing.stats.record(experts.layer if experts.layer is not None else -1, step.predicted,
                                         {e: counts[e] for e in used})
        store = rt.store
        step.hold_all = store.fits(sum(units[e].nbytes for e in store.cold_ids(units, used)))
        if not step.hold_all:
            yield from self._one_at_a_time(step, used)
            return
        if self.order == "index":                  # strawman: expert order, waiting for each
            for e in used:
                held[e] = rt.scheduler.acquire(units[e])
                yield e
            return
        hot = sorted(store.ready_ids(units, used), key=lambda e: (-counts[e], e))
        landed: queue.SimpleQueue = queue.SimpleQueue()
        cold = [e for e in used if e not in hot]
        for e in sorted(cold, key=lambda e: (-counts[e], e)):
            self._watch(e, landed, strict=True)
        for e in itertools.chain(hot, (landed.get() for _ in cold)):   # blocks until the next one lands
            held[e] = rt.scheduler.acquire(units[e])
            yield e

    def _one_at_a_time(self, step: "LayerStep", used: list[int]):
        """``block`` under a tight budget: each chosen expert acquired, computed by the caller,
        released, in expert order."""
        sched, units, held = self.experts.runtime.scheduler, self.experts.units, step.held
        for e in used:
            held[e] = sched.acquire(units[e])
            try:
                yield e
            finally:
                del held[e]
                sched.release(units[e])


def _group_name(key: str, group: list[int]) -> str:
    """Trace name of a grouped compute: ``key[a,b,c]`` (the unit name for one expert)."""
    return f"{key}[{','.join(map(str, group))}]"


