"""The AVX512-BF16 kernels (no AMX: AMD Zen 4 and 5, Intel Cooper Lake; kinject/engine/host_gemv.c, "bfloat16
and int8 on AVX512-BF16").

torch's bfloat16 GEMV and GEMM there are oneDNN's VDPBF16PS kernels, whose order (one float32 accumulator
per output, column pairs in order, blocks of 512 or 1024 columns) the kernel follows. Random weights of one
scale rarely tell orders apart (an ulp in 10^4 outputs), so these inputs are built to cancel: each row holds
large terms of both signs among small ones, the small ones' low bits lost or kept by where the large ones
sit in the sum, so any other order, block size or pair order changes about half of the outputs (measured
when the order was found). INT8 weights: with AVX512-VNNI their sums are exact (tests/engine/test_host_int8_exact.py);
without it, and for rows holding a NaN, they are widened to bfloat16 and summed in the bf16 order: with unit
scales their outputs are then ``F.linear`` on the widened weights, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from test_host_gemv import _threads


@pytest.fixture
def dp(gemv):
    if not gemv.dp:
        pytest.skip("no AVX512-BF16 kernel here (it needs AVX512-BF16 without AMX)")
    return gemv


def _cancelling(out: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, cols, generator=g) * 2 ** -10
    big = torch.tensor([64.0, -64.0, 80.0, -80.0, 96.0, -96.0, 112.0, -112.0])
    where = torch.stack([torch.randperm(cols, generator=g)[:8] for _ in range(out)])
    return w.scatter_(1, where, big.expand(out, 8)).to(torch.bfloat16)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("out,cols,rows", [(256, 256, 1), (256, 768, 3), (200, 1000, 1), (48, 1100, 2),
                                           (130, 2048, 1), (130, 2048, 5), (33, 77, 4), (64, 4100, 1)])
def test_bf16_has_torchs_bits_on_sums_built_to_cancel(dp, out, cols, rows, threads):
    w = _cancelling(out, cols, seed=out + cols)
    x = torch.ones(rows, cols, dtype=torch.bfloat16)
    x[-1] = torch.randn(cols, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    y = _threads(threads, lambda: dp.bf16([w], [rows], x, out, cols, exact=True))
    ref = _threads(threads, lambda: F.linear(x, w))
    assert torch.equal(y, ref)      # (F.linear's: torch.mv itself parts from it on such inputs at some sizes)


def test_bf16_group_of_experts_with_uneven_rows_has_torchs_bits(dp):
    ws = [_cancelling(96, 1024, seed=s) for s in range(4)]
    counts = [1, 0, 3, 2]
    x = torch.randn(sum(counts), 1024, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    y = dp.bf16(ws, counts, x, 96, 1024, exact=True)
    start = 0
    for w, n in zip(ws, counts):
        assert torch.equal(y[start:start + n], F.linear(x[start:start + n], w))
        start += n


@pytest.mark.parametrize("out,cols,rows", [(256, 1024, 1), (96, 768, 3), (40, 2048, 2), (17, 100, 5)])
def test_int8_sums_in_the_bf16_order_then_scales(dp, out, cols, rows):
    if dp.int8_vnni_cols:
        pytest.skip("INT8 sums are exact here (AVX512-VNNI): test_host_int8_exact.py")
    g = torch.Generator().manual_seed(cols)
    q = torch.randint(-127, 128, (out, cols), generator=g, dtype=torch.int8)
    x = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
    unit = torch.ones(out, dtype=torch.bfloat16)
    y = dp.int8([q.data_ptr()], [unit.data_ptr()], [rows], x, out, cols)
    assert torch.equal(y, F.linear(x, q.to(torch.bfloat16)))
    s = (torch.rand(out, generator=g) * 0.01).to(torch.bfloat16)
    ys = dp.int8([q.data_ptr()], [s.data_ptr()], [rows], x, out, cols)
    acc = F.linear(x.double(), q.double())                      # the true sum; the kernel's float32 sum is close
    assert torch.allclose(ys.double(), (acc * s.double()).to(torch.bfloat16).double(), rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("march", ["x86-64", "haswell", "skylake-avx512", "icelake-server", "cooperlake",
                                   "sapphirerapids"])
def test_the_kernel_builds_and_links_for_each_x86_target(gemv, march, tmp_path):
    """Each ISA's sections stand alone: a build for a CPU without AVX512-BF16, VNNI or AMX names no
    function another section defines (such a library would fail to load there, and the host experts
    with it). Built here for each target and loaded (every symbol resolved at load; nothing run)."""
    import ctypes
    import platform
    import shutil
    import subprocess

    from kinject.engine import host_gemv

    cc = shutil.which("cc")
    if platform.machine() != "x86_64" or cc is None:
        pytest.skip("needs an x86-64 compiler")
    out = tmp_path / f"host_gemv_{march}.so"
    flags = [f if f != "-march=native" else f"-march={march}" for f in host_gemv.FLAGS]
    done = subprocess.run([cc, *flags, "-Werror=implicit-function-declaration", str(host_gemv.SOURCE), "-o",
                           str(out)], capture_output=True, text=True)
    if "bad value" in done.stderr:
        pytest.skip(f"this compiler does not know -march={march}")
    assert done.returncode == 0, done.stderr
    lib = ctypes.CDLL(str(out))
    assert lib.kinject_host_gemv_abi() == host_gemv.ABI
