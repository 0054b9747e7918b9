"""The state the pieces of :class:`~operators.experts.GroupedExperts` share, as two plain objects.

``GroupedExperts`` is composed of narrow pieces (docs/architecture.md, "Experts"): the order policy
(:class:`operators.expert_order.ExpertOrder`: which experts run when), the per-layout interception
(:mod:`operators.expert_interception`: how a block's call reaches the experts), the compute sites
(:mod:`operators.expert_sites`: where a group of ready experts computes) and the prefetch planning
of the operator itself. What they share is held here, and handed to each piece explicitly:

* :class:`ExpertSet`: what the operator's experts *are*, fixed once it is attached (its key,
  layer, layout, units, the runtime and routing they live in, how to bind weights to the module);
  every piece reads it, none writes it;
* :class:`LayerStep`: what one layer-step *holds, keeps, uses and predicted* (the units acquired
  for a block call, the units kept until a lookup ends, the experts the router chose, the experts
  predicted and handed to prefetch, the loads counted at the last layer end). Written by the
  operator's prefetch planning, the order policy and the interception; each gets it passed in.

Neither holds a reference back to the operator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from kinject.engine.store import Unit
    from kinject.runtime import Runtime
    from operators.expert_layouts import ExpertLayout
    from operators.expert_routing import ExpertRouting


class ExpertSet:
    """One experts operator's experts as its pieces see them (read-only to them).

    ``units``: one store unit per stored expert (``units[e]``: expert ``e``; the list object stays the
    same for the operator's life, filled at attach and emptied at detach); ``stored``: experts
    ``0 .. stored-1`` have a unit, the rest (up to ``num_experts``) are zero-compute; ``weights``: the
    rule's tier; ``dtype``: the compute dtype of the weights (None: each unit's own); ``module``: the
    wrapped experts module; ``bound(tensors)``: a context manager that points the module's parameters
    at ``tensors`` for its block; ``layer``: the pipeline position, set at attach (positions are known
    once every operator is built)."""

    __slots__ = ("runtime", "routing", "key", "layer", "layout", "units", "stored", "num_experts", "weights",
                 "dtype", "module", "bound")

    def __init__(self, *, runtime: "Runtime", routing: "ExpertRouting", key: str, layout: "ExpertLayout",
                 weights: str, dtype: Any, module: Any, bound: Callable):
        self.runtime, self.routing, self.key, self.layout = runtime, routing, key, layout
        self.layer: int | None = None
        self.units: list["Unit"] = []
        self.stored = int(layout.stored)
        self.num_experts = int(layout.num_experts)
        self.weights, self.dtype, self.module, self.bound = weights, dtype, module, bound


class LayerStep:
    """What one experts layer holds, keeps, uses and predicted in the current step.

    ``entered``: the step the scheduler was last entered for this layer; ``routed``: the last step
    its gate routed; ``held``: expert -> its acquired tensors for the block call in progress
    (``block`` layouts); ``used``: the experts the block call's router chose (None before its first
    experts-module call); ``hold_all``: that call holds every chosen expert at once (the budget
    allows); ``tokens``: the block call's tokens; ``kept``: units acquired and kept until the call
    ends (``lookup``); ``predicted_at`` / ``predicted``: the experts predicted for prefetch in that
    step (what the prefetch statistics compare with the router's choice); ``prediction``: (step,
    experts) the prediction made once per step; ``prefetched``: experts handed to prefetch and not
    yet consumed; ``handed``: (prediction, prefetched set, units) last handed to the scheduler;
    ``last_loads``: the store's (loads, bytes) of the operator at the last layer end."""

    __slots__ = ("entered", "routed", "held", "used", "hold_all", "tokens", "kept", "predicted_at", "predicted",
                 "prediction", "prefetched", "handed", "last_loads")

    def __init__(self) -> None:
        self.entered = -1
        self.routed = -1
        self.held: dict[int, dict] = {}
        self.used: list[int] | None = None
        self.hold_all = True
        self.tokens: int | None = None
        self.kept: list = []
        self.predicted_at = -1
        self.predicted: set[int] = set()
        self.prediction: tuple[int, list[int]] | None = None
        self.prefetched: set[int] = set()
        self.handed: tuple | None = None
        self.last_loads = (0, 0)

    def reset(self) -> None:
        """The operator's units were (re)made or removed: nothing of a step is carried over."""
        self.__init__()

    def note_predicted(self, step: int, experts) -> None:
        """Experts predicted for ``step`` (several asks in one step add up)."""
        if self.predicted_at != step:
            self.predicted_at, self.predicted = step, set()
        self.predicted.update(experts)

    def predicted_in(self, step: int) -> set[int] | None:
        """The experts predicted for ``step``, None when no prediction was made in it."""
        return self.predicted if self.predicted_at == step else None

    def take_prefetched(self) -> set[int]:
        """The experts handed to prefetch since the last call (consumed: the router has chosen)."""
        got = self.prefetched
        if got:
            self.prefetched = set()
        return got
