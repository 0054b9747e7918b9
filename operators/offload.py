"""``OffloadedModule``: any module's weights in a tier, prefetched one operator ahead.

The generic operator: embeddings, lm_head, dense MLPs, shared experts, or a whole
decoder layer (Klotski's "simple pipeline": prefetch layer L+1 whole while layer L
computes). The module's own forward runs unchanged on the acquired weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from torch import nn

from operators.base import Operator, ParamBinding, check_quant_kwarg

if TYPE_CHECKING:
    from kinject.runtime import Runtime


class OffloadedModule(Operator):
    def __init__(self, base: nn.Module, *, key: str, runtime: "Runtime",
                 weights: Literal["device", "host", "disk"] = "host", quant: dict | None = None):
        """``quant``: HQQ settings (``{nbits: 4, group_size: 64}``) for the module's weights:
        stored and moved packed, dequantized on the compute device right before use."""
        from kinject.engine.quant import QuantSpec

        super().__init__(base, key=key, runtime=runtime)
        self.weights = weights
        self.quant = QuantSpec.from_dict(quant)
        self.binding = ParamBinding(base, runtime, key)

    def attach(self) -> None:
        self.binding.take(self.weights, layer=self.layer, quant=self.quant)
        super().attach()

    def detach(self) -> nn.Module:
        self.binding.give_back()
        return super().detach()

    check_kwargs = staticmethod(check_quant_kwarg)

    def prefetch_units(self) -> list:
        return self.binding.prefetch_units()

    def prefetch_settled(self) -> bool:
        return self.binding.settled()

    def offloads(self) -> bool:
        return self.binding.offloaded

    def forward(self, *args, **kwargs):
        rt = self.runtime
        rt.scheduler.enter(self)
        with self.binding.in_use(), rt.tracer.span("compute", self.key, layer=self.layer):
            return self.base(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"key={self.key!r}, weights={self.weights!r}" + (f", quant={self.quant}" if self.quant else "")
