"""A decode step's attention forward in a few calls (kinject/engine/decode_attention.py): the same bits
as the forward it replaces (which runs the same kernels one call at a time), the same cache contents,
over several steps, batches of 1 and 3, Llama's and Qwen3's forward code; every call it does not take
goes to that forward; attached only where its parts have kinject's forwards; detach restores."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from transformers import DynamicCache, LlamaConfig, Qwen3MoeConfig
from transformers.models.llama import modeling_llama
from transformers.models.qwen3_moe import modeling_qwen3_moe

from kinject.engine import decode_attention, host_gemv, host_norm, host_rotary


@pytest.fixture
def gemv(gemv, monkeypatch):
    if not gemv.exact_bf16 or gemv.sum_lanes is None:
        pytest.skip("no bfloat16 kernels with torch's bits here")
    monkeypatch.setattr(host_gemv, "MIN_LINEAR_WEIGHTS", 1)         # the test modules' linears are small
    return gemv


def _module(kind: str):
    common = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=1,
                  vocab_size=64)
    if kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, **common)
        attn, rope = modeling_qwen3_moe.Qwen3MoeAttention(cfg, 0), modeling_qwen3_moe.Qwen3MoeRotaryEmbedding(cfg)
    else:
        cfg = LlamaConfig(intermediate_size=64, **common)
        attn, rope = modeling_llama.LlamaAttention(cfg, 0), modeling_llama.LlamaRotaryEmbedding(cfg)
    cfg._attn_implementation = "sdpa"
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.dim() == 1 else 0.06) + (1.0 if p.dim() == 1 else 0))
    return attn.to(torch.bfloat16).eval(), rope


def _cache(attn: nn.Module, cache) -> dict:
    """``cache`` under the name the attention forward takes it by (``cache`` in transformers 5.24,
    ``past_key_values`` in 5.17: read off its signature, as the fused step does)."""
    import inspect

    return {list(inspect.signature(inspect.unwrap(type(attn).forward)).parameters)[4]: cache}


def _attach(attn: nn.Module, fast: bool) -> list:
    holder = nn.ModuleList([attn])
    done = [host_gemv.attach_linears(holder, fast), host_norm.attach_norms(holder),
            host_rotary.attach_rotary(holder, attention=fast), decode_attention.attach_attention(holder, fast)]
    return done


def _detach(done: list) -> None:
    decode_attention.detach_attention(done[3])
    host_rotary.detach_rotary(done[2])
    host_norm.detach_norms(done[1])
    host_gemv.detach_linears(done[0])


def _steps(attn, rope, batch: int, prompt: int, steps: int, seed: int, fused: bool):
    """A prefill of ``prompt`` tokens then ``steps`` decode steps through ``attn`` (its fused forward used or
    bypassed), each output and the cache's keys and values at the end."""
    g = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    forward = attn.__dict__["forward"]
    outs = []
    with torch.no_grad():
        for t, n in enumerate([prompt] + [1] * steps):
            start = 0 if t == 0 else prompt + t - 1
            x = torch.randn(batch, n, 256, generator=g).to(torch.bfloat16)
            cos, sin = rope(x, torch.arange(start, start + n).expand(batch, n))
            fn = forward if fused else forward.replaced
            outs.append(fn(hidden_states=x, position_embeddings=(cos, sin), attention_mask=None, **_cache(attn, cache),
                           position_ids=torch.arange(start, start + n).expand(batch, n))[0])
    return outs, cache.layers[0].keys, cache.layers[0].values


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


@pytest.mark.parametrize("kind", ["qwen3_moe", "llama"])
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("batch,prompt,steps", [(1, 5, 6), (3, 2, 4)])
def test_fused_step_has_the_replaced_forwards_bits(gemv, monkeypatch, kind, fast, batch, prompt, steps):
    attn, rope = _module(kind)
    done = _attach(attn, fast)
    assert done[3] == [attn] and isinstance(attn.__dict__["forward"], decode_attention.DecodeAttention)
    taken = []
    real = host_gemv.HostGemv.attention_inputs
    monkeypatch.setattr(host_gemv.HostGemv, "attention_inputs",
                        lambda self, *a: (taken.append(a[0].shape[0]), real(self, *a))[1])
    got, gk, gv = _steps(attn, rope, batch, prompt, steps, seed=batch * 10 + prompt, fused=True)
    ref, rk, rv = _steps(attn, rope, batch, prompt, steps, seed=batch * 10 + prompt, fused=False)
    assert taken == [batch] * steps                    # every decode step fused, the prefill not
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(got, ref))
    assert torch.equal(_bits(gk), _bits(rk)) and torch.equal(_bits(gv), _bits(rv))
    assert gk.shape == (batch, 2, prompt + steps, 64)
    _detach(done)
    assert "forward" not in attn.__dict__ and not any("forward" in m.__dict__ for m in attn.modules())


def test_calls_it_does_not_take_run_the_replaced_forward(gemv):
    attn, rope = _module("qwen3_moe")
    done = _attach(attn, fast=False)
    fused = attn.__dict__["forward"]
    calls = []
    real = fused.replaced
    fused.replaced = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    x = torch.randn(1, 1, 256).to(torch.bfloat16)
    cos, sin = rope(x, torch.tensor([[3]]))
    with torch.no_grad():
        cache = DynamicCache()
        fused(hidden_states=torch.randn(1, 3, 256).to(torch.bfloat16), position_embeddings=rope(x, torch.arange(3)[None]),
              attention_mask=None, **_cache(attn, cache))                                      # a prefill
        fused(hidden_states=x, position_embeddings=(cos, sin), attention_mask=torch.ones(1, 1, 1, 4, dtype=torch.bool),
              **_cache(attn, cache))                                                           # a mask
        fused(hidden_states=x, position_embeddings=(cos, sin), attention_mask=None)   # no cache
        fused(x, (cos, sin), None, cache)                                            # positional arguments
        hook = attn.q_proj.register_forward_hook(lambda *a: calls.append("hook"))
        fused(hidden_states=x, position_embeddings=(cos, sin), attention_mask=None, **_cache(attn, cache))   # a hook
        hook.remove()
    fused(hidden_states=x, position_embeddings=(cos, sin), attention_mask=None, **_cache(attn, cache))  # gradients on
    assert calls.count(1) == 6 and calls.count("hook") == 1
    fused.replaced = real
    _detach(done)


def test_not_attached_where_its_parts_keep_torchs_forwards(gemv):
    attn, _ = _module("qwen3_moe")
    holder = nn.ModuleList([attn])
    rotary = host_rotary.attach_rotary(holder)
    assert decode_attention.attach_attention(holder) == []          # no one-row linears, no norms
    host_rotary.detach_rotary(rotary)
    assert decode_attention.template_of(attn) is True
    assert decode_attention.template_of(_module("llama")[0]) is False
    assert decode_attention.template_of(nn.Linear(2, 2)) is None
