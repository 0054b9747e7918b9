"""kinject's int4 host kernel (kinject/engine/host_gemv.c, "int4 weights"; host_kernels.pack_int4).

The layout round-trips and puts each code where the kernel reads it; each output is the int4 format's
documented weight ``q * s`` times the rows, summed in float32 (within float32 summation of the float64
truth, before the one bfloat16 rounding); a row's bits do not depend on the other rows of the call (one
row at a time, several, windows of a long prompt); the fused SwiGLU equals two calls with torch's gate
between them; widths the kernel does not take are refused or left to torch's kernel.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kinject.engine import host_gemv
from kinject.engine import host_kernels as hk


@pytest.fixture
def int4(gemv):
    if not gemv.int4_vectorized:
        pytest.skip("no vector int4 kernel in this build (it needs AVX2 or AVX-512)")
    return gemv


def _w(out: int, cols: int, seed: int, scale: float = 0.05) -> torch.Tensor:
    return (torch.randn(out, cols, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


def _linear(out: int, cols: int, seed: int, g) -> tuple[hk.Int4GemvLinear, torch.Tensor]:
    q, s = hk.quantize_int4(_w(out, cols, seed))
    return hk.Int4GemvLinear(q, s, g), hk.dequantize_int4(q, s, hk.INT4_GROUP, torch.float64)


def _unpack(packed: torch.Tensor, layout: int, out: int) -> torch.Tensor:
    """The signed codes ``[out, in]`` of :func:`~kinject.engine.host_kernels.pack_int4`'s ``layout``, read back."""
    rows, half = packed.shape
    if layout == 1:          # 32-bit words, nibble k of word j: code 16 k + j
        words = packed.contiguous().view(torch.int32).reshape(rows, half // 64, 1, 16)
        nib = (words >> (torch.arange(8, dtype=torch.int32) * 4).view(1, 1, 8, 1)) & 0xF     # [out, blocks, k, j]
        codes = nib.reshape(rows, 2 * half)
    else:                    # panels: [panel, group, vector c, row i, t] words, nibble m: column 2 (4 c + m) + t
        words = packed.contiguous().view(torch.int16).to(torch.int32).reshape(rows // 16, half // 16, 4, 16, 2)
        nib = (words.unsqueeze(-1) >> (torch.arange(4, dtype=torch.int32) * 4)) & 0xF      # [..., i, t, m]
        codes = nib.permute(0, 3, 1, 2, 5, 4).reshape(rows, 2 * half)                     # [panel, i, group, c, m, t]
    return torch.where(codes >= 8, codes - 16, codes).to(torch.int8)[:out]


@pytest.mark.parametrize("layout", [1, 3])
def test_layout_round_trips_and_places_each_code_where_the_kernel_reads_it(layout):
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (19, 256), generator=gen, dtype=torch.int8)       # (a second, padded panel)
    packed = hk.pack_int4(q, layout)
    rows = 19 if layout == 1 else 32
    assert packed.dtype == torch.uint8 and packed.shape == (rows, 128)
    assert torch.equal(_unpack(packed, layout, 19), q)
    if layout == 1:
        words = packed.view(torch.int32).reshape(19, 2, 16)
        for row, block, k, j in ((0, 0, 0, 0), (1, 1, 7, 15), (2, 0, 3, 9), (2, 1, 5, 2), (18, 0, 2, 13)):
            nibble = (int(words[row, block, j]) >> (4 * k)) & 0xF
            assert nibble - 16 * (nibble >= 8) == q[row, 128 * block + 16 * k + j]
        return
    words = packed.view(torch.int16).reshape(-1)                  # panel, group, vector c, word 2 i + t
    for row, col in ((0, 0), (1, 33), (15, 255), (16, 7), (18, 130), (5, 64)):
        panel, i, group, p, t = row // 16, row % 16, col // 32, (col % 32) // 2, col % 2
        c, m = p // 4, p % 4
        word = int(words[((panel * 8 + group) * 4 + c) * 32 + 2 * i + t])
        nibble = (word >> (4 * m)) & 0xF
        assert nibble - 16 * (nibble >= 8) == q[row, col]
    assert not _unpack(packed, layout, 32)[19:].any()             # the padded rows hold code 0


def test_layout_3_scales_sit_by_panel_and_group():
    s = torch.arange(19 * 8, dtype=torch.float32).reshape(19, 8).to(torch.bfloat16)
    assert torch.equal(hk.pack_int4_scales(s, 1), s)
    packed = hk.pack_int4_scales(s, 3).reshape(2, 8, 16)          # [panel, group, row]
    assert torch.equal(packed[0, 5], s[:16, 5]) and torch.equal(packed[1, 2, :3], s[16:, 2])
    assert not packed[1, :, 3:].any()


def test_the_kernel_reads_a_layout_pack_int4_writes(int4):
    assert int4.int4_layout in (1, 3)
    with pytest.raises(hk.HostKernelError, match="no layout 2"):
        hk.pack_int4(torch.zeros(1, 128, dtype=torch.int8), 2)


def test_layout_refuses_codes_it_cannot_hold():
    with pytest.raises(hk.HostKernelError, match=r"multiple of 128 inputs, got torch.int8 \[2, 96\]"):
        hk.pack_int4(torch.zeros(2, 96, dtype=torch.int8), 1)
    with pytest.raises(hk.HostKernelError, match=r"codes in \[-8, 7\]"):
        hk.pack_int4(torch.full((1, 128), 9, dtype=torch.int8), 1)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("out,cols", [(64, 128), (1536, 1024), (1024, 768), (40, 384)])
def test_outputs_are_the_documented_weight_summed_in_float32(int4, out, cols, threads):
    lin, deq = _linear(out, cols, out + cols, int4)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 2, 4, 5, 9):
            x = _w(rows, cols, rows, 1.0)
            y = lin(x)
            ref = x.double() @ deq.t()
            # one bfloat16 rounding of a float32 sum: within 2^-8 of the value, plus the sum's own error
            bound = ref.abs() * 2.0 ** -8 + (x.double().abs() @ deq.abs().t()) * cols * 2.0 ** -24
            assert y.dtype == torch.bfloat16 and y.shape == (rows, out)
            assert ((y.double() - ref).abs() <= bound).all()
            assert torch.equal(y, torch.cat([lin(x[i:i + 1]) for i in range(rows)]))   # a row's bits are its own
    finally:
        torch.set_num_threads(old)


def test_a_group_of_experts_is_each_expert_alone_and_windows_change_no_bit(int4, monkeypatch):
    lins = [_linear(96, 256, e, int4)[0] for e in range(3)]
    counts = [3, 0, 6]
    x = _w(sum(counts), 256, 7, 1.0)
    ptrs = [m.packed.data_ptr() for m in lins], [m.scales.data_ptr() for m in lins]
    y = int4.int4(*ptrs, counts, x, 96, 256)
    assert torch.equal(y, torch.cat([lins[0](x[:3]), lins[2](x[3:])]))
    monkeypatch.setattr(host_gemv, "int8_window", lambda cols: 4)   # a long prompt's windows of rows
    assert torch.equal(int4.int4(*ptrs, counts, x, 96, 256), y)


@pytest.mark.parametrize("inter,hidden,counts", [(256, 384, [2, 0, 5]), (768, 1024, [1] * 8)])
def test_fused_int4_swiglu_equals_two_int4_calls_and_torchs_gate(int4, inter, hidden, counts):
    if not int4.swiglu_takes("int4", inter, hidden):
        pytest.skip("no fused gate here (torch's vector exp is not the kernel's)")
    ups = [_linear(2 * inter, hidden, e, int4)[0] for e in range(len(counts))]
    downs = [_linear(hidden, inter, 50 + e, int4)[0] for e in range(len(counts))]
    x = _w(sum(counts), hidden, 99, 3.0)
    ptr = lambda ms, a: [getattr(m, a).data_ptr() for m in ms]      # noqa: E731
    y = int4.swiglu_int4(ptr(ups, "packed"), ptr(ups, "scales"), ptr(downs, "packed"), ptr(downs, "scales"), counts, x,
                         inter, hidden)
    g, u = int4.int4(ptr(ups, "packed"), ptr(ups, "scales"), counts, x, 2 * inter, hidden).chunk(2, -1)
    assert torch.equal(y, int4.int4(ptr(downs, "packed"), ptr(downs, "scales"), counts, F.silu(g) * u, hidden, inter))


def test_widths_it_does_not_take_are_refused_or_left_to_torchs_kernel(int4):
    assert int4.int4_takes(128) and not int4.int4_takes(96) and not int4.int4_takes(128, group=64)
    assert not int4.int4_takes(host_gemv.INT4_MAX_COLS + 128) and not int4.swiglu_takes("int4", 96, 128)
    with pytest.raises(ValueError, match="no int4 kernel here for an inner dimension of 96"):
        int4.int4([0], [0], [1], _w(1, 96, 0), 8, 96)
    lin, _ = _linear(8, 128, 0, int4)
    with pytest.raises(ValueError, match="sum to 2, x has 3 rows"):
        int4.int4([lin.packed.data_ptr()], [lin.scales.data_ptr()], [2], _w(3, 128, 1), 8, 128)
    # the host format: kinject's kernel where it takes the width, torch's int4 kernel elsewhere
    assert isinstance(hk.linear_for(_w(16, 256, 1), "int4", compute_dtype=torch.bfloat16, gemv=int4), hk.Int4GemvLinear)
    assert isinstance(hk.linear_for(_w(16, 96, 1), "int4", compute_dtype=torch.bfloat16, gemv=int4), hk.Int4Linear)
    assert isinstance(hk.linear_for(_w(16, 256, 1), "int4", compute_dtype=torch.bfloat16), hk.Int4Linear)
