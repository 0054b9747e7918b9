"""Weights tied across two claimed modules (DiffusionGemma's decoder layers reuse its encoder's
Parameters): the store keeps one unit per tied tensor set, every operator whose module holds those
Parameters binds to it (one copy, its bytes counted once), and restore leaves them tied."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import kinject
from kinject.testing import build_tiny_model, tiny_batch, tiny_tokenizer

RULES = Path(__file__).resolve().parents[1] / "rules" / "klotski.yaml"
TIED = ("self_attn", "mlp.gate", "mlp.experts")         # layer 1's modules reuse layer 0's Parameters


def _tie(model) -> None:
    first, second = model.model.layers[0], model.model.layers[1]
    for path in TIED:
        src, dst = first.get_submodule(path), second.get_submodule(path)
        for name, param in list(src.named_parameters()):
            owner, _, leaf = name.rpartition(".")
            setattr(dst.get_submodule(owner) if owner else dst, leaf, param)


def _tier_bytes(model, tier: str) -> int:
    return model.kinject.store.summary()["tier_bytes"][tier]


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_tied_modules_share_one_unit_and_give_transformers_tokens(tier, tmp_path):
    model = build_tiny_model("mixtral")
    untied = copy.deepcopy(model)
    _tie(model)
    tied = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
    before = {n: p.detach().clone() for n, p in tied.items()}
    tok = tiny_tokenizer()
    batch = tiny_batch(tok, 3, min_tokens=8)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    ref = model.generate(**batch, **kw)                                # transformers, weights tied
    opts = [f"pipeline.offload_dir={tmp_path}/off", f"vars.weights={tier}", "pipeline.micro_batch_size=2"]

    kinject.optimize(untied, RULES, [*opts[1:], f"pipeline.offload_dir={tmp_path}/off2"])
    layer1 = sum(u.wire_nbytes for name, u in untied.kinject.store.units.items() if name.startswith("model.layers.1."))
    untied_bytes = _tier_bytes(untied, tier)
    kinject.restore(untied)

    kinject.optimize(model, RULES, opts)
    ops = {op.key: op for op in model.kinject.operators}
    for path in TIED:
        a, b = ops[f"model.layers.0.{path}"], ops[f"model.layers.1.{path}"]
        units_a = a.units if hasattr(a, "units") else [a.binding.unit]
        units_b = b.units if hasattr(b, "units") else [b.binding.unit]
        assert units_a and all(x is y for x, y in zip(units_a, units_b, strict=True)), path
    assert layer1 > 0 and _tier_bytes(model, tier) == untied_bytes - layer1          # counted once
    assert not any(name.startswith("model.layers.1.") for name in model.kinject.store.units)
    assert torch.equal(model.generate(**batch, **kw), ref)

    kinject.restore(model)
    after = dict(model.named_parameters(remove_duplicate=False))
    assert all(after[n] is p for n, p in tied.items())                 # the same Parameters: still tied
    assert all(torch.equal(p, before[n]) for n, p in after.items())


def test_a_tie_covering_part_of_a_module_is_refused_naming_both(tmp_path):
    """Layer 1's experts hold layer 0's gate_up_proj but their own down_proj: no one unit serves both."""
    model = build_tiny_model("mixtral")
    first, second = model.model.layers[0].mlp.experts, model.model.layers[1].mlp.experts
    second.gate_up_proj = first.gate_up_proj
    with pytest.raises(kinject.InjectionError, match="only some are tied") as info:
        kinject.optimize(model, RULES, [f"pipeline.offload_dir={tmp_path}/off"])
    assert "model.layers.1.mlp.experts" in str(info.value) and "model.layers.0.mlp.experts" in str(info.value)
    assert getattr(model, "kinject", None) is None and model.model.layers[1].mlp.experts is second
