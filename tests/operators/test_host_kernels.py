"""Host expert kernels (kinject/engine/host_kernels.py, operators/host_compute.py) and the int8 format.

bf16: bit-identical to transformers' own expert arithmetic (``x @ W.T`` and its grouped GEMM) at
1, a few and many rows per expert, and identical greedy tokens to the untouched model with every
expert on the host at two batch shapes. int8 / int4: the formats' documented arithmetic
(``(x @ q.T) * s`` accumulated in float32; ``q * s`` per group), the stored int8 bytes used in
place, and the errors a bad ``host_format`` or weight raises.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import kinject
from kinject.engine import host_kernels as hk
from kinject.engine.formats.base import FormatError
from kinject.engine.formats.int8 import Int8Format, dequantize, quantize
from kinject.errors import RuleError
from kinject.fixtures import tiny_moe_path
from operators.experts import GroupedExperts
from operators.host_experts import HostComputeError, choose_backend

HOST = ["vars.experts_compute=host", "pipeline.micro_batch_size=2", "pipeline.n_batches=2"]


def _w(out: int, cols: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    return (torch.randn(out, cols, generator=torch.Generator().manual_seed(seed)) * 0.05).to(dtype)


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("shape", [(96, 64), (256, 128)])
def test_dense_kernel_is_bit_identical_to_linear_and_grouped_mm(rows, shape):
    w = _w(*shape, seed=rows)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    y = hk.DenseLinear(w)(x)
    assert torch.equal(y, F.linear(x, w))
    stacked = torch.stack([w, _w(*shape, seed=99)])                     # [2, out, in]: expert 0 has every row
    offs = torch.tensor([rows, rows], dtype=torch.int32)
    assert torch.equal(y, F.grouped_mm(x, stacked.transpose(-2, -1), offs=offs))


@pytest.mark.parametrize("shape", [(48, 64), (200, 96)])
def test_int8_quantize_and_kernel_follow_the_documented_arithmetic(shape):
    w = _w(*shape, seed=3)
    w[5] = 0                                                            # an all-zero row: q 0, no division by zero
    parts = quantize(w)
    q, s = parts["weight"], parts["weight_scale"]
    assert q.dtype == torch.int8 and q.shape == w.shape and s.shape == w.shape[:1] and s.dtype == w.dtype
    assert q.abs().max() <= 127 and not q[5].any()
    deq = dequantize(parts, torch.float32)
    assert ((deq - w.float()).abs() <= s.float().unsqueeze(-1) / 2 + 1e-6).all()     # round to nearest
    for rows in (1, 5):
        x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        y = hk.Int8Linear(q, s)(x)
        ref = (x.float() @ q.float().t()) * s.float()
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), ref, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("group,shape", [(32, (64, 128)), (32, (96, 64))])
def test_int4_kernel_follows_the_documented_arithmetic(group, shape):
    w = _w(*shape, seed=4)
    q, s = hk.quantize_int4(w, group)
    assert q.min() >= -8 and q.max() <= 7 and s.shape == (shape[0], shape[1] // group)
    deq = hk.dequantize_int4(q, s, group, torch.float32)
    # round to nearest; the largest value clamps from 7.5 to 7 steps, plus the scale's bf16 rounding
    assert ((deq - w.float()).abs() <= s.float().repeat_interleave(group, -1) * 0.55).all()
    kernel = hk.int4_linear(q, s, group)
    for rows in (1, 7):
        x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        torch.testing.assert_close(kernel(x).float(), x.float() @ deq.t(), rtol=1e-2, atol=2e-3)


def test_int8_encoder_gives_the_parts_and_the_codec_that_decodes_them():
    from kinject.engine.formats.int8 import encode

    w = _w(16, 64, 7)
    parts, codec = encode(w, {})
    assert isinstance(codec, Int8Format) and set(parts) == {"weight", "weight_scale"}
    torch.testing.assert_close(codec.dequantize(parts, torch.float32), dequantize(quantize(w), torch.float32))
    codec.check("x.weight", {k: (tuple(v.shape), v.dtype) for k, v in parts.items()}, (16, 64))
    with pytest.raises(FormatError, match=r"int8: takes no settings .*\['group_size'\]"):
        encode(w, {"group_size": 32})


def test_bad_weights_and_formats_are_refused_naming_them():
    with pytest.raises(FormatError, match=r"int8: quantizes float weights.*torch.int32 \[4\]"):
        quantize(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(hk.HostKernelError, match=r"input dimension 40 .* group size 32"):
        hk.quantize_int4(_w(8, 40, 0))
    with pytest.raises(hk.HostKernelError, match="host_format 'int3'"):
        hk.linear_for(_w(8, 32, 0), "int3", compute_dtype=torch.bfloat16)
    fmt = Int8Format()
    with pytest.raises(FormatError, match=r"experts.down_proj: int8 values must be int8 \[8, 32\]"):
        fmt.check("experts.down_proj", {"weight": ((8, 32), torch.uint8), "weight_scale": ((8,), torch.bfloat16)},
                  (8, 32))
    with pytest.raises(FormatError, match=r"x.weight: int8 scale must be float \[8\]"):
        fmt.check("x.weight", {"weight": ((8, 32), torch.int8), "weight_scale": ((8, 1), torch.bfloat16)}, (8, 32))


def _kernels(weights: dict, stored: dict, host_format=None) -> hk.ExpertKernels:
    gate = lambda h: F.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1]      # noqa: E731 - transformers' default gate
    return hk.ExpertKernels(weights=lambda e: weights[e], stored=lambda e: stored.get(e, {}), cacheable=lambda e: True,
                            up="gate_up_proj", down="down_proj", activation=gate, post=None, host_format=host_format,
                            compute_dtype=torch.bfloat16)


def test_stored_int8_experts_compute_on_their_stored_bytes_in_place():
    """An expert the store holds in format int8 is computed from those bytes (no dequantized copy,
    no copy of the values), the same as the documented ``(x @ q.T) * s`` per projection."""
    gu, dn = _w(64, 32, 1), _w(32, 32, 2)                                # gated: [2I, H], [H, I]
    stored = {0: {"gate_up_proj": (quantize(gu), Int8Format()), "down_proj": (quantize(dn), Int8Format())}}
    weights = {0: {}}                                                   # never asked: the stored bytes are used
    k = _kernels(weights, stored)
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    y = k([0], [{}], [3], x)
    up, _ = k.kernels(0)
    assert up.q.data_ptr() == stored[0]["gate_up_proj"][0]["weight"].data_ptr() and k.kinds == {"Int8Linear": 2}
    p1, p2 = stored[0]["gate_up_proj"][0], stored[0]["down_proj"][0]
    h = ((x.float() @ p1["weight"].float().t()) * p1["weight_scale"].float()).to(torch.bfloat16)
    h = F.silu(h[:, :32]) * h[:, 32:]
    ref = (h.float() @ p2["weight"].float().t()) * p2["weight_scale"].float()
    torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-3)


def test_group_of_experts_keeps_row_order_and_skips_empty_experts():
    weights = {e: {"gate_up_proj": _w(64, 32, 10 + e), "down_proj": _w(32, 32, 20 + e)} for e in range(3)}
    k = _kernels(weights, {})
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    y = k([0, 1, 2], [{}] * 3, [2, 0, 3], x)
    for e, rows in ((0, slice(0, 2)), (2, slice(2, 5))):
        h = F.linear(x[rows], weights[e]["gate_up_proj"])
        assert torch.equal(y[rows], F.linear(F.silu(h[:, :32]) * h[:, 32:], weights[e]["down_proj"]))


@pytest.mark.parametrize("fmt", [None, "int8", "int4"])
def test_a_prompts_busy_experts_leave_the_others_grouped_with_their_own_values(fmt, monkeypatch):
    """Experts with MM_ROWS rows or more go through their own kernels, the rest through one grouped call:
    each expert's rows are what it computes alone (bfloat16: torch's own ``F.linear`` bits), and the
    grouped call is made once, on the other experts' rows only."""
    from kinject.engine import host_gemv

    gemv = host_gemv.load()
    if gemv is None or fmt is None and not gemv.exact_bf16 or fmt == "int4" and not gemv.int4_takes(128):
        pytest.skip("no compiled grouped kernel for this format here")
    H, inter = 128, 128
    weights = {e: {"gate_up_proj": _w(2 * inter, H, 30 + e), "down_proj": _w(H, inter, 40 + e)} for e in range(5)}
    gate = lambda h: F.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1]      # noqa: E731
    gate.fused = "silu"
    k = hk.ExpertKernels(weights=lambda e: weights[e], stored=lambda e: {}, cacheable=lambda e: True,
                         up="gate_up_proj", down="down_proj", activation=gate, post=None, host_format=fmt,
                         compute_dtype=torch.bfloat16, gemv=gemv)
    grouped = []
    real = k._grouped
    monkeypatch.setattr(k, "_grouped", lambda pairs, rows, x: grouped.append(list(rows)) or real(pairs, rows, x))
    for counts in ([hk.MM_ROWS + 3, 2, 0, 5, 1], [3, hk.MM_ROWS, 1, hk.MM_ROWS + 1, 2]):
        grouped.clear()
        x = torch.randn(sum(counts), H, generator=torch.Generator().manual_seed(sum(counts))).to(torch.bfloat16)
        before = k.grouped_calls
        y = k(list(range(5)), [{}] * 5, counts, x)
        assert grouped == [[n for n in counts if 0 < n < hk.MM_ROWS]] and k.grouped_calls == before + 1
        start = 0
        for e, n in enumerate(counts):
            rows = slice(start, start + n)
            alone = k._one_by_one([k.kernels(e)], [n], x[rows]) if n >= hk.MM_ROWS else real([k.kernels(e)], [n], x[rows])
            assert torch.equal(y[rows], alone), (counts, e)
            if fmt is None:                                   # bfloat16: transformers' own arithmetic
                h = F.linear(x[rows], weights[e]["gate_up_proj"])
                assert torch.equal(y[rows], F.linear(gate(h), weights[e]["down_proj"])), (counts, e)
            start += n


# ---- the model: every expert on the host -------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_bf16():
    return AutoModelForCausalLM.from_pretrained(tiny_moe_path(), dtype=torch.bfloat16)


def _experts(model) -> list[GroupedExperts]:
    return [op for op in model.kinject.operators if isinstance(op, GroupedExperts)]


def _prompts(tok, n: int):
    from kinject.testing import tiny_prompts
    return tok(tiny_prompts(n), return_tensors="pt", padding=True)


@pytest.mark.parametrize("batch,new", [(1, 12), (3, 7)])
def test_bf16_host_experts_give_transformers_tokens(hf_bf16, tok, batch, new, tmp_path):
    """bf16, every expert on the host through torch-host: identical greedy tokens to transformers'
    bf16 model, at batch 1 and at a batch that is not a multiple of the micro-batch."""
    enc = _prompts(tok, batch)
    gen = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id)
    ref = hf_bf16.generate(**enc, **gen)
    model = kinject.from_pretrained(tiny_moe_path(), "rules/hybrid.yaml", [*HOST, f"pipeline.offload_dir={tmp_path}"],
                                    dtype=torch.bfloat16)
    assert torch.equal(model.generate(**enc, **gen), ref)
    ops = _experts(model)
    assert ops and all(op.host.backend.name == "torch-host" for op in ops)
    assert sum(op.host.stats["experts"] for op in ops) > 0
    assert all(set(op.host._kernel.kinds) <= {"DenseLinear"} for op in ops if op.host._kernel is not None)


@pytest.mark.parametrize("fmt,kind", [("int8", "Int8Linear"), ("int4", "Int4Linear")])
def test_host_format_computes_the_formats_arithmetic_in_the_model(tok, fmt, kind, tmp_path):
    """``vars.experts_host_format``: every host expert computes in that format, and a layer's output
    is the format's documented arithmetic on its weights (dequantized here as the format says)."""
    model = kinject.from_pretrained(tiny_moe_path(), "rules/hybrid.yaml",
                                    [*HOST, f"vars.experts_host_format={fmt}", f"pipeline.offload_dir={tmp_path}"],
                                    dtype=torch.bfloat16)
    enc = _prompts(tok, 2)
    out = model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == enc["input_ids"].shape[1] + 4
    op = _experts(model)[0]
    gemv, cfg = op.host._kernel.gemv, model.config
    if fmt == "int4" and gemv is not None and gemv.int4_takes(cfg.hidden_size) and gemv.int4_takes(cfg.intermediate_size):
        kind = "Int4GemvLinear"                  # kinject's int4 kernel takes the model's widths here
    assert op.host.backend.name == "torch-host" and set(op.host._kernel.kinds) == {kind}
    w = op.host.weights(1)
    x = torch.randn(4, w["gate_up_proj"].shape[-1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)

    def deq(t):
        if fmt == "int8":
            return dequantize(quantize(t), torch.float32)
        q, s = hk.quantize_int4(t)
        return hk.dequantize_int4(q, s, hk.INT4_GROUP, torch.float32)

    h = (x.float() @ deq(w["gate_up_proj"]).t()).to(torch.bfloat16)
    inter = h.shape[-1] // 2
    ref = (F.silu(h[:, :inter]) * h[:, inter:]).float() @ deq(w["down_proj"]).t()
    y = op.host.compute([1], [{}], [4], x)
    torch.testing.assert_close(y.float(), ref, rtol=3e-2, atol=3e-3)


def test_host_format_quantizes_every_expert_at_the_first_host_compute(tmp_path):
    """One token routed to 2 of 8 experts per layer: the first host compute still builds every
    expert's int8 kernels (quantized once), so no later prefill pays for an expert's first use."""
    model = kinject.from_pretrained(tiny_moe_path(), "rules/hybrid.yaml",
                                    [*HOST, "vars.experts_host_format=int8", f"pipeline.offload_dir={tmp_path}"],
                                    dtype=torch.bfloat16)
    ids = torch.tensor([[5]])
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
    for op in _experts(model):
        assert op.host._kernel.kinds == {"Int8Linear": 2 * op.experts.stored}, op.key


def test_host_format_errors_name_the_key_before_anything_changes(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_path(), dtype=torch.float32)
    with pytest.raises(RuleError, match=r"key 'replace.kwargs.host_format'.*'int3'"):
        kinject.optimize(model, "rules/hybrid.yaml", ["vars.experts_compute=host", "vars.experts_host_format=int3",
                                                      f"pipeline.offload_dir={tmp_path}"])
    with pytest.raises(RuleError, match=r"key 'replace.kwargs.host_format'.*needs compute: host or auto"):
        kinject.optimize(model, "rules/klotski.yaml", ["vars.experts_host_format=int8", f"pipeline.offload_dir={tmp_path}"])
    assert not hasattr(model, "kinject")


def test_host_format_is_served_by_torch_host_alone():
    class Looped:                                       # a layout computed through its block's own loop
        name, call, math, params = "loop_block", "loop_block", None, ()

    with pytest.raises(HostComputeError) as err:
        choose_backend(Looped(), where="model.layers.0.mlp (compute: host)", host_format="int8")
    msg = str(err.value)
    assert "torch-host: needs transformers' fused experts contract" in msg
    assert "torch-grouped: computes the experts' stored form only (host_format 'int8' asked)" in msg


def test_rule_stored_int8_experts_compute_natively_on_the_host_and_decode_on_the_device(tok, tmp_path):
    """``quant: {format: int8}`` (the encoder registry) stores the experts as int8 values + row scales;
    the host computes on those stored bytes in place; the same units moved to the device (compute:
    device) are decoded there by the format: both sides give the format's arithmetic."""
    enc = _prompts(tok, 2)
    gen = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    outs = {}
    for where in ("host", "device"):
        model = kinject.from_pretrained(tiny_moe_path(), "rules/hybrid.yaml",
                                        [f"vars.experts_compute={where}", "vars.experts_quant={format: int8}",
                                         f"pipeline.offload_dir={tmp_path / where}"], dtype=torch.bfloat16)
        outs[where] = model.generate(**enc, **gen)
        op = _experts(model)[0]
        unit = op.units[1]
        assert isinstance(unit.stored["gate_up_proj"], Int8Format)
        if where == "host":
            assert set(op.host._kernel.kinds) == {"Int8Linear"}
            up, _ = op.host._kernel.kernels(1)
            assert up.q.data_ptr() == unit.tensors["gate_up_proj.weight"].data_ptr()       # the stored bytes
    agree = (outs["host"] == outs["device"]).float().mean().item()
    assert agree > 0.9, f"host int8 and device-decoded int8 agree on {agree:.0%} of tokens"
