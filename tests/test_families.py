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


def test_layer_reference_lists_are_cut_to_layers_they_still_name():
    """A per-layer list of layer numbers (each layer's K/V source, itself or an earlier layer) is no
    list of kinds: the cut keeps one layer reading its own and one reading another's, that one's
    source with it, and renumbers the entries to the kept positions (before: every distinct number
    kept its layer, and the kept entries still named the full model's layers)."""
    types = ["sliding"] * 4 + ["indexed"] + ["sliding"] * 4 + ["indexed"] + ["sliding"] * 4 + ["indexed"]
    sources = list(range(15))
    sources[9] = sources[14] = 4                                    # indexed layers reading layer 4's K/V
    assert families._is_layer_reference_list("kv_source_layers", sources, 15)
    assert not families._is_layer_reference_list("kv_source_layers", [0, 2, 1], 3)     # names a later layer
    keep = families._kept_layers({"layer_types": types}, {}, 15, minimum=2, references={"kv_source_layers": sources})
    assert keep == [0, 4, 9]
    assert families._renumbered_references(sources, keep) == [0, 1, 1]
    assert [types[i] for i in keep] == ["sliding", "indexed", "indexed"]


@pytest.mark.skipif("kolibri1_1" not in SCANNED, reason="the installed transformers has no kolibri1_1 family (5.25 added it)")
def test_kolibri_tiny_config_validates_and_still_shares_kv_and_selects_keys(monkeypatch):
    """Kolibri 1.1 (transformers 5.25) validates that a sliding layer reads its own K/V and every
    layer one of its own kind: the tiny config keeps a few layers, one indexed layer reading another's
    K/V among them, and its indexer (pool and top-k) selects fewer keys than the tiny prompts show."""
    from transformers.models.kolibri1_1 import modeling_kolibri1_1 as kolibri

    config = families.tiny_family_config("kolibri1_1")
    config.validate_architecture()
    kinds, sources = config.layer_types, config.kv_source_layers
    assert config.num_hidden_layers <= 6 and set(kinds) == {"sliding_attention", "indexed_attention"}
    assert any(s != i for i, s in enumerate(sources))
    assert all(kinds[s] == kinds[i] for i, s in enumerate(sources))
    selected = []
    for name in ("select_pool", "select_tokens"):
        original = getattr(kolibri.Kolibri1_1Indexer, name)

        def counted(self, queries, keys, visible, *rest, original=original, name=name):
            out = original(self, queries, keys, visible, *rest)
            selected.append((name, int(out.sum()) < int(visible.sum())))
            return out
        monkeypatch.setattr(kolibri.Kolibri1_1Indexer, name, counted)
    families.build_tiny_family_model("kolibri1_1").generate(**_batch(), max_new_tokens=2, do_sample=False)
    assert {name for name, fewer in selected if fewer} == {"select_pool", "select_tokens"}


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
