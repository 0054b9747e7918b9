"""kinject: run huge Mixture-of-Experts models fast on small GPUs, by configuration.

    import kinject
    model = kinject.optimize(model, "rules/mixtral_klotski.yaml")
    model.generate(...)          # unchanged HF API
    model.kinject.report()

The package map (imports run one way, top to bottom; ``tests/test_layout.py`` enforces it):

    kinject.app, kinject.bench     the users: command line, batch job, demo; benchmark suites
    kinject.plan                   profile data, profiler, Klotski's planner, roofline bound
    kinject (optimize, from_pretrained, restore), kinject.inject, kinject.rules
    operators                      the injectable operators rule files name
    kinject.runtime                the one interface operators talk to (store, scheduler, tracer)
    kinject.engine, kinject.kv, kinject.io
                                   tiered store, transfers, scheduler, prefetcher, HQQ; the KV
                                   cache; checkpoint index and streaming load
    kinject.trace, kinject.testing, kinject.errors

The public names below are imported on first use, so ``import kinject.errors`` (what every
layer imports) does not pull the whole package in, and no layer imports upwards through it.
"""

import importlib

from kinject.errors import (BudgetError, InjectionError, KinjectError, LoadError, PlanError, RuleError,
                            TransferError)

__version__ = "0.1.0"

_LAZY = {
    "optimize": "kinject.inject", "restore": "kinject.inject", "match_rule": "kinject.inject",
    "match_modules": "kinject.inject", "InjectionReport": "kinject.inject",
    "from_pretrained": "kinject.pretrained",
    "load_rules": "kinject.rules", "PipelineConfig": "kinject.rules", "Rule": "kinject.rules", "RuleSet": "kinject.rules",
}

__all__ = [
    "optimize", "from_pretrained", "restore", "load_rules", "match_rule", "match_modules", "InjectionReport",
    "PipelineConfig", "Rule", "RuleSet",
    "KinjectError", "RuleError", "InjectionError", "LoadError", "BudgetError", "TransferError", "PlanError",
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kinject' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
