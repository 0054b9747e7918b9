"""kinject's compiled grouped GEMV: every routed host expert of a layer step in one call (docs/architecture.md,
"Host compute").

Why a kernel of our own: at batch 1 a host expert is two matrix-vector products over weights read
once, so the step's bound is the experts' bytes over the memory bandwidth. torch's ``mv`` reaches
that bound on a large matrix (26 GB/s on 2 cores here) but not on one expert's 1.5-3 MB: each call
opens its own parallel region and ramps the prefetchers again, and the 16 products of a layer step
reach 15-18 GB/s. ``host_gemv.c`` computes all of a step's experts of one projection in one parallel
region, reading each weight row once for all of its expert's rows, the next rows prefetched
(22-25 GB/s at the bench's shape).

bfloat16 with torch's bits: on a CPU with AMX torch's GEMM is oneDNN's AMX brgemm, TDPBF16PS over
the inner dimension in blocks of 32, in order, into one float32 accumulator per output; the kernel
runs the same instructions in the same order (checked against ``torch.mv`` when it loads), so the
default ``pipeline.host_gemv: exact`` computes bfloat16 host experts and a CPU model's one-row
linears with it, and INT8 host experts: ``(x @ q.T) * s`` with the sum exact where AMX-INT8 computes
it (the float32 closest to the true sum: each activation row written as a few signed bytes, so the
weights go from memory to the tiles with no conversion) and on AVX512-VNNI (the same arithmetic, the row
as unsigned bytes offset from zero, VPDPBUSD), else summed in float32 as ``_weight_int8pack_mm`` does, in
the kernel's own order.
Without AMX but with AVX512-BF16 (AMD Zen 4 and 5) torch's GEMM is oneDNN's VDPBF16PS kernel: one float32
accumulator per output, column pairs in order, in blocks of 512 or 1024 columns (found on inputs built to
cancel); the kernel runs that instruction in that order, the weights transposed 16 rows at a time in
registers, and the same check finds torch's bits (INT8 weights there: the exact sums of AVX512-VNNI; widened
to bfloat16 and summed in that order for a row holding a NaN). Elsewhere its bfloat16 path sums in torch's own
vectorized order: where torch computes in it too (an AVX2 CPU, where oneDNN has no bfloat16 GEMM) the same
check at load finds torch's bits and ``exact`` uses it; where torch computes with oneDNN's emulated bfloat16
(AVX-512 without BF16 or AMX) about 1 output in 10^4 rounds to the neighbouring bfloat16 value, enough for
greedy tokens to part from transformers' on a long generation, so it is used there only with ``host_gemv:
fast``.
``host_gemv: torch`` leaves every product to torch.

The C file ships with kinject and is compiled on first use for the machine it runs on (``cc -O3
-march=native -fopenmp``) into ``$KINJECT_CACHE/kernels`` (default ``~/.cache/kinject/kernels``),
keyed by the source, the compiler and the CPU, then loaded with :mod:`ctypes` (no torch headers: it
builds in a second and does not depend on torch's version). Where no compiler works
:func:`load` returns None and says why (:func:`unavailable_reason`); the
host experts then compute with torch's kernels (:mod:`kinject.engine.host_kernels`), as before.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from kinject.engine.host_kernels import MM_ROWS
from kinject.engine.rebind import is_rebound, plain_forward, rebound_forward
from kinject.paths import cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("host_gemv.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
ABI = 20
ORDERS = {"DEFAULT": 0, "AVX2": 1, "AVX512": 2}   # torch's CPU capability -> the kernel's vector width
MODES = ("exact", "fast", "torch")            # pipeline.host_gemv
# a linear's weights from which the one-row GEMV pays for its call (ctypes, checks: ~10 us against
# F.linear's ~4): 256 x 1024, half a MiB of bfloat16, ~25 us of reads at memory speed
MIN_LINEAR_WEIGHTS = 1 << 18
# a router's F.linear (attach_linears rebinds it): measured inside a decode step, where torch's call
# of a 64 x 1024 weight takes ~120 us, not the ~30 us of a loop over it alone
MIN_FUNCTIONAL_WEIGHTS = 1 << 15
# rows of one call of a linear's exact GEMV (more: windows of this many, each row's sum independent of the
# others, so the same bits): bounds the float32 copy of the rows the kernel makes (1 MiB at 1024 columns)
ROW_WINDOW = 256
_Pointer1, _Count1 = ctypes.c_void_p * 1, ctypes.c_int64 * 1    # one weight's call (rows_checked)
# the int4 kernel's largest inner dimension (a row's float32 scales on its stack; host_gemv.c, INT4_MAX_COLS)
INT4_MAX_COLS = 16384
_BF16 = torch.bfloat16

_lock = threading.Lock()
_loaded: "HostGemv | None" = None
_why_not: str | None = None
_tried = False


def _cpu_identity() -> str:
    """What ``-march=native`` compiles for: the CPU model and its feature flags (Linux), else the platform."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()}:{platform.processor()}"
    keep = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(dict.fromkeys(keep))


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc)


class HostGemv:
    """The loaded kernel: :meth:`bf16` and :meth:`int8` compute ``y [sum(counts), rows_out]`` from
    each expert's weight and its ``counts[e]`` rows of ``x`` (in the experts' order)."""

    def __init__(self, lib: ctypes.CDLL, path: Path):
        self.path = path
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._bf16 = lib.kinject_grouped_gemv_bf16
        self._bf16.argtypes = [i64, p, p, i64, i64, p, p, ctypes.c_int, ctypes.c_int]
        self._bf16.restype = None
        self._bf16_amx = lib.kinject_grouped_gemv_bf16_amx
        self._bf16_amx.argtypes = [i64, p, p, i64, i64, p, p, ctypes.c_int]
        self._bf16_amx.restype = None
        self._int8 = lib.kinject_grouped_gemv_int8
        self._int8.argtypes = [i64, p, p, p, i64, i64, p, p, ctypes.c_int]
        self._int8.restype = None
        self._swiglu = lib.kinject_grouped_swiglu_bf16_amx
        self._swiglu.argtypes = [i64, p, p, p, i64, i64, p, i64, p, p, p, ctypes.c_int, p]   # x, its row stride
        self._swiglu.restype = None
        self._gate = lib.kinject_swiglu_bf16
        self._gate.argtypes = [i64, i64, p, p, p]
        self._gate.restype = None
        self._int8_amx = lib.kinject_grouped_gemv_int8_amx
        self._int8_amx.argtypes = [i64, p, p, p, i64, i64, p, p, ctypes.c_int]
        self._int8_amx.restype = None
        self._swiglu_int8 = lib.kinject_grouped_swiglu_int8_amx
        self._swiglu_int8.argtypes = [i64, p, p, p, p, p, i64, i64, p, i64, p, p, p, ctypes.c_int, p]
        self._swiglu_int8.restype = None
        self._gate_avx2 = lib.kinject_swiglu_bf16_avx2
        self._gate_avx2.argtypes = [i64, i64, p, p, p]
        self._gate_avx2.restype = None
        self._swiglu_avx2 = lib.kinject_grouped_swiglu_bf16_avx2
        self._swiglu_avx2.argtypes = self._swiglu.argtypes
        self._swiglu_avx2.restype = None
        self._swiglu_int8_avx2 = lib.kinject_grouped_swiglu_int8_avx2
        self._swiglu_int8_avx2.argtypes = self._swiglu_int8.argtypes
        self._swiglu_int8_avx2.restype = None
        self._int4 = lib.kinject_grouped_gemv_int4
        self._int4.argtypes = self._int8.argtypes
        self._int4.restype = None
        self._swiglu_int4 = lib.kinject_grouped_swiglu_int4
        self._swiglu_int4.argtypes = [*self._swiglu_int8.argtypes, ctypes.c_int]
        self._swiglu_int4.restype = None
        self._bf16_dp = lib.kinject_grouped_gemv_bf16_dp
        self._bf16_dp.argtypes = self._bf16_amx.argtypes
        self._bf16_dp.restype = None
        self._int8_dp = lib.kinject_grouped_gemv_int8_dp
        self._int8_dp.argtypes = self._int8.argtypes
        self._int8_dp.restype = None
        self._swiglu_dp = lib.kinject_grouped_swiglu_bf16_dp
        self._swiglu_dp.argtypes = self._swiglu.argtypes
        self._swiglu_dp.restype = None
        self._swiglu_int8_dp = lib.kinject_grouped_swiglu_int8_dp
        self._swiglu_int8_dp.argtypes = self._swiglu_int8.argtypes
        self._swiglu_int8_dp.restype = None
        # int4 weights in kinject's layout (host_kernels.pack_int4) computed here: a vector build (AVX2 or AVX-512)
        self.int4_layout = int(lib.kinject_host_gemv_int4())     # the int4 layout it reads (host_kernels.pack_int4)
        self.int4_vectorized = self.int4_layout > 0
        capability = torch.backends.cpu.get_cpu_capability()
        self.order = ORDERS.get(capability, 0)
        # bfloat16 (host_gemv: fast) only where this build vectorizes at torch's CPU capability
        self.vectorized = self.order > 0 and bool(lib.kinject_host_gemv_orders() >> self.order & 1)
        # bfloat16 with torch's bits, confirmed on random rows here: on AMX the order oneDNN's brgemm uses;
        # elsewhere the vectorized order of torch's own GEMV and GEMM (what torch runs where oneDNN has no
        # bfloat16 kernel: an AVX2 CPU; where it has one, the check finds other bits and torch computes)
        self.amx = bool(lib.kinject_host_gemv_amx())             # this process may use AMX
        # without AMX, AVX512-BF16 (Zen 4 and 5): oneDNN's VDPBF16PS order (host_gemv.c), for bfloat16 and INT8
        self.dp = not self.amx and bool(lib.kinject_host_gemv_dp())
        self.exact_bf16 = self.amx or self.dp or self.vectorized  # (the check below computes with it)
        self.exact_bf16 = self.exact_bf16 and self._same_bits_as_torch()
        # rows of one linear below which its exact GEMV beats torch's GEMM: on AMX oneDNN's GEMM wins from
        # MM_ROWS on; torch's own order (AVX2, where torch's bfloat16 GEMM is MKL's at ~10 GMAC/s on a Zen 3
        # core pair) lost at every count measured, 8 to 2048 rows (2-3.5x the kernel's time), so no bound
        self.exact_rows = MM_ROWS if self.amx or self.dp else 1 << 62
        # INT8 weights widened to bfloat16 tiles on AMX (the same float32 arithmetic, at memory speed)
        self.int8_amx = self.amx and bool(lib.kinject_host_gemv_int8_amx())
        # ... and on AMX-INT8 with exact sums where the inner dimension is a multiple of 64 (:meth:`int8`)
        # (or on AVX512-VNNI, any inner dimension up to the kernel's bound)
        self.int8_vnni_cols = int(lib.kinject_host_gemv_int8_vnni()) if self.dp else 0
        self.int8_exact = self.int8_amx and bool(lib.kinject_host_gemv_int8_exact()) or self.int8_vnni_cols > 0
        # both projections and transformers' default gate between them in one call (:meth:`swiglu`):
        # with torch's own vector exp (AMX and AVX512-BF16: its AVX-512 one; torch's own order: its AVX2 one),
        # where the gate then has torch's bits here
        self.wide_gate = (self.amx or self.dp) and capability == "AVX512"
        self.vector_exp = _torch_exp("Sleef_expf16_u10") if self.wide_gate else \
            _torch_exp("Sleef_expf8_u10") if not self.amx and not self.dp and self.exact_bf16 \
            and capability == "AVX2" else None
        self._gate = self._gate if self.wide_gate else self._gate_avx2
        self.fused_gate = self.vector_exp is not None and self._gate_same_as_torch()
        # a decode step's weighted sum of its experts' outputs (:meth:`weighted_rows`), where its bits are torch's
        self._weighted = lib.kinject_weighted_rows_bf16
        self._weighted.argtypes = [i64, i64, p, p, p, p]
        self._weighted.restype = None
        self.weighted_exact = self._weighted_same_as_torch()
        # a decode step's experts and their weighted sum in one call (:meth:`one_token_experts`)
        self._one_token = lib.kinject_one_token_swiglu
        self._one_token.argtypes = [ctypes.c_int, p, i64, i64, p, p, p, p, p, p, i64, i64, p, p, ctypes.c_int, p,
                                    ctypes.c_int]
        self._one_token.restype = ctypes.c_int
        # a decode step's top-k router in one call (:meth:`route_topk`; kinject/engine/decode_router.py)
        self._route = lib.kinject_route_topk_bf16
        self._route.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, p, p, i64, i64, i64, ctypes.c_int,
                                ctypes.c_int, p, p, p, p]
        self._route.restype = ctypes.c_int
        # RMSNorm of a few rows (kinject/engine/host_norm.py): the float32 sum in torch's order needs
        # the vector width torch's sum kernel uses here (found, not assumed; None: norms stay with torch)
        self._row_sum = lib.kinject_row_sum_f32
        self._row_sum.argtypes = [i64, p, ctypes.c_int]
        self._row_sum.restype = ctypes.c_float
        self._rms_norm = lib.kinject_rms_norm_bf16
        self._rms_norm.argtypes = [i64, i64, p, p, p, ctypes.c_float, ctypes.c_int, ctypes.c_int]
        self._rms_norm.restype = None
        self.sum_lanes = self._torch_sum_lanes()
        self._rotary = lib.kinject_rotary_bf16
        self._rotary.argtypes = [i64, i64, i64, i64, i64, p, p, p, p, p, p]
        self._rotary.restype = None
        self._attend = lib.kinject_attend_bf16
        self._attend.argtypes = [i64] * 5 + [p, i64, i64, p, i64, i64, i64, p, i64, i64, i64, p, ctypes.c_float,
                                               ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self._attend.restype = ctypes.c_int
        self._attention_inputs = lib.kinject_attention_inputs_bf16
        self._attention_inputs.argtypes = [i64, i64, p, p, i64, p, p, i64, ctypes.c_int, ctypes.c_int, ctypes.c_int, i64,
                                           p, p, ctypes.c_float, ctypes.c_int, ctypes.c_int, p, p, p, p, p, p, p]
        self._attention_inputs.restype = None
        self.attend_pairs = bool(lib.kinject_attend_pairs())   # long blocks' p @ v in VDPBF16PS pairs (AVX512-BF16)

    def bf16_exact_for(self, cols: int) -> bool:
        """Whether :meth:`bf16` gives torch's bits for an inner dimension of ``cols`` (AMX: whole
        blocks of 32; AVX512-BF16 and torch's own order: any)."""
        return self.exact_bf16 and (cols % 32 == 0 or not self.amx)

    def _same_bits_as_torch(self) -> bool:
        gen = torch.Generator().manual_seed(0)
        shapes = [(1536, 1024, 0.05, 3), (100, 768, 1.0, 1), (37, 2048, 0.02, 17)]
        if not self.amx:                                  # torch's order has tails: inner sizes of every residue
            shapes += [(64, 1000, 0.05, 2), (33, 77, 1.0, 5), (16, 4100, 0.01, 1)]
        for rows, cols, scale, m in shapes:
            w = (torch.randn(rows, cols, generator=gen) * scale).to(torch.bfloat16)
            x = torch.randn(m, cols, generator=gen).to(torch.bfloat16)
            y = self.bf16([w], [m], x, rows, cols, exact=True)
            if not (torch.equal(y, torch.nn.functional.linear(x, w)) and torch.equal(y[0], torch.mv(w, x[0]))):
                logger.info("host compute: the GEMV's bits differ from torch's here; bfloat16 stays with torch")
                return False
        return True

    def _gate_same_as_torch(self) -> bool:
        """Whether the C gate gives ``F.silu(g) * u``'s bits (bfloat16) on values from the far tails of
        the exponential to zero and subnormals."""
        gen = torch.Generator().manual_seed(0)
        inter = 512
        gu = torch.cat([torch.randn(64, 2 * inter, generator=gen) * s for s in (0.01, 1.0, 8.0, 40.0)])
        gu[0, :inter] = torch.linspace(-110.0, 110.0, inter)
        gu[1, :8] = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 88.7, -88.7, 103.0, -103.0])
        gu = gu.to(torch.bfloat16)
        h = torch.empty((gu.shape[0], inter), dtype=torch.bfloat16)
        self._gate(gu.shape[0], inter, gu.data_ptr(), h.data_ptr(), self.vector_exp)
        gate, up = gu.chunk(2, dim=-1)
        if not torch.equal(h, torch.nn.functional.silu(gate) * up):
            logger.info("host compute: the fused gate's bits differ from torch's here; the gate stays with torch")
            return False
        return True

    @staticmethod
    def _torch_weighted_rows(y: torch.Tensor, rows: Sequence[int], w: torch.Tensor) -> torch.Tensor:
        """What :meth:`weighted_rows` computes, as torch's operations."""
        k = len(rows)
        return (y.index_select(0, torch.tensor(rows)) * w.reshape(k, 1)).view(1, k, y.shape[1]).sum(dim=1)

    def _weighted_same_as_torch(self) -> bool:
        """Whether :meth:`weighted_rows` gives torch's bits here: zeros of both signs, ties, NaN, k of 1 to 10."""
        gen = torch.Generator().manual_seed(0)
        for k, cols in ((8, 1024), (1, 40), (10, 300), (2, 16)):
            y = (torch.randn(k + 2, cols, generator=gen) * torch.rand(k + 2, 1, generator=gen) * 30).to(torch.bfloat16)
            y[0, :4] = torch.tensor([0.0, -0.0, float("nan"), 1e-40])
            w = torch.rand(k, generator=gen).to(torch.bfloat16)
            w[0] = -0.0
            rows = torch.randperm(k + 2, generator=gen)[:k].tolist()
            if not torch.equal(self.weighted_rows(y, rows, w).view(torch.int16),
                               self._torch_weighted_rows(y, rows, w).view(torch.int16)):
                logger.info("host compute: the weighted sum's bits differ from torch's here; it stays with torch")
                return False
        return True

    def weighted_rows(self, y: torch.Tensor, rows: Sequence[int], w: torch.Tensor,
                      shape: Sequence[int] | None = None) -> torch.Tensor:
        """``(y.index_select(0, rows) * w.view(k, 1)).view(1, k, cols).sum(1)`` for bfloat16 CPU ``y [n,
        cols]`` and ``w`` (k weights), as one call with torch's bits (:attr:`weighted_exact`): a decode
        step's experts' outputs weighted and summed in slot order (``operators/expert_interception.py``),
        where four torch operations right after the experts' weights streamed through the caches cost
        tens of microseconds each. ``shape``: the result's (``cols`` values; default ``[1, cols]``),
        made so rather than viewed after."""
        k = len(rows)
        if (y.dtype != _BF16 or w.dtype != _BF16 or y.dim() != 2 or not y.is_cpu or w.numel() != k
                or not y.is_contiguous() or not w.is_contiguous() or not k or min(rows) < 0 or max(rows) >= y.shape[0]):
            raise ValueError(f"weighted rows: needs bfloat16 CPU rows [n, cols] and k weights for k row numbers < n, "
                             f"got {y.dtype} {list(y.shape)} on {y.device}, weights {w.dtype} {list(w.shape)}, "
                             f"rows {list(rows)}")
        out = torch.empty(shape if shape is not None else (1, y.shape[1]), dtype=_BF16)
        if out.numel() != y.shape[1]:
            raise ValueError(f"weighted rows: a result of shape {list(out.shape)} does not hold {y.shape[1]} values")
        self._weighted(k, y.shape[1], y.data_ptr(), (ctypes.c_int64 * k)(*rows), w.data_ptr(), out.data_ptr())
        return out

    def one_token_table(self, kind: str, ups: Sequence[tuple], downs: Sequence[tuple], inter: int,
                        hidden: int) -> "OneTokenTable | None":
        """The table :meth:`one_token_experts` reads a layer's experts from: every expert's fused-SwiGLU
        pointers (``ups`` / ``downs``: each expert's projection descriptor,
        :func:`~kinject.engine.host_kernels.gemv_key`, whose tensors it keeps alive), the kernel
        :meth:`swiglu_bf16` / :meth:`swiglu_int8` / :meth:`swiglu_int4` would call and its arguments'
        shape. None where that fused call or the weighted sum would not take them (:meth:`swiglu_takes`,
        :attr:`weighted_exact`)."""
        if not ups or len(ups) != len(downs) or not self.weighted_exact or not self.swiglu_takes(kind, inter, hidden):
            return None
        if kind == "bf16":
            fn, sig = self._swiglu if self.amx else self._swiglu_dp if self.dp else self._swiglu_avx2, 0
        elif kind == "int8":
            fn = self._swiglu_int8 if self.amx else self._swiglu_int8_dp if self.dp else self._swiglu_int8_avx2
            sig = 1
        else:
            fn, sig = self._swiglu_int4, 2
        n = len(ups)
        table = OneTokenTable(sig, ctypes.cast(fn, ctypes.c_void_p).value, n, inter, hidden,
                              int8_window(max(inter, hidden)) if kind != "bf16" else ONE_TOKEN_MAX_K,
                              (ctypes.c_void_p * n)(*[u[3] for u in ups]),
                              (ctypes.c_void_p * n)(*[d[3] for d in downs]),
                              None if sig == 0 else (ctypes.c_void_p * n)(*[u[4] for u in ups]),
                              None if sig == 0 else (ctypes.c_void_p * n)(*[d[4] for d in downs]),
                              (tuple(ups), tuple(downs)))
        return table

    def one_token_experts(self, table: "OneTokenTable", ids: torch.Tensor, weights: torch.Tensor,
                          x: torch.Tensor) -> torch.Tensor | None:
        """One token's routed experts and their weighted sum, ``sum_s weights[s] * expert_{ids[s]}(x)`` in
        slot order, in one call: :meth:`swiglu_bf16` (or its int8 / int4 kernel) on the experts sorted
        ascending, then :meth:`weighted_rows`, bit for bit those two calls (``kinject_one_token_swiglu``).
        ``ids``: the router's ``k`` choices (int64), ``weights``: theirs (bfloat16), ``x``: the token
        (bfloat16, ``hidden`` values), all contiguous CPU tensors; the result has ``x``'s shape. None
        where it does not take them (another dtype or layout, more than the table's window of experts,
        an id out of range or repeated: nothing is computed then)."""
        k = ids.numel()
        if (ids.dtype is not torch.int64 or weights.dtype is not _BF16 or x.dtype is not _BF16 or not ids.is_cpu
                or not weights.is_cpu or not x.is_cpu or weights.numel() != k or x.numel() != table.hidden
                or k > table.window or not ids.is_contiguous() or not weights.is_contiguous()
                or not x.is_contiguous()):
            return None
        out = torch.empty(x.shape, dtype=_BF16)
        rc = self._one_token(table.sig, table.fn, k, table.experts, ids.data_ptr(), weights.data_ptr(), table.up,
                             table.up_scale, table.down, table.down_scale, table.inter, table.hidden, x.data_ptr(),
                             out.data_ptr(), torch.get_num_threads(), self.vector_exp, int(self.wide_gate))
        return out if rc == 0 else None

    def route_topk(self, x: torch.Tensor, w: torch.Tensor, k: int, norm: bool,
                   exact: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """transformers' top-k router of one token in one call: ``logits = F.linear(x, w)`` (``x``: one
        bfloat16 row, ``w``: ``[experts, cols]``; through :meth:`rows_checked`'s GEMV, ``exact`` as there),
        ``softmax(logits, dtype=float)``, its ``topk(k)``, divided by their sum where ``norm``, to bfloat16:
        ``(logits [1, experts], scores [1, k], indices [1, k])`` with torch's bits. Only where
        :attr:`route_exact` (checked against torch's operations at load) and for contiguous CPU tensors,
        checked by the caller (:class:`~kinject.engine.decode_router.DecodeRouter`). None where torch's
        ``topk`` could order the choices otherwise (ties among them, or with the first left out) or a logit
        is NaN: the caller then runs the router's own forward."""
        experts, cols = w.shape
        logits = torch.empty((1, experts), dtype=_BF16)
        scores = torch.empty((1, k), dtype=_BF16)
        indices = torch.empty((1, k), dtype=torch.int64)
        kernel = (1 if self.amx else 2 if self.dp else 0) if exact else 0
        rc = self._route(kernel, self.order, torch.get_num_threads(), x.data_ptr(), w.data_ptr(), experts, cols, k,
                         int(norm), self.sum_lanes or 0, self.vector_exp, logits.data_ptr(), scores.data_ptr(),
                         indices.data_ptr())
        return (logits, scores, indices) if rc == 0 else None

    @functools.cached_property
    def route_exact(self) -> bool:
        """Whether :meth:`route_topk`'s softmax, selection and normalisation give torch's bits here (tried once,
        on random logits of several expert counts and k, against torch's own operations on the same logits):
        it needs torch's AVX-512 exp and its sum's vector width."""
        if not self.wide_gate or self.vector_exp is None or self.sum_lanes is None:
            return False
        gen = torch.Generator().manual_seed(0)
        for experts, k, cols in ((64, 8, 256), (128, 8, 128), (60, 4, 64), (8, 2, 64), (256, 8, 64), (7, 1, 32),
                                 (128, 1, 64), (512, 8, 64), (15, 4, 64), (12, 3, 32)):
            for trial in range(12):
                x = (torch.randn(1, cols, generator=gen) * 4).to(_BF16)
                w = (torch.randn(experts, cols, generator=gen) * (0.02 + trial % 4)).to(_BF16)
                if trial >= 4:                  # equal rows, so equal logits: ties in and around the top k
                    w = w[torch.randint(0, max(2, experts // (trial - 2)), (experts,), generator=gen)].contiguous()
                for norm in (True, False):
                    got = self.route_topk(x, w, k, norm, exact=False)
                    if got is None:
                        continue
                    logits, scores, indices = got
                    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
                    value, index = torch.topk(probs, k, dim=-1)
                    if norm:
                        value /= value.sum(dim=-1, keepdim=True)
                    if not torch.equal(index, indices) or not torch.equal(value.to(_BF16).view(torch.int16),
                                                                          scores.view(torch.int16)):
                        logger.info("host compute: the router's softmax / top-k bits differ from torch's here; "
                                    "routers stay with torch")
                        return False
        return True

    def _torch_sum_lanes(self) -> int | None:
        """The vector width (floats) with which torch's float32 sum of a contiguous row adds in its
        order here, tried on random rows of many lengths: None where no width gives torch's sums."""
        g = torch.Generator().manual_seed(0)
        rows = [torch.randn(n, generator=g).pow(2) * 10.0 ** (n % 7 - 3)
                for n in (8, 17, 64, 96, 128, 200, 576, 1024, 2880, 4100, 7168)]
        sums = [float(v.sum()) for v in rows]
        for lanes in (8, 16):
            if all(self._row_sum(v.numel(), v.data_ptr(), lanes) == s for v, s in zip(rows, sums)):
                return lanes
        logger.info("host compute: no vector width gives torch's float32 sums here; RMSNorms stay with torch")
        return None

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, variant: int) -> torch.Tensor:
        """transformers' RMSNorm of the rows of ``x`` (contiguous bfloat16 CPU ``[..., n]``, ``n <= 16384``;
        ``weight`` bfloat16 ``[n]``; ``variant`` 0: Llama's, ``weight * x_normed.to(bf16)``, 1: the weight
        multiplied in float32, ``(weight * x_normed).to(bf16)``) with torch's bits, checked by the caller
        (:mod:`kinject.engine.host_norm`); only where :attr:`sum_lanes` is known."""
        n = x.shape[-1]
        if self.sum_lanes is None or x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 \
                or not x.is_contiguous() or not weight.is_contiguous() or weight.numel() != n or n > 16384 \
                or x.device.type != "cpu" or weight.device.type != "cpu" or variant not in (0, 1):
            raise ValueError(f"no RMSNorm kernel for {x.dtype} {list(x.shape)} with a {weight.dtype} "
                             f"{list(weight.shape)} weight (variant {variant})")
        return self.rms_norm_checked(x, weight, eps, variant)

    def rms_norm_checked(self, x: torch.Tensor, weight: torch.Tensor, eps: float, variant: int) -> torch.Tensor:
        """:meth:`rms_norm` with its checks made by the caller (:class:`~kinject.engine.host_norm.OneRowNorm`)."""
        n = x.shape[-1]
        y = torch.empty_like(x)
        self._rms_norm(x.numel() // n if n else 0, n, x.data_ptr(), weight.data_ptr(), y.data_ptr(), eps,
                       self.sum_lanes, variant)
        return y

    def rotary(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q * cos + rotate_half(q) * sin, the same of k)`` for ``q`` ``[b, hq, s, d]``, ``k`` ``[b, hk, s, d]``
        and ``cos``, ``sin`` ``[b, s, d]``, all contiguous bfloat16 CPU tensors, ``d`` even (checked by the
        caller, :class:`~kinject.engine.host_rotary.NativeRotary`), with torch's bits."""
        b, hq, s, d = q.shape
        out_q = torch.empty((b, hq, s, d), dtype=torch.bfloat16)
        out_k = torch.empty((b, k.shape[1], s, d), dtype=torch.bfloat16)
        self._rotary(b, hq, k.shape[1], s, d, q.data_ptr(), k.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                     out_q.data_ptr(), out_k.data_ptr())
        return out_q, out_k

    def attention_inputs(self, x: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, heads: int,
                         kv_heads: int, head_dim: int, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                         eps: float, variant: int, cos: torch.Tensor, sin: torch.Tensor,
                         exact: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A decode step's query, key and value ``[b, heads or kv_heads, 1, head_dim]`` from ``x`` (``b``
        rows of one token): the projections through :meth:`rows_checked`'s GEMV (``exact`` as there), the
        per-head RMSNorms of :meth:`rms_norm` where ``q_norm`` / ``k_norm`` are given (their ``eps`` and
        ``variant``), and :meth:`rotary` with ``cos`` / ``sin`` ``[b, 1, head_dim]``: the same functions in
        the same order as those calls one by one, in one call. Every tensor contiguous bfloat16 on the CPU,
        the weights ``[heads * head_dim, cols]`` and ``[kv_heads * head_dim, cols]``, at most
        :data:`ROW_WINDOW` rows, the norms only where :attr:`sum_lanes`: checked by the caller
        (:class:`~kinject.engine.decode_attention.DecodeAttention`)."""
        b, cols = x.shape[0], x.shape[-1]
        nq, nk = heads * head_dim, kv_heads * head_dim
        q_raw = torch.empty((b, nq + nk), dtype=_BF16)
        q = torch.empty((b, heads, 1, head_dim), dtype=_BF16)
        k = torch.empty((b, kv_heads, 1, head_dim), dtype=_BF16)
        v = torch.empty((b, kv_heads, 1, head_dim), dtype=_BF16)
        kernel = (1 if self.amx else 2 if self.dp else 0) if exact else 0
        raw = q_raw.data_ptr()
        self._attention_inputs(b, cols, x.data_ptr(), wq.data_ptr(), nq, wk.data_ptr(), wv.data_ptr(), nk, kernel,
                               self.order, torch.get_num_threads(), head_dim,
                               None if q_norm is None else q_norm.data_ptr(),
                               None if k_norm is None else k_norm.data_ptr(), eps, self.sum_lanes or 0, variant,
                               cos.data_ptr(), sin.data_ptr(), raw, raw + 2 * b * nq, q.data_ptr(), k.data_ptr(),
                               v.data_ptr())
        return q, k, v

    def attend_takes(self, keys: int, head_dim: int) -> bool:
        """Whether :meth:`attend` computes a query row against ``keys`` cached rows of ``head_dim``
        (any number of keys, head sizes up to 512)."""
        return 0 < head_dim <= 512 and keys >= 1

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of one query position: ``q`` ``[b, h, 1, d]``, ``k`` / ``v`` ``[b, hk, n, d]`` bfloat16
        CPU tensors whose last dimension is contiguous, ``h`` a multiple of ``hk`` (head ``i`` reads
        key/value head ``i // (h // hk)``), no mask; ``[b, 1, h, d]`` out, as transformers' attention
        functions return it. torch's flash-kernel arithmetic, its products' float32 orders approximated:
        all but about one output in 10^3-10^4 with its bits (those a bfloat16 ulp off; ``host_gemv: fast``
        only); checked by the caller
        (:class:`~kinject.engine.host_sdpa.HostSdpa`) with :meth:`attend_takes`."""
        b, h, _, d = q.shape
        hk, n = k.shape[1], k.shape[2]
        out = torch.empty((b, 1, h, d), dtype=_BF16)
        lanes = 16 if self.order == 2 else 8
        rc = self._attend(b, h, hk, n, d, q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0),
                          k.stride(1), k.stride(2), v.data_ptr(), v.stride(0), v.stride(1), v.stride(2),
                          out.data_ptr(), scale, lanes, int(self.order > 0), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"host attention does not take q {list(q.shape)}, k {list(k.shape)}")
        return out

    def swiglu_takes(self, kind: str, inter: int, hidden: int) -> bool:
        """Whether :meth:`swiglu` (``kind`` ``"bf16"``), :meth:`swiglu_int8` (``"int8"``) or
        :meth:`swiglu_int4` (``"int4"``) computes experts of width ``inter`` on a hidden size ``hidden``."""
        if kind == "int4":
            return self.fused_gate and self.int4_takes(hidden) and self.int4_takes(inter)
        kernel = self.exact_bf16 if kind == "bf16" else (self.int8_amx or not self.amx) if kind == "int8" else False
        return kernel and self.fused_gate and inter % 32 == 0 and hidden % 32 == 0

    def int4_takes(self, cols: int, group: int = 32) -> bool:
        """Whether :meth:`int4` computes a weight of ``cols`` inputs in groups of ``group`` (kinject's int4
        layout: blocks of 128 codes, groups of 32; a vector build)."""
        return self.int4_vectorized and group == 32 and 0 < cols <= INT4_MAX_COLS and cols % 128 == 0

    def swiglu(self, ups: Sequence[torch.Tensor], downs: Sequence[torch.Tensor], counts: Sequence[int],
               x: torch.Tensor, inter: int, hidden: int) -> torch.Tensor:
        """A SwiGLU expert group whole, with torch's bits: ``down(F.silu(g) * u)``, ``g, u = (x @ up.T).chunk(2)``
        per expert (``ups``: contiguous bfloat16 ``[2 inter, hidden]``, ``downs``: ``[hidden, inter]``,
        checked by the caller, :func:`~kinject.engine.host_kernels.gemv_key`), one parallel region for
        both projections and the gate (only where :meth:`swiglu_takes`)."""
        return self.swiglu_bf16([w.data_ptr() for w in ups], [w.data_ptr() for w in downs], counts, x, inter, hidden)

    def swiglu_bf16(self, ups: Sequence[int], downs: Sequence[int], counts: Sequence[int], x: torch.Tensor,
                    inter: int, hidden: int) -> torch.Tensor:
        """:meth:`swiglu` on the weights' addresses (a decode step's caller holds them:
        :func:`~kinject.engine.host_kernels.gemv_key`)."""
        fn = self._swiglu if self.amx else self._swiglu_dp if self.dp else self._swiglu_avx2
        return self._fused("bf16", fn, (ups, downs), counts, x, inter, hidden)

    def swiglu_int8(self, ups: Sequence[int], up_scales: Sequence[int], downs: Sequence[int],
                    down_scales: Sequence[int], counts: Sequence[int], x: torch.Tensor, inter: int,
                    hidden: int) -> torch.Tensor:
        """:meth:`swiglu` for INT8 experts: pointers of their int8 ``[2 inter, hidden]`` / ``[hidden, inter]``
        values and bfloat16 per-row scales (as :meth:`int8`); each projection in :meth:`int8`'s arithmetic."""
        fn = self._swiglu_int8 if self.amx else self._swiglu_int8_dp if self.dp else self._swiglu_int8_avx2
        return self._fused("int8", fn, (ups, up_scales, downs, down_scales), counts, x, inter, hidden)

    def swiglu_int4(self, ups: Sequence[int], up_scales: Sequence[int], downs: Sequence[int],
                    down_scales: Sequence[int], counts: Sequence[int], x: torch.Tensor, inter: int,
                    hidden: int) -> torch.Tensor:
        """:meth:`swiglu` for int4 experts in kinject's layout: pointers of their packed ``[2 inter, hidden / 2]``
        / ``[hidden, inter / 2]`` codes and bfloat16 group scales (as :meth:`int4`)."""
        wide = int(self.wide_gate)               # the gate's exp: torch's AVX-512 one, else its AVX2 one
        return self._fused("int4", lambda *a: self._swiglu_int4(*a, wide),
                           (ups, up_scales, downs, down_scales), counts, x, inter, hidden)

    def _fused(self, kind: str, fn, pointers: tuple, counts: Sequence[int], x: torch.Tensor, inter: int,
               hidden: int) -> torch.Tensor:
        """One fused SwiGLU call: ``pointers`` the per-expert pointer lists ``fn`` takes before the counts.
        ``x`` may be one row broadcast to every row (``x.expand(n, hidden)``, a decode step's token for
        each of its experts): the kernel reads it with row stride 0 (no k-row copy is made here)."""
        if not self.swiglu_takes(kind, inter, hidden):
            raise ValueError(f"no fused {kind} SwiGLU here for width {inter} and hidden size {hidden}")
        x, stride = self._fused_rows(x, hidden, counts)
        window = int8_window(max(inter, hidden)) if kind in ("int8", "int4") else x.shape[0]
        if x.shape[0] > window:
            return torch.cat([self._fused(kind, fn, tuple([p[e] for e in experts] for p in pointers), rows, x[a:b],
                                          inter, hidden)
                              for experts, rows, a, b in row_windows(counts, window)])
        k, n = len(counts), x.shape[0]
        y = torch.empty((n, hidden), dtype=_BF16)
        fn(k, *[(ctypes.c_void_p * k)(*p) for p in pointers], (ctypes.c_int64 * k)(*counts), inter, hidden,
           x.data_ptr(), stride, None, None, y.data_ptr(), torch.get_num_threads(), self.vector_exp)
        return y

    @staticmethod
    def _fused_rows(x: torch.Tensor, cols: int, counts: Sequence[int]) -> tuple[torch.Tensor, int]:
        """:meth:`_rows` for the fused kernels, which also read one row broadcast to all (row stride 0):
        ``(rows, their stride)``."""
        broadcast = x.dim() == 2 and x.stride() == (0, 1) and x.dtype is _BF16 and x.is_cpu and x.shape[1] == cols
        return HostGemv._counted(x if broadcast else HostGemv._check(x, cols), counts), 0 if broadcast else cols

    @staticmethod
    def _rows(x: torch.Tensor, cols: int, counts: Sequence[int]) -> torch.Tensor:
        """``x`` checked as the kernels' rows: as many as ``counts`` sums (the kernels read and write
        that many, so a mismatch would reach past the tensors)."""
        return HostGemv._counted(HostGemv._check(x, cols), counts)

    @staticmethod
    def _counted(x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        if sum(counts) != x.shape[0]:
            raise ValueError(f"grouped GEMV: the experts' row counts sum to {sum(counts)}, x has {x.shape[0]} rows")
        return x

    @staticmethod
    def _check(x: torch.Tensor, cols: int) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != cols or x.device.type != "cpu":
            raise ValueError(f"grouped GEMV needs bfloat16 CPU rows [n, {cols}], got {x.dtype} {list(x.shape)} "
                             f"on {x.device}")
        return x.contiguous()

    def bf16(self, weights: Sequence[torch.Tensor], counts: Sequence[int], x: torch.Tensor, rows_out: int,
             cols: int, exact: bool) -> torch.Tensor:
        """``weights``: contiguous bfloat16 CPU ``[rows_out, cols]`` weights (checked and kept alive by
        the caller, :class:`~kinject.engine.host_kernels.DenseLinear`). ``exact``: torch's bits (AMX;
        only where :meth:`bf16_exact_for`), else the float32 order of the vectorized path (fast)."""
        x = self._rows(x, cols, counts)
        k = len(weights)
        y = torch.empty((x.shape[0], rows_out), dtype=torch.bfloat16)
        ptrs, n = (ctypes.c_void_p * k)(*[w.data_ptr() for w in weights]), (ctypes.c_int64 * k)(*counts)
        if exact:
            if not self.bf16_exact_for(cols):
                raise ValueError(f"no exact bfloat16 GEMV here for an inner dimension of {cols}")
        if exact and self.amx:
            self._bf16_amx(k, ptrs, n, rows_out, cols, x.data_ptr(), y.data_ptr(), torch.get_num_threads())
        elif exact and self.dp:
            self._bf16_dp(k, ptrs, n, rows_out, cols, x.data_ptr(), y.data_ptr(), torch.get_num_threads())
        else:
            self._bf16(k, ptrs, n, rows_out, cols, x.data_ptr(), y.data_ptr(), torch.get_num_threads(), self.order)
        return y

    def rows_checked(self, w: torch.Tensor, x: torch.Tensor, rows: int, out: int, cols: int,
                     exact: bool, shape: tuple | None = None) -> torch.Tensor:
        """:meth:`bf16` of one weight on ``rows`` rows, the checks already made by the caller
        (:func:`_one_row`: contiguous bfloat16 CPU ``x`` of ``rows * cols`` values and ``w [out, cols]``;
        ``exact`` only where :meth:`bf16_exact_for`); more than :data:`ROW_WINDOW` rows in windows of it.
        ``shape``: the output's shape (``rows * out`` values; default ``[rows, out]``), made as it is
        returned rather than viewed after (a decode step makes 41 of these)."""
        if rows > ROW_WINDOW:
            x = x.reshape(rows, cols)
            y = torch.cat([self.rows_checked(w, x[a:a + ROW_WINDOW], min(ROW_WINDOW, rows - a), out, cols, exact)
                           for a in range(0, rows, ROW_WINDOW)])
            return y if shape is None else y.view(shape)
        y = torch.empty(shape or (rows, out), dtype=_BF16)
        ptr, n = _Pointer1(w.data_ptr()), _Count1(rows)
        if exact and self.amx:
            self._bf16_amx(1, ptr, n, out, cols, x.data_ptr(), y.data_ptr(), torch.get_num_threads())
        elif exact and self.dp:
            self._bf16_dp(1, ptr, n, out, cols, x.data_ptr(), y.data_ptr(), torch.get_num_threads())
        else:
            self._bf16(1, ptr, n, out, cols, x.data_ptr(), y.data_ptr(), torch.get_num_threads(), self.order)
        return y

    def int8(self, weights: Sequence[int], scales: Sequence[int], counts: Sequence[int], x: torch.Tensor,
             rows_out: int, cols: int) -> torch.Tensor:
        """``weights``: pointers of contiguous int8 ``[rows_out, cols]`` values; ``scales``: of their
        contiguous bfloat16 ``[rows_out]`` per-row scales. Where :attr:`int8_exact` (on AMX-INT8 where
        ``cols % 64 == 0`` and ``rows_out % 16 == 0``; on AVX512-VNNI up to :attr:`int8_vnni_cols`) each
        output is ``bf16(float32(sum(x * q)) * s)``, the sum exact and independent of the other rows, so a
        call is split into windows of rows (:func:`row_windows`) without changing a bit; elsewhere (and
        for rows holding a NaN or an infinity) the sum is in float32, in the kernel's order."""
        fn = self._int8_amx if self.int8_amx and rows_out % 16 == 0 and cols % 32 == 0 else \
            self._int8_dp if self.dp else self._int8
        return self._scaled_group(fn, weights, scales, counts, self._rows(x, cols, counts), rows_out, cols)

    def int4(self, weights: Sequence[int], scales: Sequence[int], counts: Sequence[int], x: torch.Tensor,
             rows_out: int, cols: int) -> torch.Tensor:
        """``weights``: pointers of int4 codes in kinject's layout (:func:`~kinject.engine.host_kernels.pack_int4`:
        ``[rows_out, cols / 2]`` bytes); ``scales``: of their contiguous bfloat16 ``[rows_out, cols / 32]`` group
        scales; only where :meth:`int4_takes`. Each output is the weights ``q * s`` (exact in float32) times
        the row, summed in float32 in the kernel's order (AVX2: each group's ``q * x`` sum times its scale):
        the same bits whatever the call's other rows, so a long prompt is computed in windows of rows."""
        if not self.int4_takes(cols):
            raise ValueError(f"no int4 kernel here for an inner dimension of {cols}")
        return self._scaled_group(self._int4, weights, scales, counts, self._rows(x, cols, counts), rows_out, cols)

    def _scaled_group(self, fn, weights: Sequence[int], scales: Sequence[int], counts: Sequence[int],
                      x: torch.Tensor, rows_out: int, cols: int) -> torch.Tensor:
        """One call of a grouped kernel on weight and scale pointers (INT8, int4), its rows checked by the
        caller; more than :func:`int8_window` rows in windows of them (each row's result is its own)."""
        window = int8_window(cols)
        if x.shape[0] > window:
            return torch.cat([self._scaled_group(fn, [weights[e] for e in experts], [scales[e] for e in experts], rows,
                                                 x[a:b], rows_out, cols)
                              for experts, rows, a, b in row_windows(counts, window)])
        k = len(weights)
        y = torch.empty((x.shape[0], rows_out), dtype=torch.bfloat16)
        fn(k, (ctypes.c_void_p * k)(*weights), (ctypes.c_void_p * k)(*scales), (ctypes.c_int64 * k)(*counts),
           rows_out, cols, x.data_ptr(), y.data_ptr(), torch.get_num_threads())
        return y


ONE_TOKEN_MAX_K = 64        # the most experts kinject_one_token_swiglu takes a call (its stack arrays)


@dataclass(frozen=True)
class OneTokenTable:
    """A layer's experts as :meth:`HostGemv.one_token_experts` reads them: the fused kernel (``fn``, its
    argument shape ``sig``), the experts' count and widths, the most experts a call (``window``), one
    pointer per expert for each projection and its scales (None for bfloat16), and ``held``: what
    keeps the pointed-to tensors alive."""

    sig: int
    fn: int
    experts: int
    inter: int
    hidden: int
    window: int
    up: object
    down: object
    up_scale: object
    down_scale: object
    held: tuple = field(repr=False, compare=False)


def int8_window(cols: int) -> int:
    """The most activation rows one INT8 or int4 call takes: the exact INT8 path writes each row's digits,
    up to 8 bytes per value plus padding, the int4 one a float32 copy of the rows (16 MiB at most: a long
    prompt's prefill is computed in windows)."""
    return max(64, (16 << 20) // (16 * cols))


def row_windows(counts: Sequence[int], limit: int) -> list[tuple[list[int], list[int], int, int]]:
    """``counts`` (rows per expert, in order) cut into windows of at most ``limit`` rows: per window
    the experts it holds rows of, their row counts in it, and its row range ``[a, b)`` of the call."""
    windows, experts, rows, start, filled = [], [], [], 0, 0
    for e, n in enumerate(counts):
        while n:
            take = min(n, limit - filled)
            experts.append(e), rows.append(take)
            n, filled = n - take, filled + take
            if filled == limit:
                windows.append((experts, rows, start, start + filled))
                experts, rows, start, filled = [], [], start + filled, 0
    if filled:
        windows.append((experts, rows, start, start + filled))
    return windows


def _torch_exp(symbol: str) -> int | None:
    """The address of the float32 vector ``exp`` torch's kernels call at its CPU capability
    (``Sleef_expf16_u10`` for AVX-512, ``Sleef_expf8_u10`` for AVX2: ``Vectorized<float>::exp``), looked
    up in torch's own library (loaded already): None where it is not found."""
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        lib = Path(torch.__file__).parent / "lib" / name
        if lib.is_file():
            try:
                return ctypes.cast(getattr(ctypes.CDLL(str(lib)), symbol), ctypes.c_void_p).value
            except (OSError, AttributeError):
                return None
    return None


def _build(cc: str) -> Path:
    """The shared library for this source, compiler and CPU, compiled once into the cache (written to a
    temporary name, then renamed: processes compiling at once do not read half a file)."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[:1]
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cc, *version, " ".join(FLAGS), _cpu_identity(),
                                    str(ABI)]).encode()).hexdigest()[:16]
    out = cache_dir() / "kernels" / f"host_gemv-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=120)
        if res.returncode != 0:
            first = (res.stderr.strip().splitlines() or ["no message"])[0]
            raise OSError(f"{cc} failed to compile {SOURCE.name}: {first}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load() -> HostGemv | None:
    """The compiled kernel (built and loaded once per process), or None: :func:`unavailable_reason` says why."""
    global _loaded, _why_not, _tried
    if _tried:
        return _loaded
    with _lock:
        if _tried:
            return _loaded
        try:
            cc = _compiler()
            if cc is None:
                raise OSError("no C compiler (cc, or $CC) on PATH")
            path = _build(cc)
            lib = ctypes.CDLL(str(path))
            if lib.kinject_host_gemv_abi() != ABI:
                raise OSError(f"{path} is not ABI {ABI}")
            _loaded = HostGemv(lib, path)
            logger.info("host compute: grouped GEMV kernel %s", path)
        except (OSError, subprocess.SubprocessError, AttributeError) as err:
            _why_not = str(err)
            logger.info("host experts: no compiled grouped GEMV (%s); torch's kernels compute them", _why_not)
        _tried = True
    return _loaded


def unavailable_reason() -> str | None:
    """Why :func:`load` returned None (None: it did not, or was not called yet)."""
    return _why_not


# ---------------------------------------------------------------- plain linears computed on a CPU


class OneRowLinear:
    """The ``forward`` kinject gives an unbiased ``nn.Linear`` computed on a CPU: fewer than
    :attr:`HostGemv.exact_rows` bfloat16 rows (a decode step's attention projections, lm_head; on AVX2 a
    prefill's too) through the grouped GEMV, one weight read for all rows, with torch's bits where it has
    them (``fast``: everywhere it vectorizes); anything else, and any call that records gradients
    (the kernel has no backward), through ``F.linear`` as before. The weight is read from the module's
    parameters at each call (the store may bind another tensor between steps), from their dict rather
    than through ``nn.Module.__getattr__`` (a Python frame per call)."""

    __slots__ = ("module", "params", "gemv", "fast")

    def __init__(self, module: torch.nn.Linear, gemv: HostGemv, fast: bool):
        self.module, self.params, self.gemv, self.fast = module, module._parameters, gemv, fast

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.params.get("weight")
        if w is None:                              # (not a registered parameter any more)
            w = self.module.weight
        y = _one_row(self.gemv, self.fast, x, w)
        return y if y is not None else torch.nn.functional.linear(x, w, self.module.bias)


class _OneRowFunctional(types.ModuleType):
    """``torch.nn.functional`` as a router's rebound forward sees it (:mod:`kinject.engine.rebind`): ``linear`` of fewer
    than ``MM_ROWS`` bfloat16 rows through the grouped GEMV (:func:`_one_row`), everything else torch's."""

    def __init__(self, gemv: HostGemv, fast: bool):
        super().__init__(torch.nn.functional.__name__)
        self.linear = functools.partial(_functional_linear, gemv, fast)

    def __getattr__(self, name: str):
        return getattr(torch.nn.functional, name)


def _functional_linear(gemv: HostGemv, fast: bool, input: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    y = _one_row(gemv, fast, input, weight) if bias is None else None
    return y if y is not None else torch.nn.functional.linear(input, weight, bias)


def _one_row(gemv: HostGemv, fast: bool, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """``F.linear(x, w)`` (no bias) through the grouped GEMV where it computes it (bfloat16 CPU rows,
    fewer than :attr:`HostGemv.exact_rows` (``fast``: MM_ROWS), no autograd, torch's bits unless ``fast``),
    else None. Checked once here and
    computed by :meth:`HostGemv.rows_checked` (41 calls per decode step of the bench model: each
    microsecond of Python here is a third of a millisecond per token, so the checks are the tensors'
    cheapest attributes: ``is_cpu``, not ``device.type``, which makes a device object)."""
    if x.dtype is not _BF16 or w.dtype is not _BF16 or not x.is_cpu or not w.is_cpu or w.dim() != 2 \
            or not w.is_contiguous() or not x.is_contiguous():
        return None
    out, cols = w.shape
    shape = x.shape
    if shape[-1] != cols or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)):
        return None
    rows = x.numel() // cols if cols else 0
    exact = one_row_exact(gemv, fast, rows, cols)
    if exact is None:
        return None
    return gemv.rows_checked(w, x, rows, out, cols, exact, (*shape[:-1], out))


def one_row_exact(gemv: HostGemv, fast: bool, rows: int, cols: int) -> bool | None:
    """Whether the one-row GEMV computes ``rows`` rows of ``cols`` with torch's bits (True) or, under
    ``fast``, in its vectorized order (False); None where it does not take them (no rows, from
    :attr:`HostGemv.exact_rows` rows on (``fast``: MM_ROWS), or no torch's bits here without ``fast``)."""
    exact = gemv.bf16_exact_for(cols)
    return exact if 0 < rows < (gemv.exact_rows if exact else MM_ROWS) and (exact or fast) else None


def _calls_functional_linear(module: torch.nn.Module) -> bool:
    """Whether ``module`` (not an ``nn.Linear``, a plain class forward, no instance forward) has a 2-D
    bfloat16 weight of its own of at least :data:`MIN_FUNCTIONAL_WEIGHTS` values and a class forward
    whose code calls ``linear`` on a global bound to ``torch.nn.functional`` (``F.linear``: 66 of the 69
    routers of transformers 5's MoE families that call a functional linear)."""
    fn = plain_forward(module)
    if isinstance(module, torch.nn.Linear) or fn is None or "linear" not in fn.__code__.co_names \
            or not any(fn.__globals__.get(n) is torch.nn.functional for n in fn.__code__.co_names):
        return False
    return any(p.dim() == 2 and p.dtype is torch.bfloat16 and p.numel() >= MIN_FUNCTIONAL_WEIGHTS
               for p in module.parameters(recurse=False))


def attach_linears(model: torch.nn.Module, fast: bool = False) -> list[torch.nn.Linear]:
    """Give every unbiased ``nn.Linear`` of ``model`` a :class:`OneRowLinear` forward (an instance
    attribute; :func:`detach_linears` removes it): plain ``nn.Linear`` forwards only (a subclass with
    a forward of its own, a router returning scores and indices, keeps it, as does a module with an
    instance ``forward``) of at least :data:`MIN_LINEAR_WEIGHTS` weights (a tiny one is faster through
    torch's call); and every module whose own forward calls ``F.linear`` on its weight (a router:
    :func:`_calls_functional_linear`) a copy of that forward whose ``F.linear`` takes the same path
    (:func:`~kinject.engine.rebind.rebound_forward`). None where the kernel is unavailable, or where it has neither torch's
    bits nor (``fast``) a vectorized path here."""
    gemv = load()
    if gemv is None or not (gemv.exact_bf16 or (fast and gemv.vectorized)):
        return []
    done, functional = [], None
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and type(m).forward is torch.nn.Linear.forward and m.bias is None \
                and "forward" not in m.__dict__ and m.in_features * m.out_features >= MIN_LINEAR_WEIGHTS:
            m.forward = OneRowLinear(m, gemv, fast)
            done.append(m)
        elif _calls_functional_linear(m):
            functional = functional or _OneRowFunctional(gemv, fast)
            m.forward = rebound_forward(m, lambda name, value: functional if value is torch.nn.functional else None)
            done.append(m)
    return done


def detach_linears(modules: list[torch.nn.Linear]) -> None:
    """Exact inverse of :func:`attach_linears`."""
    for m in modules:
        own = m.__dict__.get("forward")
        if isinstance(own, OneRowLinear) or is_rebound(own):
            del m.forward
