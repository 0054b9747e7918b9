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
