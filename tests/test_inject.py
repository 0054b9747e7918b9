"""Matching semantics (pure, on names) and injection end to end on every tiny family."""

import pytest
import torch
from torch import nn

import kinject
from kinject.inject import match_modules, match_rule
from kinject.rules import load_rules
from kinject.testing import FAMILIES, build_tiny_model, tiny_batch, tiny_tokenizer
from operators.base import Default


def rules_of(*rules, **pipeline):
    return load_rules({"pipeline": pipeline or {"device": "cpu"}, "rules": list(rules)})


def rule(match, recursive=True, optional=False, cls="default"):
    return {"match": match, "replace": {"class": cls}, "recursive": recursive, "optional": optional}


class Attention(nn.Module):
    pass


class FancyAttention(Attention):
    pass


def test_match_rule_is_a_pure_function_of_rule_name_module():
    rs = rules_of(rule({"name": r"layers\.\d+\.attn$"}), rule({"class": "Attention"}),
                  rule({"class": "tests_never_imported_anyway.X".split(".")[-1]}, optional=True),
                  rule({"name": "^a", "class": "torch.nn.Linear"}))
    by_name, by_cls, _, both = rs.rules
    assert match_rule(by_name, "model.layers.3.attn", nn.Identity())
    assert not match_rule(by_name, "model.layers.3.attn.q", nn.Identity())
    assert match_rule(by_cls, "anything", FancyAttention())          # class name seen in the MRO
    assert not match_rule(by_cls, "anything", nn.Linear(1, 1))
    assert match_rule(both, "a.b", nn.Linear(1, 1))
    assert not match_rule(both, "a.b", nn.Identity())                # both must hold
    assert not match_rule(both, "b.a", nn.Linear(1, 1))


def test_class_name_pattern_matches_the_class_name_by_regex():
    by_pattern, with_name = rules_of(rule({"class_name": "Attention$"}),
                                     rule({"class_name": "^Linear$", "name": "proj$"})).rules
    assert match_rule(by_pattern, "anything", FancyAttention())
    assert not match_rule(by_pattern, "anything", nn.Linear(1, 1))
    assert match_rule(with_name, "layers.0.proj", nn.Linear(1, 1))
    assert not match_rule(with_name, "layers.0.mlp", nn.Linear(1, 1))   # both must hold


def tree():
    root = nn.Module()
    root.layers = nn.ModuleList()
    for _ in range(2):
        layer = nn.Module()
        layer.attn = FancyAttention()
        layer.attn.proj = nn.Linear(2, 2)
        layer.mlp = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        root.layers.append(layer)
    return root


def test_first_match_wins_and_recursive_false():
    rs = rules_of(rule({"name": r"layers\.0\.attn$"}, recursive=False), rule({"class": "Attention"}),
                  rule({"class": "Linear"}))
    claims, report = match_modules(tree(), rs)
    names = {c.name: c.rule.index for c in claims}
    assert names["layers.0.attn"] == 0 and names["layers.1.attn"] == 1       # first match wins
    assert "layers.0.attn.proj" not in names                                 # recursive: false
    assert names["layers.1.attn.proj"] == 2                                  # walk continues below rule 1
    assert report.matches[2] == ["layers.0.mlp.0", "layers.1.attn.proj", "layers.1.mlp.0"]


def test_optional_rule_may_match_nothing():
    rs = rules_of(rule({"class": "Attention"}), rule({"name": "nothing_here"}, optional=True))
    claims, report = match_modules(tree(), rs)
    assert len(claims) == 2 and report.matches.get(1) is None


def test_nested_operators_restore_exactly():
    model = tree()
    before = [(n, id(m)) for n, m in model.named_modules()]
    kinject.optimize(model, {"rules": [rule({"name": r"layers\.\d+$"}), rule({"class": "Linear"})]})
    assert isinstance(model.layers[0], Default) and isinstance(model.layers[0].base.attn.proj, Default)
    assert len(model.kinject.operators) == 6
    kinject.restore(model)
    assert [(n, id(m)) for n, m in model.named_modules()] == before
    with pytest.raises(kinject.InjectionError, match="not optimized"):
        kinject.restore(model)


def test_optimize_twice_is_refused():
    model = tree()
    kinject.optimize(model, {"rules": [rule({"class": "Attention"})]})
    with pytest.raises(kinject.InjectionError, match="already optimized"):
        kinject.optimize(model, {"rules": [rule({"class": "Attention"})]})


@pytest.mark.parametrize("family", FAMILIES)
def test_resident_rules_give_identical_greedy_tokens(family):
    model = build_tiny_model(family)
    tok = tiny_tokenizer()
    batch = tiny_batch(tok, 4, min_tokens=16)
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
    ref = model.generate(**batch, **kw)
    kinject.optimize(model, f"rules/{family}_resident.yaml")
    assert model.kinject.injection.matches, "resident rules matched nothing"
    out = model.generate(**batch, **kw)
    assert torch.equal(ref, out)
    assert out.shape[1] == batch["input_ids"].shape[1] + 16


def test_operator_plain_attributes_skip_module_registration_tensors_and_modules_do_not():
    import torch
    from operators.base import Default

    class _Rt:
        pass

    op = Default(torch.nn.Linear(2, 2), key="x", runtime=_Rt(), device="cpu")    # (Operator itself is abstract)
    op.state = (1, [2])
    assert op.__dict__["state"] == (1, [2]) and "state" not in op._modules
    op.child = torch.nn.Linear(1, 1)
    assert "child" in op._modules and "child" not in op.__dict__
    op.weight = torch.nn.Parameter(torch.zeros(1))
    assert "weight" in op._parameters
    with pytest.raises(TypeError):
        op.weight = 3                                     # as nn.Module: not a Parameter
    op.child = None
    assert op._modules["child"] is None


def test_weights_tied_across_two_claimed_modules_are_refused(tmp_path):
    """Two experts modules sharing only some of their parameters (a partial tie across stacks) are
    refused before anything changes, naming both: no one store unit serves both modules."""
    from pathlib import Path

    model = build_tiny_model("mixtral")
    first, second = model.model.layers[0].mlp.experts, model.model.layers[1].mlp.experts
    second.gate_up_proj = first.gate_up_proj                                   # tied
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rules = Path(__file__).resolve().parents[1] / "rules" / "klotski.yaml"
    with pytest.raises(kinject.InjectionError) as info:
        kinject.optimize(model, rules, [f"pipeline.offload_dir={tmp_path}/off"])
    msg = str(info.value)
    assert "model.layers.1.mlp.experts" in msg and "model.layers.0.mlp.experts.gate_up_proj" in msg
    assert getattr(model, "kinject", None) is None and model.model.layers[1].mlp.experts is second
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
