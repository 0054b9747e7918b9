"""``GroupedExperts``: Klotski's expert-centric MoE compute over one store unit per expert.

Wraps any experts module (or a per-expert ``ModuleList``, or an expert table) through its
layout adapter (:mod:`operators.expert_layouts`: which tensors form expert ``e``'s unit, and
the family's own math for it) and computes experts in Klotski's order (§5), every group of
experts ready at the same moment in one call (:meth:`ExpertLayout.compute_sorted`):

1. every expert a token of the batch group selected that is neither materialised nor in
   flight is fetched at once (most tokens first, channel ``ondemand``) — usually the gate
   (:class:`operators.gate.PrefetchGate`) already did that, this is idempotent;
2. ``order="hot_first"``: experts already on the device (resident, or prefetched while the
   attention ran: the hot ones) compute first, most tokens first; then the cold ones in
   the order their transfers complete (done-callbacks feed a queue; the compute thread
   blocks on it, it never polls). ``order="index"``: expert index order, waiting for each;
3. each expert's unit is acquired once per layer per step (a group's units in one store call)
   and released right after its group, so with the ``free`` policy its device copy is gone
   before the next group computes.

Blocks whose loop over experts is the family's own code (the block's forward runs unchanged;
nothing of its math is re-implemented, so tokens stay bit-identical):

* ``loop_block`` (rule on the block, which holds a per-expert ``ModuleList`` it loops over): the
  block's forward runs twice. The first pass records every expert call's inputs (each call
  answers zeros shaped like its output, the shape found on the meta device: nothing computed,
  no weight read); the recorded experts then compute in the order above (hot first, cold as they
  land), each on its recorded inputs with the family's own expert module; the second pass runs
  the block again and every expert call is answered by its output (inputs checked equal; a call
  that differs computes on its unit -- on a GPU the values are checked once after the pass, and a
  difference runs the block a third time, every expert on its unit: see :func:`_same_call`). The
  block's routing and combination run twice, its experts once; the gate's second routing equals the
  first, so it queues nothing new.
* ``module_list`` (rule on a per-expert ``ModuleList`` / ``ModuleDict`` alone): whoever loops over it
  -- the block that owns the list, or the container's own forward (Switch Transformers, NLLB-MoE) --
  is replayed as a ``loop_block`` is (expert inputs recorded, the experts computed hot first then as
  they land, each call answered by its output), so the family's loop no longer orders the compute
  and the gate queues the loads most tokens first. Where the owning block is another operator's,
  its loop calls each expert, computed on its unit when reached, and the gate queues the loads in
  expert index order, the order that loop consumes them (:meth:`GroupedExperts.queue_loads`).
* ``block`` (rule on the block: at least two children whose class ends in ``Experts``, shared
  experts not counted; JetMoE's ``input_linear`` then ``output_linear``): one unit per expert
  spanning all its weights. The block's code fixes the order of its experts *modules*, each
  called once with every expert's rows; within the first module call the experts compute hot
  first, then as their transfers land (``order="index"``: index order), each unit acquired once
  and held until the block returns, so the later module calls wait for nothing. Cost: the
  chosen experts of one block call are on the device together (the family's code needs every
  expert's first projection before any second one); an expert's second projection cannot start
  before every first projection ran. When the device budget cannot hold them all, each module
  call takes them one at a time in expert order instead (loaded once per module call).

Prefetch (``prefetch_units``): the K hot experts the correlation table predicts from the
batch group's choices at the previous MoE layer (Klotski §6.2), so the scheduler loads them
while this layer's attention runs (rule files use ``pipeline.prefetch_lookahead`` >= 2).
Predictions and real usage are recorded in a shared :class:`~kinject.engine.prefetch.PrefetchStats`
and reported (``model.kinject.report()``).

The operator is composed of narrow pieces, each handed what it reads (docs/architecture.md,
"Experts"): :class:`~operators.expert_step.ExpertSet` (what its experts are: key, layer, layout,
units) and :class:`~operators.expert_step.LayerStep` (what a layer-step holds, keeps, uses and
predicted), :class:`~operators.expert_order.ExpertOrder` (which experts run when),
:class:`~operators.expert_placement.ExpertSites` (which compute site each expert uses: the device's,
:class:`~operators.expert_sites.DeviceSide`, or the host's, :class:`~operators.host_experts.HostExperts`),
the interception of its layout (:mod:`operators.expert_interception`: how a block's call reaches the
experts), :mod:`operators.expert_routing` (the routing state gates and experts share,
:class:`ExpertRouting`) and :mod:`operators.expert_layouts` (which tensors form expert ``e``'s unit,
the family's math for it). This module keeps the composition: construction, the units' lifecycle
(attach / detach), prefetch planning and the forward entry point.

Shared per-runtime state (``runtime.shared``): ``"experts_by_layer"`` (layer -> operator),
``"correlation"`` (:class:`~kinject.engine.prefetch.CorrelationTable`), ``"prefetch_stats"``
(:class:`~kinject.engine.prefetch.PrefetchStats`), ``"expert_routing"`` (:class:`ExpertRouting`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from operators.base import Operator, ParamBinding, check_quant_kwarg
from operators.expert_interception import ExpertCalls, calls_for
from operators.expert_layouts import LAYOUTS, ExpertLayout, LayoutError, infer_layout
from operators.expert_order import ExpertOrder
from operators.expert_placement import ExpertSites
from operators.expert_routing import (  # noqa: F401  (re-exported: gates, tests and examples import them from here)
    _ROUTING_KWARGS, ExpertRouting, _is_sizes, _tokens_per_expert, indices_at,
    router_index_position, routing)
from operators.expert_step import ExpertSet, LayerStep
from operators.host_experts import HostExperts, check_compute_kwarg

if TYPE_CHECKING:
    from kinject.runtime import Runtime
    from kinject.engine.store import Unit

logger = logging.getLogger(__name__)


class GroupedExperts(Operator):
    """Expert-centric compute of a fused experts module, one store unit per expert.

    ``weights``: tier of the experts; ``order``: ``hot_first`` (Klotski) or ``index``
    (strawman: expert index order, waiting for each); ``hot_experts``: K, how many predicted
    hot experts to prefetch (default: the model's top-k); ``hot_probability``: also prefetch
    every further expert the table expects this batch group to use with at least this chance
    (a batch group spread over most experts then prefetches most of them; default: off, K only);
    ``hot_prefetch_at``: when that prefetch starts: ``lookahead`` (the scheduler's, while this
    layer's attention runs: the paper) or ``previous_layer`` (when the previous MoE layer's experts
    start: its choices are all the prediction needs, so the predicted experts queue right behind
    that layer's cold loads and the next attention's weights, and the link does not idle until
    this layer's attention starts);
    ``prefetch``: ``hot`` (K predicted),
    ``all`` (the whole layer, one unit per expert) or ``none`` (everything on demand);
    ``predictor``: ``correlation`` (Klotski's table: from the previous layer's choices) or
    ``next_gate`` (the previous layer's :class:`~operators.gate.PrefetchGate` runs this layer's
    router on its own input and prefetches every expert it picks, at most ``hot_experts`` if
    given; the first MoE layer, or one without such a gate, falls back to the table).
    ``layout``: how the module holds its experts (:mod:`operators.expert_layouts`; inferred from
    parameter names, shapes and config when not given). On a MoE block holding several experts
    modules (layout ``block``) the operator takes them over (:meth:`owned_descendants`) and the
    block's own forward runs (module docstring: which orders are possible there).
    """

    serves_moe = True

    def __init__(self, base: nn.Module, *, key: str, runtime: "Runtime",
                 weights: Literal["device", "host", "disk"] = "host",
                 order: Literal["hot_first", "index"] = "hot_first",
                 hot_experts: int | None = None,
                 hot_probability: float | None = None,
                 hot_prefetch_at: Literal["lookahead", "previous_layer"] = "lookahead",
                 prefetch: Literal["hot", "all", "none"] = "hot",
                 predictor: Literal["correlation", "next_gate"] = "correlation",
                 layout: str | None = None,
                 fill_link: bool = False, quant: dict | None = None,
                 compute: Literal["device", "host", "auto"] = "device", host_format: str | None = None):
        from kinject.engine.encode import parse_quant

        super().__init__(base, key=key, runtime=runtime)
        self.predictor = predictor
        # a stored format per expert (HQQ, fp8, int4, ...): moved as stored, decoded before use
        self.quant = parse_quant(quant, per_expert=True)
        self.weights, self.order, self.prefetch = weights, order, prefetch
        self.layout: ExpertLayout = infer_layout(base, key, layout)   # LayoutError lists what it saw
        self.names = list(self.layout.params)
        self.num_experts = int(self.layout.num_experts)   # the router's choices (zero-compute ones included)
        self.stored = int(self.layout.stored)             # experts 0 .. stored-1 have a unit
        config = getattr(base, "config", None)
        self.hot_experts = hot_experts if hot_experts is not None else \
            int(getattr(config, "num_experts_per_tok", None) or 2)
        self._hot_cap = hot_experts                # next_gate: every predicted expert unless K is given
        self.hot_probability = hot_probability
        self.hot_prefetch_at = hot_prefetch_at
        self.binding = ParamBinding(base, runtime, key, self.names)   # placeholders for the expert params
        self._registered = False
        self._all_there_at = -1                    # store.drops when every unit was last seen there (_all_there)
        self._not_there = 0                        # the unit _all_there found missing last (asked first next time)
        self._reads_disk = False                   # some unit lives in the disk tier (set at attach)
        self.fill_link = fill_link
        self.compute = compute
        # the pieces (docs/architecture.md, "Experts"): what the experts are, a layer-step's state, where each
        # expert computes (the host side is made now, so compute: host on a layout no host kernel serves is
        # refused before any swap), which run when, and how this layout's calls reach them
        self.experts = ExpertSet(runtime=runtime, routing=routing(runtime), key=key, layout=self.layout,
                                 weights=weights, dtype=self.binding.dtype, module=base, bound=self.bound)
        self.units: list["Unit"] = self.experts.units      # the same list: filled at attach, emptied at detach
        self.step = LayerStep()
        self.sites = ExpertSites(self.experts, compute, host_format)
        self.host: HostExperts | None = self.sites.host    # None: every expert off the device moves to it
        self.order_policy = ExpertOrder(self.experts, order, self.sites, self._enter)
        self.calls: ExpertCalls = calls_for(self.experts, self.order_policy, self.sites, self.step)

    @property
    def top_k_seen(self) -> int | None:
        """k of the last routed call (a gate that returns only logits routes with it)."""
        return self.calls.top_k_seen

    @classmethod
    def check_kwargs(cls, kwargs: dict) -> None:
        check_quant_kwarg(kwargs, per_expert=True)
        check_compute_kwarg(kwargs)
        name = kwargs.get("layout")
        if name is not None and name not in LAYOUTS:
            err = ValueError(f"unknown experts layout {name!r}; layouts: {', '.join(LAYOUTS)}")
            err.key = "layout"
            raise err
        k = kwargs.get("hot_experts")
        if k is not None and k < 0:
            err = ValueError(f"hot_experts must be >= 0, got {k}")
            err.key = "hot_experts"
            raise err
        p = kwargs.get("hot_probability")
        if p is not None and not (isinstance(p, (int, float)) and not isinstance(p, bool) and 0 < p < 1):
            err = ValueError(f"hot_probability must be a probability in (0, 1), got {p!r}")
            err.key = "hot_probability"
            raise err

    @classmethod
    def owned_descendants(cls, module: nn.Module, kwargs: dict) -> list[str]:
        """A MoE block's experts modules (layout ``block``): this operator schedules them, so no
        other rule claims them (:func:`kinject.inject.match_modules`)."""
        try:
            lay = infer_layout(module, "", kwargs.get("layout"))
        except LayoutError:
            return []                      # the operator's own construction reports it
        if lay.call == "loop_block":
            return [lay.list_name]
        return list(lay.children) if lay.call == "block" else []

    # ------------------------------------------------------------ attach / detach

    def attach(self) -> None:
        rt = self.runtime
        r = routing(rt)
        registry = r.experts
        partial = self.layout.call in ("sized", "lookup")      # one of several experts modules of a block
        if self.layer in registry and not (partial and registry[self.layer].layout.call == self.layout.call):
            raise ValueError(f"two GroupedExperts in layer {self.layer}: {registry[self.layer].key!r} and {self.key!r}")
        shared = self.binding.taken_by_another()      # experts tied to another claimed module's
        if shared is not None:
            self.units[:] = shared[0]
        else:
            self._add_units()
        rt.store.cache_scores[self.key] = self._cache_score     # the host cache keeps the experts predicted hot
        self._reads_disk = any(u.tier == "disk" for u in self.units)
        self.experts.layer = self.layer
        self.step.reset()
        self.sites.reset()
        self._all_there_at, self._not_there = -1, 0
        if self.layer in registry:
            r.partners.setdefault(self.layer, []).append(self)
        else:
            registry[self.layer] = self
        r.layers_changed()
        self._registered = True
        self.calls.install()
        if r.report_lines not in rt.reporters:
            rt.reporters.append(r.report_lines)
        super().attach()

    def _unit_params(self, e: int) -> list[str]:
        if self.layout.call in ("container", "loop_block"):
            return self.layout.expert_params(e)
        return self.names

    def _sources(self, name: str, p: nn.Parameter) -> list:
        """Per-expert tensors (views of ``p``) or, for a meta ``p`` (loaded with experts on disk),
        lazy references to exactly expert ``e``'s rows of the checkpoint tensor
        (:meth:`ExpertLayout.rows`): nothing is read here, a unit reads its own bytes when fetched."""
        lay = self.layout
        if lay.call in ("container", "loop_block"):   # each child's own parameter is its expert's part
            e = lay.expert_of(name)
            src = p.data if not p.is_meta else self.runtime.checkpoint_source(f"{self.key}.{name}")
            return {e: src}
        full = f"{self.key}.{name}"
        is_stored = getattr(self.runtime.checkpoint, "is_stored", None)   # (any index with sources works)
        stored = p.is_meta and is_stored is not None and is_stored(full)
        if self.quant is None and (self.weights == "device" or self.weights == "host" and not stored):
            whole = self._whole(full, p)
            return [lay.part(name, whole, e) for e in range(self.stored)]
        if not p.is_meta:
            return [lay.part(name, p.data, e) for e in range(self.stored)]
        if self.runtime.checkpoint is None:
            self.runtime.checkpoint_source(full)      # the error naming the parameter (reading nothing else)
        spans = [lay.rows(name, e) for e in range(self.stored)]                    # (start, stop, squeeze)
        return [self.runtime.checkpoint.rows_source(full, a, b, squeeze=sq) for a, b, sq in spans]

    def _whole(self, full: str, p: nn.Parameter) -> torch.Tensor:
        """Parameter ``p`` whole, where its tier keeps it (a meta one read from the checkpoint in one
        go): one pinned host tensor (CUDA) or one device tensor. Every expert's tensors are views of
        it, so the experts keep their ``[E, ...]`` layout (one grouped GEMM runs over it) and a host
        tier pins one buffer per parameter, not one per expert."""
        rt, dtype = self.runtime, self.binding.dtype
        src = rt.checkpoint_source(full) if p.is_meta else None
        if self.weights == "device":           # (a meta one through plain host memory: pinning it would not pay)
            t = p.data if src is None else src.read(dtype)
            return t.to(rt.store.device, dtype or t.dtype)
        if src is None:
            return rt.transfer.pin(p.data)
        held = getattr(src, "in_memory", None)       # a source that already keeps the tensor in host memory
        if held is not None and (t := held(dtype)) is not None:
            return rt.transfer.pin(t)
        return src.read(dtype, out=rt.transfer.empty_host(src.shape, dtype or src.dtype))   # straight into (pinned) host memory

    def __getitem__(self, i):            # ``module_list``: the block indexes its experts
        return self.base[i]

    def __len__(self) -> int:
        return len(self.base) if isinstance(self.base, nn.ModuleList) else self.num_experts

    def __iter__(self):
        return iter(self.base)

    @contextlib.contextmanager
    def bound(self, tensors: dict[str, torch.Tensor]):
        """The module's parameters ``tensors`` point at the given device tensors for the block."""
        params = self.binding.params
        for n, t in tensors.items():
            params[n].data = t
        try:
            yield
        finally:
            for n in tensors:
                params[n].data = self.binding.placeholders[n]

    def _add_units(self) -> None:
        """One store unit per expert, from the module's fused parameters; those then become
        storage-less stand-ins, and the units are registered as the copy of these Parameters."""
        rt, params = self.runtime, self.binding.params
        sources = {n: self._sources(n, params[n]) for n in self.names}
        for e in range(self.stored):
            self.units.append(rt.store.add(f"{self.key}[{e}]", {n: sources[n][e] for n in self._unit_params(e)},
                                           self.weights, layer=self.layer, dtype=self.binding.dtype,
                                           quant=_for_expert(self.quant, e), owner=self.key, stack=(self.key, e)))
        self.binding.stand_in()
        rt.store.tie(self.binding.tie_key(), self.units, self.binding)

    def detach(self) -> nn.Module:
        rt = self.runtime
        self.calls.uninstall()
        self.binding.restore()
        for u in self.units:
            if u.name in rt.store:
                rt.store.remove(u)
        rt.store.cache_scores.pop(self.key, None)
        self.units.clear()
        self._not_there = 0
        self.step.reset()
        self.sites.reset()
        self.sites.close()
        if self._registered:
            r = routing(rt)
            if r.experts.get(self.layer) is self:
                r.experts.pop(self.layer, None)
                rest = r.partners.pop(self.layer, [])
                if rest:
                    r.experts[self.layer] = rest[0]
                    if rest[1:]:
                        r.partners[self.layer] = rest[1:]
                r.layers_changed()
            elif self in r.partners.get(self.layer, []):
                r.partners[self.layer].remove(self)
                r.layers_changed()
            self._registered = False
            if not r.experts:
                r.save_table()
                if r.report_lines in rt.reporters:
                    rt.reporters.remove(r.report_lines)
        return super().detach()

    # ------------------------------------------------------------ prefetch

    def predicted(self) -> list[int]:
        """The experts to prefetch for this step: the K the correlation table predicts hot from
        the previous MoE layer's choices (none until that layer has routed; the first MoE layer
        uses expert frequencies), or what the previous gate predicted (``next_gate``)."""
        now, step = self.runtime.scheduler.step, self.step
        pred = step.prediction
        if pred is not None and pred[0] == now:
            return pred[1]
        r, layer = self.experts.routing, self.experts.layer
        pregated = r.pregated(layer) if self.predictor == "next_gate" else None
        if self.prefetch == "all":
            experts = list(range(self.num_experts))
        elif pregated is not None:                 # the previous gate ran this layer's router
            experts = sorted((e for e, n in enumerate(pregated) if n), key=lambda e: (-pregated[e], e))
            experts = experts[: self._hot_cap] if self._hot_cap is not None else experts
        else:
            have_prev = r.prev_choices(layer) is not None
            if not have_prev and r.has_prev_layer(layer):
                return []       # the layer this prediction is made from has not routed yet: ask again later
            experts = r.predict(layer, min(self.hot_experts, self.num_experts), self.hot_probability)
            step.prediction = (now, experts)
        step.note_predicted(now, experts)
        return experts

    def offloads(self) -> bool:
        return self.runtime.store.any_offloaded(self.units)

    def _all_there(self) -> bool:
        """Every expert's weights are on the device, on their way, or need no transfer ever (host
        tensors a CPU uses in place: ``TensorStore.never_moves``), so a prediction could start no
        transfer: the prefetcher skips it (bookkeeping that scales with transfers, not with layers).
        The store counts the device copies and host cache entries it forgets (``drops``); while none
        was forgotten since every unit was last seen there, they still all are, and the answer costs
        one comparison. Otherwise the unit found missing last time is asked first: a layer with experts
        never read (DeepSeek-V3's counts from disk: a third of them) answers with one question."""
        store = self.runtime.store
        drops = store.drops
        if self._all_there_at == drops:
            return True
        units = self.units
        hint = self._not_there
        if hint and not store.settled(units[hint]):
            return False                          # (the unit that was missing last time still is)
        for i, u in enumerate(units):
            if not store.settled(u):
                if i != hint:
                    self._not_there = i           # (a module attribute: set only when it changes)
                return False
        self._all_there_at = drops
        return True

    @property
    def device_gemv_groups(self) -> int:
        """Groups of this operator's experts the device (a CPU) computed through kinject's grouped GEMV."""
        return self.sites.device_gemv_groups

    def routing_counts(self, tokens: int | None) -> bool:
        """Whether this layer's routing of ``tokens`` tokens is worth counting in the correlation
        table: what the table predicts is only ever used to move experts ahead, and to rank the
        disk tier's host cache. So not where every expert off the device computes where it lives at
        that token count (``compute: host``, or ``auto`` where moving never wins at it) and none is
        read from disk: bookkeeping scales with transfers. Counted again as soon as a larger batch
        group or a prefill could move some."""
        host = self.sites.host
        if host is None or not host.moves_none_at(tokens):
            return True
        return self._reads_disk

    def _cache_score(self, unit: "Unit") -> float | None:
        """How often the routers chose ``unit``'s expert in this layer (the correlation table's
        frequencies): what the store's host cache of the disk tier keeps (hot experts stay, the
        least likely are evicted). None without a table: the cache falls back to LRU."""
        table = self.experts.routing.table_obj
        freq = table.freq.get(self.layer) if table is not None and isinstance(self.layer, int) else None
        if freq is None:
            return None
        return float(freq[int(unit.name[len(self.key) + 1:-1])])     # unit names: f"{key}[{e}]"

    def prefetch_settled(self) -> bool:
        """Nothing to start ahead: no prefetch, every expert there (:meth:`_all_there`), or every
        one off the device computed where it lives at this forward's rows, by a decision that only
        the token count changes (the scheduler forgets settled positions when the input shape does)."""
        if self.prefetch == "none" or not self.units or self._all_there():
            return True
        host = self.sites.host
        return host is not None and host.moves_none_at(self.experts.routing.last_tokens)

    def prefetch_units(self) -> list:
        if self.prefetch_settled():
            return []
        sites, step = self.sites, self.step
        if sites.host is not None and sites.moves_none(self.experts.routing.last_tokens):
            return []                              # every expert off the device computes where it lives
        predicted = self.predicted()
        handed = step.handed
        if handed is not None and handed[0] is predicted and handed[1] is step.prefetched:
            units = handed[2]                      # the same prediction, not consumed since: same units
        else:
            store, stored = self.runtime.store, self.experts.stored
            experts = [e for e in predicted if e < stored and store.offloaded(self.units[e])]
            if sites.host is not None:             # only the ones worth moving (the rest compute where they live)
                experts = sites.worth_prefetching(experts, self.experts.routing.last_tokens, self.hot_experts)
            step.prefetched.update(experts)
            units = [self.units[e] for e in experts]
            step.handed = (predicted, step.prefetched, units)
        if self.fill_link and self.prefetch == "hot" and units:
            self._start_filling(units)
        return units

    # ------------------------------------------------------------ link filling

    def _start_filling(self, hot: list) -> None:
        """``fill_link``: once the K hot experts have landed and while the gate has not routed
        yet, keep the link busy with the next experts in the table's ranking, one at a time
        (each starts when the previous lands), as long as the budget allows. What the router
        then does not choose is discarded like any unused prefetch."""
        now = self.runtime.scheduler.step
        if self.step.routed == now or not isinstance(self.layer, int):
            return
        store = self.runtime.store
        for u in hot:
            store.prefetch(u)                      # idempotent: the scheduler's call is then a no-op
        stored = self.experts.stored
        ranking = self.experts.routing.predict(self.layer, stored)
        pending = [e for e in ranking if e < stored and self.units[e] not in hot]
        store.on_landing(hot[-1], lambda _h: self._fill_next(now, pending))

    def _fill_next(self, now: int, ranking: list[int]) -> None:
        """Done-callback (a transfer thread): prefetch the next ranked expert not there yet."""
        rt, step = self.runtime, self.step
        store = rt.store
        while ranking:
            if step.routed >= now or rt.scheduler.step != now:
                return                             # the gate has routed: on-demand loads take over
            e = ranking.pop(0)
            u = self.units[e]
            if store.placed(u) or not store.offloaded(u):
                continue
            if not store.prefetch(u):
                return                             # out of budget
            step.prefetched.add(e)
            if step.predicted_at == now:
                step.predicted.add(e)
            store.on_landing(u, lambda _h: self._fill_next(now, ranking))
            return

    def queue_loads(self, counts: list[int]) -> None:
        """Start on-demand loads of every selected expert not materialised nor in flight, in the
        order they will be consumed (what fits the budget now; the rest is loaded in :meth:`forward`):
        most tokens first where this operator orders the compute, expert index order where the
        block's own loop calls the experts as it reaches them (``module_list`` not replayed)."""
        self.step.routed = self.runtime.scheduler.step
        units, store = self.units, self.runtime.store
        on_host = self.sites.on_host(counts)
        wanted = [e for e, n in enumerate(counts[: self.experts.stored]) if n and e not in on_host]
        cold = store.cold_ids(units, wanted) if wanted else wanted
        if not cold:
            return
        if self.calls.sorts_loads:                 # most tokens first; ties: ascending ids (stable)
            cold.sort(key=counts.__getitem__, reverse=True)
        store.fetch_many([units[e] for e in cold])

    def _enter(self, step: LayerStep) -> None:
        """About to compute: the scheduler prefetches ahead, then the next MoE layer's ``previous_layer``
        prefetch (the order policy and the interception call it once per layer-step)."""
        rt = self.runtime
        step.entered = rt.scheduler.step
        rt.scheduler.enter(self)
        self.experts.routing.prefetch_next(self.experts.layer)

    # ------------------------------------------------------------ compute

    def forward(self, *args, **kwargs):
        return self.calls(*args, **kwargs)

    def extra_repr(self) -> str:
        return (f"key={self.key!r}, layout={self.layout.name!r}, experts={self.num_experts}, weights={self.weights!r}, "
                f"order={self.order!r}, "
                f"hot_experts={self.hot_experts}, hot_probability={self.hot_probability}, hot_prefetch_at={self.hot_prefetch_at!r}, "
                f"prefetch={self.prefetch!r}, predictor={self.predictor!r}")


def _for_expert(quant, e: int):
    """Expert ``e``'s stored format: a ``per_expert`` table's choice for it, else the operator's."""
    return quant.for_expert(e) if hasattr(quant, "for_expert") else quant
