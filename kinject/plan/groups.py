"""How many prompts one ``generate`` call takes: ``n`` micro-batches of ``bs`` sequences.

A run (``kinject run``, ``kinject run --ray``) and the planner bench ask :func:`plan_groups`: the
pipeline's ``micro_batch_size`` and ``n_batches``, where ``n_batches: auto`` is the planner's choice
from the model's measured profile (:func:`kinject.plan.planner.throughput_n`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kinject.errors import KinjectError
from kinject.plan import planner, profiler

logger = logging.getLogger(__name__)

DEFAULT_GROUP = 8           # micro_batch_size when the pipeline leaves it unset


@dataclass
class GroupPlan:
    n: int
    bs: int
    source: str         # where n and bs came from, for the summary

    @property
    def size(self) -> int:
        return self.n * self.bs


AUTO_N_MAX = 16          # the largest batch group ``n_batches: auto`` considers (beyond it a group only adds latency
                         # and leaves the range the profile calibrates)


def _bytes(budget):
    """A budget in bytes, or None (unbounded, or ``auto`` not yet resolved by a runtime)."""
    return None if budget == "auto" else budget


def plan_groups(pipeline, model=None, profile=None) -> GroupPlan:
    """``n * bs`` prompts per ``generate``: the pipeline's values, ``bs`` unset = 8,
    ``n_batches: auto`` = the planner's ``n`` (needs ``model``): the smallest ``n <= AUTO_N_MAX`` whose
    predicted tokens/s is within 2 % of the best (:func:`kinject.plan.planner.throughput_n`), else 1
    with a warning. ``profile``: plan from it instead of the model's cached one (measured at its bs)."""
    bs = pipeline.micro_batch_size or DEFAULT_GROUP
    src = "pipeline" if pipeline.micro_batch_size else f"micro_batch_size unset: {DEFAULT_GROUP}"
    if pipeline.n_batches != "auto":
        return GroupPlan(int(pipeline.n_batches), bs, src)
    try:
        profile = profile or profiler.measure_profile(model, bs=bs, device=pipeline.device)
        # (a rule file's ``auto`` budgets are resolved by the runtime; unresolved here: no constraint)
        n = planner.throughput_n(profile, planner.Constraints(device_budget=_bytes(pipeline.device_budget),
                                                              host_budget=_bytes(pipeline.host_budget)),
                                 n_max=AUTO_N_MAX, context=profile.meta.get("context", 0),
                                 hot_coverage=profiler.hot_coverage(model))
        return GroupPlan(n, bs, f"{src}; n from the planner")
    except (ImportError, AttributeError, NotImplementedError, KinjectError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        logger.warning("pipeline.n_batches: auto: the planner gave no plan (%s); using n_batches=1", msg)
        return GroupPlan(1, bs, f"{src}; n_batches auto -> 1 (no planner profile)")
