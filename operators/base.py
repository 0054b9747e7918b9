"""Operator base class: what every injectable operator is.

An operator **wraps** the original module (``self.base``) and reuses its math; it adds
placement, prefetch, micro-batching or ordering around it. Construction must not change
the original module (the injector builds every operator before swapping any, so a failed
``optimize`` can leave the model untouched); weights move only in :meth:`Operator.attach`,
which :meth:`Operator.detach` undoes exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from kinject.runtime import Runtime


class Operator(nn.Module):
    """Base of all kinject operators.

    Subclasses declare their rule kwargs as keyword-only constructor parameters with
    type hints (``weights: Literal["device", "host", "disk"] = "host"``): the rule loader
    checks rule kwargs against that signature, so a typo is an error, not a silent no-op.
    Optional ``check_kwargs(cls, kwargs)`` classmethod: value checks beyond types,
    raising ValueError (with a ``key`` attribute naming the kwarg, when useful).
    """

    def __init__(self, base: nn.Module, *, key: str, runtime: "Runtime"):
        super().__init__()
        self.base = base          # the original HF module, kept as is
        self.key = key            # its dotted name in the original model
        # Not a submodule: the runtime is shared by all operators of one model.
        object.__setattr__(self, "runtime", runtime)

    @classmethod
    def from_module(cls, base: nn.Module, *, key: str, runtime: "Runtime", **kwargs) -> "Operator":
        """Build the operator for ``base`` (the matched module) without changing ``base``."""
        return cls(base, key=key, runtime=runtime, **kwargs)

    def attach(self) -> None:
        """Apply phase: hand weights to the store, register with the runtime."""
        self.runtime.register(self)

    def detach(self) -> nn.Module:
        """Exact inverse of :meth:`attach`; returns the original module, weights restored.

        Also called after an ``attach`` that raised halfway, so it must undo whatever part
        of ``attach`` did happen."""
        self.runtime.unregister(self)
        return self.base

    def forward(self, *args, **kwargs):
        return self.base(*args, **kwargs)

    def extra_repr(self) -> str:
        return f"key={self.key!r}"


class Default(Operator):
    """KTransformers' ``default``: keep the module and its math, only set its device.

    Rule alias: ``replace: {class: default, kwargs: {device: cuda:0}}``. Without ``device``
    the pipeline's compute device is used.
    """

    def __init__(self, base: nn.Module, *, key: str, runtime: "Runtime", device: str | None = None):
        super().__init__(base, key=key, runtime=runtime)
        self.target = torch.device(device) if device is not None else runtime.device
        self._saved: dict[str, torch.Tensor] = {}

    def attach(self) -> None:
        for name, t in _tensors(self.base):
            if t.device != self.target:
                self._saved[name] = t.data
                t.data = t.data.to(self.target)
        super().attach()

    def detach(self) -> nn.Module:
        tensors = dict(_tensors(self.base))
        for name, data in self._saved.items():
            tensors[name].data = data
        self._saved.clear()
        return super().detach()


def _tensors(module: nn.Module):
    """Parameters and buffers of a module, with their dotted names (shared ones once)."""
    yield from module.named_parameters()
    yield from module.named_buffers()
