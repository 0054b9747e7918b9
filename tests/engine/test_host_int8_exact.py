"""INT8 host experts on AMX-INT8 and on AVX512-VNNI (kinject/engine/host_gemv.c, "exact sums"): each output is
the float32 nearest to the true ``sum(x * q)``, times the row's scale, rounded to bfloat16.

Checked against that arithmetic written out in Python integers (every bfloat16 is an 8-bit integer
times a power of two), at a decode step's shape and at shapes whose rows need several tiles of
digits, a 16-row tail, an expert with no rows, subnormal and widely spread activations (the 128-bit
combination; the grid 2^-62 below the largest value's power of two), one thread and two. A row's result does
not depend on the other rows of its call, which is what lets a long prompt's call be cut into
windows; a NaN leaves the call to the float32 kernel.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kinject.engine import host_gemv
from test_host_gemv import _int8, _threads

SPAN = 55   # binary orders of magnitude a row holds exactly (DIGITS_SPAN in host_gemv.c)


@pytest.fixture
def exact(gemv):
    if not gemv.int8_exact:
        pytest.skip("no AMX-INT8 or AVX512-VNNI here: the int8 group sums in float32")
    return gemv


def _round_f32(n: int, e2: int) -> float:
    """``n * 2**e2`` rounded to the nearest float32 (ties to even), for results in float32's normal range."""
    if n == 0:
        return 0.0
    sign, n = (-1 if n < 0 else 1), abs(n)
    shift = n.bit_length() - 24
    if shift > 0:
        q, r = divmod(n, 1 << shift)
        half = 1 << (shift - 1)
        n, e2 = q + (r > half or (r == half and q & 1)), e2 + shift
    return sign * math.ldexp(n, e2)


def _grid(x: torch.Tensor) -> tuple[list[int], int]:
    """A bfloat16 row as integers on its grid (the smallest nonzero value's unit, but no finer than
    2^-(SPAN + 7) of the largest value's power of two: values below it rounded to nearest even on it)
    and the grid's power of two."""
    bits = x.view(torch.int16).tolist()
    parts = []
    for b in bits:
        b &= 0xffff
        e, m = (b >> 7) & 0xff, (b & 0x7f) | (0x80 if (b >> 7) & 0xff else 0)
        parts.append((-1 if b & 0x8000 else 1, max(e, 1), m))
    nonzero = [e for s, e, m in parts if m]
    if not nonzero:
        return [0] * len(parts), 0
    low = max(min(nonzero), max(nonzero) - SPAN)
    ints = []
    for s, e, m in parts:
        if e >= low:
            ints.append(s * (m << (e - low)))
        else:
            q, r = divmod(m, 1 << (low - e))
            half = 1 << (low - e - 1)
            ints.append(s * (q + (r > half or (r == half and q & 1))))
    return ints, low - 134


def _reference(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """bf16(float32(sum(x * q)) * s) per row, the sum exact (Python integers)."""
    qi = q.to(torch.int64).tolist()
    scale = s.float().numpy()
    out = np.zeros((x.shape[0], q.shape[0]), dtype=np.float32)
    for j in range(x.shape[0]):
        ints, e2 = _grid(x[j])
        for r, row in enumerate(qi):
            total = sum(a * b for a, b in zip(ints, row))
            out[j, r] = np.float32(_round_f32(total, e2)) * scale[r]
    return torch.from_numpy(out).to(torch.bfloat16)


def _call(g, parts, counts, x, out, cols):
    return g.int8([q.data_ptr() for q, _ in parts], [s.data_ptr() for _, s in parts], counts, x, out, cols)


def _per_expert(parts, counts, x, fn) -> torch.Tensor:
    out, start = [], 0
    for (q, s), n in zip(parts, counts):
        out.append(fn(x[start:start + n], q, s))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("out,cols,counts", [(48, 128, [2, 0, 3]), (32, 64, [19, 1]), (16, 192, [1])])
def test_int8_sums_are_exact_on_amx_int8(exact, out, cols, counts, threads):
    parts = [_int8(out, cols, e) for e in range(len(counts))]
    x = (torch.randn(sum(counts), cols, generator=torch.Generator().manual_seed(5)) * 2).to(torch.bfloat16)
    x[0, :5] = torch.tensor([3e-39, -1e-38, 0.0, 7e-12, 1e4])   # subnormals, a spread of ~150 binary orders
    x[-1] = 0
    x[-1, 3] = -1.5                                               # one value (a single digit)
    y = _threads(threads, lambda: _call(exact, parts, counts, x, out, cols))
    assert torch.equal(y, _per_expert(parts, counts, x, _reference))


def test_int8_sums_are_exact_at_a_decode_steps_shape(exact):
    """Eight experts of 1536 x 1024, one row each: the float64 sum is exact at this spread."""
    parts = [_int8(1536, 1024, e) for e in range(8)]
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).expand(8, -1).contiguous()
    y = _call(exact, parts, [1] * 8, x, 1536, 1024)
    ref = _per_expert(parts, [1] * 8, x, lambda xs, q, s: ((xs.double() @ q.double().t()).float() * s.float())
                      .to(torch.bfloat16))
    assert torch.equal(y, ref)


def test_a_rows_result_does_not_depend_on_the_other_rows_of_its_call(exact):
    """A widely spread row makes the call write eight digits a row (the 128-bit combination); the
    other rows' outputs are those they get alone, with three."""
    parts = [_int8(64, 256, 3)]
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    alone = torch.cat([_call(exact, parts, [1], x[j:j + 1], 64, 256) for j in range(4)])
    wide = x.clone()
    wide[2, :3] = torch.tensor([1e-30, 5e-20, 1e6])
    together = _call(exact, parts, [4], wide, 64, 256)
    assert torch.equal(together[[0, 1, 3]], alone[[0, 1, 3]])
    assert torch.equal(together[2:3], _reference(wide[2:3], *parts[0]))


def test_long_calls_are_cut_into_windows_with_the_same_bits(exact, fused_exact, monkeypatch):
    parts = [_int8(64, 128, e) for e in range(3)]
    ups, downs = [_int8(128, 128, 10 + e) for e in range(3)], [_int8(128, 64, 20 + e) for e in range(3)]
    counts = [7, 0, 12]
    x = torch.randn(19, 128, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    ptr = lambda ts, i: [t[i].data_ptr() for t in ts]      # noqa: E731
    whole = _call(exact, parts, counts, x, 64, 128)
    fused = fused_exact.swiglu_int8(ptr(ups, 0), ptr(ups, 1), ptr(downs, 0), ptr(downs, 1), counts, x, 64, 128)
    monkeypatch.setattr(host_gemv, "int8_window", lambda cols: 5)
    assert torch.equal(_call(exact, parts, counts, x, 64, 128), whole)
    assert torch.equal(fused_exact.swiglu_int8(ptr(ups, 0), ptr(ups, 1), ptr(downs, 0), ptr(downs, 1), counts, x, 64,
                                               128), fused)


@pytest.fixture
def fused_exact(exact):
    if not exact.fused_gate:
        pytest.skip("no fused SwiGLU here: it needs torch's AVX-512 exp")
    return exact


def test_row_windows_cut_experts_rows_in_order():
    assert host_gemv.row_windows([7, 0, 12], 5) == [([0], [5], 0, 5), ([0, 2], [2, 3], 5, 10),
                                                    ([2], [5], 10, 15), ([2], [4], 15, 19)]
    assert host_gemv.row_windows([2, 3], 5) == [([0, 1], [2, 3], 0, 5)]
    assert host_gemv.int8_window(1024) >= 64


def test_a_nan_activation_leaves_the_call_to_the_float32_kernel(exact):
    parts = [_int8(32, 128, 1)]
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    x[1, 7] = float("nan")
    y = _call(exact, parts, [3], x, 32, 128)
    assert y[1].isnan().all() and not y[[0, 2]].isnan().any()
    ref = ((x[[0, 2]].float() @ parts[0][0].float().t()) * parts[0][1].float()).to(torch.bfloat16)
    torch.testing.assert_close(y[[0, 2]].float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_the_fused_int8_swiglu_keeps_the_exact_sums(fused_exact):
    """Both projections of the fused call in the exact arithmetic, torch's gate between them."""
    ups, downs = [_int8(512, 256, e) for e in range(2)], [_int8(256, 256, 30 + e) for e in range(2)]
    counts = [1, 2]
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    ptr = lambda ts, i: [t[i].data_ptr() for t in ts]      # noqa: E731
    y = fused_exact.swiglu_int8(ptr(ups, 0), ptr(ups, 1), ptr(downs, 0), ptr(downs, 1), counts, x, 256, 256)
    g, u = _per_expert(ups, counts, x, _reference).chunk(2, -1)
    assert torch.equal(y, _per_expert(downs, counts, F.silu(g) * u, _reference))


def test_small_values_count_where_the_large_ones_cancel(exact):
    """1 - 1 + 2^-58: a float32 sum that adds the small value before the cancellation keeps nothing of
    it; the exact sum is 2^-58 q. A row whose largest value is 1 has a grid of 2^-62: 2^-66 rounds to 0."""
    q, s = _int8(16, 64, 8)
    q = q.clone()
    q[:, 1] = q[:, 0]
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    x[:, 0], x[:, 1], x[0, 2], x[1, 3] = 1.0, -1.0, 2.0 ** -58, 2.0 ** -66
    y = _call(exact, [(q, s)], [2], x, 16, 64)
    assert torch.equal(y[0], (q[:, 2].float() * 2.0 ** -58 * s.float()).to(torch.bfloat16))
    assert torch.equal(y[1], torch.zeros(16, dtype=torch.bfloat16))
    assert torch.equal(y, _reference(x, q, s))


@pytest.mark.parametrize("spread", [20, 30, 38])
def test_rows_of_four_to_six_digits(exact, spread):
    """Rows spanning 20, 30 and 38 binary orders need 4, 5 and 6 digits: at 1024 values the first two
    combine in 64-bit lanes, the third in 128 bits; all exact."""
    parts = [_int8(32, 1024, 9)]
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(spread)).to(torch.bfloat16)
    x[:, 5], x[:, 6] = 2.0 ** 4, -(2.0 ** (4 - spread))
    y = _call(exact, parts, [3], x, 32, 1024)
    assert torch.equal(y, _reference(x, *parts[0]))
