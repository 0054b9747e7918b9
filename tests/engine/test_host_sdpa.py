"""A decode step's attention in one compiled call (kinject/engine/host_sdpa.py, ``host_gemv: fast``):
torch's flash-kernel arithmetic, its products' orders approximated, every output within a bfloat16 ulp
of torch's and all but about one in 10^4 equal; every call it does not take goes to transformers' own
function; only the rebound attention forwards see it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3_moe import modeling_qwen3_moe

from kinject.engine import host_sdpa, host_rotary, rebind


def _qkv(b, h, hk, n, d, seed, cache=None):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, h, 1, d, generator=g) * 2).to(torch.bfloat16)
    rows = cache or n                            # a cache holding more rows than are used: strided views
    k = torch.randn(b, hk, rows, d, generator=g).to(torch.bfloat16)[:, :, :n]
    v = torch.randn(b, hk, rows, d, generator=g).to(torch.bfloat16)[:, :, :n]
    return q, k, v


def _within_one_ulp(got: torch.Tensor, ref: torch.Tensor) -> bool:
    """Each value equal to the reference or its bfloat16 neighbour."""
    a, r = got.float(), ref.float()
    ulp = torch.ldexp(torch.ones_like(r), torch.frexp(torch.maximum(a.abs(), r.abs()))[1] - 8)
    return bool(((a - r).abs() <= ulp).all())


SHAPES = [  # (batch, heads, kv heads, keys, head size, cache rows)
    (1, 16, 4, 1, 64, None), (1, 16, 4, 7, 64, None), (1, 16, 4, 33, 64, 50), (3, 8, 8, 64, 64, None),
    (1, 16, 4, 65, 64, None), (2, 6, 2, 100, 128, 130), (1, 4, 1, 513, 64, None), (1, 8, 2, 1100, 80, 1200),
    (1, 12, 3, 31, 96, None), (1, 4, 2, 70, 75, None),
]


@pytest.mark.parametrize("b,h,hk,n,d,cache", SHAPES)
def test_attend_is_torchs_sdpa_within_a_bfloat16_ulp(gemv, b, h, hk, n, d, cache):
    assert gemv.attend_takes(n, d)
    q, k, v = _qkv(b, h, hk, n, d, seed=n * d + b, cache=cache)
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=hk < h).transpose(1, 2)
    got = gemv.attend(q, k, v, d ** -0.5)
    assert got.shape == (b, 1, h, d)
    assert _within_one_ulp(got, ref)
    assert (got != ref).float().mean().item() < 0.01          # a rounding tie now and then, not a pattern


@pytest.mark.parametrize("n,d", [(7, 64), (16, 64), (64, 64), (20, 200), (21, 192), (65, 64), (100, 128), (600, 64), (1100, 64)])
def test_attend_sums_values_in_torchs_order(gemv, n, d):
    """With a zero query every score is 0, so p @ v alone sets the output; values built to cancel
    (a third of them +-256 among unit ones) make most other orders of its sums (four partial sums, or
    blocks of keys summed other than from zero and then added) change many outputs: here every bit is
    torch's."""
    if min(n, 512) * d > 4096 and not gemv.attend_pairs:
        pytest.skip(f"{min(n, 512)} keys x {d}: torch's order there is pinned only with VDPBF16PS (AVX512-BF16)")
    g = torch.Generator().manual_seed(n + d)
    q = torch.zeros(1, 16, 1, d).to(torch.bfloat16)
    k = torch.randn(1, 4, n, d, generator=g).to(torch.bfloat16)
    big = (torch.rand(1, 4, n, d, generator=g) < 0.3) * torch.randn(1, 4, n, d, generator=g).sign() * 256
    v = (big + torch.randn(1, 4, n, d, generator=g)).to(torch.bfloat16)
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True).transpose(1, 2)
    assert torch.equal(gemv.attend(q, k, v, d ** -0.5), ref)


def test_attend_scale_and_a_single_thread_give_the_same_values(gemv):
    q, k, v = _qkv(1, 16, 4, 200, 64, seed=3)
    ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=0.3).transpose(1, 2)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gemv.attend(q, k, v, 0.3)
    finally:
        torch.set_num_threads(old)
    assert torch.equal(one, gemv.attend(q, k, v, 0.3)) and _within_one_ulp(one, ref)


def test_calls_it_does_not_take_go_to_the_original(gemv):
    calls = []

    def original(module, query, key, value, attention_mask, **kw):
        calls.append(kw)
        return "original", None

    attend = host_sdpa.HostSdpa(original, gemv)
    module = nn.Module()
    q, k, v = _qkv(1, 4, 2, 9, 64, seed=1)
    mask = torch.ones(1, 1, 1, 9, dtype=torch.bool)
    assert attend(module, q, k, v, mask)[0] == "original"                        # a mask
    assert attend(module, q.expand(1, 4, 2, 64), k, v, None)[0] == "original"    # two query rows
    assert attend(module, q.float(), k.float(), v.float(), None)[0] == "original"
    assert attend(module, q, k, v, None, dropout=0.1)[0] == "original"
    assert attend(module, q, k, v, None, softcap=30.0)[0] == "original"
    assert attend(module, q, k, v, None, s_aux=torch.zeros(4))[0] == "original"
    assert attend(module, q, k[:, :1].expand(1, 3, 9, 64), v[:, :1].expand(1, 3, 9, 64), None)[0] == "original"
    assert len(calls) == 7
    out, none = attend(module, q, k, v, None, scaling=0.125)
    assert none is None and out.shape == (1, 1, 4, 64) and len(calls) == 7


def _attention():
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         num_hidden_layers=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                         vocab_size=64, attn_implementation="sdpa")
    cfg._attn_implementation = "sdpa"
    attn = modeling_qwen3_moe.Qwen3MoeAttention(cfg, 0).to(torch.bfloat16)
    return attn, modeling_qwen3_moe.Qwen3MoeRotaryEmbedding(cfg)


@pytest.mark.parametrize("attention", [False, True])
def test_attach_with_attention_gives_the_forward_its_own_sdpa(gemv, attention):
    """``attention`` (host_gemv: fast): the rebound forward's interface has HostSdpa as ``sdpa``;
    transformers' global interface is untouched either way, and detach restores the class forward."""
    attn, rope = _attention()
    x = torch.randn(1, 1, 256).to(torch.bfloat16)
    cos, sin = rope(x, torch.tensor([[0]]))
    before = ALL_ATTENTION_FUNCTIONS["sdpa"]
    with torch.no_grad():
        ref = attn(x, (cos, sin), None)[0]
        done = host_rotary.attach_rotary(nn.ModuleList([attn]), attention=attention)
        assert done == [attn] and rebind.is_rebound(attn.__dict__["forward"])
        fn = attn.__dict__["forward"].__func__
        while host_sdpa.NAME not in fn.__code__.co_names:       # (a decorator's wrapper: its copy inside)
            fn = fn.__wrapped__
        seen = fn.__globals__[host_sdpa.NAME]
        assert isinstance(seen["sdpa"], host_sdpa.HostSdpa) == attention
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is before
        got = attn(x, (cos, sin), None)[0]
        assert _within_one_ulp(got, ref)
    host_rotary.detach_rotary(done)
    assert "forward" not in attn.__dict__ and ALL_ATTENTION_FUNCTIONS["sdpa"] is before


@pytest.mark.parametrize("prompts,new", [(["The quick brown fox"], 9), (["Hello", "A much longer prompt", "x"], 5)])
def test_fast_host_model_runs_its_decode_attention_through_the_kernel(gemv, tok, tmp_path, monkeypatch, prompts,
                                                                      new):
    """A kinject model with ``host_gemv: fast``: decode steps without a mask (one sequence) take the
    kernel, padded batches (a mask) stay with torch's; tokens as many as asked, text the same length."""
    import kinject
    from kinject.fixtures import tiny_moe_path

    taken = []
    real = host_sdpa.HostGemv.attend
    monkeypatch.setattr(host_sdpa.HostGemv, "attend",
                        lambda self, *a: (taken.append(a[0].shape), real(self, *a))[1])
    model = kinject.from_pretrained(tiny_moe_path(), "rules/hybrid.yaml",
                                    ["vars.experts_compute=host", "pipeline.host_gemv=fast"], dtype=torch.bfloat16)
    enc = tok(prompts, return_tensors="pt", padding=True)
    out = model.generate(**enc, max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == enc["input_ids"].shape[1] + new
    assert bool(taken) == (len(prompts) == 1)
    kinject.restore(model)
    assert not any(rebind.is_rebound(m.__dict__.get("forward")) for m in model.modules())


def test_an_interface_with_its_own_sdpa_or_overrides_is_respected(gemv):
    """A modeling file's own ``sdpa`` (another arithmetic) keeps its interface as it is; its other
    overrides survive in the copy that takes the kernel."""
    from transformers.modeling_utils import AttentionInterface

    custom = AttentionInterface()
    custom["sdpa"] = lambda *a, **k: ("its own", None)
    assert host_sdpa.interface_with_host_sdpa(custom, gemv) is None
    local = AttentionInterface()
    local["flash_attention_2"] = mine = lambda *a, **k: ("local", None)
    copy = host_sdpa.interface_with_host_sdpa(local, gemv)
    assert isinstance(copy["sdpa"], host_sdpa.HostSdpa) and copy["flash_attention_2"] is mine
    assert copy.get_interface("eager", None) is None and isinstance(local["sdpa"], type(lambda: 0))
    assert host_sdpa.interface_with_host_sdpa(object(), gemv) is None
