"""The compiled grouped GEMV (kinject/engine/host_gemv.py + host_gemv.c).

bfloat16, every expert of a group at once, at one and several rows per expert, an expert with no
rows, output counts that are not a multiple of the kernel's tiles and blocks, one thread and two:
on AMX torch's bits exactly (the default); the portable float32 order (``pipeline.host_gemv: fast``)
within one ulp, inputs leaving a 32-element and a scalar tail included. INT8: torch's
``_weight_int8pack_mm`` arithmetic. The one-row ``nn.Linear`` forward, its inverse, the setting in
a model, and how the loader says why the kernel is not there.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kinject.engine import host_gemv
from kinject.engine import host_kernels as hk
from kinject.engine.formats.int8 import Int8Format, quantize

GATE = lambda h: F.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1]      # noqa: E731 - transformers' default gate


@pytest.fixture
def fused(gemv):
    """The kernel where it computes a SwiGLU group whole (AMX and torch's AVX-512 exp, or torch's own
    order and its AVX2 exp)."""
    if not gemv.fused_gate:
        pytest.skip("no fused SwiGLU here: it needs AMX and torch's AVX-512 exp, or torch's AVX2 order and exp")
    return gemv


@pytest.fixture
def fast(gemv):
    """The kernel where it computes bfloat16 too (``pipeline.host_gemv: fast``)."""
    if not gemv.vectorized:
        pytest.skip("the grouped GEMV does not vectorize at torch's CPU capability here")
    return gemv


def _w(out: int, cols: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(out, cols, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


def _within_one_ulp(y: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal but for rounding ties: at most one bfloat16 ulp apart, and equal in >= 99.9 % of outputs."""
    ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs().clamp_min(1e-30)
    assert ((y.float() - ref.float()).abs() <= ulp * 1.01).all()
    assert (y == ref).float().mean() >= 0.999


def _each_expert(y, ws, counts, x, check) -> None:
    start = 0
    for w, n in zip(ws, counts):
        if n:
            check(y[start:start + n], F.linear(x[start:start + n], w))
            for j in range(start, start + n):
                check(y[j], torch.mv(w, x[j]))
        start += n


def _threads(n: int, fn):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("out,cols", [(1536, 1024), (70, 96), (3, 128), (129, 64), (37, 2048), (9, 130), (65, 1000)])
def test_bf16_exact_group_has_torchs_bits(gemv, out, cols, threads):
    """AMX, oneDNN's order, or (a CPU where torch has no oneDNN bfloat16 kernel: AVX2) torch's own
    order, tails included: the bits of F.linear and torch.mv for every expert and row, ties included
    (weights scaled so that many sums fall near a rounding midpoint)."""
    if not gemv.bf16_exact_for(cols):
        pytest.skip(f"no path with torch's bits on this CPU / torch for an inner dimension of {cols}")
    counts = [1, 0, 3, 2]
    ws = [_w(out, cols, 10 + e, 0.05) for e in range(len(counts))]
    x = _w(sum(counts), cols, 99)
    y = _threads(threads, lambda: gemv.bf16(ws, counts, x, out, cols, exact=True))
    _each_expert(y, ws, counts, x, lambda a, b: torch.testing.assert_close(a, b, rtol=0, atol=0))


def test_bf16_exact_is_refused_where_it_has_no_torch_bits(gemv):
    """AMX computes whole blocks of 32 with torch's bits; torch's own order (no AMX) any inner size,
    where the check at load found torch computing in it."""
    assert gemv.bf16_exact_for(130) == (gemv.exact_bf16 and not gemv.amx)
    assert gemv.bf16_exact_for(128) == gemv.exact_bf16
    if gemv.bf16_exact_for(130):
        pytest.skip("torch's own order here: every inner size has torch's bits")
    with pytest.raises(ValueError, match="inner dimension of 130"):
        gemv.bf16([_w(8, 130, 1)], [1], _w(1, 130, 2), 8, 130, exact=True)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("out,cols", [(1536, 1024), (70, 200), (3, 130), (129, 64)])
def test_bf16_fast_group_equals_torch_but_for_rounding_ties(fast, out, cols, threads):
    counts = [1, 0, 3, 2]
    ws = [_w(out, cols, 10 + e, 0.05) for e in range(len(counts))]
    x = _w(sum(counts), cols, 99)
    y = _threads(threads, lambda: fast.bf16(ws, counts, x, out, cols, exact=False))
    _each_expert(y, ws, counts, x, _within_one_ulp)


@pytest.mark.parametrize("out,cols", [(1536, 1024), (70, 96), (5, 40)])
def test_int8_group_follows_weight_int8pack_mm(gemv, out, cols):
    counts = [2, 1]
    parts = [quantize(_w(out, cols, e)) for e in range(2)]
    scales = [p["weight_scale"].to(torch.bfloat16).contiguous() for p in parts]
    x = _w(3, cols, 7)
    y = gemv.int8([p["weight"].data_ptr() for p in parts], [s.data_ptr() for s in scales], counts, x, out, cols)
    # (x @ q.T) * s in float32, rounded once: _weight_int8pack_mm's arithmetic (which crashes on 5 x 40 here)
    ref = torch.cat([((x[:2].float() @ parts[0]["weight"].float().t()) * scales[0].float()).to(torch.bfloat16),
                     ((x[2:].float() @ parts[1]["weight"].float().t()) * scales[1].float()).to(torch.bfloat16)])
    if out % 16 == 0 and cols % 32 == 0:
        assert torch.equal(ref[:2], torch.ops.aten._weight_int8pack_mm(x[:2], parts[0]["weight"], scales[0])) or \
            (ref[:2] == torch.ops.aten._weight_int8pack_mm(x[:2], parts[0]["weight"], scales[0])).float().mean() > 0.97
    torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2, atol=1e-2)
    assert (y == ref).float().mean() > 0.97                 # the same arithmetic, the sum in its own order


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("out,cols", [(1536, 1024), (70, 96), (9, 40), (64, 1000), (48, 2112)])
def test_int8_group_rows_have_the_bits_of_one_row_at_a_time(gemv, out, cols, threads):
    """An expert's rows come out as they would one at a time (a prefill's several rows per expert, a
    decode step's one; row tails of 1-3 weight rows and inner tails included): a token's output does
    not depend on what else is in the call."""
    counts = [3, 1, 2, 5]
    parts = [quantize(_w(out, cols, 30 + e, 0.05)) for e in range(len(counts))]
    ws = [p["weight"].data_ptr() for p in parts]
    scales = [p["weight_scale"].to(torch.bfloat16).contiguous() for p in parts]
    ss = [s.data_ptr() for s in scales]
    x = _w(sum(counts), cols, 8, 2.0)
    y = _threads(threads, lambda: gemv.int8(ws, ss, counts, x, out, cols))
    rows, start = [], 0
    for e, n in enumerate(counts):
        rows += [gemv.int8([ws[e]], [ss[e]], [1], x[start + j:start + j + 1], out, cols) for j in range(n)]
        start += n
    assert torch.equal(y, torch.cat(rows))


def _swiglu_ref(ups, downs, counts, x) -> list[torch.Tensor]:
    """torch's per expert: F.linear, F.silu(g) * u, F.linear."""
    out, start = [], 0
    for up, down, n in zip(ups, downs, counts):
        g, u = F.linear(x[start:start + n], up).chunk(2, -1)
        out.append(F.linear(F.silu(g) * u, down))
        start += n
    return out


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("inter,hidden,counts", [(768, 1024, [1] * 8), (256, 512, [3, 0, 2, 1]), (96, 64, [1, 5]),
                                                 (32, 2048, [2])])
def test_fused_swiglu_group_has_torchs_bits(fused, inter, hidden, counts, threads):
    """Both projections and transformers' default gate in one call equal torch's F.linear ->
    F.silu(g) * u -> F.linear per expert bit for bit: one row and several per expert, an expert with
    no rows, widths whose projections leave a 16-row tile tail, one thread and two."""
    ups = [_w(2 * inter, hidden, e, 0.05) for e in range(len(counts))]
    downs = [_w(hidden, inter, 50 + e, 0.05) for e in range(len(counts))]
    x = _w(sum(counts), hidden, 99, 3.0)                      # gate values far into silu's tails too
    y = _threads(threads, lambda: fused.swiglu(ups, downs, counts, x, inter, hidden))
    assert torch.equal(y, torch.cat(_swiglu_ref(ups, downs, counts, x)))


def test_fused_swiglu_refuses_what_it_does_not_compute(fused):
    """A width or hidden size off the 32-element blocks, and rows that do not match the counts, are
    refused with what is wrong (the kernel would read past the tensors)."""
    assert not fused.swiglu_takes("bf16", 40, 64) and not fused.swiglu_takes("bf16", 64, 48) and fused.swiglu_takes("bf16", 64, 64)
    with pytest.raises(ValueError, match="width 40"):
        fused.swiglu([_w(80, 64, 1)], [_w(64, 40, 2)], [1], _w(1, 64, 3), 40, 64)
    with pytest.raises(ValueError, match="sum to 3, x has 2 rows"):
        fused.swiglu([_w(128, 64, 1)] * 2, [_w(64, 64, 2)] * 2, [1, 2], _w(2, 64, 3), 64, 64)


def test_grouped_gemv_refuses_rows_that_do_not_match_the_counts(gemv):
    with pytest.raises(ValueError, match="sum to 8, x has 1 rows"):
        gemv.bf16([_w(64, 64, e) for e in range(8)], [1] * 8, _w(1, 64, 3), 64, 64, exact=gemv.exact_bf16)
    q = quantize(_w(64, 64, 1))
    s = q["weight_scale"].to(torch.bfloat16).contiguous()
    with pytest.raises(ValueError, match="sum to 2, x has 3 rows"):
        gemv.int8([q["weight"].data_ptr()], [s.data_ptr()], [2], _w(3, 64, 3), 64, 64)


def _int8(out: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    part = quantize(_w(out, cols, seed, 0.05))
    return part["weight"], part["weight_scale"].to(torch.bfloat16).contiguous()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("inter,hidden,counts", [(256, 512, [2, 0, 1]), (768, 1024, [1] * 8)])
def test_fused_int8_swiglu_equals_two_int8_calls_and_torchs_gate(fused, inter, hidden, counts, threads):
    """INT8 experts whole in one call: each projection in the int8 group's arithmetic (AMX, or AVX2),
    the gate with torch's bits between them."""
    if not fused.swiglu_takes("int8", inter, hidden):
        pytest.skip("no fused int8 SwiGLU here")
    ups = [_int8(2 * inter, hidden, e) for e in range(len(counts))]
    downs = [_int8(hidden, inter, 50 + e) for e in range(len(counts))]
    x = _w(sum(counts), hidden, 99, 3.0)
    ptr = lambda ts, i: [t[i].data_ptr() for t in ts]      # noqa: E731
    y = _threads(threads, lambda: fused.swiglu_int8(ptr(ups, 0), ptr(ups, 1), ptr(downs, 0), ptr(downs, 1), counts, x,
                                                    inter, hidden))
    g, u = fused.int8(ptr(ups, 0), ptr(ups, 1), counts, x, 2 * inter, hidden).chunk(2, -1)
    assert torch.equal(y, fused.int8(ptr(downs, 0), ptr(downs, 1), counts, F.silu(g) * u, hidden, inter))
    with pytest.raises(ValueError, match="width 40"):
        fused.swiglu_int8(ptr(ups, 0), ptr(ups, 1), ptr(downs, 0), ptr(downs, 1), counts, x, 40, hidden)


@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("inter,hidden,k", [(256, 512, 3), (768, 1024, 8)])
def test_fused_swiglu_reads_one_row_broadcast_to_every_row(fused, monkeypatch, kind, inter, hidden, k):
    """A decode step's token for each of its k experts, as a stride-0 view (no k-row copy): the bits of
    the same call on k real rows, in one call and in windows of rows (a window cut inside the view)."""
    if not fused.swiglu_takes(kind, inter, hidden):
        pytest.skip(f"no fused {kind} SwiGLU here")
    counts = [1] * k
    if kind == "bf16":
        ups, downs = [_w(2 * inter, hidden, e, 0.05) for e in range(k)], [_w(hidden, inter, 50 + e, 0.05) for e in range(k)]
        call = lambda x: fused.swiglu(ups, downs, counts, x, inter, hidden)      # noqa: E731
    elif kind == "int8":
        ups, downs = [_int8(2 * inter, hidden, e) for e in range(k)], [_int8(hidden, inter, 50 + e) for e in range(k)]
        ptr = lambda ts, i: [t[i].data_ptr() for t in ts]      # noqa: E731
        call = lambda x: fused.swiglu_int8(ptr(ups, 0), ptr(ups, 1), ptr(downs, 0), ptr(downs, 1), counts, x,  # noqa: E731
                                           inter, hidden)
    else:
        lin = lambda out, cols, seed: hk.Int4GemvLinear(*hk.quantize_int4(_w(out, cols, seed, 0.05)), fused)  # noqa: E731
        ups, downs = [lin(2 * inter, hidden, e) for e in range(k)], [lin(hidden, inter, 50 + e) for e in range(k)]
        ptr = lambda ms, a: [getattr(m, a).data_ptr() for m in ms]      # noqa: E731
        call = lambda x: fused.swiglu_int4(ptr(ups, "packed"), ptr(ups, "scales"), ptr(downs, "packed"),  # noqa: E731
                                           ptr(downs, "scales"), counts, x, inter, hidden)
    token = _w(1, hidden, 99, 3.0)
    broadcast = token.expand(k, hidden)
    assert broadcast.stride() == (0, 1)
    y = call(broadcast.contiguous())
    assert torch.equal(call(broadcast), y)
    monkeypatch.setattr(host_gemv, "int8_window", lambda cols: 2)
    assert torch.equal(call(broadcast), y) and torch.equal(call(broadcast.contiguous()), y)
    with pytest.raises(ValueError, match="sum to"):
        call(token.expand(k + 1, hidden))


def _kernels(weights: dict, stored: dict, g, bf16: bool = False, activation=GATE) -> hk.ExpertKernels:
    return hk.ExpertKernels(weights=lambda e: weights[e], stored=lambda e: stored.get(e, {}), cacheable=lambda e: True,
                            up="gate_up_proj", down="down_proj", activation=activation, post=None, host_format=None,
                            compute_dtype=torch.bfloat16, gemv=g, gemv_bf16=bf16)


def test_host_experts_with_the_default_gate_take_the_fused_call(fused, monkeypatch):
    """Host experts whose gate is marked as transformers' default go through the one fused call,
    with the bits of the two calls and torch's gate between them; an unmarked gate keeps two calls."""
    from operators.expert_compute import SiluGate

    calls = []
    real = fused.swiglu_bf16
    monkeypatch.setattr(fused, "swiglu_bf16", lambda *a, **k: calls.append(1) or real(*a, **k))
    weights = {e: {"gate_up_proj": _w(128, 64, 10 + e, 0.05), "down_proj": _w(64, 64, 20 + e, 0.05)} for e in range(3)}
    x = _w(5, 64, 3, 2.0)
    marked, plain = _kernels(weights, {}, fused, activation=SiluGate(GATE)), _kernels(weights, {}, fused)
    for counts in ([2, 0, 3], [1, 1, 1]):
        rows = x[:sum(counts)]
        assert torch.equal(marked([0, 1, 2], [{}] * 3, counts, rows), plain([0, 1, 2], [{}] * 3, counts, rows))
    assert len(calls) == 2 and marked.grouped_calls == plain.grouped_calls == 2
    if fused.swiglu_takes("int8", 64, 64):                      # stored INT8 experts: the fused INT8 call
        int8_calls = []
        real8 = fused.swiglu_int8
        monkeypatch.setattr(fused, "swiglu_int8", lambda *a, **k: int8_calls.append(1) or real8(*a, **k))
        stored = {e: {role: (quantize(w), Int8Format()) for role, w in weights[e].items()} for e in range(3)}
        marked8 = _kernels({}, stored, fused, activation=SiluGate(GATE))
        plain8 = _kernels({}, stored, fused)
        assert torch.equal(marked8([0, 1, 2], [{}] * 3, [2, 0, 3], x), plain8([0, 1, 2], [{}] * 3, [2, 0, 3], x))
        assert len(int8_calls) == 1


def test_by_default_bf16_experts_keep_torchs_bits_and_int8_experts_use_the_kernel(gemv):
    """Default (``exact``): a bfloat16 group goes through the kernel only where it has torch's bits
    (AMX), and is equal to the per-expert torch path bit for bit either way; a stored-INT8 group
    goes through the kernel, one call per projection, in the format's arithmetic."""
    weights = {e: {"gate_up_proj": _w(128, 64, 10 + e, 0.05), "down_proj": _w(64, 64, 20 + e, 0.05)} for e in range(3)}
    x = _w(5, 64, 3)
    with_gemv, without = _kernels(weights, {}, gemv), _kernels(weights, {}, None)
    assert torch.equal(with_gemv([0, 1, 2], [{}] * 3, [2, 0, 3], x), without([0, 1, 2], [{}] * 3, [2, 0, 3], x))
    assert with_gemv.grouped_calls == (1 if gemv.exact_bf16 else 0)

    stored = {e: {role: (quantize(w), Int8Format()) for role, w in weights[e].items()} for e in range(3)}
    k8, ref8 = _kernels({}, stored, gemv), _kernels({}, stored, None)
    y = k8([0, 1, 2], [{}] * 3, [2, 0, 3], x)
    assert k8.grouped_calls == 1
    torch.testing.assert_close(y.float(), ref8([0, 1, 2], [{}] * 3, [2, 0, 3], x).float(), rtol=2e-2, atol=2e-3)


def test_fast_mode_computes_bf16_groups_with_the_kernel(fast):
    weights = {e: {"gate_up_proj": _w(128, 64, 10 + e, 0.05), "down_proj": _w(64, 64, 20 + e, 0.05)} for e in range(3)}
    x = _w(5, 64, 3)
    k, ref = _kernels(weights, {}, fast, bf16=True), _kernels(weights, {}, None)
    y = k([0, 1, 2], [{}] * 3, [2, 0, 3], x)
    assert k.grouped_calls == 1
    torch.testing.assert_close(y.float(), ref([0, 1, 2], [{}] * 3, [2, 0, 3], x).float(), rtol=2e-2, atol=1e-3)
    many = _w(20, 64, 4)                                      # >= MM_ROWS rows for one expert: torch's GEMM
    assert torch.equal(k([0], [{}], [20], many), ref([0], [{}], [20], many))
    assert k.grouped_calls == 1
    xg = x.clone().requires_grad_(True)                       # gradients recorded: torch's kernels, a backward
    k([0, 1, 2], [{}] * 3, [2, 0, 3], xg).float().sum().backward()
    assert k.grouped_calls == 1 and xg.grad is not None


@pytest.mark.parametrize("fast_mode", [False, True])
def test_one_row_linear_forward_and_its_inverse(gemv, fast_mode, monkeypatch):
    if not (gemv.exact_bf16 or (fast_mode and gemv.vectorized)):
        pytest.skip("nothing to attach here")
    class Router(nn.Linear):                                  # a subclass with a forward of its own
        def forward(self, x):
            return super().forward(x).softmax(-1), None

    model = nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 32, bias=True),
                          nn.Linear(130, 8, bias=False), Router(8, 4, bias=False),
                          nn.Linear(8, 8, bias=False)).to(torch.bfloat16)
    monkeypatch.setattr(host_gemv, "MIN_LINEAR_WEIGHTS", 100)
    done = host_gemv.attach_linears(model, fast=fast_mode)
    assert done == [model[0], model[2]]           # a biased linear, a subclass, a tiny one: torch's forward
    for shape in ((1, 64), (1, 1, 64), (3, 64), (40, 64)):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape))).to(torch.bfloat16)
        y = model[0](x)
        assert y.shape == (*shape[:-1], 96)
        if gemv.exact_bf16:
            assert torch.equal(y, F.linear(x, model[0].weight)), shape
        else:
            _within_one_ulp(y, F.linear(x, model[0].weight))
    x130 = _w(1, 130, 4)                                      # no torch bits at 130: torch's, unless fast
    if not fast_mode:
        assert torch.equal(model[2](x130), F.linear(x130, model[2].weight))
    with pytest.raises(RuntimeError, match="same dtype"):       # anything else: torch's forward, its errors
        model[0](torch.ones(2, 64))
    assert model[3](_w(1, 8, 5))[1] is None
    model[0].weight.requires_grad_(True)                      # gradients recorded: torch's forward, a backward
    xg = _w(1, 64, 6)
    y = model[0](xg)
    assert y.grad_fn is not None
    y.float().sum().backward()
    assert model[0].weight.grad is not None
    with torch.no_grad():
        assert model[0](xg).grad_fn is None
    host_gemv.detach_linears(done)
    assert all("forward" not in m.__dict__ for m in model)


def test_a_prefills_rows_take_the_exact_gemv_where_it_beats_torchs_gemm(gemv, monkeypatch):
    """Where torch computes bfloat16 in its own order (no AMX) the exact GEMV has no row bound: a
    prefill's rows go through it too, more than ROW_WINDOW of them in windows, with F.linear's bits;
    on AMX (oneDNN's GEMM faster from MM_ROWS rows on) they stay with torch."""
    from kinject.engine.host_kernels import MM_ROWS

    if not gemv.exact_bf16:
        pytest.skip("no exact GEMV here")
    calls = []
    real = gemv.rows_checked
    monkeypatch.setattr(gemv, "rows_checked", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    w = _w(96, 64, 1, 0.05)
    for rows in (MM_ROWS, 40, host_gemv.ROW_WINDOW + 37):
        x = _w(rows, 64, rows, 2.0).view(1, rows, 64)
        calls.clear()
        y = host_gemv._functional_linear(gemv, False, x, w)
        assert torch.equal(y, F.linear(x, w)) and y.shape == (1, rows, 96)
        assert bool(calls) == (rows < gemv.exact_rows)
        if rows > host_gemv.ROW_WINDOW and calls:
            assert calls == [rows, host_gemv.ROW_WINDOW, 37]      # the call, then its windows
    assert gemv.exact_rows == (MM_ROWS if gemv.amx or gemv.dp else 1 << 62)


def test_loader_says_why_without_a_compiler(monkeypatch, tmp_path):
    for name, value in (("_tried", False), ("_loaded", None), ("_why_not", None)):
        monkeypatch.setattr(host_gemv, name, value)
    monkeypatch.setenv("KINJECT_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert host_gemv.load() is None
    assert "compiler" in host_gemv.unavailable_reason()
    assert not list(tmp_path.rglob("*.so"))
    assert host_gemv.attach_linears(nn.Linear(8, 8, bias=False).to(torch.bfloat16)) == []


def test_a_failing_compile_names_the_compiler_and_the_file(monkeypatch, tmp_path):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\necho 'boom: no' >&2\nexit 1\n")
    fake.chmod(0o755)
    for name, value in (("_tried", False), ("_loaded", None), ("_why_not", None)):
        monkeypatch.setattr(host_gemv, name, value)
    monkeypatch.setenv("KINJECT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(fake))
    assert host_gemv.load() is None
    why = host_gemv.unavailable_reason()
    assert "host_gemv.c" in why and "boom" in why
    assert not list((tmp_path / "cache").rglob("*.so")) and not list((tmp_path / "cache").rglob("tmp*"))


def test_a_routers_functional_linear_takes_the_kernel_and_its_inverse(gemv):
    """A module whose forward calls ``F.linear`` on its own weight (transformers' routers) gets a copy of
    that forward whose one-row bfloat16 ``F.linear`` is the kernel's: the same outputs (torch's bits
    where it has them), the module's other lines untouched, removed by detach_linears."""
    if not gemv.exact_bf16:
        pytest.skip("no bfloat16 with torch's bits here")
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    cfg = Qwen3MoeConfig(hidden_size=1024, num_experts=64, num_experts_per_tok=8, norm_topk_prob=True)
    router = Qwen3MoeTopKRouter(cfg)
    nn.init.normal_(router.weight)
    router = router.to(torch.bfloat16)

    class Scaled(nn.Module):                   # F.linear with a bias: torch's call, inside the copy
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(64, 1024).to(torch.bfloat16))
            self.bias = nn.Parameter(torch.randn(64).to(torch.bfloat16))

        def forward(self, x):
            return F.linear(x, self.weight, self.bias) * 2

    class Tiny(Scaled):                        # a weight too small to pay for the call
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 64).to(torch.bfloat16))

        def forward(self, x):
            return F.linear(x, self.weight)

    model = nn.ModuleList([router, Scaled(), Tiny(), nn.Linear(1024, 8, bias=False)])
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        refs = [router(x[:1]), router(x), model[1](x[:1]), router(x.repeat(8, 1))]
    done = host_gemv.attach_linears(model)
    assert done == [router, model[1]]
    calls = []
    real = gemv.rows_checked
    gemv_calls = lambda *a, **k: (calls.append([a[2]]), real(*a, **k))[1]   # noqa: E731
    try:
        gemv.rows_checked = gemv_calls
        with torch.no_grad():
            got = [router(x[:1]), router(x), model[1](x[:1]), router(x.repeat(8, 1))]
    finally:
        del gemv.rows_checked
    for a, b in zip(got, refs):
        for u, v in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            assert torch.equal(u, v)
    # the router's one and three rows; the biased one: torch's; 24 rows: torch's where its GEMM wins (AMX)
    assert calls == [[1], [3]] + ([[24]] if 24 < gemv.exact_rows else [])
    n = len(calls)
    y = router(x[:1])                                          # gradients recorded: torch's call
    assert y[0].grad_fn is not None and not calls[n:]
    host_gemv.detach_linears(done)
    assert all("forward" not in m.__dict__ for m in model)


# ---- in a model: pipeline.host_gemv ------------------------------------------------------------------


def _host_model(tmp_path, *sets):
    import kinject
    from kinject.fixtures import tiny_moe_path
    return kinject.from_pretrained(tiny_moe_path(), "rules/hybrid.yaml",
                                   ["vars.experts_compute=host", f"pipeline.offload_dir={tmp_path}", *sets],
                                   dtype=torch.bfloat16)


def _host_kernels(model):
    from operators.experts import GroupedExperts
    return [op.host._kernel for op in model.kinject.operators
            if isinstance(op, GroupedExperts) and op.host is not None and op.host._kernel is not None]


@pytest.mark.parametrize("setting", ["exact", "fast", "torch"])
def test_pipeline_host_gemv_setting(gemv, tok, tmp_path, setting, monkeypatch):
    """``exact`` (default): bfloat16 host experts and one-row linears through the kernel where it
    has torch's bits (AMX), INT8 ones always; ``fast``: bfloat16 wherever it vectorizes; ``torch``:
    torch everywhere. The one-row forwards are taken off again by kinject.restore."""
    import kinject
    bf16_grouped = {"exact": gemv.exact_bf16, "fast": gemv.vectorized or gemv.exact_bf16, "torch": False}[setting]
    int8_grouped = setting != "torch"
    linears = bf16_grouped
    monkeypatch.setattr(host_gemv, "MIN_LINEAR_WEIGHTS", 1)      # the fixture's linears are tiny
    enc = tok(["The quick brown fox"], return_tensors="pt")
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    for fmt, grouped in ((None, bf16_grouped), ("int8", int8_grouped)):
        sets = [f"pipeline.host_gemv={setting}"] + ([f"vars.experts_host_format={fmt}"] if fmt else [])
        model = _host_model(tmp_path, *sets)
        model.generate(**enc, **gen)
        kernels = _host_kernels(model)
        assert kernels and (sum(k.grouped_calls for k in kernels) > 0) == grouped, (setting, fmt)
        attached = [m for m in model.modules() if isinstance(m.__dict__.get("forward"), host_gemv.OneRowLinear)]
        assert bool(attached) == linears, (setting, fmt)
        kinject.restore(model)
        assert not [m for m in model.modules() if isinstance(m.__dict__.get("forward"), host_gemv.OneRowLinear)]


def test_a_bad_host_gemv_setting_is_refused_naming_the_key(tmp_path):
    from kinject.errors import KinjectError
    with pytest.raises((KinjectError, ValueError), match="host_gemv"):
        _host_model(tmp_path, "pipeline.host_gemv=quick")


# ---- a CPU device's experts (compute: device) -----------------------------------------------------


def _device_model(tmp_path, setting):
    import kinject
    from kinject.fixtures import tiny_moe_path
    return kinject.from_pretrained(tiny_moe_path(), "rules/klotski.yaml",
                                   [f"pipeline.host_gemv={setting}", f"pipeline.offload_dir={tmp_path / setting}"],
                                   dtype=torch.bfloat16)


def _device_gemv_steps(model) -> int:
    from operators.experts import GroupedExperts
    return sum(op.device_gemv_groups for op in model.kinject.operators if isinstance(op, GroupedExperts))


@pytest.mark.parametrize("prompts", [["The quick brown fox"], ["Hello", "A much longer prompt about foxes and dogs", "x"]])
def test_cpu_device_experts_take_the_grouped_gemv_with_transformers_bits(gemv, tok, tmp_path, prompts):
    """On a CPU device the device is host memory: compute: device experts of a decode step (fewer
    than MM_ROWS rows each) go through the same compiled grouped GEMV as host experts, with torch's
    bits (the logits of every step equal transformers' own and those of pipeline.host_gemv: torch);
    the prefill's many rows keep the family's grouped GEMM. Batch 1 and an uneven batch of 3."""
    from transformers import AutoModelForCausalLM

    from kinject.fixtures import tiny_moe_path
    enc = tok(prompts, return_tensors="pt", padding=True)
    gen = dict(max_new_tokens=9, min_new_tokens=9, do_sample=False, pad_token_id=tok.pad_token_id,
               return_dict_in_generate=True, output_logits=True)
    ref = AutoModelForCausalLM.from_pretrained(tiny_moe_path(), dtype=torch.bfloat16).generate(**enc, **gen)
    runs = {}
    for setting in ("exact", "torch"):
        model = _device_model(tmp_path, setting)
        runs[setting] = (model.generate(**enc, **gen), _device_gemv_steps(model))
        said = "through kinject's grouped GEMV" in model.kinject.report()
        assert said == (runs[setting][1] > 0), setting
    for setting, (out, steps) in runs.items():
        assert torch.equal(out.sequences, ref.sequences), setting
        assert all(torch.equal(a, b) for a, b in zip(out.logits, ref.logits)), setting
    assert runs["torch"][1] == 0
    assert (runs["exact"][1] > 0) == gemv.exact_bf16


def test_cpu_device_gemv_declines_what_it_does_not_compute(gemv):
    """float32 rows, a group with MM_ROWS rows of one expert, weights of another dtype and a call
    that records gradients answer None (the family's math computes them)."""
    from kinject.engine.host_kernels import MM_ROWS
    from operators.expert_compute import ExpertMath
    from operators.expert_sites import GemvGroups

    math = ExpertMath(up="gate_up_proj", down="down_proj", transposed=False, activation=GATE, post=None)
    site = GemvGroups(gemv, True, math)
    ws = [{"gate_up_proj": _w(128, 64, e), "down_proj": _w(64, 64, 10 + e)} for e in range(2)]
    x = torch.randn(3, 64).to(torch.bfloat16)
    y = site(ws, [1, 2], x)
    assert y is not None and site.groups == 1
    start = 0
    for w, n in zip(ws, [1, 2]):
        h = GATE(F.linear(x[start:start + n], w["gate_up_proj"]))
        _within_one_ulp(y[start:start + n], F.linear(h, w["down_proj"]))
        start += n
    assert site(ws, [1, 2], x.float()) is None
    assert site(ws, [1, MM_ROWS], torch.randn(MM_ROWS + 1, 64).to(torch.bfloat16)) is None
    assert site([{k: v.float() for k, v in w.items()} for w in ws], [1, 2], x) is None
    with torch.enable_grad():
        assert site(ws, [1, 2], x.clone().requires_grad_()) is None
    assert site.groups == 1


@pytest.mark.parametrize("k,cols", [(8, 1024), (1, 40), (3, 17)])
def test_weighted_rows_have_torchs_bits(gemv, k, cols):
    """A decode step's weighted sum of its experts' outputs: torch's gather, product and sum in one
    call, bit for bit (zeros of both signs, subnormals, NaN); bad input is refused."""
    if not gemv.weighted_exact:
        pytest.skip("the weighted sum's bits are not torch's here")
    gen = torch.Generator().manual_seed(k)
    y = (torch.randn(k + 3, cols, generator=gen) * 50).to(torch.bfloat16)
    y[1, :3] = torch.tensor([-0.0, 1e-40, float("nan")])
    w = torch.rand(k, generator=gen).to(torch.bfloat16)
    rows = torch.randperm(k + 3, generator=gen)[:k].tolist()
    got = gemv.weighted_rows(y, rows, w)
    want = (y.index_select(0, torch.tensor(rows)) * w.reshape(k, 1)).view(1, k, cols).sum(dim=1)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    with pytest.raises(ValueError, match="weighted rows"):
        gemv.weighted_rows(y, [k + 3] * k, w)
    with pytest.raises(ValueError, match="weighted rows"):
        gemv.weighted_rows(y.float(), rows, w)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("inter,hidden,experts,ids", [(768, 1024, 16, [9, 2, 15, 0, 7, 3, 12, 5]),
                                                      (256, 512, 6, [4, 1, 3]), (128, 256, 8, [6])])
def test_one_token_experts_equal_the_fused_call_and_its_weighted_sum(fused, kind, inter, hidden, experts, ids, threads):
    """A decode step's experts and their weighted sum in one call: the fused SwiGLU on the experts sorted
    ascending (the token broadcast to them), then the weighted sum in slot order, bit for bit; k of 8, 3
    and 1 out of more experts, slots out of expert order, every format the fused call computes."""
    if not fused.swiglu_takes(kind, inter, hidden):
        pytest.skip(f"no fused {kind} SwiGLU here")
    if kind == "bf16":
        weights = [(hk.DenseLinear(_w(2 * inter, hidden, e, 0.05)), hk.DenseLinear(_w(hidden, inter, 50 + e, 0.05)))
                   for e in range(experts)]
    elif kind == "int8":
        weights = [(hk.Int8Linear(*_int8(2 * inter, hidden, e)), hk.Int8Linear(*_int8(hidden, inter, 50 + e)))
                   for e in range(experts)]
    else:
        lin = lambda out, cols, seed: hk.Int4GemvLinear(*hk.quantize_int4(_w(out, cols, seed, 0.05)), fused)  # noqa: E731
        weights = [(lin(2 * inter, hidden, e), lin(hidden, inter, 50 + e)) for e in range(experts)]
    ups, downs = [u.gemv for u, _ in weights], [d.gemv for _, d in weights]
    table = fused.one_token_table(kind, ups, downs, inter, hidden)
    token = _w(1, hidden, 99, 3.0)
    index = torch.tensor([ids])
    slot_weights = torch.rand(1, len(ids), generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    order = sorted(ids)
    ou, od = [ups[e] for e in order], [downs[e] for e in order]
    broadcast = token.expand(len(ids), hidden)
    if kind == "bf16":
        y = fused.swiglu_bf16([u[3] for u in ou], [d[3] for d in od], [1] * len(ids), broadcast, inter, hidden)
    else:
        call = fused.swiglu_int8 if kind == "int8" else fused.swiglu_int4
        y = call([u[3] for u in ou], [u[4] for u in ou], [d[3] for d in od], [d[4] for d in od], [1] * len(ids),
                 broadcast, inter, hidden)
    ref = fused.weighted_rows(y, [order.index(e) for e in ids], slot_weights, token.shape)
    got = _threads(threads, lambda: fused.one_token_experts(table, index, slot_weights, token))
    assert got is not None and got.shape == token.shape and torch.equal(got, ref)


def test_one_token_experts_refuse_what_they_do_not_compute(fused):
    """An id out of range, a repeated id, ids that are not int64, weights or a token of another dtype or
    size: None, nothing computed (the interception then computes them group by group)."""
    inter, hidden = 128, 256
    ups = [hk.DenseLinear(_w(2 * inter, hidden, e, 0.05)).gemv for e in range(4)]
    downs = [hk.DenseLinear(_w(hidden, inter, 50 + e, 0.05)).gemv for e in range(4)]
    table = fused.one_token_table("bf16", ups, downs, inter, hidden)
    assert table is not None and fused.one_token_table("bf16", ups, downs, 40, hidden) is None   # a width it refuses
    token, w = _w(1, hidden, 1), torch.full((1, 2), 0.5, dtype=torch.bfloat16)
    assert fused.one_token_experts(table, torch.tensor([[1, 3]]), w, token) is not None
    for ids in ([[1, 4]], [[-1, 2]], [[2, 2]]):
        assert fused.one_token_experts(table, torch.tensor(ids), w, token) is None
    assert fused.one_token_experts(table, torch.tensor([[1, 3]], dtype=torch.int32), w, token) is None
    assert fused.one_token_experts(table, torch.tensor([[1, 3]]), w.float(), token) is None
    assert fused.one_token_experts(table, torch.tensor([[1, 3]]), w, _w(1, hidden - 32, 1)) is None
    assert fused.one_token_experts(table, torch.tensor([[1, 3, 0]]), w, token) is None        # 3 ids, 2 weights
