"""kinject.io.key_templates: transformers' key renaming once per template, identical to it per key.

Every key of a checkpoint is renamed by :class:`~kinject.io.conversions.KeyMapper` (templates) and
by transformers' own ``rename_source_key`` one key at a time; the two must agree on every key:
DeepSeek-V3's real counts (61 layers, 256 experts, 45k+ keys, its MTP layer's keys included) and
the tiny models of other families in their hub layouts (per-expert keys) and in transformers 5's.
"""

from __future__ import annotations

import re

import pytest
import torch

from kinject.io.conversions import KeyMapper
from kinject.io.key_templates import TemplateRenamer, fixed_digits
from kinject.io.loading import parameters_on_meta
from kinject.testing import _checkpoint_keys, save_tiny_model, tiny_config

_LAYER = re.compile(r"(?<=layers\.)\d+(?=\.)")
_EXPERT = re.compile(r"(?<=experts\.)\d+(?=\.)")
REAL = dict(num_hidden_layers=61, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
            first_k_dense_replace=3, n_group=8, topk_group=4)


def _meta_model(family: str, **overrides):
    from transformers import AutoModelForCausalLM

    with parameters_on_meta():
        return AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=torch.bfloat16)


def _transformers_map(model, key: str, targets: dict) -> tuple[str, str | None, str]:
    """``key`` renamed by transformers itself, one key at a time (and by its renamings only)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    if not hasattr(model, "_test_mapping"):
        mapping = get_model_conversion_mapping(model)
        model._test_mapping = ([t for t in mapping if isinstance(t, WeightRenaming)],
                               [t for t in mapping if isinstance(t, WeightConverter)])
    renamings, converters = model._test_mapping
    target, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, targets)
    by_renamings = key
    for renaming in renamings:
        by_renamings, _ = renaming.rename_source_key(by_renamings)
    return target, pattern, by_renamings


def _assert_same_mapping(model, keys: list[str]) -> KeyMapper:
    targets = dict(model.state_dict(keep_vars=True))
    fast, alone = KeyMapper(model, targets), KeyMapper(model, targets, templates=False)
    for key in keys:
        assert fast.renamed(key) == _transformers_map(model, key, targets)[:2], key
        a, b = fast.map(key), alone.map(key)
        assert (a.targets, a.position, a.expert, a.pattern, str(a.recipe)) == \
               (b.targets, b.position, b.expert, b.pattern, str(b.recipe)), key
    return fast


def _real_count_keys(tmp_path) -> list[str]:
    """The keys of a DeepSeek-V3 checkpoint at its real counts, in the hub's per-expert layout:
    those of a small one written by transformers, each layer's and expert's repeated over the real
    layers and experts (the dense ones over the dense layers), and the MTP layer 61 the release has."""
    small = save_tiny_model("deepseek_v3", tmp_path / "small", legacy_expert_keys=True, num_hidden_layers=3,
                            n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1)
    keys = []
    for key in _checkpoint_keys(small):
        layer = _LAYER.search(key)
        if layer is None:
            keys.append(key)
            continue
        dense = int(layer.group()) < 1
        layers = range(REAL["first_k_dense_replace"]) if dense else range(REAL["first_k_dense_replace"], 62)
        for lay in layers:
            named = _LAYER.sub(str(lay), key)
            if _EXPERT.search(named):
                keys += [_EXPERT.sub(str(e), named) for e in range(REAL["n_routed_experts"])]
            else:
                keys.append(named)
    return sorted(set(keys))


def test_deepseek_v3_real_counts_every_key_as_transformers(tmp_path):
    keys = _real_count_keys(tmp_path)
    assert len(keys) > 45_000 and any(k.startswith("model.layers.61.") for k in keys)
    model = _meta_model("deepseek_v3", **REAL)
    fast = _assert_same_mapping(model, keys)
    assert fast._renamer.calls < len(keys) // 20     # what makes it fast: transformers ran once per template


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
@pytest.mark.parametrize("legacy", [True, False])
def test_other_families_every_key_as_transformers(tmp_path, family, legacy):
    if legacy and family == "gpt_oss":
        pytest.skip("gpt-oss has no per-expert hub layout")
    overrides = dict(num_hidden_layers=12)
    path = save_tiny_model(family, tmp_path / family, legacy_expert_keys=legacy, **overrides)
    _assert_same_mapping(_meta_model(family, **overrides), _checkpoint_keys(path))


def test_rules_that_tell_digits_apart_keep_their_keys_apart():
    """Rules naming digits (``layers.1.`` only, ``w1`` and ``w3``) rename keys with that digit differently: keys
    equal but for it never share a template, so each is renamed as transformers renames it."""
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    rules = [WeightRenaming(r"layers\.1\.", "first."), WeightRenaming(r"experts\.([0-9]+)\.w[13]", r"experts.\1.up")]
    assert fixed_digits(rules) == "13"        # "[13]" tells 1 and 3 from the other digits
    renamer = TemplateRenamer(lambda k: ((rename_source_key(k, rules, [])[0],), None), fixed_digits(rules))
    keys = [f"layers.{a}.experts.{b}.w{w}" for a in (1, 2, 4, 5, 11, 12, 21, 45, 54) for b in (0, 1, 2, 3, 4, 6, 13, 31, 46, 64)
            for w in (1, 2, 3)]
    for key in keys:
        assert renamer(key)[0][0] == rename_source_key(key, rules, [])[0], key
    assert renamer.calls < len(keys)


@pytest.mark.parametrize("pattern, told", [
    (r"layers\.(\d+)\.mlp", set()), (r"experts\.[0-9]+\.", set()), (r"proj\.0\.", {"0"}),
    (r"layer_[3-5]", {"3", "4", "5"}), (r"x[^7]", {"7"}), (r"\w+\.\d{2}", set()), (r"(a)\1", set()),
])
def test_digits_a_pattern_tells_apart(pattern, told):
    from kinject.io.key_templates import _told_apart

    assert _told_apart(pattern) == told
