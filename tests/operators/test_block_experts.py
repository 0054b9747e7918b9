"""MoE blocks without one experts module: the schedule comes from a rule on the block itself.

* JetMoE's block holds two experts modules (``input_linear``, ``output_linear``: parallel experts).
  ``rules/klotski.yaml`` matches the block (``with_children``: two children whose class ends in
  ``Experts``, shared experts not counted): one unit per expert spanning both, acquired once per
  block call, in the order the weights are there; the block's own routing and forward run (same
  tokens).
* A per-expert ``ModuleList`` whose block loops over the experts itself (the loop is the family's
  code): matched on the block (``loop_block``), the block's forward runs twice -- expert inputs
  recorded, then every expert call answered by its output, the experts computed in between hot
  first; matched on the list alone (``module_list``), the block that owns the list is replayed the
  same way.
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import nn

import kinject
from kinject import families
import operators.expert_interception
from kinject.testing import build_tiny_model
from operators.experts import GroupedExperts
from test_any_family import LegacySparseMoeBlock, _generate, _legacy_mixtral, _overrides, _rules


def _experts(model) -> list[GroupedExperts]:
    return [op for op in model.kinject.operators if isinstance(op, GroupedExperts)]


def _optimize_with_room_for_one_expert(model, tmp_path) -> int:
    """Optimize ``model`` under a device budget with room for 1.5 expert units beside the rest of
    the model (sizes read from an unbudgeted optimize first); returns the budget."""
    kinject.optimize(model, copy.deepcopy(_rules()), _overrides(tmp_path))
    store = model.kinject.store
    external, unit = store.resident_external, max(u.nbytes for op in _experts(model) for u in op.units)
    kinject.restore(model)
    budget = external + unit + unit // 2
    kinject.optimize(model, copy.deepcopy(_rules()), _overrides(tmp_path, f"pipeline.device_budget={budget}"))
    return budget


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


def test_module_list_replays_hot_first_and_loads_most_tokens_first(tmp_path):
    """Rule on the list alone (``module_list``): the block that loops over it is replayed like a
    ``loop_block``, so its experts compute in Klotski's order, not the loop's: per layer call the
    experts ready when it starts in one group, then the others as they land, in groups; and the
    gate queues the loads most tokens first (ties: ascending ids), not in loop order. Tokens are
    the untouched model's."""
    from test_klotski import compute_groups

    model = _legacy_mixtral()
    ref = _generate(model)
    kinject.optimize(model, _without_block_rule(), _overrides(tmp_path, "vars.weights=disk", "pipeline.trace=true"))
    store = model.kinject.store
    ops = _experts(model)
    assert all(op.layout.name == "module_list" and op.calls.replays for op in ops)
    expert_units = {u.name for op in ops for u in op.units}
    queued: list[tuple[list[int], list[int]]] = []   # (tokens per expert, experts queued in issue order) per routing
    original_reads = store._start_reads              # a batch of disk reads, in the order it was queued

    def recording_reads(units):
        if queued and queued[-1][1] is not None:
            queued[-1][1].extend(int(u.name.rsplit("[", 1)[1].rstrip("]")) for u in units if u.name in expert_units)
        return original_reads(units)

    def routed(op):
        queue = op.queue_loads

        def mark(counts):
            queued.append((list(counts), []))
            try:
                return queue(counts)
            finally:
                queued.append(([], None))             # later reads are not this routing's
        return mark

    store._start_reads = recording_reads
    for op in ops:
        op.queue_loads = routed(op)
    try:
        assert torch.equal(_generate(model), ref)
    finally:
        del store._start_reads
        for op in ops:
            del op.queue_loads
    orders = [(counts, es) for counts, es in queued if es is not None and len(es) > 1]
    assert orders
    assert all(es == sorted(es, key=lambda e: (-counts[e], e)) for counts, es in orders), orders
    assert any(es != sorted(es) for _, es in orders)          # the loop's index order would differ
    groups = compute_groups(model.kinject.tracer.events())
    assert groups and all(len({e for c in comps for e in c.args["experts"]}) ==
                          sum(len(c.args["experts"]) for c in comps) for comps in groups.values())   # each once
    assert all([c.args["hot"] for c in comps] == sorted((c.args["hot"] for c in comps), reverse=True)
               and sum(c.args["hot"] for c in comps) <= 1 for comps in groups.values())   # hot first, one group
    assert any(len(c.args["experts"]) > 1 for comps in groups.values() for c in comps)
    kinject.restore(model)
    assert not any("forward" in m.__dict__ for m in model.modules())   # the block's replay is undone


# ------------------------------------------------------------------ a block of two grouped experts modules


class GroupedProjExperts(nn.Module):
    """One projection per expert called Llama-4 style: ``x[E*T, in]``, each expert's T rows (the
    expert count read from the weight, as Llama-4's experts do)."""

    def __init__(self, num_experts: int, d_in: int, d_out: int):
        super().__init__()
        self.num_experts = num_experts
        self.weight = nn.Parameter(torch.randn(num_experts, d_in, d_out) * d_in ** -0.5)

    def forward(self, x):
        x = x.view(self.weight.shape[0], -1, x.shape[-1])                      # [E, T, in]
        return torch.bmm(x, self.weight).view(-1, self.weight.shape[-1])       # [E*T, out]


class TwoProjRouter(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.randn(num_experts, hidden) * hidden ** -0.5)

    def forward(self, x):
        scores, index = torch.topk(nn.functional.linear(x, self.weight).softmax(-1), self.top_k, dim=-1)
        return scores, index                                                   # [T, k], [T, k]


class TwoProjMoeBlock(nn.Module):
    """A block that loops over nothing itself: scatter scores to ``[E, T]``, up, act, down, sum."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int):
        super().__init__()
        self.router = TwoProjRouter(hidden, num_experts, top_k)
        self.up_experts = GroupedProjExperts(num_experts, hidden, inter)
        self.down_experts = GroupedProjExperts(num_experts, inter, hidden)

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.reshape(-1, h)                                        # [T, H]
        scores, index = self.router(x)
        dense = torch.zeros(x.shape[0], self.up_experts.num_experts, dtype=x.dtype).scatter(1, index, scores)
        xs = (dense.t()[:, :, None] * x[None]).reshape(-1, h)                   # [E*T, H]
        y = self.down_experts(nn.functional.silu(self.up_experts(xs)))          # [E*T, H]
        return y.view(-1, x.shape[0], h).sum(0).reshape(b, s, h)


def _mixtral_with_blocks(block_class):
    """A tiny Mixtral whose every MoE block is ``block_class(hidden, 32, experts, top_k)`` (seed 0),
    and its greedy tokens."""
    from kinject.testing import build_tiny_model

    model = build_tiny_model("mixtral")
    torch.manual_seed(0)
    c = model.config
    for layer in model.model.layers:
        layer.mlp = block_class(c.hidden_size, 32, c.num_local_experts, c.num_experts_per_tok)
    model.eval()
    return model, _generate(model)


def test_block_of_two_grouped_experts_modules(tmp_path):
    """The ``block`` layout is not JetMoE's: any block whose experts modules are called grouped."""
    model, ref = _mixtral_with_blocks(TwoProjMoeBlock)
    c = model.config
    kinject.optimize(model, copy.deepcopy(_rules()), _overrides(tmp_path, "vars.weights=disk"))
    ops = _experts(model)
    assert [op.layout.name for op in ops] == ["block"] * len(model.model.layers)
    assert all(len(op.units) == c.num_local_experts for op in ops)
    assert torch.equal(_generate(model), ref)
    kinject.restore(model)
    assert torch.equal(_generate(model), ref)


# ------------------------------------------------------------------ counts as a tensor, a plain Linear router


class CountsTensorGemm(nn.Module):
    """One projection per expert called with rows sorted by expert and their counts as a *tensor*
    (it calls ``.cpu()`` and ``cumsum`` on them), as transformers 5.17's ``AriaGroupedExpertsGemm``."""

    def __init__(self, num_experts: int, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_experts, d_in, d_out) * d_in ** -0.5)

    def forward(self, x, tokens_per_expert):
        ends = torch.cumsum(tokens_per_expert.cpu(), dim=0).tolist()
        out = x.new_zeros((x.shape[0], self.weight.shape[-1]))
        start = 0
        for e, end in enumerate(ends):
            out[start:end] = x[start:end] @ self.weight[e]
            start = end
        return out


class LogitsRoutedExperts(nn.Module):
    """Experts given the router's logits: top-k, sort by expert, two grouped projections, combine
    (transformers 5.17's ``AriaExperts``)."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.fc1 = CountsTensorGemm(num_experts, hidden, 2 * inter)
        self.fc2 = CountsTensorGemm(num_experts, inter, hidden)

    def forward(self, x, router_logits):
        k = self.top_k
        logits, index = torch.topk(router_logits, k, dim=1)                      # [T, k]
        scores = logits.softmax(-1)
        counts = torch.bincount(index.flatten(), minlength=self.num_experts)     # [E], a tensor
        order = torch.argsort(index.flatten(), stable=True)
        a, b = self.fc1(x.index_select(0, order // k), counts).chunk(2, dim=-1)
        ys = self.fc2(nn.functional.silu(a) * b, counts)                          # [T*k, H], sorted
        out = torch.zeros_like(ys).index_copy_(0, order, ys).view(-1, k, ys.shape[-1])
        return (out * scores.unsqueeze(-1)).sum(1)                               # [T, H]


class LinearRouterMoeBlock(nn.Module):
    """A block whose router is a plain ``nn.Linear`` named ``router`` (logits only)."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int):
        super().__init__()
        self.router = nn.Linear(hidden, num_experts, bias=False)
        self.experts = LogitsRoutedExperts(hidden, inter, num_experts, top_k)

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.reshape(-1, h)
        return self.experts(x, self.router(x)).reshape(b, s, h)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_block_of_experts_taking_counts_as_a_tensor_behind_a_linear_router(tier, tmp_path):
    """transformers 5.17's Aria (and Jamba's router): the experts modules get their per-expert counts
    as a tensor, so the layout hands them counts in that form; the plain ``Linear`` named ``router``
    becomes a PrefetchGate, which routes with the k the block's first experts-module call showed."""
    from operators.experts import routing
    from operators.gate import PrefetchGate

    model, ref = _mixtral_with_blocks(LinearRouterMoeBlock)
    c = model.config
    kinject.optimize(model, copy.deepcopy(_rules()), _overrides(tmp_path, f"vars.weights={tier}"))
    rt = model.kinject
    ops = _experts(model)
    assert [op.key for op in ops] == [f"model.layers.{i}.mlp.experts" for i in range(len(model.model.layers))]
    assert all(op.layout.name == "block" and len(op.units) == c.num_local_experts for op in ops)
    gates = [op for op in rt.operators if isinstance(op, PrefetchGate)]
    assert [g.key for g in gates] == [f"model.layers.{i}.mlp.router" for i in range(len(model.model.layers))]
    seen: list[tuple[int, bool]] = []                   # (step, routed before the experts ran)
    hooks = [op.base.fc1.register_forward_pre_hook(lambda _m, _a, op=op: seen.append(
        (rt.scheduler.step, routing(rt).routed_counts(op.layer) is not None))) for op in ops]
    assert torch.equal(_generate(model), ref)
    for h in hooks:
        h.remove()
    assert all(op.top_k_seen == c.num_experts_per_tok for op in ops)
    later = [routed for step, routed in seen if step > seen[0][0]]
    assert later and all(later), seen                   # from the second step the gate routed first
    kinject.restore(model)
    assert torch.equal(_generate(model), ref)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_loop_block_records_then_replays_with_experts_computed_hot_first(tier, tmp_path):
    """The legacy block (a ``for`` over a ``ModuleList``) matched on the block: one unit per expert,
    each used expert computed once per step in groups (``acquire_many``: no expert waits for the
    block's loop to reach it), every expert call of the second pass answered from those outputs
    (no on-demand ``acquire``), identical tokens; restore gives the block back unchanged."""
    model = _legacy_mixtral()
    ref = _generate(model)
    kinject.optimize(model, copy.deepcopy(_rules()), _overrides(tmp_path, f"vars.weights={tier}"))
    ops = _experts(model)
    assert [op.key for op in ops] == [f"model.layers.{i}.mlp" for i in range(len(model.model.layers))]
    assert all(op.layout.name == "loop_block" and len(op.units) == model.config.num_local_experts for op in ops)
    assert "loop_block (8 x LegacyExpert in .experts" in ops[0].layout.describe()
    sched = model.kinject.scheduler
    units = {u.name for op in ops for u in op.units}
    single, grouped = [], []
    acquire, acquire_many = sched.acquire, sched.acquire_many

    def one(unit, *a, **kw):
        single.append(unit.name)
        return acquire(unit, *a, **kw)

    def many(us, *a, **kw):
        grouped.append(([u.name for u in us], sched.step))
        return acquire_many(us, *a, **kw)

    sched.acquire, sched.acquire_many = one, many
    try:
        assert torch.equal(_generate(model), ref)
    finally:
        del sched.acquire, sched.acquire_many
    assert not [n for n in single if n in units], "an expert call was not answered by the replay"
    per_step = [(n, step) for names, step in grouped for n in names if n in units]
    assert per_step and len(per_step) == len(set(per_step)), "an expert computed twice in one step"
    kinject.restore(model)
    assert all("forward" not in vars(e) for layer in model.model.layers for e in layer.mlp.experts)
    assert torch.equal(_generate(model), ref)


class ChainedMoeBlock(LegacySparseMoeBlock):
    """A block whose expert inputs depend on earlier experts' outputs: the first pass (zeros for every
    output) records other inputs than the second pass gives."""

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.reshape(-1, h)
        weights = torch.softmax(self.gate(x), dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(weights, self.top_k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        mask = nn.functional.one_hot(chosen, num_classes=len(self.experts)).permute(2, 1, 0)
        for e in range(len(self.experts)):
            idx, tok = torch.where(mask[e])
            if tok.numel():
                out.index_add_(0, tok, self.experts[e](x[tok] + out[tok]) * weights[tok, idx, None])
        return out.reshape(b, s, h)


@pytest.mark.parametrize("gpu", [False, True])
@pytest.mark.parametrize("chained", [False, True])
def test_loop_block_compares_replayed_inputs_without_a_device_sync_per_call(gpu, chained, monkeypatch, tmp_path):
    """The second pass's expert inputs are checked against the recorded ones. ``gpu``: as if every
    tensor were on a GPU, where ``torch.equal`` waits for the device -- no call compares values on
    the host; the comparisons are read once per block call. ``chained``: a block whose second pass
    gives its experts other inputs; each such call (CPU), or the whole block once more (GPU),
    computes on the units. Tokens are the untouched model's either way."""
    model = build_tiny_model("mixtral")
    for layer in model.model.layers:
        layer.mlp = (ChainedMoeBlock if chained else LegacySparseMoeBlock)(layer.mlp, model.config)
    model.eval()
    ref = _generate(model)
    kinject.optimize(model, copy.deepcopy(_rules()), _overrides(tmp_path))
    assert all(op.layout.name == "loop_block" for op in _experts(model))
    if gpu:
        monkeypatch.setattr(operators.expert_interception, "reading_syncs", lambda t: True)
    host_compares = []
    equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda x, y: (host_compares.append(sys._getframe(1).f_code.co_name),
                                                      equal(x, y))[1])
    sched = model.kinject.scheduler
    units = {u.name for op in _experts(model) for u in op.units}
    single = []
    acquire = sched.acquire
    sched.acquire = lambda unit, *a, **kw: (single.append(unit.name), acquire(unit, *a, **kw))[1]
    try:
        assert torch.equal(_generate(model), ref)
    finally:
        del sched.acquire
    replay_compares = host_compares.count("_same_call")
    assert replay_compares == 0 if gpu else replay_compares > 0
    assert bool([n for n in single if n in units]) == chained     # replay answered every call unless chained
    kinject.restore(model)


def test_jetmoe_block_under_a_budget_of_one_expert_takes_them_one_at_a_time(tmp_path):
    """A budget with room for one expert unit beside the rest of the model: the block cannot hold
    every chosen expert across its two experts-module calls, so each call takes them one at a time
    (loaded again for the second call) -- same tokens, the budget never exceeded."""
    model = families.build_tiny_family_model("jetmoe")
    ref = _generate(model)
    budget = _optimize_with_room_for_one_expert(model, tmp_path)
    assert torch.equal(_generate(model), ref)
    assert model.kinject.store.peak <= budget
    assert not all(op.step.hold_all for op in _experts(model))
    kinject.restore(model)


def test_loop_block_under_a_budget_of_one_expert(tmp_path):
    """The recorded experts compute through the same budget-aware order as every layout (cold ones
    started as room frees up): with room for one expert unit beside the rest, same tokens."""
    model = _legacy_mixtral()
    ref = _generate(model)
    budget = _optimize_with_room_for_one_expert(model, tmp_path)
    assert all(op.layout.name == "loop_block" for op in _experts(model))
    assert torch.equal(_generate(model), ref)
    assert model.kinject.store.peak <= budget
    kinject.restore(model)
