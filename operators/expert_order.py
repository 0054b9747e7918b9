"""Which experts run when: Klotski's expert-centric order (§5) for :class:`~operators.experts.GroupedExperts`.

:class:`ExpertOrder` decides, for the experts a batch group routed to, in which groups and in which
order their units are acquired, computed and released:

* ``order="hot_first"`` (Klotski): experts already on the device (resident, or prefetched while the
  attention ran) in one group first; then cold ones as their transfers land (done-callbacks feed a
  queue, the compute thread blocks on it, it never polls), every expert landed by the time the
  previous group is done joining the next group (:meth:`ExpertOrder._hot_then_landed`);
* ``order="index"`` (strawman): expert index order, waiting for each (:meth:`ExpertOrder._index_groups`);
* ``block`` layouts (the block's code calls its experts modules): hot first, then as they land, one
  expert at a time, units held until the block returns (:meth:`ExpertOrder._block_order`).

It says nothing about *how* a group computes (the caller's ``run_group``: the interception code,
:mod:`operators.expert_interception`, over a compute site, :mod:`operators.expert_sites`) nor how a
block's call is intercepted. A mixin of :class:`~operators.experts.GroupedExperts`: it reads the
operator's ``runtime``, ``units``, ``stored``, ``key``, ``layer``, ``order``, ``host`` (the host side of
experts computed where they live, :mod:`operators.host_experts`: its experts leave the device's order),
and the per-step
prediction bookkeeping (``_pred_step``, ``_prefetched``, ``_last_loads``, ``_kept``, ``_held``,
``_block_used``, ``_hold_all``).
"""

from __future__ import annotations

import functools
import itertools
import queue
from typing import TYPE_CHECKING, Any

from kinject.errors import BudgetError
from operators.expert_routing import ExpertRouting, routing

if TYPE_CHECKING:
    from kinject.engine.store import Unit


class ExpertOrder:
    """The order and grouping of a layer's expert computes, and the loads they wait for
    (a mixin of :class:`~operators.experts.GroupedExperts`; module docstring: what it reads)."""

    def _schedule(self, counts: list[int], run_group, run_zero, keep: bool = False, start_host=None) -> None:
        """Klotski's expert-centric order over the experts with tokens, in groups:
        ``run_group(group, tensors)`` is called with experts ``group`` (ascending) whose weights
        are on the device (``tensors[i]``: expert ``group[i]``'s unit); ``run_zero(e)`` for a
        zero-compute expert (no weights). ``keep``: units stay acquired until :meth:`_release_kept`.
        With host compute (``compute: host / auto``) the experts the host side chose
        (:meth:`operators.host_experts.HostExperts.choose`) compute there first, while the device's
        cold experts are still on the link: on a CPU device through ``run_group`` with their host
        tensors; on CUDA ``start_host(group)`` starts them on the host worker and returns the function
        that adds their outputs after the device's groups (none given: they compute on the device)."""
        rt = self.runtime
        r = routing(rt)
        self._enter()                             # after queueing cold experts: they go first
        used = [e for e, n in enumerate(counts) if n]
        self._discard_unused(used)                # predicted but not chosen: free their room now
        step = rt.scheduler.step
        if self._pred_step[0] == step:
            r.stats.record(self.layer if self.layer is not None else -1, self._pred_step[1],
                           counts)
        self._kept = []
        tracer = rt.tracer

        def compute(group: list[int], hot: bool, held: dict | None = None) -> None:
            units = [self.units[e] for e in group]
            rest = [u for u in units if held is None or u.name not in held]
            try:
                got = iter(rt.scheduler.acquire_many(rest))
            except BaseException:
                rt.scheduler.release_many([u for u in units if held is not None and u.name in held])
                raise
            tensors = [held[u.name] if held is not None and u.name in held else next(got) for u in units]
            try:
                if tracer.enabled:
                    with tracer.span("compute", _group_name(self.key, group), layer=self.layer,
                                     args={"experts": group, "tokens": sum(counts[e] for e in group),
                                           "hot": hot, "step": step}):
                        run_group(group, tensors)
                else:
                    run_group(group, tensors)
            finally:
                if keep:
                    self._kept.extend(units)
                else:
                    rt.scheduler.release_many(units)

        stored_used = [e for e in used if e < self.stored]
        for e in used:
            if e >= self.stored:                  # zero-compute expert: the module's own path, no weights
                run_zero(e)
        finish_host = None
        if self.host is not None:
            stored_used, finish_host = self._host_side(stored_used, counts, run_group, start_host)
        if self.order == "index":
            self._index_groups(stored_used, compute)
        else:
            units = self.units                   # hot: on the device now (TensorStore.ready, inlined: per expert)
            ready = [e for e in stored_used
                     if units[e].device is not None or units[e].handle is not None and units[e].handle.done()]
            self._hot_then_landed(stored_used, counts, ready, compute)
        if finish_host is not None:
            finish_host()
        self._after_layer(r, used)

    def _host_side(self, used: list[int], counts: list[int], run_group, start_host) -> tuple[list[int], Any]:
        """Host compute of this step's host experts (:meth:`_schedule`): returns the experts left
        for the device, and the function that finishes the host ones (CUDA) or None."""
        group = sorted(self.host.choose(counts).intersection(used))
        if not group:
            return used, None
        finish = None
        if self.runtime.device.type == "cuda":
            if start_host is None:
                return used, None                 # this call shape computes on the device only
            finish = start_host(group)
        else:
            own = self.host.backend.kernel is not None      # a backend's own kernel: only routed calls have one
            self.host.run(group, counts, functools.partial(run_group, compute=self.host.compute) if own else run_group)
        chosen = set(group)
        return [e for e in used if e not in chosen], finish

    def _enter(self) -> None:
        """About to compute: the scheduler prefetches ahead, then the next MoE layer's ``previous_layer`` prefetch."""
        self._entered = self.runtime.scheduler.step
        self.runtime.scheduler.enter(self)
        routing(self.runtime).prefetch_next(self.layer)

    def _release_kept(self) -> None:
        self.runtime.scheduler.release_many(self._kept)
        self._kept = []

    def _index_groups(self, used: list[int], compute) -> None:
        """Strawman order: expert index order, waiting for each expert that is not there yet;
        the ones after it that are already on the device join its group (order unchanged)."""
        rt, i = self.runtime, 0
        while i < len(used):
            head = self.units[used[i]]
            held = {head.name: rt.scheduler.acquire(head)}     # waits (a stall) if not landed yet
            group = [used[i]]
            i += 1
            while i < len(used) and rt.store.ready(self.units[used[i]]):
                group.append(used[i])
                i += 1
            compute(group, True, held)             # releases (or keeps) the head with its group

    def _hot_then_landed(self, used: list[int], counts: list[int], ready: list[int], compute) -> None:
        """Ready experts first, in one group; then cold ones as their transfers land, every
        expert that has landed by the time the previous group is done joining the next group."""
        if len(ready) == len(used):               # every chosen expert is there: one group, nothing to wait for
            if ready:
                compute(ready, True)
            return
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
        with self.runtime.tracer.span("stall", f"wait {self.key} (cold experts)", kind="wait", layer=self.layer):
            return landed.get()                   # blocks until a transfer lands (done-callback)

    def _watch(self, e: int, landed: queue.SimpleQueue, *, strict: bool) -> bool:
        """Make sure expert ``e`` is on its way and put it on ``landed`` when it is there.
        False when it could not be started (budget) and ``strict`` is off."""
        unit = self.units[e]
        if unit.device is None and unit.handle is None:
            if strict:
                self.runtime.store.fetch(unit, "ondemand")      # BudgetError if it can never fit
            elif not self._try_fetch(unit):
                return False
        handle = unit.handle
        if handle is None:
            landed.put(e)
        else:
            handle.add_done_callback(lambda _h, e=e: landed.put(e))
        return True

    def _discard_unused(self, used: list[int]) -> None:
        """Policy ``free``: drop prefetched experts the router did not choose (in flight: when they land)."""
        prefetched = self._prefetched
        if not prefetched:
            return
        store = self.runtime.store
        self._prefetched = set()
        if store.policy == "free":
            keep = set(used)
            for e in prefetched - keep:
                store.discard(self.units[e])

    def _after_layer(self, r: ExpertRouting, used: list[int]) -> None:
        """Count this step's expert loads for the report (the store counts them per owner)."""
        loads, nbytes = self.runtime.store.owner_loads.get(self.key, (0, 0))
        last_loads, last_bytes = self._last_loads
        if loads < last_loads:                    # the store's statistics were reset
            last_loads = last_bytes = 0
        self._last_loads = (loads, nbytes)
        r.count_io(self.layer, loads - last_loads, nbytes - last_bytes, len(used))

    def _try_fetch(self, unit: "Unit") -> bool:
        store = self.runtime.store
        if not store.fits(unit.nbytes) and store.policy != "cache":
            return False
        try:
            store.fetch(unit, "ondemand")
        except BudgetError:
            return False
        return True

    def _block_order(self, counts: list[int]):
        """The experts with rows, their units acquired into ``self._held``: on the block's first
        experts-module call, units on the device first (most tokens first), then the others in the
        order their transfers land (the gate queued them when it routed); on later calls every
        unit is held already, in expert order. When the device budget cannot hold every chosen
        expert at once, each module call instead takes them one at a time in expert order, each
        released right after its compute (every expert is then loaded once per module call)."""
        rt = self.runtime
        used = [e for e, n in enumerate(counts[: self.stored]) if n]
        if self._block_used is not None and not self._hold_all:
            yield from self._one_at_a_time(used)
            return
        if self._block_used is not None:
            for e in used:
                if e not in self._held:
                    self._held[e] = rt.scheduler.acquire(self.units[e])
                yield e
            return
        self._block_used = used
        self._enter()
        self._discard_unused(used)
        if self._pred_step[0] == rt.scheduler.step:
            routing(rt).stats.record(self.layer if self.layer is not None else -1, self._pred_step[1],
                                     {e: counts[e] for e in used})
        store = rt.store
        self._hold_all = store.fits(sum(self.units[e].nbytes for e in used
                                        if self.units[e].offloaded and self.units[e].device is None
                                        and self.units[e].handle is None))
        if not self._hold_all:
            yield from self._one_at_a_time(used)
            return
        if self.order == "index":                  # strawman: expert order, waiting for each
            for e in used:
                self._held[e] = rt.scheduler.acquire(self.units[e])
                yield e
            return
        hot = sorted((e for e in used if rt.store.ready(self.units[e])), key=lambda e: (-counts[e], e))
        landed: queue.SimpleQueue = queue.SimpleQueue()
        cold = [e for e in used if e not in hot]
        for e in sorted(cold, key=lambda e: (-counts[e], e)):
            self._watch(e, landed, strict=True)
        for e in itertools.chain(hot, (landed.get() for _ in cold)):   # blocks until the next one lands
            self._held[e] = rt.scheduler.acquire(self.units[e])
            yield e

    def _one_at_a_time(self, used: list[int]):
        """``block`` under a tight budget: each chosen expert acquired, computed by the caller,
        released, in expert order."""
        sched = self.runtime.scheduler
        for e in used:
            self._held[e] = sched.acquire(self.units[e])
            try:
                yield e
            finally:
                del self._held[e]
                sched.release(self.units[e])

def _group_name(key: str, group: list[int]) -> str:
    """Trace name of a grouped compute: ``key[a,b,c]`` (the unit name for one expert)."""
    return f"{key}[{','.join(map(str, group))}]"


