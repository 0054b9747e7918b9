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

from torch import nn

from operators.experts import router_indices, routing
from operators.offload import OffloadedModule

if TYPE_CHECKING:
    from kinject.runtime import Runtime


class PrefetchGate(OffloadedModule):
    def __init__(self, base: nn.Module, *, key: str, runtime: "Runtime",
                 weights: Literal["device", "host", "disk"] = "host", quant: dict | None = None):
        super().__init__(base, key=key, runtime=runtime, weights=weights, quant=quant)
        self._registered = False

    def attach(self) -> None:
        gates = routing(self.runtime).gates
        if self.layer in gates:
            raise ValueError(f"two PrefetchGates in layer {self.layer}: {gates[self.layer].key!r} and {self.key!r}")
        super().attach()
        gates[self.layer] = self
        self._registered = True

    def detach(self) -> nn.Module:
        if self._registered:
            routing(self.runtime).gates.pop(self.layer, None)
            self._registered = False
        return super().detach()

    def forward(self, *args, **kwargs):
        rt = self.runtime
        with self.binding.in_use(), rt.tracer.span("compute", self.key, layer=self.layer):
            out = self.base(*args, **kwargs)
        index = router_indices(out)                 # [T, k], or None for a logits-only router
        r = routing(rt)
        if index is not None:
            r.route(self.layer, index)              # on-demand loads of cold experts, table update
        r.pregate(self.layer, args, kwargs)         # next layer's experts predicted by its own gate, if asked
        rt.scheduler.enter(self)                    # then whatever the lookahead prefetches
        return out

    def choices_for(self, args: tuple, kwargs: dict):
        """This router's top-k choices (``[T, k]``) for another layer's router input: the
        ``next_gate`` predictor (its weights are acquired like for its own forward)."""
        rt = self.runtime
        with self.binding.in_use(), rt.tracer.span("compute", f"{self.key} (pre-gate)", layer=self.layer):
            return router_indices(self.base(*args, **kwargs))
