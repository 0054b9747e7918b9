"""A decode step's top-k router in one call (kinject/engine/decode_router.py, ``kinject_route_topk_bf16``).

The kernel against torch's own operations on the same logits (softmax in float32, ``topk``, the sum and
quotients, bfloat16), expert counts whole and not whole vectors, k of 1 to 8, normalised or not, with
ties among the chosen probabilities and across the k-th (torch's ``topk`` order reproduced where it uses
``nth_element``; refused where it uses a partial sort); then the router forward in a model: every
decode step's every router through it, the logits, scores and tokens of the forward it replaced, batch 1
and a batch of three (which keeps the replaced forward), and its inverse.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kinject.engine import decode_router, host_gemv
from kinject.engine.rebind import is_rebound

_BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def gemv():
    g = host_gemv.load()
    if g is None or not g.wide_gate or g.vector_exp is None or g.sum_lanes is None:
        pytest.skip("no router kernel here (it needs torch's AVX-512 exp and its sum's vector width)")
    assert g.route_exact, "the router kernel's bits differ from torch's where it has what it needs"
    return g


def _torch_route(logits: torch.Tensor, k: int, norm: bool):
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    value, index = torch.topk(probs, k, dim=-1)
    if norm:
        value /= value.sum(dim=-1, keepdim=True)
    return value.to(logits.dtype), index


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("experts,k,cols", [(64, 8, 1024), (60, 4, 256), (128, 8, 128), (8, 2, 64), (7, 1, 32),
                                            (15, 4, 64), (12, 3, 32), (17, 2, 64), (256, 2, 64), (512, 8, 64)])
def test_router_kernel_has_torchs_bits(gemv, experts, k, cols, norm):
    """Random routers and routers with equal rows (equal logits: ties in and around the top k): the
    kernel's logits are the one-row GEMV's, its scores and indices torch's softmax / topk / sum on them,
    bit for bit, or (a tie torch's partial sort would order, a case of k * 64 <= experts) None."""
    gen = torch.Generator().manual_seed(experts * 10 + k)
    taken = declined = 0
    for trial in range(24):
        x = (torch.randn(1, cols, generator=gen) * 3).to(_BF16)
        w = (torch.randn(experts, cols, generator=gen) * (0.02 + trial % 3)).to(_BF16)
        if trial % 2:
            w = w[torch.randint(0, max(2, experts // 3), (experts,), generator=gen)].contiguous()
        exact = host_gemv.one_row_exact(gemv, False, 1, cols)
        got = gemv.route_topk(x, w, k, norm, exact)
        if got is None:
            declined += 1
            assert k * 64 <= experts            # only torch's partial sort's ties are refused
            continue
        taken += 1
        logits, scores, indices = got
        assert torch.equal(logits, F.linear(x, w) if exact else logits)
        value, index = _torch_route(logits, k, norm)
        assert torch.equal(indices, index) and torch.equal(scores.view(torch.int16), value.view(torch.int16))
    assert taken == 24 if k * 64 > experts else taken >= 8      # (nth_element: ties too)


def test_router_kernel_refuses_nan(gemv):
    x = torch.ones(1, 64, dtype=_BF16)
    w = torch.randn(16, 64).to(_BF16)
    w[3, 0] = float("nan")
    assert gemv.route_topk(x, w, 2, True, host_gemv.one_row_exact(gemv, False, 1, 64)) is None


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    from kinject.testing import save_tiny_model

    return save_tiny_model("qwen3_moe", tmp_path_factory.mktemp("router_qwen3_moe"), dtype=_BF16, draw_in_dtype=True,
                           hidden_size=256, moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4)


@pytest.mark.parametrize("batch,new", [(1, 9), (3, 3)])
def test_router_forward_in_a_model_gives_the_replaced_forwards_bits(gemv, qwen3_moe_dir, batch, new, monkeypatch):
    import kinject
    from kinject.testing import tiny_tokenizer

    model = kinject.from_pretrained(str(qwen3_moe_dir), "rules/hybrid.yaml", ["vars.experts_compute=host"])
    routers = [m for m in model.modules() if isinstance(m.__dict__.get("forward"), decode_router.DecodeRouter)]
    assert len(routers) == model.config.num_hidden_layers
    tok = tiny_tokenizer()
    prompt = tok(["def parse(path):\n    with open(path) as f:"] * batch, return_tensors="pt")
    gen = dict(max_new_tokens=new, do_sample=False, output_logits=True, return_dict_in_generate=True)
    real, used = host_gemv.HostGemv.route_topk, []
    monkeypatch.setattr(host_gemv.HostGemv, "route_topk", lambda self, *a: (lambda r: used.append(r is not None) or r)(
        real(self, *a)))
    fast = model.generate(**prompt, **gen)
    assert used.count(True) == (len(used) if batch == 1 else 0)
    assert len(used) == ((new - 1) * len(routers) if batch == 1 else 0)
    monkeypatch.setattr(decode_router.DecodeRouter, "__call__", lambda self, *a, **kw: self.replaced(*a, **kw))
    plain = model.generate(**prompt, **gen)
    assert torch.equal(fast.sequences, plain.sequences)
    assert torch.equal(torch.stack(fast.logits), torch.stack(plain.logits))
    kinject.restore(model)
    assert not any("forward" in m.__dict__ for m in model.modules() if decode_router.recognised(m))
    assert all(not is_rebound(m.__dict__.get("forward")) for m in model.modules())
