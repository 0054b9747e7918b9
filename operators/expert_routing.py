"""What the gates and the experts operators of one model share: :class:`ExpertRouting`.

This step's routing per MoE layer (tokens per expert, the choices a correlation table learns
from), the correlation table itself (Klotski §6.2), the prefetch statistics and the transfer
counts of the report. One per runtime (:func:`routing`); the gates
(:class:`~operators.gate.PrefetchGate`) feed it, every
:class:`~operators.experts.GroupedExperts` reads it. The helpers that read a router's output or an
experts call's routing arguments, whatever the family names them, live here too.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kinject.errors import KinjectError
from kinject.engine.prefetch import CorrelationTable, PrefetchStats

if TYPE_CHECKING:
    from kinject.runtime import Runtime


class RoutedExperts(Protocol):
    """What the routing asks of an experts operator of a layer (:class:`operators.experts.GroupedExperts`
    implements it; named here so this module imports no operator)."""

    num_experts: int
    units: list
    predictor: str
    hot_prefetch_at: str
    host: Any
    key: str
    device_gemv_groups: int             # groups the device (a CPU) computed through kinject's grouped GEMV

    def queue_loads(self, counts: list[int]) -> None: ...
    def prefetch_units(self) -> list: ...
    def prefetch_settled(self) -> bool: ...
    def routing_counts(self, tokens: int | None) -> bool: ...

logger = logging.getLogger(__name__)

# Names the experts forward's routing arguments have across families (GPT-OSS differs).
_INDEX_KWARGS = ("top_k_index", "router_indices", "selected_experts", "topk_indices")
_WEIGHT_KWARGS = ("top_k_weights", "routing_weights", "router_scores", "topk_weights")
_ROUTING_KWARGS = _INDEX_KWARGS + _WEIGHT_KWARGS


def routing(runtime: "Runtime") -> "ExpertRouting":
    """The runtime's one :class:`ExpertRouting` (made on first use; asked several times per layer-step)."""
    return runtime.peek("expert_routing") or runtime.shared("expert_routing", lambda: ExpertRouting(runtime))


def _is_sizes(x: Any) -> bool:
    """Per-expert row counts of a ``sized`` call: a list / tuple, or a 1-D integer tensor (a
    family's grouped GEMM may take its counts as a tensor)."""
    if isinstance(x, (list, tuple)):
        return True
    return isinstance(x, torch.Tensor) and x.dim() == 1 and not x.is_floating_point() and x.dtype != torch.bool


def router_index_position(output: Any) -> int | None:
    """Where a router's output holds its top-k expert indices (an integer tensor ``[T, k]``): its
    position in the returned tuple / list, -1 for the output itself, None if nowhere. A router
    returns the same structure every call, so a caller may keep the answer and only check it
    (:func:`indices_at`)."""
    items = output if isinstance(output, (tuple, list)) else (output,)
    for i, t in enumerate(items):
        if isinstance(t, torch.Tensor) and t.ndim == 2 and t.dtype in _INDEX_DTYPES:
            return i if items is output else -1
    return None


def indices_at(output: Any, at: int) -> torch.Tensor | None:
    """The indices at the position :func:`router_index_position` found in an earlier output of the
    same router, if they are still there (else None: look again)."""
    t = output if at < 0 else output[at] if isinstance(output, (tuple, list)) and len(output) > at else None
    return t if isinstance(t, torch.Tensor) and t.ndim == 2 and t.dtype in _INDEX_DTYPES else None


#: what a router's top-k indices may be stored as (every integer dtype; not bool)
_INDEX_DTYPES = frozenset({torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint16,
                           torch.uint32, torch.uint64})


class ExpertRouting:
    """What gates and experts of one model share: this step's routing per layer, the
    correlation table, the prefetch statistics, and transfer counts for the report."""

    def __init__(self, runtime: "Runtime"):
        self.runtime = runtime
        self.experts: dict[int | None, RoutedExperts] = runtime.shared("experts_by_layer", dict)
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
        self.pregates = False                            # some experts predict with ``next_gate`` (:meth:`pregate`)

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
        counts, counts_t, in_range = _counts_per_expert(cpu, n)                         # [E]
        self._routed[layer] = (step, choices, counts, cpu)
        if op is not None:
            op.queue_loads(counts)
        for o in self.partners.get(layer, ()):
            o.queue_loads(counts)
        if isinstance(layer, int):
            self._choices[layer] = (step, cpu)
            partners = self.partners.get(layer)
            counted = op is None or op.routing_counts(self.last_tokens) or \
                partners is not None and any(o.routing_counts(self.last_tokens) for o in partners)
            table = self.table() if counted else None
            if table is not None and table.online and layer in table.layer_ids and self.learns():
                try:
                    table.observe(layer, cpu, counts=(counts_t if counts_t is not None else torch.tensor(counts))
                                  if in_range and n == table.num_experts else None)
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
        """An experts operator attached or detached: :meth:`next_layer`, :meth:`learns` and
        :attr:`pregates` look again."""
        self._next = None
        self._learns = None
        self.pregates = any(op.predictor == "next_gate" for op in self.operators())

    def operators(self) -> list:
        """Every experts operator of the model: one per MoE layer, and the further ones of a layer
        with several (parallel-experts pairs)."""
        return [*self.experts.values(), *(o for group in self.partners.values() for o in group)]

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
        answer = bool(p.save_table and p.correlation_table) or any(
            not store.never_moves(u) for op in self.operators() for u in op.units)
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
        return table.predict(layer, self.prev_choices(layer), k, min_use=min_use,
                             tokens=self.prediction_tokens(layer))

    def prediction_tokens(self, layer: int | None) -> int | None:
        """Tokens of the forward a prediction for ``layer`` is for, where no earlier layer's choices
        tell it: the next forward's once ``layer`` has routed in this one (a lookahead that wraps
        around to the next step), else this forward's. Why not the last routing's count: a prefill's
        256 tokens would size the first decode step's prefetch of 8 tokens (every expert "likely")."""
        sched = self.runtime.scheduler
        seen = self._routed.get(layer)
        tokens = sched.next_forward_tokens() if seen is not None and seen[0] == sched.step else sched.forward_tokens()
        return tokens or self.last_tokens

    # ------------------------------------------------------------ reporting

    def count_io(self, layer: int | None, loads: int, nbytes: int, used: int) -> None:
        s = self.io.setdefault(layer, {"steps": 0, "loads": 0, "bytes": 0, "used": 0})
        s["steps"] += 1
        s["loads"] += loads
        s["bytes"] += nbytes
        s["used"] += used

    def report_lines(self) -> list[str]:
        from kinject.formatting import format_bytes as _fmt

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
        return lines + self._host_lines() + self._device_gemv_lines()

    def _device_gemv_lines(self) -> list[str]:
        """A CPU device's experts computed through kinject's grouped GEMV (decode steps), per operator."""
        return [f"  {op.key}: the device (a CPU) computed {n} expert groups through kinject's grouped GEMV"
                for op in self.operators() if (n := op.device_gemv_groups)]

    def _host_lines(self) -> list[str]:
        """The host lane of the report: experts computed where they live, the bytes that did not move."""
        from kinject.formatting import format_bytes as _fmt

        hosts = [op.host for op in self.operators() if op.host is not None]
        lines = [line for h in hosts if (line := h.report_line()) is not None]
        if not lines:
            return []
        saved = sum(h.stats["saved_bytes"] for h in hosts)
        act = sum(h.stats["activation_bytes"] for h in hosts)
        return [f"host compute (experts computed where they live): saved {_fmt(saved)} of expert moves, "
                f"moved {_fmt(act)} of activations instead", *lines]



# choices up to this many (a decode step's T * k) are counted in Python: one ``tolist`` instead of a
# ``bincount`` and a ``tolist`` of all E counts (torch operations, ~10 us each at batch 1 on a CPU)
FEW_CHOICES = 64


def _counts_per_expert(choices: torch.Tensor, n: int) -> tuple[list[int], torch.Tensor | None, bool]:
    """Top-k choices (CPU ``[T, k]``) -> (tokens per expert as a list of ``n``, the same as a tensor where
    it was counted by torch (else None), whether every choice was in ``[0, n)``); ids outside are not
    counted (:func:`_tokens_per_expert`)."""
    if choices.numel() <= FEW_CHOICES:
        counts = [0] * n
        in_range = True
        for e in _flat_ids(choices):
            if 0 <= e < n:
                counts[e] += 1
            else:
                in_range = False
        return counts, None, in_range
    counts_t, in_range = _tokens_per_expert(choices, n)
    return counts_t.tolist(), counts_t, in_range


def _flat_ids(choices: torch.Tensor) -> list[int]:
    """``choices.view(-1).tolist()`` without the view operation for a decode step's ``[1, k]`` (after the
    experts' weights have flushed the caches, a view costs ~20 us, its work ~1)."""
    if choices.dim() == 2 and choices.shape[0] == 1:
        return choices.tolist()[0]
    return choices.tolist() if choices.dim() == 1 else choices.reshape(-1).tolist()


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
