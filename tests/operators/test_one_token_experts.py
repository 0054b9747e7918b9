"""A decode step's one token through the experts (``FusedCalls._one_token``): the general routed
path's values bit for bit, without its sort, gathers and scatter.

Every expert on the host (one group of all k), and Klotski's placement under a small device budget
(resident experts first, then the cold ones as they arrive: groups that are not one slice of the
token's experts, so outputs land in a partial buffer), in float32 and bfloat16, three new tokens
and seven: the logits of every step are those of the general path.
"""

from __future__ import annotations

import pytest
import torch

import kinject
from kinject.fixtures import tiny_moe_path
from operators import expert_compute
from operators.expert_interception import FusedCalls

GEN = dict(do_sample=False, output_logits=True, return_dict_in_generate=True)


@pytest.fixture(scope="module")
def prompt(tok):
    return tok(["def parse(path):\n    with open(path) as f:"], return_tensors="pt")


def _logits(rules: str, overrides: list[str], dtype: torch.dtype, prompt, new: int) -> torch.Tensor:
    model = kinject.from_pretrained(tiny_moe_path(), rules, overrides, dtype=dtype)
    out = model.generate(**prompt, max_new_tokens=new, **GEN)
    return torch.stack(out.logits)


@pytest.mark.parametrize("dtype,new", [(torch.float32, 3), (torch.bfloat16, 7)])
@pytest.mark.parametrize("rules,extra", [
    ("rules/hybrid.yaml", ["vars.experts_compute=host"]),
    ("rules/klotski.yaml", ["pipeline.micro_batch_size=1", "pipeline.n_batches=1", "pipeline.device_budget=6MiB"]),
])
def test_one_token_path_gives_the_general_paths_bits(prompt, rules, extra, dtype, new, tmp_path, monkeypatch):
    overrides = [*extra, f"pipeline.offload_dir={tmp_path}"]
    calls = []
    real = FusedCalls._one_token
    monkeypatch.setattr(FusedCalls, "_one_token", lambda self, *a: calls.append(1) or real(self, *a))
    fast = _logits(rules, overrides, dtype, prompt, new)
    assert len(calls) >= new - 1                      # every decode step's every MoE layer took it
    monkeypatch.setattr(FusedCalls, "_one_token", lambda self, *a: None)
    general = _logits(rules, overrides, dtype, prompt, new)
    assert torch.equal(fast, general)
    # the token's rows are real rows: no kernel refused them (a refusal turns torch's grouped GEMM off)
    assert False not in expert_compute._KERNEL_OK.values()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_groups_land_in_slot_order(dtype):
    """Groups of the token's experts out of slot order, one of them not one slice of the rows: the
    weighted sum is the general path's (bfloat16: the compiled weighted sum where it is here)."""
    from kinject.engine import host_gemv

    torch.manual_seed(0)
    H, k = 40, 4
    x = torch.randn(1, H, dtype=dtype)
    ids = torch.tensor([[7, 2, 5, 0]])
    w = torch.rand(1, k, dtype=dtype)
    outs = {e: torch.randn(1, H, dtype=dtype) for e in range(8)}
    gemv = host_gemv.load()

    class Site:
        def compute(self, group, tensors, counts, xs):
            assert xs.shape[0] == len(group) and all(n == 1 for n in counts)
            return torch.cat([outs[e] for e in group])

    class Order:
        def schedule(self, step, counts, run_group, run_zero, **kw):
            run_group([2, 7], [{}, {}], Site())                # rows 1 and 3: not a slice
            run_group([0, 5], [{}, {}], Site())

    calls = FusedCalls.__new__(FusedCalls)
    calls.order, calls.step = Order(), None
    calls.experts = type("E", (), {"num_experts": 8, "units": [type("U", (), {"compute_dtype": dtype})()]})()
    combine = gemv.weighted_rows if gemv is not None and gemv.weighted_exact else None
    calls.sites = type("S", (), {"weighted_rows": combine})()
    y = calls._one_token(x, ids, w, [1] * 8)
    rows = torch.cat([outs[int(e)] for e in ids[0]])                                  # slot order
    assert torch.equal(y, (rows * w.reshape(k, 1)).view(1, k, H).sum(dim=1))
    if combine is not None:
        wide = torch.rand(k, 2, dtype=dtype)[:, 0].reshape(1, k)                     # weights as a strided view
        assert torch.equal(calls._one_token(x, ids, wide, [1] * 8),
                           (rows * wide.reshape(k, 1)).view(1, k, H).sum(dim=1))
        calls.sites.weighted_rows = None
        assert torch.equal(calls._one_token(x, ids, w, [1] * 8), y)
    assert calls._one_token(x, torch.tensor([[7, 2, 9, 0]]), w, [1] * 8) is None      # an id past the experts



@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory):
    """A tiny Qwen3-MoE in bfloat16 (its router returns bfloat16 weights, as the fused sum needs; the
    fixture's Mixtral routes in float32), widths the fused kernels take."""
    from kinject.testing import save_tiny_model

    return save_tiny_model("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"), dtype=torch.bfloat16,
                           draw_in_dtype=True, hidden_size=256, moe_intermediate_size=128, num_experts=8,
                           num_experts_per_tok=3)


@pytest.mark.parametrize("fmt,new", [("bf16", 7), ("int8", 3), ("int4", 3)])
def test_every_host_expert_and_their_sum_in_one_call(qwen3_moe_dir, prompt, fmt, new, tmp_path, monkeypatch):
    """Every expert on the host, batch 1: each decode step's MoE layers compute the token's experts and
    their weighted sum in one compiled call (where this machine has the fused kernel), with the logits
    of the group-by-group path at every step; a batch of two keeps the general path."""
    from kinject.engine import host_gemv
    from operators.host_experts import HostExperts

    gemv = host_gemv.load()
    if gemv is None or not gemv.fused_gate or not gemv.swiglu_takes(fmt, 128, 256):
        pytest.skip(f"no fused {fmt} SwiGLU here")
    overrides = ["vars.experts_compute=host", f"pipeline.offload_dir={tmp_path}"]
    if fmt != "bf16":
        overrides.append(f"vars.experts_host_format={fmt}")
    model = kinject.from_pretrained(str(qwen3_moe_dir), "rules/hybrid.yaml", overrides)
    real, done = HostExperts.one_token, []
    monkeypatch.setattr(HostExperts, "one_token", lambda self, *a: (lambda y: done.append(y is not None) or y)(real(self, *a)))
    fast = torch.stack(model.generate(**prompt, max_new_tokens=new, **GEN).logits)
    assert done.count(True) == len(done) == (new - 1) * model.config.num_hidden_layers   # every decode step, every layer
    monkeypatch.setattr(HostExperts, "one_token", lambda self, *a: None)
    assert torch.equal(fast, torch.stack(model.generate(**prompt, max_new_tokens=new, **GEN).logits))
    done.clear()
    monkeypatch.setattr(HostExperts, "one_token", lambda self, *a: (lambda y: done.append(y is not None) or y)(real(self, *a)))
    model.generate(**{k: v.repeat(2, 1) for k, v in prompt.items()}, max_new_tokens=2, **GEN)
    assert not done                                                # two rows a step: the general path
