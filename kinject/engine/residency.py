"""What the device budget keeps: the residency plan (``pipeline.keep_resident: true``).

A step runs every module that is not a routed expert -- attention, routers, shared experts, dense
MLPs, embeddings, lm_head -- once per step. An offloaded one is moved again every step: at batch 1
that is most of what crosses the link once experts compute where they live (``compute: auto``).
Where the budget has room beyond what the moving units need, keeping such a unit on the device
saves its bytes every step. The plan decides, once, after every operator is attached, from what
each kept byte saves per step on the link (the same link the costs of
:class:`~kinject.engine.costs.PlacementCosts` price):

* a unit whose module must compute on the device (attention's projections, routers) saves its
  stored bytes (``wire_nbytes``) per step: kept first, the most bytes saved per budget byte first
  (a packed format saves fewer than it occupies), then in execution order;
* a unit whose operator can compute it where it lives (``OffloadedModule(compute: host | auto)``:
  embeddings, lm_head) saves only its activations when kept: it is kept last, with what is left;
* routed experts are not kept (the experts operators decide per step: moved, or computed on the host).

Room stays for what keeps moving: :data:`WORKING_UNITS` of the largest every-step unit still
moved each step (one in use, one prefetched ahead: the overlap), and at least one of the largest
expert (an on-demand load must always fit, :meth:`TensorStore.check_fits`; experts move only on
the steps their operators choose to, and a prefetch that does not fit is skipped). The plan is
logged and shown by ``model.kinject.report()``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kinject.formatting import format_bytes

if TYPE_CHECKING:
    from kinject.engine.store import TensorStore
    from kinject.engine.unit import Unit

logger = logging.getLogger(__name__)

WORKING_UNITS = 2
"""Units of the largest every-step unit still moving left room for: one in use, one prefetched ahead."""


def _reserve(every_step_moving: list[int], others: list[int]) -> int:
    """Room for what keeps moving (module docstring)."""
    return max(WORKING_UNITS * max(every_step_moving, default=0), max(others, default=0))


@dataclass
class ResidencyPlan:
    """The units kept on the device and why (``reason``), the room left for moving units."""

    kept: list["Unit"] = field(default_factory=list)
    moving: list["Unit"] = field(default_factory=list)       # every-step units left to move / compute on the host
    reserve: int = 0
    budget: int | None = None

    @property
    def kept_bytes(self) -> int:
        return sum(u.nbytes for u in self.kept)

    @property
    def saved_per_step(self) -> int:
        """Link bytes the kept units no longer move each step (those that must compute on the device)."""
        return sum(u.wire_nbytes for u in self.kept if not u.host_compute)

    def report_line(self) -> str:
        moved = [u for u in self.moving if not u.host_compute]
        host = [u for u in self.moving if u.host_compute]
        return (f"residency plan: kept {len(self.kept)} every-step units on the device ({format_bytes(self.kept_bytes)}, "
                f"saving {format_bytes(self.saved_per_step)} of moves per step); moved each step: {len(moved)} "
                f"({format_bytes(sum(u.wire_nbytes for u in moved))}); computed where they live: {len(host)} "
                f"({format_bytes(sum(u.wire_nbytes for u in host))} not moved); room kept for moving units {format_bytes(self.reserve)}")


def _priority(unit: "Unit") -> tuple:
    """Kept first: must compute on the device, most bytes saved per budget byte, earliest layer."""
    saved = 0 if unit.host_compute else unit.wire_nbytes
    return (unit.host_compute, -saved / max(unit.nbytes, 1), unit.layer if unit.layer is not None else -1)


def plan_residency(store: "TensorStore") -> ResidencyPlan:
    """Keep every-step units on the device, best first, while the budget leaves room for what keeps
    moving (module docstring; no budget: all of them); returns the plan."""
    plan = ResidencyPlan(budget=store.budget)
    candidates = sorted((u for u in store.units.values() if u.every_step and u.offloaded and u.tier != "device"),
                        key=_priority)
    others = [u.nbytes for u in store.units.values() if u.offloaded and not u.every_step]
    for i, unit in enumerate(candidates):
        # what still moves once this one is kept: the rest of the candidates that must move, and the experts
        moving = [u.nbytes for u in plan.moving + candidates[i + 1:] if not u.host_compute]
        reserve = _reserve(moving, others)
        if store.fits(unit.nbytes, headroom=reserve):
            store.keep(unit)
            plan.kept.append(unit)
        else:
            plan.moving.append(unit)
    plan.reserve = _reserve([u.nbytes for u in plan.moving if not u.host_compute], others)
    logger.info("kinject: %s", plan.report_line())
    return plan
