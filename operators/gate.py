"""``PrefetchGate``: the router, plus Klotski's "queue cold experts as soon as the gate has run".

Weights live in a tier like any :class:`~operators.offload.OffloadedModule` (prefetched ahead
by the scheduler, with the layer's hot experts, while the attention computes). The original
router runs unchanged on all tokens of the batch group; when its output carries the top-k
indices (an integer ``[T, k]`` tensor in the returned tuple, as every transformers 5 MoE
router returns) the same layer's :class:`~operators.experts.GroupedExperts` immediately
starts on-demand loads of every selected expert that is neither resident nor in flight,
most tokens first, and the choices feed the correlation table (online update when
``pipeline.update_table``). Routers that return only logits leave this to
``GroupedExperts``, which does it (idempotently) when it runs.

Prediction by the next gate (``GroupedExperts(predictor="next_gate")``): right after routing
layer L, the gate applies layer L+1's router to layer L's router input and the predicted
experts of L+1 are prefetched, behind L's own on-demand loads (pre-gating; the residual
stream changes little from one layer to the next). Keep gates resident for this (they are
tiny); an offloaded next gate is loaded early.

Klotski §5: "during the computations of the gate, no prefetching is done. Instead, it is
determined whether each gate-selected expert is a hot expert or one that has already been
transferred. If not, the transfer of that expert is initiated immediately." Hence the gate
tells the scheduler it ran (``enter``, which prefetches what comes next) only *after* the
cold experts are queued, so they are ahead of any lookahead prefetch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from operators.expert_layouts import LayoutError, infer_layout
from operators.experts import indices_at, router_index_position, routing
from operators.offload import OffloadedModule

if TYPE_CHECKING:
    from kinject.runtime import Runtime


class PrefetchGate(OffloadedModule):
    """``top_k``: the block's k, for a router that returns only logits or scores and whose
    module carries no ``top_k`` / config (default: found on the router, else the k the layer's
    experts were last called with)."""

    serves_moe = True

    def __init__(self, base: nn.Module, *, key: str, runtime: "Runtime",
                 weights: Literal["device", "host", "disk"] = "host", quant: dict | None = None,
                 top_k: int | None = None):
        super().__init__(base, key=key, runtime=runtime, weights=weights, quant=quant)
        self.top_k = top_k if top_k is not None else _declared_top_k(base)
        self._registered = False
        self._routing = None                    # the runtime's ExpertRouting, while attached
        self._index_at: int | None = None       # where this router's output holds its indices (once found)

    @classmethod
    def accepts(cls, module: nn.Module, parent: nn.Module) -> bool:
        """A router scores every expert of an experts module beside it: some parameter of it has a
        dimension of at least that module's expert count E and at most 2E (a router may score
        extra no-op classes: ZAYA's E + 1). A module that only looks like a router by its name (a
        residual gate of a decoder layer, with no experts beside it) is not claimed."""
        counts = _sibling_expert_counts(module, parent)
        return any(n <= d <= 2 * n for p in module.parameters() for d in p.shape for n in counts)

    def attach(self) -> None:
        r = routing(self.runtime)
        gates = r.gates
        if self.layer in gates:
            raise ValueError(f"two PrefetchGates in layer {self.layer}: {gates[self.layer].key!r} and {self.key!r}")
        super().attach()
        gates[self.layer] = self
        self._registered = True
        self._routing = r

    def detach(self) -> nn.Module:
        if self._registered:
            routing(self.runtime).gates.pop(self.layer, None)
            self._registered = False
        self._routing = None
        return super().detach()

    def forward(self, *args, **kwargs):
        rt = self.runtime
        tracer = rt.tracer
        with self.binding.in_use():
            if tracer.enabled:
                with tracer.span("compute", self.key, layer=self.layer):
                    out = self._base(*args, **kwargs)
            else:                                   # (no span object per call when nothing is traced)
                out = self._base(*args, **kwargs)
        r = self._routing or routing(rt)
        index = self._choices(out, r)               # [T, k]: returned, or the top-k of its logits / scores
        if index is not None:
            r.route(self.layer, index)              # on-demand loads of cold experts, table update
        if r.pregates:
            r.pregate(self.layer, args, kwargs)     # next layer's experts predicted by its own gate, if asked
        rt.scheduler.enter(self)                    # then whatever the lookahead prefetches
        return out

    def choices_for(self, args: tuple, kwargs: dict):
        """This router's top-k choices (``[T, k]``) for another layer's router input: the
        ``next_gate`` predictor (its weights are acquired like for its own forward)."""
        rt = self.runtime
        with self.binding.in_use(), rt.tracer.span("compute", f"{self.key} (pre-gate)", layer=self.layer):
            return self._choices(self._base(*args, **kwargs), routing(rt))

    def _choices(self, out, r):
        """The block's top-k choices: the router's indices, else the top-k of a ``[T, E]`` logits
        or scores tensor it returns (same order as the block's own top-k; the block's math is
        untouched). None when neither can be told (the experts then load what they are given)."""
        at = self._index_at
        if at is not None:                          # where it was last time (a router returns one structure)
            index = indices_at(out, at)
            if index is not None:
                return index
        at = self._index_at = router_index_position(out)
        if at is not None:
            return out if at < 0 else out[at]
        op = r.experts.get(self.layer)
        k = self.top_k or (op.top_k_seen if op is not None else None)
        n = op.num_experts if op is not None else None
        items = out if isinstance(out, (tuple, list)) else (out,)
        scores = [t for t in items if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 2
                  and (n is None or t.shape[-1] == n)]
        if not k or not scores or k > scores[-1].shape[-1]:
            return None
        return scores[-1].topk(k, dim=-1).indices                                  # [T, k]


def _sibling_expert_counts(module: nn.Module, parent: nn.Module) -> set[int]:
    """Expert counts of the experts modules beside ``module`` (children of ``parent`` with an
    experts layout)."""
    counts = set()
    for child in parent.children():
        if child is module:
            continue
        try:
            counts.add(int(infer_layout(child).num_experts))
        except LayoutError:
            continue
    return counts


_TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "moe_top_k", "moe_topk", "top_k_experts", "moe_k")


def _declared_top_k(module: nn.Module) -> int | None:
    """The k a router (or its config) declares, if any."""
    for obj in (module, getattr(module, "config", None)):
        for name in _TOP_K_ATTRS:
            v = getattr(obj, name, None) if obj is not None else None
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                return v
    return None
