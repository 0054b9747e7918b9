"""Where a group of ready experts computes: the compute sites of :class:`~operators.experts.GroupedExperts`.

The order policy (:mod:`operators.expert_order`) decides which experts run when and hands each
group's weights (one dict per expert, as the store's units handed them out) to the interception
of the layout (:mod:`operators.expert_interception`), which knows the rows of each expert. It then
asks a *compute site* for the outputs, and nothing else: a site is the one object that turns
(experts, their weights, their rows) into expert outputs (vLLM's modular fused-MoE kernel splits
the same way: a prepare / finalize object per call shape, an experts object that only computes).

:class:`ExpertComputeSite` is that interface. It has two implementations, chosen per expert and per
step (:class:`operators.expert_placement.ExpertSites`): :class:`DeviceSide` here (the family's math
through its layout adapter, :meth:`~operators.expert_layouts.ExpertLayout.compute_sorted`: one
grouped GEMM over a stacked ``[E, ...]`` view where the experts' tensors form one, the ``loop``
backend otherwise, :mod:`operators.expert_compute`, on the device the weights were acquired to) and
:class:`operators.host_experts.HostExperts` (experts of the host tier computed where they live, only
their rows crossing the link).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Callable

import torch

from kinject.engine.host_kernels import MM_ROWS, gemv_experts_taken, gemv_key, gemv_takes
from kinject.engine.transfer import host_to_device

if TYPE_CHECKING:
    from operators.expert_step import ExpertSet


class ExpertComputeSite:
    """Computes experts of one operator on given rows.

    ``compute(group, tensors, counts, x)``: experts ``group`` (ascending), ``tensors[i]`` expert
    ``group[i]``'s weights (role -> tensor), ``x`` their rows sorted by expert (``counts[i]`` rows
    of expert ``group[i]``, ``[sum(counts), H]``) -> ``[sum(counts), H_out]``, unweighted.
    ``compute_one(e, tensors, x)``: expert ``e`` alone on rows ``x`` (layouts whose calls hand
    over one expert's rows at a time). ``reset()``: the operator's units were (re)made or removed:
    forget anything remembered about their tensors. ``takes_broadcast_rows``: whether ``x`` may be one
    row broadcast to every row (a stride-0 view, a decode step's token for each of its experts)."""

    takes_broadcast_rows = False

    def compute(self, group: list[int], tensors: list[dict], counts: list[int], x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def compute_one(self, e: int, tensors: dict, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError


class DeviceSide(ExpertComputeSite):
    """The experts compute where their weights were acquired (the device; a CPU runtime's host),
    in the family's own math through the operator's layout adapter; a group whose tensors are the
    experts' own (resident units, host units a CPU uses in place) is one grouped GEMM over their
    stacked ``[E, ...]`` view (:meth:`stacked`)."""

    def __init__(self, experts: "ExpertSet", gemv: "GemvGroups | None" = None):
        self.experts = experts
        self.gemv = gemv                           # a CPU device's few-row groups (GemvGroups), or None
        self._own_views: tuple | None = None       # (the experts' own tensor dicts, [E, ...] views)

    def compute(self, group, tensors, counts, x):
        gemv = self.gemv
        if gemv is not None:
            y = gemv(tensors, counts, x)
            if y is not None:
                return y
        experts = self.experts
        stacked = self.stacked(group, tensors)
        if stacked is None and len(group) > 2:
            parts = _by_storage(tensors)
            if 1 < len(parts) < len(group):
                return self._compute_parts(parts, group, tensors, counts, x)
        return experts.layout.compute_sorted(group, tensors, counts, x, experts.bound, stacked=stacked)

    def _compute_parts(self, parts: list[list[int]], group, tensors, counts, x: torch.Tensor) -> torch.Tensor:
        """A group whose experts landed in several slabs (a prefetched batch and the router's cold
        batch): one grouped call per slab on its experts' rows, gathered, and the outputs put back in
        the group's row order (copies of activations only; each row's result is the same bits)."""
        experts, starts = self.experts, [0, *itertools.accumulate(counts)]
        out = None
        for part in parts:
            rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in part])        # [n_part] host
            rows = host_to_device(rows, x.device)
            y = experts.layout.compute_sorted([group[i] for i in part], [tensors[i] for i in part],
                                              [counts[i] for i in part], x.index_select(0, rows), experts.bound)
            if out is None:
                out = y.new_empty((x.shape[0], y.shape[-1]))                               # [N, H_out]
            out.index_copy_(0, rows, y)
        return out

    def compute_one(self, e, tensors, x):
        return self.experts.layout.compute(e, tensors, x, self.experts.bound)

    def reset(self) -> None:
        self._own_views = None

    def stacked(self, group: list[int], tensors: list[dict]) -> dict | None:
        """Role -> ``[E, ...]`` view over every stored expert's weights, when the group's tensors
        are the experts' own (resident units, or host units a CPU uses in place or "moves" over an
        emulated link): the grouped GEMM then slices it instead of checking each expert's addresses
        (per expert, per call). Told apart by identity: a unit that was moved or dequantized hands
        out another dict."""
        if self._own_views is None:
            experts = self.experts
            own_tensors = experts.runtime.store.own_tensors
            own = [own_tensors(u) for u in experts.units]
            tensors_only = all(isinstance(t, torch.Tensor) for d in own for t in d.values())
            self._own_views = (own, experts.layout.stacked_views(own) if own and tensors_only else None)
        own, views = self._own_views
        if views is None:
            return None
        for e, t in zip(group, tensors):          # (a plain loop: no generator frame per expert)
            if t is not own[e]:
                return None
        return views


class GemvGroups:
    """A CPU device's decode-sized expert groups (fewer than
    :data:`~kinject.engine.host_kernels.MM_ROWS` bfloat16 rows per expert) through kinject's compiled
    grouped GEMV (:mod:`kinject.engine.host_gemv`): one call per projection for the whole group, each
    weight row read once, instead of torch's grouped GEMM over the same weights. On a CPU device the
    device *is* host memory, so its experts deserve the host's kernel (docs/architecture.md, "Host
    compute"). bfloat16 with torch's bits only (AMX), unless ``fast`` (``pipeline.host_gemv: fast``);
    anything else (float32, many rows, a call that records gradients) answers None and the family's
    math runs as before. Made by :func:`gemv_groups`."""

    __slots__ = ("gemv", "fast", "up", "down", "activation", "post", "groups")

    def __init__(self, gemv, fast: bool, math):
        self.gemv, self.fast = gemv, fast
        self.up, self.down, self.activation, self.post = math.up, math.down, math.activation, math.post
        self.groups = 0                            # groups it computed (report)

    def __call__(self, tensors: list[dict], counts: list[int], x: torch.Tensor) -> torch.Tensor | None:
        if x.dtype is not torch.bfloat16 or x.device.type != "cpu" or max(counts) >= MM_ROWS or min(counts) < 1:
            return None
        up, down = self.up, self.down
        ups = [gemv_key("bf16", tensors[0][up])]  # (one expert's shapes decide for the group: asked first)
        downs = [gemv_key("bf16", tensors[0][down])]
        if not gemv_takes(self.gemv, self.fast, ups[0], downs[0]):
            return None
        if len(tensors) > 1:
            ups += [gemv_key("bf16", t[up]) for t in tensors[1:]]
            downs += [gemv_key("bf16", t[down]) for t in tensors[1:]]
        y = gemv_experts_taken(self.gemv, ups, downs, list(counts), x, self.activation)
        if y is None:
            return None
        self.groups += 1
        return self.post(y) if self.post is not None else y


def gemv_groups(experts: "ExpertSet") -> GemvGroups | None:
    """The :class:`GemvGroups` of an experts operator on a CPU device, or None: another device,
    ``pipeline.host_gemv: torch``, no compiled kernel here (or one without torch's bits and no
    ``fast``), or a layout outside transformers' fused ``[out, in]`` unbiased experts contract."""
    runtime = experts.runtime
    setting = getattr(runtime.pipeline, "host_gemv", "torch")
    if runtime.device.type != "cpu" or setting == "torch":
        return None
    from operators.host_compute import skip

    if skip(experts.layout, cuda=False) is not None:
        return None
    from kinject.engine import host_gemv

    gemv = host_gemv.load()
    fast = setting == "fast"
    if gemv is None or not (gemv.exact_bf16 or fast and gemv.vectorized):
        return None
    return GemvGroups(gemv, fast and gemv.vectorized, experts.layout.math)


def weighted_rows(runtime) -> Callable | None:
    """The compiled weighted sum of a decode step's expert outputs
    (:meth:`~kinject.engine.host_gemv.HostGemv.weighted_rows`, torch's bits) on a CPU device; None
    on another device, with ``pipeline.host_gemv: torch``, or where the kernel or its bits are not here."""
    if runtime.device.type != "cpu" or getattr(runtime.pipeline, "host_gemv", "torch") == "torch":
        return None
    from kinject.engine import host_gemv

    gemv = host_gemv.load()
    return gemv.weighted_rows if gemv is not None and gemv.weighted_exact else None


def _by_storage(tensors: list[dict]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by the storage their first role's tensor lies in (slab by slab,
    in order of first appearance). Asked per group per step (DeepSeek-V3's counts: ~50 experts per
    layer, each its own storage when served from the host cache), so one role looked up once and
    one list of addresses."""
    role = next(iter(tensors[0]), None) if tensors else None
    try:
        keys = [t[role].untyped_storage().data_ptr() for t in tensors]
    except (KeyError, AttributeError, TypeError):           # (a role missing, or not a tensor: each alone)
        return [[i] for i in range(len(tensors))]
    if len(set(keys)) == len(keys):
        return [[i] for i in range(len(keys))]
    parts: dict[int, list[int]] = {}
    for i, key in enumerate(keys):
        parts.setdefault(key, []).append(i)
    return list(parts.values())
