"""MoE blocks without one experts module: the schedule comes from a rule on the block itself.

* JetMoE's block holds two experts modules (``input_linear``, ``output_linear``: parallel experts).
  ``rules/klotski.yaml`` matches the block (``with_children``: two children whose class ends in
  ``Experts``, shared experts not counted): one unit per expert spanning both, acquired once per
  block call, in the order the weights are there; the block's own routing and forward run (same
  tokens).
* A per-expert ``ModuleList`` whose block loops over the experts itself (the loop is the family's
  code): the loads of the chosen experts are issued in the order that loop consumes them.
"""

from __future__ import annotations

import copy

import pytest
import torch

import kinject
from kinject import families
from operators.experts import GroupedExperts
from test_any_family import _generate, _legacy_mixtral, _overrides, _rules


def _experts(model) -> list[GroupedExperts]:
    return [op for op in model.kinject.operators if isinstance(op, GroupedExperts)]


def _without_block_rule() -> dict:
    rules = copy.deepcopy(_rules())               # _rules() is cached: never change it
    rules["rules"] = [r for r in rules["rules"] if "with_children" not in r["match"]]
    return rules


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_jetmoe_block_one_unit_per_expert_spanning_both_experts_modules(tier, tmp_path):
    model = families.build_tiny_family_model("jetmoe")
    E = model.config.num_local_experts
    ref = _generate(model)
    kinject.optimize(model, copy.deepcopy(_rules()), _overrides(tmp_path, f"vars.weights={tier}"))
    ops = _experts(model)
    assert [op.key for op in ops] == [f"model.layers.{i}.mlp" for i in range(len(model.model.layers))]
    for op in ops:
        assert op.layout.name == "block" and list(op.layout.children) == ["input_linear", "output_linear"]
        assert len(op.units) == E
        assert all(set(u.tensors) == {"input_linear.weight", "output_linear.weight"} for u in op.units)
    acquired: list[tuple[str, int]] = []                   # (unit, step) of every acquire of an experts unit
    sched = model.kinject.scheduler
    original = sched.acquire

    def counting(unit):
        acquired.append((unit.name, sched.step))
        return original(unit)

    sched.acquire = counting
    try:
        assert torch.equal(_generate(model), ref)
    finally:
        del sched.acquire
    expert_units = {u.name for op in ops for u in op.units}
    mine = [a for a in acquired if a[0] in expert_units]
    assert mine and len(mine) == len(set(mine)), "an expert unit was acquired twice in one block call"
    loads = sum(u.loads for op in ops for u in op.units)
    kinject.restore(model)
    assert torch.equal(_generate(model), ref)

    # the same model with the experts modules scheduled one by one: two units (and loads) per expert
    kinject.optimize(model, _without_block_rule(), _overrides(tmp_path, f"vars.weights={tier}"))
    ops = _experts(model)
    assert len(ops) == 2 * len(model.model.layers) and all(op.layout.name == "sized" for op in ops)
    assert torch.equal(_generate(model), ref)
    assert sum(len(op.units) for op in ops) == 2 * E * len(model.model.layers)
    assert loads < sum(u.loads for op in ops for u in op.units)
    kinject.restore(model)


def test_block_rule_leaves_the_experts_modules_to_the_block(tmp_path):
    """The block's experts modules are its own: the ``Experts$`` rule claims none of them."""
    model = families.build_tiny_family_model("jetmoe")
    kinject.optimize(model, copy.deepcopy(_rules()), _overrides(tmp_path))
    report = model.kinject.injection
    claimed = [n for names in report.matches.values() for n in names]
    assert not [n for n in claimed if n.endswith(("mlp.input_linear", "mlp.output_linear"))], claimed
    assert "block (8 experts over 2 experts modules" in _experts(model)[0].layout.describe()
    kinject.restore(model)


def test_module_list_loads_in_the_blocks_loop_order(tmp_path):
    """The block's own ``for e in range(E)`` consumes the chosen experts in index order: the gate
    queues their loads in that order (not most tokens first), so the first expert the loop needs
    is the first to land."""
    model = _legacy_mixtral()
    ref = _generate(model)
    kinject.optimize(model, copy.deepcopy(_rules()), _overrides(tmp_path, "vars.weights=disk"))
    store = model.kinject.store
    ops = _experts(model)
    expert_units = {u.name for op in ops for u in op.units}
    fetched: list[str | None] = []     # expert units a routing queued, in issue order; None: the next routing
    queueing = [False]
    original = store.fetch

    def recording(unit, channel="ondemand", *args, **kwargs):
        if queueing[0] and unit.name in expert_units:
            fetched.append(unit.name)
        return original(unit, channel, *args, **kwargs)

    def routed(op):
        queue = op.queue_loads

        def mark(counts):
            fetched.append(None)
            queueing[0] = True
            try:
                return queue(counts)
            finally:
                queueing[0] = False
        return mark

    store.fetch = recording
    for op in ops:
        op.queue_loads = routed(op)
    try:
        assert torch.equal(_generate(model), ref)
    finally:
        del store.fetch
        for op in ops:
            del op.queue_loads
    by_layer: list[list[int]] = [[]]             # expert indices each routing queued, in issue order
    for name in fetched:
        if name is None:
            by_layer.append([])
        else:
            by_layer[-1].append(int(name.rsplit("[", 1)[1].rstrip("]")))
    by_layer = [es for es in by_layer[1:] if len(es) > 1]
    assert by_layer
    assert all(es == sorted(es) for es in by_layer), by_layer
    kinject.restore(model)
