"""``OffloadedModule``: any module's weights in a tier, prefetched one operator ahead.

The generic operator: embeddings, lm_head, dense MLPs, shared experts, or a whole
decoder layer (Klotski's "simple pipeline": prefetch layer L+1 whole while layer L
computes). The module's own forward runs unchanged on the acquired weights.

``compute: host | auto`` (default ``device``): while its weights are not on the device the module
may run where they live, only its activations crossing the link (:mod:`operators.host_module`:
embeddings and lm_head, whose weights dwarf what they read and write per step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from torch import nn

from kinject.engine.encode import parse_quant
from operators.base import Operator, ParamBinding, check_quant_kwarg
from operators.host_experts import check_compute_kwarg
from operators.host_module import HostModule

if TYPE_CHECKING:
    from kinject.runtime import Runtime


class OffloadedModule(Operator):
    def __init__(self, base: nn.Module, *, key: str, runtime: "Runtime",
                 weights: Literal["device", "host", "disk"] = "host", quant: dict | None = None,
                 compute: Literal["device", "host", "auto"] = "device"):
        """``quant``: HQQ settings (``{nbits: 4, group_size: 64}``) for the module's weights:
        stored and moved packed, dequantized on the compute device right before use. ``compute``:
        where it runs while its weights are not on the device (module docstring)."""
        super().__init__(base, key=key, runtime=runtime)
        self.weights = weights
        self.quant = parse_quant(quant)
        self.binding = ParamBinding(base, runtime, key)
        self.host = (HostModule(compute, key=key, base=base, binding=self.binding, runtime=runtime)
                     if compute != "device" else None)

    def __getattr__(self, name: str):
        """Also the module's own parameters (storage-less stand-ins between uses): model code reads
        ``self.lm_head.weight.dtype`` (HY-V4)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            params = self.__dict__["_modules"]["base"]._parameters
            if name in params:
                return params[name]
            raise

    def attach(self) -> None:
        unit = self.binding.take(self.weights, layer=self.layer, quant=self.quant)
        if self.host is not None and unit is not None:
            unit.host_compute = True                     # the residency plan keeps it last
            self.runtime.reporters.append(self._host_report)
        super().attach()

    def _host_report(self) -> list[str]:
        line = self.host.report_line()
        return [line] if line else []

    def detach(self) -> nn.Module:
        if self._host_report in self.runtime.reporters:
            self.runtime.reporters.remove(self._host_report)
        self.binding.give_back()
        return super().detach()

    @staticmethod
    def check_kwargs(kwargs: dict) -> None:
        check_quant_kwarg(kwargs)
        check_compute_kwarg(kwargs)

    def prefetch_units(self) -> list:
        if self.host is not None:                        # computed where it lives unless a call moves it
            return []
        return self.binding.prefetch_units()

    def prefetch_settled(self) -> bool:
        return self.binding.settled()

    def offloads(self) -> bool:
        return self.binding.offloaded and self.host is None    # (computed where it lives: nothing to prefetch)

    def forward(self, *args, **kwargs):
        rt = self.runtime
        rt.scheduler.enter(self)
        if self.host is not None and self.host.here(args, kwargs):
            return self.host.run(args, kwargs, self.layer)
        with self.binding.in_use(), rt.tracer.span("compute", self.key, layer=self.layer):
            return self._base(*args, **kwargs)

    def extra_repr(self) -> str:
        return (f"key={self.key!r}, weights={self.weights!r}" + (f", quant={self.quant}" if self.quant else "")
                + (f", compute={self.host.mode!r}" if self.host is not None else ""))
