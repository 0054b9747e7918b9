"""Where a group of ready experts computes: the compute site of :class:`~operators.experts.GroupedExperts`.

The ordering code (:mod:`operators.expert_order`) decides which experts run when and hands each
group's weights (one dict per expert, as the store's units handed them out) to the interception
code (:mod:`operators.expert_interception`), which knows the rows of each expert. Both then ask
the operator's *compute site* (``GroupedExperts.site``) for the outputs, and nothing else: a site
is the one object that turns (experts, their weights, their rows) into expert outputs.

:class:`ExpertComputeSite` is that interface; :class:`DeviceSide` is today's only site: the family's
math through its layout adapter (:meth:`~operators.expert_layouts.ExpertLayout.compute_sorted`:
one grouped GEMM over a stacked ``[E, ...]`` view where the experts' tensors form one, the ``loop``
backend otherwise, :mod:`operators.expert_compute`) on the device the weights were acquired to.
A host side (experts of the host tier computed where they live, only their rows crossing the
link, the partial outputs combined by the caller in the block's own weighting) implements the
same two methods; the operator's ``site`` may then be an object that sends each group, or part
of it, to the side that computes it cheaper.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from operators.experts import GroupedExperts


class ExpertComputeSite:
    """Computes experts of one :class:`~operators.experts.GroupedExperts` on given rows.

    ``compute(group, tensors, counts, x)``: experts ``group`` (ascending), ``tensors[i]`` expert
    ``group[i]``'s weights (role -> tensor), ``x`` their rows sorted by expert (``counts[i]`` rows
    of expert ``group[i]``, ``[sum(counts), H]``) -> ``[sum(counts), H_out]``, unweighted.
    ``compute_one(e, tensors, x)``: expert ``e`` alone on rows ``x`` (layouts whose calls hand
    over one expert's rows at a time). ``reset()``: the operator's units were (re)made or removed:
    forget anything remembered about their tensors."""

    def compute(self, group: list[int], tensors: list[dict], counts: list[int], x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def compute_one(self, e: int, tensors: dict, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError


class DeviceSide(ExpertComputeSite):
    """The experts compute where their weights were acquired (the device; a CPU runtime's host),
    in the family's own math through the operator's layout adapter; a group whose tensors are the
    experts' own (resident units, host units a CPU uses in place) is one grouped GEMM over their
    stacked ``[E, ...]`` view (:meth:`stacked`)."""

    def __init__(self, op: "GroupedExperts"):
        self.op = op
        self._own_views: tuple | None = None       # (the experts' own tensor dicts, [E, ...] views)

    def compute(self, group, tensors, counts, x):
        op = self.op
        return op.layout.compute_sorted(group, tensors, counts, x, op.bound, stacked=self.stacked(group, tensors))

    def compute_one(self, e, tensors, x):
        return self.op.layout.compute(e, tensors, x, self.op.bound)

    def reset(self) -> None:
        self._own_views = None

    def stacked(self, group: list[int], tensors: list[dict]) -> dict | None:
        """Role -> ``[E, ...]`` view over every stored expert's weights, when the group's tensors
        are the experts' own (resident units, or host units a CPU uses in place or "moves" over an
        emulated link): the grouped GEMM then slices it instead of checking each expert's addresses
        (per expert, per call). Told apart by identity: a unit that was moved or dequantized hands
        out another dict."""
        if self._own_views is None:
            units = self.op.units
            own = [u.tensors if u.offloaded else u.device for u in units]
            tensors_only = all(isinstance(t, torch.Tensor) for d in own for t in d.values())
            self._own_views = (own, self.op.layout.stacked_views(own) if own and tensors_only else None)
        own, views = self._own_views
        if views is None:
            return None
        for e, t in zip(group, tensors):          # (a plain loop: no generator frame per expert)
            if t is not own[e]:
                return None
        return views
