"""The CPU decode paths kinject attaches to a bfloat16 model (one-row linears, routers' ``F.linear``,
RMSNorms, rotary embeddings: docs/architecture.md, "Host compute") across families whose norms,
routers and rotary code differ: the same greedy tokens as the untouched model at batch 1 and 2, and
each path attached where the family's code is one it recognises."""

from __future__ import annotations

import warnings

import pytest
import torch

import kinject
from kinject.engine import decode_attention, host_gemv, host_norm, rebind
from kinject.testing import build_tiny_model, tiny_batch, tiny_tokenizer

# family -> (norms recognised, rotary recognised, attention implementation, decode attention fused:
# Qwen3's forward code; Mixtral's and OLMoE's differ, Qwen2-MoE's projections have biases)
FAMILIES = {"qwen3_moe": (True, True, "sdpa", True), "mixtral": (True, True, "sdpa", False),
            "deepseek_v3": (True, True, "sdpa", False), "gpt_oss": (True, False, "eager", False),
            "olmoe": (True, True, "sdpa", False), "qwen2_moe": (True, True, "sdpa", False)}


@pytest.fixture
def gemv(gemv):
    if not gemv.exact_bf16 or gemv.sum_lanes is None:
        pytest.skip("no bfloat16 kernels with torch's bits here")
    return gemv


def _generate(model, batch, new: int) -> torch.Tensor:
    tok = tiny_tokenizer()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        return model.generate(**batch, max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cpu_decode_paths_keep_transformers_tokens(gemv, family, tmp_path, monkeypatch):
    monkeypatch.setattr(host_gemv, "MIN_LINEAR_WEIGHTS", 1)         # the tiny models' linears are small
    monkeypatch.setattr(host_gemv, "MIN_FUNCTIONAL_WEIGHTS", 1)
    want_norms, want_rotary, attention, want_fused = FAMILIES[family]
    model = build_tiny_model(family, dtype=torch.bfloat16, attn_implementation=attention)
    tok = tiny_tokenizer()
    two = tiny_batch(tok, 2, min_tokens=6)
    one = {k: v[1:] for k, v in two.items()}
    refs = [_generate(model, b, 7) for b in (one, two)]
    kinject.optimize(model, "rules/hybrid.yaml", ["vars.experts_compute=host", f"pipeline.offload_dir={tmp_path}"])
    forwards = [m.__dict__.get("forward") for m in model.modules()]
    norms = sum(isinstance(f, host_norm.OneRowNorm) for f in forwards)
    rebound = [type(m).__name__ for m in model.modules()
               if rebind.is_rebound(getattr(m.__dict__.get("forward"), "replaced", m.__dict__.get("forward")))]
    assert (norms > 0) == want_norms, family
    assert any("Attention" in n for n in rebound) == want_rotary, (family, rebound)
    assert any(isinstance(f, host_gemv.OneRowLinear) for f in forwards)
    assert any(isinstance(f, decode_attention.DecodeAttention) for f in forwards) == want_fused, family
    for batch, ref in zip((one, two), refs):
        assert torch.equal(_generate(model, batch, 7), ref), family
    kinject.restore(model)
    assert not any(isinstance(m.__dict__.get("forward"), (host_norm.OneRowNorm, host_gemv.OneRowLinear,
                                                          decode_attention.DecodeAttention))
                   or rebind.is_rebound(m.__dict__.get("forward")) for m in model.modules())
