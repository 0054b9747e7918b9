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
* ``module_list`` (rule on the ``ModuleList`` alone): the block's ``for e in ...`` calls child ``e``
  when its code reaches it; a hook acquires and binds expert ``e``'s unit around that call. The
  *compute* order is the family's and cannot change (no hot-first, no expert before the loop
  reaches it); what can be chosen is the order of the *loads*: the gate queues the chosen experts
  in expert index order, the order the loop consumes them (:meth:`GroupedExperts.queue_loads`),
  so the loop waits at most for the transfer of the expert it needs next, never behind one it
  needs later; resident / prefetched experts run without waiting.
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

Shared per-runtime state (``runtime.shared``): ``"experts_by_layer"`` (layer -> operator),
``"correlation"`` (:class:`~kinject.engine.prefetch.CorrelationTable`), ``"prefetch_stats"``
(:class:`~kinject.engine.prefetch.PrefetchStats`), ``"expert_routing"`` (:class:`ExpertRouting`).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import queue
from array import array
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from kinject.errors import BudgetError, KinjectError
from kinject.engine.prefetch import CorrelationTable, PrefetchStats
from kinject.engine.transfer import host_to_device, reading_syncs
from operators.base import Operator, ParamBinding, check_quant_kwarg
from operators.expert_layouts import LAYOUTS, ExpertLayout, LayoutError, infer_layout
from operators.host_experts import HostExperts, check_compute_kwarg

if TYPE_CHECKING:
    from kinject.runtime import Runtime
    from kinject.engine.store import Unit

logger = logging.getLogger(__name__)

# Names the experts forward's routing arguments have across families (GPT-OSS differs).
_INDEX_KWARGS = ("top_k_index", "router_indices", "selected_experts", "topk_indices")
_WEIGHT_KWARGS = ("top_k_weights", "routing_weights", "router_scores", "topk_weights")
_ROUTING_KWARGS = _INDEX_KWARGS + _WEIGHT_KWARGS


def routing(runtime: "Runtime") -> "ExpertRouting":
    """The runtime's one :class:`ExpertRouting` (made on first use)."""
    return runtime.shared("expert_routing", lambda: ExpertRouting(runtime))


def _is_sizes(x: Any) -> bool:
    """Per-expert row counts of a ``sized`` call: a list / tuple, or a 1-D integer tensor (a
    family's grouped GEMM may take its counts as a tensor)."""
    if isinstance(x, (list, tuple)):
        return True
    return isinstance(x, torch.Tensor) and x.dim() == 1 and not x.is_floating_point() and x.dtype != torch.bool


def router_indices(output: Any) -> torch.Tensor | None:
    """The top-k expert indices (integer tensor ``[T, k]``) in a router's output, if any."""
    items = output if isinstance(output, (tuple, list)) else (output,)
    for t in items:
        if isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_floating_point() \
                and not t.is_complex() and t.dtype != torch.bool:
            return t
    return None


class ExpertRouting:
    """What gates and experts of one model share: this step's routing per layer, the
    correlation table, the prefetch statistics, and transfer counts for the report."""

    def __init__(self, runtime: "Runtime"):
        self.runtime = runtime
        self.experts: dict[int | None, GroupedExperts] = runtime.shared("experts_by_layer", dict)
        self.gates: dict[int | None, Any] = runtime.shared("gates_by_layer", dict)   # layer -> PrefetchGate
        self.partners: dict[int | None, list] = {}   # layer -> further GroupedExperts (parallel-experts pairs)
        self._pregated: dict[int, tuple[int, list[int]]] = {}   # layer -> (step, tokens per expert) by its gate
        self.stats: PrefetchStats = runtime.shared("prefetch_stats", PrefetchStats)
        self.table_obj: CorrelationTable | None = None   # once made (see :meth:`table`)
        self._routed: dict[int | None, tuple] = {}      # layer -> (step, choices tensor, counts)
        self._choices: dict[int, tuple[int, torch.Tensor]] = {}   # layer -> (step, cpu [T, k])
        self.io: dict[int | None, dict[str, int]] = {}  # layer -> steps, loads, bytes, used
        self.last_tokens: int | None = None             # tokens of the last routing (the batch group's size)
        self._next: dict[int, int] | None = None        # MoE layer -> the next one (see :meth:`next_layer`)
        self._learns: tuple | None = None                # (store budget, answer) of :meth:`learns`

    # ------------------------------------------------------------ correlation table

    def table(self) -> CorrelationTable | None:
        """The shared correlation table, made on first use (when every operator is attached)."""
        if self.table_obj is not None:
            return self.table_obj
        if not any(isinstance(layer, int) for layer in self.experts):
            return None
        return self.runtime.shared("correlation", self._make_table)

    def _make_table(self) -> CorrelationTable:
        p = self.runtime.pipeline
        ids = sorted(layer for layer in self.experts if isinstance(layer, int))
        num_experts = max(op.num_experts for op in self.experts.values())
        path = Path(p.correlation_table).expanduser() if p.correlation_table else None
        if path is not None and path.is_file():
            table = CorrelationTable.load(path, num_experts=num_experts)
            extra = sorted(set(table.layer_ids) - set(ids))
            if extra or table.num_layers != len(ids) or (table.fixed_layer_ids and table.layer_ids != ids):
                raise KinjectError(
                    f"correlation table {path}: made for MoE layers {table.layer_ids} ({table.num_layers} layers), "
                    f"the model's MoE layers are {ids}; rebuild it with a warm-up run")
            logger.info("correlation table loaded from %s (%d layers)", path, len(table.layer_ids))
        else:
            if path is not None:
                logger.info("correlation table %s not found: starting empty (frequency fallback)", path)
            table = CorrelationTable(len(ids), num_experts, layer_ids=ids)
        table.online = bool(p.update_table)
        self.table_obj = table
        return table

    def save_table(self) -> None:
        """``pipeline.save_table``: write the (online-updated) table to ``pipeline.correlation_table``."""
        p = self.runtime.pipeline
        if self.table_obj is not None and p.save_table and p.correlation_table:
            self.table_obj.save(p.correlation_table)

    # ------------------------------------------------------------ routing

    def route(self, layer: int | None, choices: torch.Tensor) -> list[int]:
        """A router chose ``choices`` (``[T, k]``) at ``layer``: returns tokens per expert and,
        the first time these choices are seen this step, queues the layer's cold experts and
        feeds the correlation table. Idempotent for the same choices tensor in one step."""
        step = self.runtime.scheduler.step
        seen = self._routed.get(layer)
        if seen is not None and seen[0] == step and seen[1] is choices:
            return seen[2]
        op = self.experts.get(layer)
        if choices.dtype is torch.long and choices.is_cpu and not choices.requires_grad:
            cpu = choices                                                              # [T, k] as it is
        else:
            cpu = choices.detach().to("cpu", torch.long)                               # [T, k], one sync
        self.last_tokens = cpu.shape[0]
        if seen is not None and seen[0] == step and torch.equal(seen[3], cpu):
            return seen[2]              # the gate derived these choices already (logits-only router)
        n = op.num_experts if op is not None else int(cpu.max()) + 1 if cpu.numel() else 1
        counts_t, in_range = _tokens_per_expert(cpu, n)                                # [E]
        counts = counts_t.tolist()
        self._routed[layer] = (step, choices, counts, cpu)
        for o in [op] + self.partners.get(layer, []):
            if o is not None:
                o.queue_loads(counts)
        if isinstance(layer, int):
            self._choices[layer] = (step, cpu)
            table = self.table()
            if table is not None and table.online and layer in table.layer_ids and self.learns():
                try:
                    table.observe(layer, cpu, counts=counts_t if in_range and n == table.num_experts else None)
                except KinjectError as exc:   # bookkeeping must never break inference
                    logger.debug("correlation table: %s; starting a new step", exc)
                    table.reset_step()
        return counts

    def routed_counts(self, layer: int | None) -> list[int] | None:
        """Tokens per expert a router of ``layer`` chose this step, if it has routed."""
        seen = self._routed.get(layer)
        return seen[2] if seen is not None and seen[0] == self.runtime.scheduler.step else None

    def prev_choices(self, layer: int | None) -> torch.Tensor | None:
        """This step's choices at the MoE layer before ``layer`` (None if not routed yet)."""
        table = self.table()
        if table is None or not isinstance(layer, int):
            return None
        prev = table.prev_layer(layer)
        got = self._choices.get(prev) if prev is not None else None
        return got[1] if got is not None and got[0] == self.runtime.scheduler.step else None

    def pregate(self, layer: int | None, args: tuple, kwargs: dict) -> None:
        """Router of ``layer`` ran on ``args``: if the next MoE layer's experts predict with
        ``next_gate``, run that layer's router on the same input and prefetch what it picks."""
        nxt = self.next_layer(layer)
        op = self.experts.get(nxt) if nxt is not None else None
        gate = self.gates.get(nxt) if nxt is not None else None
        if op is None or gate is None or op.predictor != "next_gate" or op.prefetch_settled():
            return
        choices = gate.choices_for(args, kwargs)
        if choices is None:
            return
        counts = _tokens_per_expert(choices.detach().to("cpu", torch.long), op.num_experts)[0].tolist()
        self._pregated[nxt] = (self.runtime.scheduler.step, counts)
        self.runtime.store.prefetch_many(op.prefetch_units())

    def next_layer(self, layer: int | None) -> int | None:
        """The next MoE layer after ``layer`` (None after the last one, or for a layer without an index).
        Asked per layer per step: the answers are kept until an experts operator attaches or detaches."""
        if self._next is None:
            ids = sorted(l for l in self.experts if isinstance(l, int))
            self._next = dict(zip(ids, ids[1:]))
        return self._next.get(layer)

    def layers_changed(self) -> None:
        """An experts operator attached or detached: :meth:`next_layer` and :meth:`learns` look again."""
        self._next = None
        self._learns = None

    def learns(self) -> bool:
        """Whether the online table counts this model's routing: only where a count can be used,
        i.e. some expert can need a transfer (a prefetch to predict), or the table is written
        out for later runs (``pipeline.save_table`` with a ``correlation_table`` path). Experts
        that all stay on the device (resident, or host tensors a CPU uses in place) would pay
        for counting every step and never predict: bookkeeping scales with transfers."""
        store = self.runtime.store
        got = self._learns
        if got is not None and got[0] == store.budget:
            return got[1]
        p = self.runtime.pipeline
        ops = [*self.experts.values(), *(o for group in self.partners.values() for o in group)]
        answer = bool(p.save_table and p.correlation_table) or any(
            not store.never_moves(u) for op in ops for u in op.units)
        self._learns = (store.budget, answer)
        return answer

    def prefetch_next(self, layer: int | None) -> None:
        """``layer``'s experts start computing (it has routed; its cold experts and the next operators'
        lookahead weights are queued): the next MoE layer's experts, when they prefetch at
        ``hot_prefetch_at="previous_layer"``, start their predicted experts now, behind those loads
        (the prediction needs nothing more than this layer's choices). Idempotent within a step
        (the prediction is kept, a unit on its way is not fetched twice)."""
        op = self.experts.get(self.next_layer(layer))
        if op is None or op.hot_prefetch_at != "previous_layer" or op.prefetch_settled():
            return
        self.runtime.store.prefetch_many(op.prefetch_units())   # stops where the budget ends

    def pregated(self, layer: int | None) -> list[int] | None:
        """Tokens per expert the previous layer's gate predicted for ``layer`` this step, if any."""
        got = self._pregated.get(layer)
        return got[1] if got is not None and got[0] == self.runtime.scheduler.step else None

    def has_prev_layer(self, layer: int | None) -> bool:
        """Whether the table predicts ``layer`` from an earlier MoE layer's choices."""
        table = self.table()
        return table is not None and isinstance(layer, int) and table.prev_layer(layer) is not None

    def predict(self, layer: int | None, k: int, min_use: float | None = None) -> list[int]:
        """The ``k`` experts of ``layer`` the table expects to be hottest for this batch group, and
        with ``min_use`` every further one it expects the batch group to use with at least that
        chance (:meth:`CorrelationTable.predict`)."""
        table = self.table()
        if table is None or not isinstance(layer, int):
            return list(range(k))
        return table.predict(layer, self.prev_choices(layer), k, min_use=min_use, tokens=self.last_tokens)

    # ------------------------------------------------------------ reporting

    def count_io(self, layer: int | None, loads: int, nbytes: int, used: int) -> None:
        s = self.io.setdefault(layer, {"steps": 0, "loads": 0, "bytes": 0, "used": 0})
        s["steps"] += 1
        s["loads"] += loads
        s["bytes"] += nbytes
        s["used"] += used

    def report_lines(self) -> list[str]:
        from kinject.engine.store import _fmt

        def pct(x):
            return "n/a" if x is None else f"{100 * x:.1f}%"

        steps = max((s["steps"] for s in self.io.values()), default=0)
        loads = sum(s["loads"] for s in self.io.values())
        moved = sum(s["bytes"] for s in self.io.values())
        lines = [f"experts: {self.stats.summary()}; experts loaded/step {loads / steps if steps else 0:.2f}; "
                 f"moved {_fmt(moved)} over {steps} steps"]
        for layer in sorted(self.io, key=lambda x: (x is None, x or 0)):
            s = self.io[layer]
            n = max(s["steps"], 1)
            lines.append(f"  layer {layer}: prefetch precision {pct(self.stats.precision(layer))}, "
                         f"hot accuracy {pct(self.stats.hot_accuracy(layer))}, "
                         f"coverage {pct(self.stats.coverage(layer))}, used/step {s['used'] / n:.2f}, "
                         f"loaded/step {s['loads'] / n:.2f}, moved {_fmt(s['bytes'])}")
        hosts = [op.host for op in (*self.experts.values(), *(o for g in self.partners.values() for o in g))
                 if op.host is not None]
        host_lines = [line for h in hosts if (line := h.report_line()) is not None]
        if host_lines:
            saved = sum(h.stats["saved_bytes"] for h in hosts)
            act = sum(h.stats["activation_bytes"] for h in hosts)
            lines.append(f"host compute (experts computed where they live): saved {_fmt(saved)} of expert moves, "
                         f"moved {_fmt(act)} of activations instead")
            lines += host_lines
        return lines


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
                 compute: Literal["device", "host", "auto"] = "device"):
        from kinject.engine.quant import QuantSpec

        super().__init__(base, key=key, runtime=runtime)
        self.predictor = predictor
        self.quant = QuantSpec.from_dict(quant)   # HQQ per expert: moved packed, dequantized before use
        self.weights, self.order, self.prefetch = weights, order, prefetch
        self.layout: ExpertLayout = infer_layout(base, key, layout)   # LayoutError lists what it saw
        self.names = list(self.layout.params)
        self.num_experts = int(self.layout.num_experts)   # the router's choices (zero-compute ones included)
        self.stored = int(self.layout.stored)             # experts 0 .. stored-1 have a unit
        config = getattr(base, "config", None)
        self.hot_experts = hot_experts if hot_experts is not None else \
            int(getattr(config, "num_experts_per_tok", None) or 2)
        self._entered = -1                   # ``module_list``: step the scheduler was last entered
        self._kept: list = []
        self.top_k_seen: int | None = None   # k of the last routed call (a logits-only gate reads it)
        self._hooks: list = []
        self._wrapped: list[nn.Module] = []  # ``block``: experts modules whose calls this operator serves
        self._inside = False                 # ``block``: inside a layout compute (the module's own forward runs)
        self._held: dict[int, dict] = {}     # ``block``: expert -> its acquired tensors, for this block call
        self._loop: tuple | None = None      # ``loop_block``: ("record", calls) / ("replay", calls, outputs, cursor, unchecked)
        self._block_used: list[int] | None = None
        self._block_tokens: int | None = None   # ``block``: tokens of the block call's hidden states
        self._hold_all = True                # ``block``: this call holds every chosen expert (the budget allows)
        self._hot_cap = hot_experts                # next_gate: every predicted expert unless K is given
        self.hot_probability = hot_probability
        self.hot_prefetch_at = hot_prefetch_at
        self.units: list["Unit"] = []
        self.binding = ParamBinding(base, runtime, key, self.names)   # placeholders for the expert params
        self._registered = False
        # (step, experts): this step's prediction, made once the previous MoE layer has routed (or at
        # once where there is none); every later ask in the step (each lookahead asks) gets it as it is
        self._pred: tuple[int, list[int]] | None = None
        self._pred_step: tuple[int, set[int]] = (-1, set())     # experts predicted this step
        self._last_loads = (0, 0)                              # store.owner_loads[key] at the last layer end
        self._prefetched: set[int] = set()                     # experts handed to prefetch, not yet consumed
        self._handed: tuple | None = None          # (prediction, _prefetched it went into, units): asked again
        self._own_views: tuple | None = None       # (the experts' own tensor dicts, [E, ...] views): _stacked
        self._all_there_at = -1                    # store.drops when every unit was last seen there (_all_there)
        self.fill_link = fill_link
        self._routed_step = -1                     # last step this layer's gate routed (stops link filling)
        self.compute = compute
        # where experts compute (operators.host_experts): None = all on the device; the backend is chosen now,
        # so a layout no host kernel serves is refused before any module is swapped
        self.host: HostExperts | None = HostExperts.of(self, compute)

    @classmethod
    def check_kwargs(cls, kwargs: dict) -> None:
        check_quant_kwarg(kwargs)
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
        params = self.binding.params
        sources = {n: self._sources(n, params[n]) for n in self.names}
        for e in range(self.stored):
            self.units.append(rt.store.add(f"{self.key}[{e}]", {n: sources[n][e] for n in self._unit_params(e)},
                                           self.weights, layer=self.layer, dtype=self.binding.dtype,
                                           quant=self.quant, owner=self.key))
        rt.store.cache_scores[self.key] = self._cache_score     # the host cache keeps the experts predicted hot
        self.binding.stand_in()           # the module's own params become storage-less stand-ins
        self._last_loads = (0, 0)
        self._own_views = self._handed = None
        self._all_there_at = -1
        if self.layer in registry:
            r.partners.setdefault(self.layer, []).append(self)
        else:
            registry[self.layer] = self
        r.layers_changed()
        self._registered = True
        if self.layout.call == "container":
            self._hook_children()
        elif self.layout.call == "block":
            self._wrap_children()
        elif self.layout.call == "loop_block":
            self._wrap_loop_children()
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
        self.runtime.checkpoint_source(full)          # the error naming the parameter when there is no checkpoint
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
        return src.read(dtype, out=rt.transfer.empty_host(src.shape, dtype or src.dtype))   # straight into (pinned) host memory

    def _hook_children(self) -> None:
        """``module_list``: child ``e``'s weights are acquired and bound around its own call."""
        for e in range(self.stored):
            child, names = self.layout.child(e), self.layout.expert_params(e)

            def pre(_m, _args, e=e, names=names):
                unit = self.units[e]
                if self._entered != self.runtime.scheduler.step:   # the block's first expert this step
                    self._entered = self.runtime.scheduler.step
                    self._enter()
                tensors = self.runtime.scheduler.acquire(unit)
                for n in names:
                    self.binding.params[n].data = tensors[n]

            def post(_m, _args, _out, e=e, names=names):
                for n in names:
                    self.binding.params[n].data = self.binding.placeholders[n]
                self.runtime.scheduler.release(self.units[e])

            self._hooks += [child.register_forward_pre_hook(pre),
                            child.register_forward_hook(post, always_call=True)]

    # ------------------------------------------------------------ a block with several experts modules

    def _wrap_children(self) -> None:
        """``block``: each experts module's call computes the experts it is given on their units
        (:meth:`_child_call`); the wrapper is an instance ``forward``, removed by :meth:`detach`."""
        for name in self.layout.children:
            def serve(own, args, kwargs, name=name):
                if self._inside:           # the layout's compute calls the module's own forward
                    return own(*args, **kwargs)
                return self._child_call(name, own, *args, **kwargs)

            self._serve_calls(self.base.get_submodule(name), serve)

    def _serve_calls(self, child: nn.Module, serve) -> None:
        """Route ``child``'s calls to ``serve(own_forward, args, kwargs)``: an instance ``forward``
        (hooks still run), removed by :meth:`detach`."""
        own = type(child).forward.__get__(child)
        child.forward = lambda *args, **kwargs: serve(own, args, kwargs)
        self._wrapped.append(child)

    def _forward_block(self, *args, **kwargs):
        """``block``: the block's own forward (its routing, its loop over its experts modules);
        the units its first experts-module call acquires are held until the block returns, so the
        later calls (``output_linear`` after ``input_linear``) find them on the device."""
        self._held, self._block_used = {}, None
        hidden = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()),
                      None)
        self._block_tokens = hidden[..., 0].numel() if hidden is not None and hidden.dim() > 1 else None
        try:
            return self.base(*args, **kwargs)
        finally:
            for e in self._held:
                self.runtime.scheduler.release(self.units[e])
            self._held = {}
            if self._block_used is not None:
                self._after_layer(routing(self.runtime), self._block_used)

    def _child_call(self, child: str, own, x: torch.Tensor, *rest):
        """Experts module ``child`` called by the block (``sized``: rows sorted by expert and their
        counts; ``grouped``: ``x[E*T, H]``): each expert it is given, on its unit's weights."""
        grouped = self.layout.children[child].call == "grouped"
        if grouped:
            groups = x.reshape(self.num_experts, -1, x.shape[-1])                 # [E, T, H]
            counts = (groups != 0).any(-1).sum(-1).tolist()                       # [E] tokens per expert
            if not self.layout.children[child].makes_zero_from_zero():
                counts = [max(n, 1) for n in counts]
            elif not any(counts):
                counts[0] = 1                      # all rows zero: expert 0 gives the (zero) output's shape
            rows = list(groups)
        else:
            self.layout.children[child].note_sizes(rest[0])                      # a list or a tensor
            counts = _as_ints(rest[0])
            T = self._block_tokens
            if self._block_used is None and T and sum(counts) % T == 0:
                # the block's k (every token's rows, once per choice): a gate that returns only
                # logits (a plain Linear router) routes with it from the next step on
                self.top_k_seen = sum(counts) // T or None
            rows = list(x.split(counts, dim=0))                                   # per expert [n_e, H]
        ys: dict[int, torch.Tensor] = {}
        for e in self._block_order(counts):
            tensors = self._held[e]
            self._inside = True
            try:
                with self.runtime.tracer.span("compute", f"{self.units[e].name} {child}", layer=self.layer,
                                              args={"expert": e, "tokens": counts[e]}):
                    ys[e] = self.layout.child_compute(child, e, tensors, rows[e], self.bound)
            finally:
                self._inside = False
        if grouped:
            like = next(iter(ys.values()))
            out = groups.new_zeros((groups.shape[0], groups.shape[1], like.shape[-1]))   # [E, T, out]
            for e, y in ys.items():
                out[e] = y.to(out.dtype)
            return out.reshape(-1, like.shape[-1])
        if not ys:
            self._inside = True
            try:
                return own(x, *rest)       # no rows at all: the module's own (empty) result
            finally:
                self._inside = False
        like = next(iter(ys.values()))
        return torch.cat([ys.get(e, like.new_zeros((0, like.shape[-1]))) for e in range(len(counts))], dim=0)

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

    # ------------------------------------------------------------ a block that loops over a ModuleList

    def _wrap_loop_children(self) -> None:
        """``loop_block``: every expert's call is answered by :meth:`_loop_call` (an instance
        ``forward``, removed by :meth:`detach`)."""
        for e, child in enumerate(self.layout.experts):
            self._serve_calls(child, lambda own, args, kwargs, e=e: self._loop_call(e, own, args, kwargs))

    def _forward_loop_block(self, *args, **kwargs):
        """The block's own forward twice: the first pass records each expert call's inputs, the
        recorded experts then compute in Klotski's order (:meth:`_schedule`), the second pass gets
        every expert call answered by its output. Costs the block's routing and combination twice
        (not its experts); the gate's routing of the second pass is the first's (no new loads).
        Where the second pass's inputs could not be compared by value call by call (GPU tensors,
        :func:`_same_call`), they are read once after it; if any differs (an expert's input
        depended on another's output, zeros in the first pass), the block runs once more with every
        expert call computed on its unit."""
        calls: dict[int, list] = {}
        self._loop = ("record", calls)
        try:
            self.base(*args, **kwargs)
            counts = [sum(_call_rows(c) for c in calls.get(e, ())) for e in range(self.num_experts)]
            results: dict[int, list] = {e: [] for e in calls}

            def run_group(group: list[int], tensors: list[dict]) -> None:
                for e, t in zip(group, tensors):
                    own = type(self.layout.experts[e]).forward.__get__(self.layout.experts[e])
                    with self.bound(t):
                        results[e] += [own(*a, **kw) for a, kw in calls[e]]

            self._schedule(counts, run_group, None)
            unchecked: list[torch.Tensor] = []
            self._loop = ("replay", calls, results, dict.fromkeys(calls, 0), unchecked)
            out = self.base(*args, **kwargs)
            if unchecked and not bool(torch.stack(unchecked).all()):          # one device sync per block call
                self._loop = None
                out = self.base(*args, **kwargs)
            return out
        finally:
            self._loop = None

    def _loop_call(self, e: int, own, args: tuple, kwargs: dict):
        """Expert ``e`` called by its block: recorded (zeros of its output's shape, from one row
        on the weightless placeholders), answered from the precomputed outputs, or -- outside the
        two passes, or when the block's second pass gives other inputs -- computed on its unit."""
        mode = self._loop
        if mode is not None and mode[0] == "shape":
            return own(*args, **kwargs)
        rows = _call_rows((args, kwargs))
        if mode is not None and mode[0] == "record":
            mode[1].setdefault(e, []).append((args, kwargs))
            if rows == 0:
                return own(*args, **kwargs)
            return self._zeros_like_output(e, args, kwargs)
        if mode is not None:
            _, calls, results, seen, unchecked = mode
            i = seen.get(e, 0)
            if i < len(results.get(e, ())) and _same_call(calls[e][i], (args, kwargs), unchecked):
                seen[e] = i + 1
                return results[e][i]
        if rows == 0:
            return own(*args, **kwargs)
        unit = self.units[e]
        tensors = self.runtime.scheduler.acquire(unit)
        try:
            with self.bound(tensors):
                return own(*args, **kwargs)
        finally:
            self.runtime.scheduler.release(unit)

    def _zeros_like_output(self, e: int, args: tuple, kwargs: dict):
        """Zeros shaped like expert ``e``'s output on these inputs: its forward on the meta device
        (meta parameters and inputs: shapes only, nothing computed, no weight read)."""
        child, saved = self.layout.experts[e], self._loop
        params = {n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n, p in child.named_parameters()}
        meta = lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v          # noqa: E731
        self._loop = ("shape",)
        try:
            out = torch.func.functional_call(child, params, tuple(meta(a) for a in args),
                                             {k: meta(v) for k, v in kwargs.items()})
        finally:
            self._loop = saved
        device = next(v.device for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))
        if isinstance(out, torch.Tensor):
            return torch.zeros(out.shape, dtype=out.dtype, device=device)
        return type(out)(torch.zeros(o.shape, dtype=o.dtype, device=device) if isinstance(o, torch.Tensor) else o
                         for o in out)

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

    def detach(self) -> nn.Module:
        rt = self.runtime
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for child in self._wrapped:
            child.__dict__.pop("forward", None)
        self._wrapped = []
        self.binding.restore()
        for u in self.units:
            if u.name in rt.store:
                rt.store.remove(u)
        rt.store.cache_scores.pop(self.key, None)
        self.units = []
        self._own_views = self._handed = None
        if self.host is not None:
            self.host.close()
        if self._registered:
            r = routing(rt)
            if r.experts.get(self.layer) is self:
                r.experts.pop(self.layer, None)
                r.layers_changed()
                rest = r.partners.pop(self.layer, [])
                if rest:
                    r.experts[self.layer] = rest[0]
                    if rest[1:]:
                        r.partners[self.layer] = rest[1:]
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
        step = self.runtime.scheduler.step
        pred = self._pred
        if pred is not None and pred[0] == step:
            return pred[1]
        r = routing(self.runtime)
        pregated = r.pregated(self.layer) if self.predictor == "next_gate" else None
        if self.prefetch == "all":
            experts = list(range(self.num_experts))
        elif pregated is not None:                 # the previous gate ran this layer's router
            experts = sorted((e for e, n in enumerate(pregated) if n), key=lambda e: (-pregated[e], e))
            experts = experts[: self._hot_cap] if self._hot_cap is not None else experts
        else:
            have_prev = r.prev_choices(self.layer) is not None
            if not have_prev and r.has_prev_layer(self.layer):
                return []       # the layer this prediction is made from has not routed yet: ask again later
            experts = r.predict(self.layer, min(self.hot_experts, self.num_experts), self.hot_probability)
            self._pred = (step, experts)
        if self._pred_step[0] != step:
            self._pred_step = (step, set())
        self._pred_step[1].update(experts)
        return experts

    def offloads(self) -> bool:
        return any(u.offloaded for u in self.units)

    def _all_there(self) -> bool:
        """Every expert's weights are on the device, on their way, or need no transfer ever (host
        tensors a CPU uses in place: ``TensorStore.never_moves``), so a prediction could start no
        transfer: the prefetcher skips it (bookkeeping that scales with transfers, not with layers).
        The store counts the device copies it forgets (``drops``); while none was forgotten since
        every unit was last seen there, they still all are, and the answer costs one comparison."""
        store = self.runtime.store
        drops = store.drops
        if self._all_there_at == drops:
            return True
        for u in self.units:
            if not store.settled(u):
                return False
        self._all_there_at = drops
        return True

    def _cache_score(self, unit: "Unit") -> float | None:
        """How often the routers chose ``unit``'s expert in this layer (the correlation table's
        frequencies): what the store's host cache of the disk tier keeps (hot experts stay, the
        least likely are evicted). None without a table: the cache falls back to LRU."""
        table = routing(self.runtime).table_obj
        freq = table.freq.get(self.layer) if table is not None and isinstance(self.layer, int) else None
        if freq is None:
            return None
        return float(freq[int(unit.name[len(self.key) + 1:-1])])     # unit names: f"{key}[{e}]"

    def prefetch_settled(self) -> bool:
        return self.prefetch == "none" or not self.units or self._all_there()

    def prefetch_units(self) -> list:
        if self.prefetch_settled():
            return []
        predicted = self.predicted()
        handed = self._handed
        if handed is not None and handed[0] is predicted and handed[1] is self._prefetched:
            units = handed[2]                      # the same prediction, not consumed since: same units
        else:
            experts = [e for e in predicted if e < self.stored and self.units[e].offloaded]
            if self.host is not None:          # only the ones worth moving (the rest compute where they live)
                experts = self.host.worth_prefetching(experts, routing(self.runtime).last_tokens, self.hot_experts)
            self._prefetched.update(experts)
            units = [self.units[e] for e in experts]
            self._handed = (predicted, self._prefetched, units)
        if self.fill_link and self.prefetch == "hot" and units:
            self._start_filling(units)
        return units

    # ------------------------------------------------------------ link filling

    def _start_filling(self, hot: list) -> None:
        """``fill_link``: once the K hot experts have landed and while the gate has not routed
        yet, keep the link busy with the next experts in the table's ranking, one at a time
        (each starts when the previous lands), as long as the budget allows. What the router
        then does not choose is discarded like any unused prefetch."""
        step = self.runtime.scheduler.step
        if self._routed_step == step or not isinstance(self.layer, int):
            return
        store = self.runtime.store
        for u in hot:
            store.prefetch(u)                      # idempotent: the scheduler's call is then a no-op
        last = hot[-1].handle
        if last is None:
            return
        ranking = routing(self.runtime).predict(self.layer, self.stored)
        pending = [e for e in ranking if e < self.stored and self.units[e] not in hot]
        last.add_done_callback(lambda _h: self._fill_next(step, pending))

    def _fill_next(self, step: int, ranking: list[int]) -> None:
        """Done-callback (a transfer thread): prefetch the next ranked expert not there yet."""
        rt = self.runtime
        while ranking:
            if self._routed_step >= step or rt.scheduler.step != step:
                return                             # the gate has routed: on-demand loads take over
            e = ranking.pop(0)
            u = self.units[e]
            if u.device is not None or u.handle is not None or not u.offloaded:
                continue
            if not rt.store.prefetch(u):
                return                             # out of budget
            self._prefetched.add(e)
            if self._pred_step[0] == step:
                self._pred_step[1].add(e)
            h = u.handle
            if h is not None:
                h.add_done_callback(lambda _h: self._fill_next(step, ranking))
            return

    def queue_loads(self, counts: list[int]) -> None:
        """Start on-demand loads of every selected expert not materialised nor in flight, in the
        order they will be consumed (what fits the budget now; the rest is loaded in :meth:`forward`):
        most tokens first where this operator orders the compute, expert index order where the
        block's own loop calls the experts (``module_list``: the family's ``for`` over its experts)."""
        self._routed_step = self.runtime.scheduler.step
        units = self.units
        on_host = self.host.choose(counts) if self.host is not None else ()
        cold = [e for e, n in enumerate(counts[: self.stored])
                if n and units[e].device is None and units[e].handle is None and e not in on_host]
        if not cold:
            return
        if self.layout.call != "container":       # most tokens first; ties: ascending ids (a stable sort)
            cold.sort(key=counts.__getitem__, reverse=True)
        self.runtime.store.fetch_many([units[e] for e in cold])

    def _try_fetch(self, unit: "Unit") -> bool:
        store = self.runtime.store
        if not store.fits(unit.nbytes) and store.policy != "cache":
            return False
        try:
            store.fetch(unit, "ondemand")
        except BudgetError:
            return False
        return True

    # ------------------------------------------------------------ compute

    def forward(self, *args, **kwargs):
        call = self.layout.call
        if call == "lookup":
            return self._forward_lookup(*args, **kwargs)
        if call == "container":
            if type(self.base).forward in (nn.ModuleList.forward, nn.ModuleDict.forward, nn.Module.forward):
                raise TypeError(f"{self.key}: a ModuleList of experts is not called; its block calls each expert")
            return self.base(*args, **kwargs)    # a keyed container's own loop calls its experts (hooked)
        if call == "block":
            return self._forward_block(*args, **kwargs)
        if call == "loop_block":
            return self._forward_loop_block(*args, **kwargs)
        args = list(args)
        hidden_states = args.pop(0) if args else kwargs.pop(next(k for k in kwargs if k not in _ROUTING_KWARGS))
        if call == "sized" and args and _is_sizes(args[0]):
            self.layout.note_sizes(args[0])
            return self._forward_sized(hidden_states, args[0])
        if call == "grouped" and not args and not set(kwargs) & set(_ROUTING_KWARGS):
            return self._forward_grouped(hidden_states)
        return self._forward_routed(hidden_states, *args, **kwargs)

    def _forward_routed(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """Called as transformers' experts are: ``(hidden_states, top_k_index, top_k_weights)``.
        The (token, expert) pairs are sorted by expert once; expert ``e``'s rows are one slice of
        the sorted order, and a group of ready experts is one call on their slices."""
        top_k_index, top_k_weights = _routing_args(tuple(args), kwargs)
        r = routing(self.runtime)
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])                                  # [T, H]
        T, k = top_k_index.shape[0], top_k_index.shape[-1]
        self.top_k_seen = k
        counts = r.route(self.layer, top_k_index)[: self.num_experts]            # [E] tokens per expert
        flat = top_k_index.reshape(-1)                                            # [S = T*k]
        perm = torch.argsort(flat, stable=True)                                   # [S], grouped by expert
        # index_select, not x[perm]: the same rows, several times faster on a CPU for many rows
        xs = x.index_select(0, perm // k)                                         # [S, H] one gather
        ws = top_k_weights.reshape(-1).index_select(0, perm).unsqueeze(-1)        # [S, 1]
        starts = [0, *itertools.accumulate(counts)]   # ids >= E (EP sentinels) sort last, stay zero
        out_dtype = _promoted(self._weight_dtype(), ws.dtype)
        S = flat.numel()
        ys = None                          # [S, H] in sorted order; zeros made on the first partial write

        def buffer() -> torch.Tensor:
            nonlocal ys
            if ys is None:
                ys = x.new_zeros((S, shape[-1]), dtype=out_dtype)
            return ys

        def rows_of(group: list[int]):
            n = [counts[e] for e in group]
            if starts[group[-1] + 1] - starts[group[0]] == sum(n):                # one slice of the sorted rows
                return slice(starts[group[0]], starts[group[-1] + 1]), n
            return host_to_device(_slices_index([starts[e] for e in group], n), xs.device), n

        def run_group(group: list[int], tensors: list[dict]) -> None:
            nonlocal ys
            rows, n = rows_of(group)
            stacked = self._stacked(group, tensors)
            if isinstance(rows, slice) and rows.start == 0 and rows.stop == S:        # every row: no buffer
                y = self.layout.compute_sorted(group, tensors, n, xs, self.bound, stacked=stacked) * ws
                ys = y if y.dtype == out_dtype else y.to(out_dtype)
                return
            buffer()[rows] = self.layout.compute_sorted(group, tensors, n, xs[rows], self.bound,
                                                        stacked=stacked) * ws[rows]

        def run_zero(e: int) -> None:
            rows, _ = rows_of([e])
            buffer()[rows] = self.layout.compute_zero(e, xs[rows]) * ws[rows]

        start_host = None
        if self.host is not None and xs.device.type == "cuda":
            def start_host(group: list[int]):
                rows, n = rows_of(group)
                job = self.host.start(group, counts, xs[rows], lambda g, ts, x: self.layout.compute_sorted(
                    g, ts, n, x, self.bound))

                def finish() -> None:
                    buffer()[rows] = job.result() * ws[rows]
                return finish

        self._schedule(counts, run_group, run_zero, start_host=start_host)
        buffer()
        # back to (token, slot) order: a gather by the inverse permutation (a scatter of whole rows,
        # out[perm] = ys, is several times slower on a CPU for a prefill's thousands of rows); the
        # inverse of a decode step's few pairs is one argsort, of many a scatter (linear, not S log S)
        inverse = torch.argsort(perm) if S <= 4096 else \
            torch.empty_like(perm).scatter_(0, perm, torch.arange(S, device=perm.device))
        final = ys.index_select(0, inverse).view(T, k, shape[-1]).sum(dim=1)      # [T, H]
        return (final if final.dtype == hidden_states.dtype else final.to(hidden_states.dtype)).reshape(shape)

    def _stacked(self, group: list[int], tensors: list[dict]) -> dict | None:
        """Role -> ``[E, ...]`` view over every stored expert's weights, when the group's tensors
        are the experts' own (resident units, or host units a CPU uses in place or "moves" over an
        emulated link): the grouped GEMM then slices it instead of checking each expert's addresses
        (per expert, per call). Told apart by identity: a unit that was moved or dequantized hands
        out another dict."""
        if self._own_views is None:
            own = [u.tensors if u.offloaded else u.device for u in self.units]
            tensors_only = all(isinstance(t, torch.Tensor) for d in own for t in d.values())
            self._own_views = (own, self.layout.stacked_views(own) if own and tensors_only else None)
        own, views = self._own_views
        if views is None:
            return None
        for e, t in zip(group, tensors):          # (a plain loop: no generator frame per expert)
            if t is not own[e]:
                return None
        return views

    def _forward_grouped(self, x: torch.Tensor) -> torch.Tensor:
        """Called with ``x[E*T, H]``: each expert's T rows, router scores already applied (0 for a
        token that did not pick it); an expert whose rows are all zero is skipped when zero rows
        give zero (no biases), otherwise every expert runs."""
        E = self.num_experts
        groups = x.reshape(E, -1, x.shape[-1])                                     # [E, T, H]
        counts = (groups != 0).any(-1).sum(-1).tolist()                           # [E] tokens per expert
        if not self.layout.makes_zero_from_zero():
            counts = [max(n, 1) for n in counts]
        out = torch.zeros_like(groups)                                            # [E, T, H]

        def run(e: int, y_of) -> None:
            out[e] = y_of(groups[e]).to(out.dtype)

        self._schedule(counts, *self._one_by_one(run))
        return out.reshape(x.shape)

    def _forward_sized(self, x: torch.Tensor, given) -> torch.Tensor:
        """Called with rows sorted by expert and their counts (parallel experts; ``given``: a list
        or an integer tensor, handed back as it is when there are no rows)."""
        sizes = _as_ints(given)
        starts = [0, *itertools.accumulate(sizes)]
        ys: dict[int, torch.Tensor] = {}

        def run(e: int, y_of) -> None:
            ys[e] = y_of(x[starts[e]: starts[e + 1]])

        self._schedule(list(sizes), *self._one_by_one(run))
        if not ys:
            return self.base(x, given)    # no rows at all: the module's own (empty) result
        like = next(iter(ys.values()))
        return torch.cat([ys.get(e, like.new_zeros((0, like.shape[-1]))) for e in range(len(sizes))], dim=0)

    def _forward_lookup(self, indices: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """Rows of an expert table: acquire the rows looked up, run the module's own lookup on them."""
        flat = indices.reshape(-1).to("cpu", torch.long)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        used = [e for e, n in enumerate(counts) if n]
        rows: dict[int, torch.Tensor] = {}

        def run_group(group: list[int], tensors: list[dict]) -> None:
            for e, t in zip(group, tensors):
                rows[e] = t["weight"]

        self._schedule(counts, run_group, None, keep=True)
        try:
            table = torch.stack([rows[e] for e in used]) if used else None        # [u, H]
            remap = torch.zeros(self.num_experts, dtype=torch.long, device=indices.device)
            remap[host_to_device(torch.tensor(used), indices.device)] = torch.arange(len(used), device=indices.device)
            if table is None:
                return self.base(indices, *args, **kwargs)
            with self.bound({"weight": table}):
                return self.base(remap[indices], *args, **kwargs)
        finally:
            self._release_kept()

    def _one_by_one(self, run):
        """(group function, zero-compute function) that call ``run(e, y_of)`` per expert with
        ``y_of(x) -> expert e on rows x`` through the layout's per-expert math."""
        def run_group(group: list[int], tensors: list[dict]) -> None:
            for e, t in zip(group, tensors):
                run(e, lambda xs, e=e, t=t: self.layout.compute(e, t, xs, self.bound))

        def run_zero(e: int) -> None:
            run(e, lambda xs: self.layout.compute_zero(e, xs))

        return run_group, run_zero

    def _schedule(self, counts: list[int], run_group, run_zero, keep: bool = False, start_host=None) -> None:
        """Klotski's expert-centric order over the experts with tokens, in groups:
        ``run_group(group, tensors)`` is called with experts ``group`` (ascending) whose weights
        are on the device (``tensors[i]``: expert ``group[i]``'s unit); ``run_zero(e)`` for a
        zero-compute expert (no weights). ``keep``: units stay acquired until :meth:`_release_kept`.
        With host compute (``compute: host / auto``) the experts :meth:`HostExperts.choose` keeps on
        the host compute there first, while the device's cold experts are still on the link: on a CPU
        device through ``run_group`` with their host tensors; on CUDA ``start_host(group)`` starts
        them on the host worker and returns the function that adds their outputs after the device's
        groups (none given: they compute on the device)."""
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
        host = self.host
        group = sorted(host.choose(counts).intersection(used))
        if not group:
            return used, None
        if self.runtime.device.type == "cuda":
            if start_host is None:
                return used, None                 # this call shape computes on the device only
            finish = start_host(group)
        else:
            host.run(group, counts, run_group)
            finish = None
        chosen = set(group)
        return [e for e in used if e not in chosen], finish

    def _enter(self) -> None:
        """About to compute: the scheduler prefetches ahead, then the next MoE layer's ``previous_layer`` prefetch."""
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

    def _weight_dtype(self) -> torch.dtype:
        return self.units[0].compute_dtype

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

    def extra_repr(self) -> str:
        return (f"key={self.key!r}, layout={self.layout.name!r}, experts={self.num_experts}, weights={self.weights!r}, order={self.order!r}, "
                f"hot_experts={self.hot_experts}, hot_probability={self.hot_probability}, hot_prefetch_at={self.hot_prefetch_at!r}, "
                f"prefetch={self.prefetch!r}, predictor={self.predictor!r}")


# ---------------------------------------------------------------- helpers


def _call_rows(call: tuple) -> int:
    """Rows of an expert call ``(args, kwargs)``: the first dimension of its first tensor."""
    args, kwargs = call
    t = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)
    return int(t.shape[0]) if t is not None and t.dim() > 0 else 0


def _same_call(a: tuple, b: tuple, unchecked: list[torch.Tensor]) -> bool:
    """Whether a replayed expert call (``b``) got the inputs of the recorded call ``a``: the same
    arguments, tensors of the same shapes, dtypes and devices, equal other values -- and equal tensor
    values. Those are compared here only where that is free (CPU tensors): on a GPU ``torch.equal``
    makes the host wait for the device, once per expert call. There the comparison is queued
    instead (a 0-dim bool appended to ``unchecked``) and the block reads all of them at once after its
    second pass (:meth:`GroupedExperts._forward_loop_block`)."""
    (aa, ak), (ba, bk) = a, b
    if len(aa) != len(ba) or set(ak) != set(bk):
        return False
    queued = []
    for x, y in zip((*aa, *(ak[k] for k in sorted(ak))), (*ba, *(bk[k] for k in sorted(bk)))):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
                    and x.dtype == y.dtype and x.device == y.device):
                return False
            if reading_syncs(x):
                queued.append(torch.eq(x, y).all())
            elif not torch.equal(x, y):
                return False
        elif x != y:
            return False
    unchecked += queued
    return True


def _as_ints(sizes) -> list[int]:
    """Per-expert row counts as Python ints: a tensor in one ``tolist`` (one device sync on a GPU,
    not one per expert), a list as it is."""
    return sizes.tolist() if isinstance(sizes, torch.Tensor) else [int(n) for n in sizes]


def _slices_index(starts: list[int], counts: list[int]) -> torch.Tensor:
    """Row indices of the slices ``[starts[i], starts[i] + counts[i])``, concatenated (CPU)."""
    if sum(counts) <= 1024:                # a decode step's few rows: one tensor from a list (six ops cost more)
        rows = array("q", [r for a, c in zip(starts, counts) for r in range(a, a + c)])
        return torch.frombuffer(rows, dtype=torch.long) if rows else torch.empty(0, dtype=torch.long)
    n = torch.tensor(counts)
    shift = torch.tensor(starts) - (torch.cumsum(n, 0) - n)          # [g] start minus its place in the output
    return torch.repeat_interleave(shift, n) + torch.arange(int(n.sum()))


@functools.lru_cache(maxsize=64)
def _promoted(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """``torch.promote_types``, remembered (asked per layer-step with the same two dtypes)."""
    return torch.promote_types(a, b)


def _group_name(key: str, group: list[int]) -> str:
    """Trace name of a grouped compute: ``key[a,b,c]`` (the unit name for one expert)."""
    return f"{key}[{','.join(map(str, group))}]"


def _tokens_per_expert(choices: torch.Tensor, n: int) -> tuple[torch.Tensor, bool]:
    """Top-k choices (CPU ``[T, k]``) -> (how many tokens picked each of ``n`` experts, ``[n]``;
    whether every choice was in ``[0, n)``). Ids outside, e.g. expert-parallel sentinels, are
    not counted. One ``bincount`` when every id is in range (a longer result or an error for a
    negative id sends it to the filtered count)."""
    flat = choices.flatten()
    try:
        counts = torch.bincount(flat, minlength=n)
    except RuntimeError:                   # a negative id
        counts = None
    if counts is not None and counts.numel() == n:
        return counts, True
    return torch.bincount(flat[(flat >= 0) & (flat < n)], minlength=n), False


def _routing_args(args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(top_k_index [T, k], top_k_weights [T, k]) from the experts call, whatever the family names them."""
    rest = list(args)
    index = rest.pop(0) if rest else next((kwargs[n] for n in _INDEX_KWARGS if n in kwargs), None)
    weights = rest.pop(0) if rest else next((kwargs[n] for n in _WEIGHT_KWARGS if n in kwargs), None)
    if index is None or weights is None:
        raise TypeError("GroupedExperts.forward(hidden_states, top_k_index, top_k_weights): routing arguments "
                        f"missing (got {len(args)} positional, keywords {sorted(kwargs)})")
    return index, weights
