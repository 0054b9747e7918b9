"""Every decoder-only MoE family transformers registers, ported by ``rules/klotski.yaml`` alone.

The families come from scanning transformers' causal-LM auto mapping (:mod:`kinject.families`),
never from a hand-kept list. For each: router -> PrefetchGate, experts -> GroupedExperts (one
store unit per expert, whatever the layout), micro-batches smaller than the batch, and the same
greedy tokens as the untouched model, with the experts on the host tier and, loaded by
``kinject.from_pretrained`` from a checkpoint saved in the family's own format, on disk.
Attention stays untouched here (mixed-attention families' mixers and caches are tested on their own). The same runs
again with ``rules/hybrid.yaml`` (experts computed where they live, on both tiers).
"""

from __future__ import annotations

import copy
import functools
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import kinject
from kinject import families
from kinject.rules import _read_rule_file
from kinject.testing import build_tiny_model, tiny_batch, tiny_tokenizer
from operators.expert_layouts import LAYOUTS, LayoutError, infer_layout
from operators.experts import GroupedExperts
from operators.gate import PrefetchGate
from helpers.transformers_bugs import skip_if_untouched_model_bug

SCANNED = families.moe_families()
RULES = Path(__file__).resolve().parents[1] / "rules" / "klotski.yaml"
HYBRID_RULES = RULES.with_name("hybrid.yaml")
NEW_TOKENS = 3
# Families the generic rules cannot port yet; model_type -> reason (empty: every family ports).
PORT_FAILURES: dict[str, str] = {}
# Families whose checkpoint kinject cannot yet read lazily with experts on disk; model_type -> reason.
DISK_FAILURES: dict[str, str] = {}
# Families whose router is not a module of its own kind (product keys computed by a plain Linear
# inside the block): their experts load what each lookup needs, no gate prefetch.
_NO_ROUTER_LAYOUTS = {"lookup"}


@functools.lru_cache(maxsize=2)
def _rules(path: Path = RULES) -> dict:
    """A shipped rule file (its ``extends:`` chain merged) without its attention rule."""
    data, _ = _read_rule_file(path, str(path), ())
    data["rules"] = [r for r in data["rules"] if not r["replace"]["class"].endswith("OffloadedAttention")]
    return data


def _batch():
    return tiny_batch(tiny_tokenizer(), 4, min_tokens=8)                       # [4, L], left-padded


def _generate(model) -> torch.Tensor:
    tok = tiny_tokenizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(**_batch(), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id)


def _overrides(tmp_path: Path, *extra: str) -> list[str]:
    # micro-batches of 2 rows, batch of 4, the host KV across a (fast emulated) link so it is chunked
    return ["pipeline.micro_batch_size=2", "pipeline.n_batches=2", "pipeline.emulate_bandwidth=1000",
            f"pipeline.offload_dir={tmp_path}/off", *extra]


def _build_or_report(model_type: str):
    """The tiny model, or None for a family reported as unbuildable (families.KNOWN_FAILURES)."""
    try:
        model = families.build_tiny_family_model(model_type)
    except Exception as exc:  # noqa: BLE001
        assert model_type in families.KNOWN_FAILURES, f"{model_type} does not build and is not reported: {exc!r}"
        return None
    assert model_type not in families.KNOWN_FAILURES, f"{model_type} builds; drop it from KNOWN_FAILURES"
    return model


def _reference(model_type: str, model) -> torch.Tensor:
    """The untouched model's tokens; the test is skipped where a bug of the installed transformers
    keeps the untouched model from generating (:mod:`helpers.transformers_bugs`)."""
    try:
        return _generate(model)
    except Exception as exc:  # noqa: BLE001
        skip_if_untouched_model_bug(model_type, exc)
        raise


def _check_placement(model) -> None:
    ops = model.kinject.operators
    experts = [op for op in ops if isinstance(op, GroupedExperts)]
    assert experts, "no experts module became GroupedExperts"
    for op in experts:
        assert len(op.units) == op.stored > 0                                   # one unit per expert
    gated = {op.layer for op in ops if isinstance(op, PrefetchGate)}
    for op in experts:
        if op.layout.name not in _NO_ROUTER_LAYOUTS:
            assert op.layer in gated, f"{op.key}: its router is not a PrefetchGate"


@pytest.mark.parametrize("model_type", SCANNED)
def test_family_on_host_tier(model_type, tmp_path):
    model = _build_or_report(model_type)
    if model is None:
        return
    ref = _reference(model_type, model)
    try:
        kinject.optimize(model, copy.deepcopy(_rules()), _overrides(tmp_path))
        _check_placement(model)
        out = _generate(model)
    except Exception as exc:  # noqa: BLE001
        assert model_type in PORT_FAILURES, f"{model_type}: {exc!r}"
        return
    assert model_type not in PORT_FAILURES, f"{model_type} ports; drop it from PORT_FAILURES"
    assert torch.equal(out, ref)
    assert model.kinject.store.stats["bytes"]["host"] > 0
    kinject.restore(model)
    assert torch.equal(_generate(model), ref)
    kinject.optimize(model, copy.deepcopy(_rules(HYBRID_RULES)), _overrides(tmp_path, *HYBRID))
    _check_hybrid(model, ref)


# rules/hybrid.yaml as shipped (experts_compute auto, keep_resident, embeddings / lm_head computed where
# they live); over a slow emulated link every expert a layout can compute on the host is cheaper
# there than moved, so the host path runs
HYBRID = ("pipeline.emulate_bandwidth=0.001",)


def _check_hybrid(model, ref: torch.Tensor) -> None:
    """Same tokens with experts computed where they live (where a host kernel serves the layout)."""
    assert torch.equal(_generate(model), ref)
    hosts = [op.host for op in model.kinject.operators if isinstance(op, GroupedExperts) and op.host is not None]
    assert all(h.stats["experts"] > 0 for h in hosts)
    experts = [op for op in model.kinject.operators if isinstance(op, GroupedExperts)]
    assert hosts or all(op.layout.call not in ("routed", "grouped", "sized") for op in experts)


@pytest.mark.parametrize("model_type", SCANNED)
def test_family_from_checkpoint_with_experts_on_disk(model_type, tmp_path):
    model = _build_or_report(model_type)
    if model is None:
        return
    ref = _reference(model_type, model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(tmp_path / "ckpt")                               # the family's own format
    del model
    try:
        ported = kinject.from_pretrained(tmp_path / "ckpt", copy.deepcopy(_rules()),
                                         _overrides(tmp_path, "vars.weights=disk"), attn_implementation="eager")
        _check_placement(ported)
        out = _generate(ported)
    except Exception as exc:  # noqa: BLE001
        assert model_type in PORT_FAILURES or model_type in DISK_FAILURES, f"{model_type}: {exc!r}"
        return
    assert model_type not in DISK_FAILURES, f"{model_type} loads from disk; drop it from DISK_FAILURES"
    assert torch.equal(out, ref)
    experts = [op for op in ported.kinject.operators if isinstance(op, GroupedExperts)]
    assert all(u.tier == "disk" for op in experts for u in op.units)
    assert ported.kinject.store.stats["bytes"]["disk"] > 0
    del ported
    hybrid = kinject.from_pretrained(tmp_path / "ckpt", copy.deepcopy(_rules(HYBRID_RULES)),
                                     _overrides(tmp_path, "vars.weights=disk", *HYBRID), attn_implementation="eager")
    _check_hybrid(hybrid, ref)


# ------------------------------------------------------------------ per-expert ModuleList (remote code)


class LegacyExpert(nn.Module):
    """One expert as older families and remote code write it."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)

    def forward(self, x):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class LegacyMoEGate(nn.Module):
    """A router that returns only logits; the block does the top-k."""

    def __init__(self, hidden: int, n: int, top_k: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n, hidden))
        self.top_k = top_k

    def forward(self, x):
        return nn.functional.linear(x, self.weight)                             # [T, E]


class LegacySparseMoeBlock(nn.Module):
    """Mixtral as transformers 4 wrote it: a ModuleList of experts the block loops over."""

    def __init__(self, fused: nn.Module, config):
        super().__init__()
        E, k = config.num_local_experts, config.num_experts_per_tok
        inter, hidden = fused.experts.down_proj.shape[2], fused.experts.down_proj.shape[1]
        self.top_k = k
        self.gate = LegacyMoEGate(hidden, E, k)
        self.gate.weight.data.copy_(fused.gate.weight.data)
        self.experts = nn.ModuleList(LegacyExpert(hidden, inter) for _ in range(E))
        for e, ex in enumerate(self.experts):
            gate_w, up_w = fused.experts.gate_up_proj.data[e].chunk(2, dim=0)
            ex.w1.weight.data.copy_(gate_w)
            ex.w3.weight.data.copy_(up_w)
            ex.w2.weight.data.copy_(fused.experts.down_proj.data[e])

    def forward(self, hidden_states):
        b, s, h = hidden_states.shape
        x = hidden_states.reshape(-1, h)                                         # [T, H]
        logits = self.gate(x)                                                    # [T, E]
        weights = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(weights, self.top_k, dim=-1)                # [T, k]
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        mask = nn.functional.one_hot(chosen, num_classes=len(self.experts)).permute(2, 1, 0)   # [E, k, T]
        for e in range(len(self.experts)):
            idx, tok = torch.where(mask[e])
            if tok.numel():
                out.index_add_(0, tok, self.experts[e](x[tok]) * weights[tok, idx, None])
        return out.reshape(b, s, h)


def _legacy_mixtral():
    model = build_tiny_model("mixtral")
    for layer in model.model.layers:
        layer.mlp = LegacySparseMoeBlock(layer.mlp, model.config)
    return model.eval()


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_module_list_experts_and_logits_only_router(tier, tmp_path):
    model = _legacy_mixtral()
    ref = _generate(model)
    kinject.optimize(model, copy.deepcopy(_rules()), _overrides(tmp_path, f"vars.weights={tier}"))
    experts = [op for op in model.kinject.operators if isinstance(op, GroupedExperts)]
    assert [op.layout.name for op in experts] == ["loop_block"] * len(model.model.layers)   # a rule on the block
    assert all(len(op.units) == model.config.num_local_experts for op in experts)
    gates = [op for op in model.kinject.operators if isinstance(op, PrefetchGate)]
    assert len(gates) == len(experts) and all(g.top_k == 2 for g in gates)
    assert torch.equal(_generate(model), ref)
    r = model.kinject.peek("expert_routing")
    assert r is not None and r.table_obj is not None                          # the gate's derived top-k fed the table
    kinject.restore(model)
    assert torch.equal(_generate(model), ref)


# ------------------------------------------------------------------ layouts: inference and errors


def test_layout_error_lists_parameters_and_layouts():
    with pytest.raises(LayoutError) as info:
        infer_layout(nn.Linear(4, 3), "model.layers.0.mlp.odd")
    msg = str(info.value)
    assert "weight[3, 4]" in msg and "model.layers.0.mlp.odd" in msg
    assert all(name in msg for name in LAYOUTS)


def test_named_layout_must_fit():
    with pytest.raises(LayoutError, match="does not fit layout 'stacked'"):
        infer_layout(nn.Embedding(8, 4), "x", "stacked")
    assert infer_layout(nn.Embedding(8, 4), "x", "lookup").name == "lookup"
    with pytest.raises(LayoutError, match="unknown experts layout"):
        infer_layout(nn.Embedding(8, 4), "x", "nope")


def _route_gain_experts_class():
    """A subclass of Mixtral's fused experts (a ``@use_experts_implementation`` class) whose forward
    adds computation of its own around the contract's: each route its own row, a learned gain per
    expert and hidden unit on each route's output, then the weighted sum -- the shape of Ergo's
    experts in transformers 5.25 (its per-expert RMSNorm), on any release."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    class RouteGainExperts(MixtralExperts):
        def __init__(self, config):
            super().__init__(config)
            self.route_gain = nn.Parameter(torch.ones(config.num_local_experts, config.hidden_size))

        def forward(self, hidden_states, top_k_index, top_k_weights):
            k = top_k_index.shape[1]
            rows = hidden_states.repeat_interleave(k, dim=0)                     # [T*k, H]
            flat = top_k_index.reshape(-1, 1)                                    # [T*k, 1]
            out = super().forward(rows, flat, torch.ones(flat.shape, dtype=rows.dtype))
            out = out * self.route_gain[flat.squeeze(1)]
            return (out.view(*top_k_index.shape, -1) * top_k_weights.unsqueeze(-1)).sum(1)

    return RouteGainExperts


def _mixtral_with_route_gains(gains: bool = True):
    """Tiny Mixtral with its experts swapped for :func:`_route_gain_experts_class`'s (same weights,
    gains drawn far from 1); ``gains=False``: the same model with plain experts (the gains dropped)."""
    model = build_tiny_model("mixtral")
    if not gains:
        return model
    cls, gen = _route_gain_experts_class(), torch.Generator().manual_seed(1)
    for layer in model.model.layers:
        plain = layer.mlp.experts
        experts = cls(model.config)
        experts.load_state_dict(plain.state_dict(), strict=False)
        experts.route_gain.data.copy_(torch.rand(experts.route_gain.shape, generator=gen) * 4 - 2)
        layer.mlp.experts = experts
    return model.eval()


def test_experts_with_a_forward_of_their_own_run_it(tmp_path):
    """A class carrying the fused contract's flags whose forward is not the contract's: the ``fused``
    layout (whose math would drop the gains) refuses it, naming its forward; ``fused_module`` runs
    its own forward per expert, so the tokens are transformers' (without the refusal they are not)."""
    model = _mixtral_with_route_gains()
    experts = model.model.layers[0].mlp.experts
    assert experts.has_gate and hasattr(experts, "is_transposed")               # the contract's flags
    assert infer_layout(build_tiny_model("mixtral").model.layers[0].mlp.experts).name == "fused"
    assert infer_layout(experts).name == "fused_module"
    with pytest.raises(LayoutError, match=r"RouteGainExperts runs a forward of its own "
                                          r"\(.*RouteGainExperts\.forward\)"):
        infer_layout(experts, "model.layers.0.mlp.experts", "fused")
    ref = _generate(model)
    assert not torch.equal(ref, _generate(_mixtral_with_route_gains(gains=False)))   # the gains matter
    kinject.optimize(model, copy.deepcopy(_rules()), _overrides(tmp_path))
    _check_placement(model)
    assert {op.layout.name for op in model.kinject.operators if isinstance(op, GroupedExperts)} == {"fused_module"}
    assert torch.equal(_generate(model), ref)


@pytest.mark.skipif("ergo" not in SCANNED, reason="the installed transformers has no ergo family (5.25 added it)")
def test_ergos_experts_run_their_own_forward():
    """Ergo's experts (transformers 5.25) normalise each route with a learned RMSNorm per expert
    before the weighted sum, in a forward of their own: computed by it (``fused_module``), never by
    the fused contract's math, which has no such norm (their tokens: test_family_on_host_tier[ergo])."""
    model = families.build_tiny_family_model("ergo")
    found = [(name, m) for name, m in model.named_modules() if type(m).__name__ == "ErgoExperts"]
    assert found
    for name, experts in found:
        assert infer_layout(experts, name).name == "fused_module"
        with pytest.raises(LayoutError, match=r"ErgoExperts runs a forward of its own \(ErgoExperts\.forward\)"):
            infer_layout(experts, name, "fused")


def _longcat_zero_compute_in_experts() -> bool:
    """Where LongCat-Flash's two zero-compute experts live: in its experts module, beside the real
    ones, with a forward of its own (transformers <= 5.24), or in its MoE block, which sends their
    routes to real experts at weight 0 and adds the identity part itself, the experts module then a
    plain fused contract one of the real experts (5.25). Told from the module, not the version."""
    model = families.build_tiny_family_model("longcat_flash")
    block = model.model.layers[0].mlp
    in_experts = getattr(block.experts, "zero_expert_num", 0)
    assert (in_experts or block.zero_expert_num) == 2                # the tiny config's two, in one or the other
    return bool(in_experts)


def test_inferred_layouts_of_the_odd_families():
    """The layouts the issue lists, each inferred from names, shapes and config alone."""
    seen = {}
    for model_type in ("mixtral", "dbrx", "longcat_flash", "llama4_text", "jetmoe", "doge"):
        model = families.build_tiny_family_model(model_type)
        for name, module in model.named_modules():
            if name.endswith(("experts", "input_linear", "down_embed")) and "shared" not in name and "attention" not in name:
                lay = infer_layout(module, name)
                seen[model_type] = (lay.name, lay.call, lay.num_experts, lay.stored)
                break
    assert seen["mixtral"][:2] == ("fused", "routed")
    assert seen["dbrx"][:2] == ("stacked", "routed")
    if _longcat_zero_compute_in_experts():
        assert seen["longcat_flash"] == ("fused_module", "routed", 10, 8)     # 2 zero-compute experts
    else:                                                                   # the block computes them
        assert seen["longcat_flash"] == ("fused", "routed", 8, 8)
    assert seen["llama4_text"][:2] == ("fused_module", "grouped")
    assert seen["jetmoe"][:2] == ("sized", "sized")
    assert seen["doge"][:2] == ("lookup", "lookup")


def test_inspect_prints_each_experts_layout(tmp_path, capsys):
    from kinject.app.cli import main

    longcat = "fused_module (8 experts, 2 zero-compute, routed call" if _longcat_zero_compute_in_experts() \
        else "fused (8 experts, routed call"
    for model_type, expected in (("dbrx", "stacked (8 experts, routed call"), ("longcat_flash", longcat)):
        families.tiny_family_config(model_type).save_pretrained(tmp_path / model_type)
        assert main(["inspect", str(tmp_path / model_type), str(RULES)]) == 0
        out = capsys.readouterr().out
        assert "experts layouts:" in out and expected in out, out


@pytest.mark.parametrize("model_type", ["llama4_text", "dbrx", "jetmoe"])
def test_logits_only_router_queues_the_blocks_top_k(model_type, tmp_path):
    """Routers returning scores / logits only: the gate takes their top-k (k from the router, else
    from the experts' last call), so the experts are known before the experts module runs."""
    from operators.experts import routing

    model = families.build_tiny_family_model(model_type)
    kinject.optimize(model, copy.deepcopy(_rules()), _overrides(tmp_path))
    rt = model.kinject
    seen: list[bool] = []
    experts = [op for op in rt.operators if isinstance(op, GroupedExperts)]
    primaries = [op for op in experts if routing(rt).experts.get(op.layer) is op]
    # a block's operator runs before its router: what counts is its first experts module's call
    called = [op.base.get_submodule(next(iter(op.layout.children))) if op.layout.call == "block" else op
              for op in primaries]
    hooks = [m.register_forward_pre_hook(lambda _m, _a, op=op: seen.append(routing(rt).routed_counts(op.layer) is not None))
             for op, m in zip(primaries, called)]
    _generate(model)
    for h in hooks:
        h.remove()
    first = len(primaries)                       # DBRX's router declares no k: known from the experts' first call
    assert seen and all(seen[first:]), seen

