"""Rebound forwards (kinject/engine/rebind.py) and the rotary embedding in one compiled call
(kinject/engine/host_rotary.py): torch's bits where the kernel takes the call, the original function
everywhere else, decorators still run, nothing outside the instance changes."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
from transformers.models.cohere import modeling_cohere
from transformers.models.llama import modeling_llama
from transformers.models.mixtral import modeling_mixtral
from transformers.models.qwen3_moe import modeling_qwen3_moe

from kinject.engine import host_rotary, rebind


def _qkcs(b, hq, hk, s, d, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, s, d, generator=g).to(torch.bfloat16)
    k = torch.randn(b, hk, s, d, generator=g).to(torch.bfloat16)
    angle = torch.randn(b, s, d, generator=g) * 5
    return q, k, angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)


def test_llamas_rotary_is_recognised_by_its_code():
    assert host_rotary.is_llama_rotary(modeling_llama.apply_rotary_pos_emb)
    assert host_rotary.is_llama_rotary(modeling_qwen3_moe.apply_rotary_pos_emb)
    assert host_rotary.is_llama_rotary(modeling_mixtral.apply_rotary_pos_emb)
    assert not host_rotary.is_llama_rotary(modeling_cohere.apply_rotary_pos_emb)     # interleaved halves
    assert not host_rotary.is_llama_rotary(None) and not host_rotary.is_llama_rotary(len)


def _hub_layer(func):
    """What ``kernels.use_kernel_forward_from_hub`` makes of a function (transformers >= 5.25 installs
    ``kernels``): an ``nn.Module`` instance whose class forward calls ``func`` from its closure."""
    class Func(nn.Module):
        def forward(self, *args, **kwargs):
            return func(*args, **kwargs)
    return Func()


def test_a_hub_kernel_layer_wrapping_llamas_rotary_is_recognised_and_others_are_not():
    plain = rebind.hub_wrapped(modeling_llama.apply_rotary_pos_emb)     # (itself, or what it wraps)
    assert plain is not None and rebind.hub_wrapped(plain) is plain
    layer = _hub_layer(plain)
    assert rebind.hub_wrapped(layer) is plain and host_rotary.is_llama_rotary(layer)
    assert not host_rotary.is_llama_rotary(_hub_layer(rebind.hub_wrapped(modeling_cohere.apply_rotary_pos_emb)))
    own = _hub_layer(plain)
    own.forward = lambda *a: None                     # an instance forward of its own: not unwrapped
    held = _hub_layer(plain)
    held.w = nn.Parameter(torch.zeros(1))             # state of its own: not unwrapped
    hooked = _hub_layer(plain)
    hooked.register_forward_hook(lambda *a: None)     # a hook would not see calls the kernel takes
    for layer in (own, held, hooked, nn.Linear(2, 2), len):
        assert rebind.hub_wrapped(layer) is None and not host_rotary.is_llama_rotary(layer)


@pytest.mark.parametrize("shape", [(1, 16, 4, 1, 64), (1, 8, 8, 1, 128), (2, 4, 2, 3, 32), (1, 2, 1, 5, 256)])
def test_native_rotary_has_torchs_bits(gemv, shape):
    original = modeling_qwen3_moe.apply_rotary_pos_emb
    native = host_rotary.NativeRotary(original, gemv)
    q, k, cos, sin = _qkcs(*shape, seed=sum(shape))
    with torch.no_grad():
        for got, ref in zip(native(q, k, cos, sin), original(q, k, cos, sin)):
            assert torch.equal(got.view(torch.int16), ref.view(torch.int16))


def test_native_rotary_leaves_other_calls_to_the_original(gemv):
    calls = []

    def original(q, k, cos, sin, unsqueeze_dim=1):
        calls.append(unsqueeze_dim)
        return modeling_llama.apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)

    native = host_rotary.NativeRotary(original, gemv)
    q, k, cos, sin = _qkcs(1, 4, 2, 3, 64, seed=1)
    with torch.no_grad():
        native(q, k, cos, sin)
        native(q, k, cos, sin, 1)
        assert calls == []
        native(q.transpose(1, 2).contiguous().transpose(1, 2), k, cos, sin)        # a prefill's strided query
        native(q.transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)
        native(q.float(), k.float(), cos.float(), sin.float())
    q.requires_grad_(True)
    native(q, k, cos, sin)
    assert calls == [1, 2, 1, 1]


def _renaming(fn):
    """A decorator in the manner of transformers' ``deprecate_kwarg``: ``old=`` becomes ``new=``."""
    @functools.wraps(fn)
    def wrapped(self, x, **kwargs):
        if "old" in kwargs:
            kwargs["new"] = kwargs.pop("old")
        return fn(self, x, **kwargs)
    return wrapped


def _helper(x):
    return x * 2


class _Block(nn.Module):
    @_renaming
    def forward(self, x, new=0):
        return _helper(x) + new


def test_a_rebound_forward_keeps_its_decorator_and_touches_nothing_else():
    block = _Block()
    forward = rebind.rebound_forward(block, lambda name, value: (lambda x: x * 3) if value is _helper else None)
    assert forward(torch.ones(1), old=1).item() == 4.0                       # the decorator still renames
    assert block(torch.ones(1)).item() == 2.0                                 # the class's forward untouched
    assert globals()["_helper"] is _helper and rebind.is_rebound(forward)
    assert rebind.rebound_forward(block, lambda name, value: None) is None
    block.forward = forward
    assert block(torch.ones(1)).item() == 3.0 and rebind.plain_forward(block) is None


def test_attach_rotary_rebinds_attention_forwards_and_detach_restores(gemv):
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         num_hidden_layers=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                         vocab_size=64)
    attn = modeling_qwen3_moe.Qwen3MoeAttention(cfg, 0).to(torch.bfloat16)
    rope = modeling_qwen3_moe.Qwen3MoeRotaryEmbedding(cfg)
    model = nn.ModuleList([attn, nn.Linear(4, 4), modeling_qwen3_moe.Qwen3MoeAttention(cfg, 0)])   # float32: left
    x = torch.randn(1, 1, 256).to(torch.bfloat16)
    pos = torch.tensor([[7]])
    cos, sin = rope(x, pos)
    with torch.no_grad():
        ref = attn(x, (cos, sin), None)[0]
        done = host_rotary.attach_rotary(model)
        assert done == [attn] and rebind.is_rebound(attn.__dict__["forward"])
        assert torch.equal(attn(x, (cos, sin), None)[0], ref)
    host_rotary.detach_rotary(done)
    assert "forward" not in attn.__dict__
