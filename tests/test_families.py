"""The family scanner: every decoder-only MoE family transformers registers, each with a tiny model."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
import torch

from kinject import families
from kinject.testing import FAMILIES, tiny_batch, tiny_config, tiny_tokenizer
from helpers.transformers_bugs import skip_if_untouched_model_bug

SCANNED = families.moe_families()


@functools.lru_cache(maxsize=1)
def _batch() -> dict[str, torch.Tensor]:
    return tiny_batch(tiny_tokenizer(), 3, min_tokens=8)


def test_scan_finds_the_known_families_and_many_more():
    assert set(FAMILIES) <= set(SCANNED)
    assert len(SCANNED) > 40
    assert SCANNED == sorted(SCANNED)


def test_scan_is_not_a_hand_list():
    """No family name is a string in the module's code (docstrings aside) except as a key of the
    override / exclusion tables."""
    tree = ast.parse(Path(families.__file__).read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(n) is not None}
    strings = {n.value for n in ast.walk(tree)
               if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings}
    spelt = strings & set(SCANNED)
    assert spelt <= set(families._FAMILY_OVERRIDES) | set(families.NOT_MOE) | set(families.KNOWN_FAILURES)
    assert len(spelt) < 10


def test_multimodal_wrappers_are_reported_with_their_text_model():
    verdicts = families.classify_causal_lm_entries()
    wrappers = {m: v for m, v in verdicts.items() if v["verdict"] == "multimodal"}
    assert "llama4" in wrappers and "llama4_text" in SCANNED
    assert all(m not in SCANNED for m in wrappers)
    assert all(v["reason"] for v in verdicts.values())


def test_known_families_keep_kinject_testing_configs():
    for family in FAMILIES:
        assert families.tiny_family_config(family).to_dict() == tiny_config(family).to_dict()


@pytest.mark.parametrize("model_type", SCANNED)
def test_family_builds_and_generates_deterministically(model_type):
    """Same seed -> identical greedy tokens; a failure must be listed in KNOWN_FAILURES (or be a bug of
    the installed transformers, :mod:`helpers.transformers_bugs`: skipped)."""
    try:
        outs = []
        for _ in range(2):
            model = families.build_tiny_family_model(model_type, seed=0)
            outs.append(model.generate(**_batch(), max_new_tokens=4, do_sample=False))
    except Exception as exc:  # noqa: BLE001
        skip_if_untouched_model_bug(model_type, exc)
        assert model_type not in FAMILIES, f"known-good family {model_type} failed: {exc!r}"
        assert model_type in families.KNOWN_FAILURES, f"{model_type} fails unreported: {exc!r}"
        return
    assert model_type not in families.KNOWN_FAILURES, f"{model_type} now builds; drop it from KNOWN_FAILURES"
    assert outs[0].shape == (3, _batch()["input_ids"].shape[1] + 4)
    assert torch.equal(outs[0], outs[1])


def test_tiny_config_is_tiny_and_uses_the_tokenizer():
    tok = tiny_tokenizer()
    for model_type in ("qwen3_next", "deepseek_v32", "jamba", "dbrx"):
        config = families.tiny_family_config(model_type)
        assert config.vocab_size == len(tok)
        assert config.eos_token_id == tok.eos_token_id
        model = families.build_tiny_family_model(model_type)
        assert sum(p.numel() for p in model.parameters()) < 2_000_000


def test_mixed_layer_kinds_keep_one_layer_of_each_kind():
    config = families.tiny_family_config("qwen3_next")
    assert sorted(set(config.layer_types)) == ["full_attention", "linear_attention"]
    config = families.tiny_family_config("deepseek_v32")
    assert config.mlp_layer_types[0] == "dense" and "sparse" in config.mlp_layer_types
    assert len(config.layer_types) == config.num_hidden_layers == len(config.mlp_layer_types)


def test_family_report_describes_experts_router_and_cache():
    r = families.family_report("qwen3_next")
    assert r["builds"] and r["forward_ok"] and r["generate_ok"] and not r["errors"]
    assert r["experts"]["class"] == "Qwen3NextExperts"
    assert r["experts"]["params"] == {"gate_up_proj": [8, 96, 64], "down_proj": [8, 64, 48]}  # [E, 2I, H], [E, H, I]
    assert r["router_output"].startswith("(f[") and r["experts_get_routing"]
    assert set(r["dynamic_cache_layers"]) == {"LinearAttentionLayer", "DynamicLayer"}
    assert "shared_expert" in r["shared"]
    r = families.family_report("jetmoe")
    assert r["experts"]["layout"] == "parallel-experts pair"


def test_family_report_records_a_failing_build(monkeypatch):
    monkeypatch.setitem(families._FAMILY_OVERRIDES, "qwen3_next", {"layer_types": ["no_such_layer", "full_attention"]})
    r = families.family_report("qwen3_next")
    assert not r["builds"] and "build" in r["errors"]
