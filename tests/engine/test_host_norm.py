"""transformers' RMSNorm in one compiled call (kinject/engine/host_norm.py): torch's bits for every
recognised class, width, row count and value scale; unrecognised norms and calls outside the kernel's
reach keep the module's own forward; in a model, attached by the runtime on a CPU and removed by
``kinject.restore``, with the same tokens as transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mixtral.modeling_mixtral import MixtralRMSNorm
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

from kinject.engine import host_norm


@pytest.fixture
def gemv(gemv):
    if gemv.sum_lanes is None:
        pytest.skip("torch's float32 sum order was not found here")
    return gemv


def _norm(cls, n: int, eps: float, seed: int) -> nn.Module:
    m = cls(n, eps=eps).to(torch.bfloat16)
    with torch.no_grad():
        m.weight.copy_(torch.randn(n, generator=torch.Generator().manual_seed(seed)))
    return m


def test_the_sum_order_found_is_torchs(gemv):
    """The width found at load reproduces torch's float32 sum bit for bit on lengths it was not tried on
    (whole vectors, a tail, several cascade levels)."""
    g = torch.Generator().manual_seed(7)
    for n in (1, 7, 8, 9, 31, 33, 100, 255, 257, 1000, 3000, 5000, 9999, 16384):
        for scale in (1e-4, 1.0, 1e4):
            v = torch.randn(n, generator=g).pow(2) * scale
            assert gemv._row_sum(n, v.data_ptr(), gemv.sum_lanes) == float(v.sum()), (n, scale)


@pytest.mark.parametrize("cls", [LlamaRMSNorm, MixtralRMSNorm, Qwen3MoeRMSNorm, GptOssRMSNorm])
@pytest.mark.parametrize("n", [64, 96, 128, 200, 1024, 2880, 7168])
def test_recognised_norms_have_torchs_bits(gemv, cls, n):
    variant = host_norm.norm_variant(cls(n))
    assert variant == (1 if cls is GptOssRMSNorm else 0)
    g = torch.Generator().manual_seed(n)
    for rows, scale, eps in ((1, 1.0, 1e-6), (3, 1e-3, 1e-5), (5, 1e3, 1e-6), (16, 1e-2, 1e-6)):
        m = _norm(cls, n, eps, rows)
        x = (torch.randn(2, rows, n, generator=g) * scale).to(torch.bfloat16)
        with torch.no_grad():
            assert torch.equal(gemv.rms_norm(x, m.weight, eps, variant).view(torch.int16),
                               m(x).view(torch.int16)), (rows, scale)


def test_other_norms_are_not_recognised():
    class Overridden(LlamaRMSNorm):
        def forward(self, x):
            return super().forward(x) * 2

    assert host_norm.norm_variant(GemmaRMSNorm(64)) is None          # 1 + weight: another computation
    assert host_norm.norm_variant(Overridden(64)) is None
    own = LlamaRMSNorm(64)
    own.forward = lambda x: x                                          # an instance forward: left alone
    assert host_norm.norm_variant(own) is None
    assert host_norm.norm_variant(nn.LayerNorm(64)) is None


def test_attach_and_detach(gemv):
    model = nn.Sequential(_norm(Qwen3MoeRMSNorm, 128, 1e-6, 1), _norm(GemmaRMSNorm, 128, 1e-6, 2),
                          _norm(GptOssRMSNorm, 96, 1e-5, 3), _norm(LlamaRMSNorm, 20000, 1e-6, 4),
                          _norm(LlamaRMSNorm, 64, 1e-6, 5).float())
    done = host_norm.attach_norms(model)
    assert done == [model[0], model[2]]   # Gemma's: another norm; 20000 wide: beyond the kernel; float32: no use
    x = torch.randn(3, 128).to(torch.bfloat16)
    ref = type(model[0]).forward(model[0], x)
    assert torch.equal(model[0](x), ref)
    # outside the kernel's reach: the module's own forward, same values
    xf = x.float()
    assert torch.equal(model[0](xf), type(model[0]).forward(model[0], xf))
    big = torch.randn(300, 128).to(torch.bfloat16)                      # a prefill's rows: torch's call
    assert torch.equal(model[0](big), type(model[0]).forward(model[0], big))
    assert torch.equal(model[0](x.t().contiguous().t()[:, :128]), ref)   # (contiguous again: same bits)
    model[0].weight.requires_grad_(True)
    y = model[0](x.requires_grad_(False))
    assert y.grad_fn is not None                                        # gradients: torch's forward
    host_norm.detach_norms(done)
    assert all("forward" not in m.__dict__ for m in model)


def test_a_disagreeing_kernel_leaves_the_norm_with_torch(gemv, monkeypatch):
    model = nn.Sequential(_norm(LlamaRMSNorm, 64, 1e-6, 1))
    monkeypatch.setattr(host_norm, "_agrees", lambda *a: False)
    assert host_norm.attach_norms(model) == []
    assert "forward" not in model[0].__dict__


def test_in_a_model_norms_are_attached_and_restored_with_transformers_tokens(gemv, tok, tmp_path):
    import kinject
    from kinject.fixtures import tiny_moe_path
    from kinject.io.untouched import load_untouched

    enc = tok(["The quick brown fox", "Hello"], return_tensors="pt", padding=True)
    ref_model = load_untouched(tiny_moe_path(), dtype=torch.bfloat16).eval()
    for new in (3, 9):
        gen = dict(max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id)
        model = kinject.from_pretrained(tiny_moe_path(), "rules/hybrid.yaml",
                                        ["vars.experts_compute=host", f"pipeline.offload_dir={tmp_path}"],
                                        dtype=torch.bfloat16)
        norms = [m for m in model.modules() if isinstance(m.__dict__.get("forward"), host_norm.OneRowNorm)]
        assert norms
        one = {k: v[1:] for k, v in enc.items()}
        for batch in (enc, one):
            assert torch.equal(model.generate(**batch, **gen), ref_model.generate(**batch, **gen)), new
        kinject.restore(model)
        assert not [m for m in model.modules() if isinstance(m.__dict__.get("forward"), host_norm.OneRowNorm)]
