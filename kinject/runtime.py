"""The Runtime: everything kinject attaches to one model, reachable as ``model.kinject``.

It owns the parsed rules, the injection report and the registered operators; later
layers add the store, the scheduler and the tracer here, so there is exactly one of each
per model and every operator shares them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from kinject.rules import RuleSet

if TYPE_CHECKING:
    from kinject.inject import InjectionReport
    from operators.base import Operator

logger = logging.getLogger(__name__)


class Runtime:
    def __init__(self, ruleset: RuleSet):
        self.rules = ruleset
        self.pipeline = ruleset.pipeline
        self.device = torch.device(ruleset.pipeline.device)
        self.operators: list["Operator"] = []
        self.injection: "InjectionReport | None" = None
        self.claims: list = []          # inject.Claim per swapped module, in walk order

    # -- model lifecycle (called by optimize / restore)
    def attach_model(self, model: torch.nn.Module) -> None:
        """Called once every operator is attached; the place for model-level hooks."""

    def detach_model(self, model: torch.nn.Module) -> None:
        """Exact inverse of :meth:`attach_model`."""

    # -- operator registry (called from Operator.attach / detach)
    def register(self, op: "Operator") -> None:
        self.operators.append(op)

    def unregister(self, op: "Operator") -> None:
        self.operators = [o for o in self.operators if o is not op]

    # -- reporting
    def summary(self) -> dict:
        return {
            "rules_file": self.rules.path,
            "device": str(self.device),
            "operators": len(self.operators),
            "matches": {r.index: len(self.injection.matches.get(r.index, [])) for r in self.rules.rules}
            if self.injection else {},
        }

    def report(self, file=None) -> str:
        """Human-readable summary of the plan; printed to ``file`` (stdout by default) and returned."""
        lines = [f"kinject runtime  rules={self.rules.path}  device={self.device}"]
        if self.injection is not None:
            lines.append(str(self.injection))
        text = "\n".join(lines)
        print(text, file=file)
        return text

    def __repr__(self) -> str:
        return f"Runtime(rules={self.rules.path!r}, device={self.device}, operators={len(self.operators)})"
