"""Every shipped rule file, through ``kinject.from_pretrained`` on a tiny saved checkpoint, gives
transformers' own greedy tokens for that checkpoint (HQQ rule files: the tokens of the same rules
applied by ``kinject.optimize`` to transformers' loaded model, since HQQ is lossy by design).

``from_pretrained`` builds the model on the meta device and lets each operator read its own
weights: an operator that only handles materialised weights fails here, whatever the family."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import kinject
from kinject.rules import load_rules
from kinject.testing import save_tiny_model, tiny_batch, tiny_tokenizer

RULE_FILES = sorted((Path(__file__).resolve().parents[1] / "rules").glob("*.yaml"))
FAMILY = "deepseek_v3"      # shared experts, dense first layer, a router buffer: every rule kind applies
NEW_TOKENS = 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_model(FAMILY, tmp_path_factory.mktemp("ckpt") / FAMILY)


def _reference(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _generate(model) -> torch.Tensor:
    tok = tiny_tokenizer()
    batch = tiny_batch(tok, 4, min_tokens=8)                                   # [4, L], left-padded
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tok.pad_token_id)


def _quantizes(rules: Path) -> bool:
    return any(r.kwargs.get("quant") for r in load_rules(rules).rules)


@pytest.mark.parametrize("rules", RULE_FILES, ids=[p.stem for p in RULE_FILES])
def test_rule_file_through_from_pretrained_gives_transformers_tokens(rules, checkpoint, tmp_path):
    overrides = [f"pipeline.offload_dir={tmp_path / 'offload'}"]
    ref_model = _reference(checkpoint)
    if _quantizes(rules):                 # lossy: the same rules on transformers' model are the reference
        kinject.optimize(ref_model, rules, list(overrides))
    expected = _generate(ref_model)
    model = kinject.from_pretrained(checkpoint, rules, overrides, dtype=torch.float32, attn_implementation="eager")
    try:
        assert torch.equal(_generate(model), expected)
    finally:
        model.kinject.transfer.close()
        if getattr(ref_model, "kinject", None) is not None:
            ref_model.kinject.transfer.close()


def test_default_with_a_device_gets_its_weights_there(checkpoint):
    """``class: default`` with ``device:`` keeps its module on that device: ``from_pretrained`` reads
    the module's weights (left on meta by the operator) onto the operator's device, everything else
    onto the pipeline's. A CPU-only suite has no second real device, so the operator names ``meta``:
    what is checked is where the loader reads each tensor."""
    rule = {"match": {"name": r"^model\.layers\.0\.self_attn$"},
            "replace": {"class": "default", "kwargs": {"device": "meta"}}}
    model = kinject.from_pretrained(checkpoint, {"pipeline": {"device": "cpu"}, "rules": [rule]})
    layers = model.model.layers
    assert {t.device.type for t in layers[0].self_attn.base.parameters()} == {"meta"}
    assert {t.device.type for t in layers[1].self_attn.parameters()} == {"cpu"}
    assert {t.device.type for t in layers[0].mlp.parameters()} == {"cpu"}
