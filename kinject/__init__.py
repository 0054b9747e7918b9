"""kinject: run huge Mixture-of-Experts models fast on small GPUs, by configuration.

    import kinject
    model = kinject.optimize(model, "rules/mixtral_klotski.yaml")
    model.generate(...)          # unchanged HF API
    model.kinject.report()
"""

from kinject.errors import (BudgetError, InjectionError, KinjectError, LoadError, PlanError, RuleError,
                            TransferError)
from kinject.inject import InjectionReport, match_modules, match_rule, optimize, restore
from kinject.io.loading import from_pretrained
from kinject.rules import PipelineConfig, Rule, RuleSet, load_rules

__version__ = "0.1.0"

__all__ = [
    "optimize", "from_pretrained", "restore", "load_rules", "match_rule", "match_modules", "InjectionReport",
    "PipelineConfig", "Rule", "RuleSet",
    "KinjectError", "RuleError", "InjectionError", "LoadError", "BudgetError", "TransferError", "PlanError",
]
