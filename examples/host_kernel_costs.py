"""Host expert kernels, one MoE layer at a time: ms per layer for each candidate (kinject/engine/host_kernels.py).

``python examples/host_kernel_costs.py THREADS ROWS[,ROWS...]``: 8 routed experts (hidden 1024, width 768,
bf16) per call, their weights rotated over 4 layers x 64 experts so every call reads past the caches;
candidates interleaved, best of 15; bf16 candidates checked bit-identical to the grouped GEMM, low-bit ones
report their relative error. Bytes / time is the GB/s each reaches (the bound: ``kinject bench host-experts``
prints the streaming-read rate).
"""

import torch
import time
import sys
import itertools
import torch.nn.functional as F
from operators.expert_compute import _gmm

torch.set_num_threads(int(sys.argv[1]))
L, E, H, I, K = 4, 64, 1024, 768, 8
g = torch.Generator().manual_seed(0)
gu = [(torch.randn(E, 2 * I, H, generator=g) * 0.02).bfloat16() for _ in range(L)]
dn = [(torch.randn(E, H, I, generator=g) * 0.02).bfloat16() for _ in range(L)]


def q8(w):
    s = w.float().abs().amax(-1).clamp(min=1e-8) / 127
    return torch.round(w.float() / s[..., None]).clamp(-127, 127).to(torch.int8), s.bfloat16()


gq = [q8(w) for w in gu]
dq = [q8(w) for w in dn]


def q4(w, gsz=32):
    wf = w.float()
    O, In = wf.shape[-2:]
    wg = wf.reshape(*wf.shape[:-1], In // gsz, gsz)
    mx, mn = wg.amax(-1), wg.amin(-1)
    scale = (mx - mn).clamp(min=1e-8) / 15
    zero = mn + scale * 8
    q = torch.clamp(torch.round((wg - mn[..., None]) / scale[..., None]), 0, 15).to(torch.int32).reshape(*wf.shape)
    sz = torch.stack([scale, zero], -1).transpose(-3, -2).contiguous().bfloat16()
    return [torch.ops.aten._convert_weight_to_int4pack_for_cpu(q[e], 1) for e in range(E)], sz


g4 = [q4(w) for w in gu]
d4 = [q4(w) for w in dn]
idsets = [sorted(torch.randperm(E, generator=g)[:K].tolist()) for _ in range(64)]
it = [0]


def nxt():
    it[0] += 1
    return it[0] % L, idsets[it[0] % 64]


def per_expert(lin_up, lin_down):
    def mk(rows):
        x = torch.randn(K * rows, H, generator=torch.Generator().manual_seed(1)).bfloat16()

        def f(l=None, ids=None):
            if l is None:
                l, ids = nxt()
            out = x.new_empty(K * rows, H)
            for j, e in enumerate(ids):
                xr = x[j * rows : (j + 1) * rows]
                h = lin_up(l, e, xr)
                a, b = h.chunk(2, -1)
                out[j * rows : (j + 1) * rows] = lin_down(l, e, F.silu(a) * b)
            return out

        return f

    return mk


def mvmm(W, xr):
    return torch.mv(W, xr[0]).unsqueeze(0) if xr.shape[0] == 1 else xr @ W.t()


def wx(W, xr):
    return torch.mv(W, xr[0]).unsqueeze(0) if xr.shape[0] == 1 else (W @ xr.t()).t()


def mvrows(W, xr):
    return torch.stack([torch.mv(W, r) for r in xr])


C = {
    "bf16 mv|x@W.t": per_expert(lambda l, e, x: mvmm(gu[l][e], x), lambda l, e, x: mvmm(dn[l][e], x)),
    "bf16 mv|W@x.t": per_expert(lambda l, e, x: wx(gu[l][e], x), lambda l, e, x: wx(dn[l][e], x)),
    "bf16 mv per row": per_expert(lambda l, e, x: mvrows(gu[l][e], x), lambda l, e, x: mvrows(dn[l][e], x)),
    "int8pack": per_expert(
        lambda l, e, x: torch.ops.aten._weight_int8pack_mm(x, gq[l][0][e], gq[l][1][e]),
        lambda l, e, x: torch.ops.aten._weight_int8pack_mm(x, dq[l][0][e], dq[l][1][e]),
    ),
    "int4pack g32": per_expert(
        lambda l, e, x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, g4[l][0][e], 32, g4[l][1][e]),
        lambda l, e, x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, d4[l][0][e], 32, d4[l][1][e]),
    ),
}


def grouped(rows):
    x = torch.randn(K * rows, H, generator=torch.Generator().manual_seed(1)).bfloat16()

    def f(l=None, ids=None):
        if l is None:
            l, ids = nxt()
        first, last = ids[0], ids[-1] + 1
        per = [0] * (last - first)
        for e in ids:
            per[e - first] = rows
        offs = torch.tensor(list(itertools.accumulate(per)), dtype=torch.int32)
        h = _gmm(x, gu[l][first:last].transpose(-2, -1), offs)
        a, b = h.chunk(2, -1)
        return _gmm(F.silu(a) * b, dn[l][first:last].transpose(-2, -1), offs)

    return f


C = {"grouped_mm (now)": grouped, **C}
bf = K * 3 * I * H * 2
nbytes = {"int8pack": K * 3 * I * H + K * (3 * I + H) * 2, "int4pack g32": K * 3 * I * H // 2 + K * 3 * I * H // 32 * 4}
rowsets = [int(r) for r in sys.argv[2].split(",")]
for rows in rowsets:
    fs = {n: mk(rows) for n, mk in C.items()}
    ref = fs["grouped_mm (now)"](1, idsets[0])
    for n, f in fs.items():
        o = f(1, idsets[0])
        if "bf16" in n:
            print(f"  rows {rows} {n}: bit-identical to grouped_mm: {torch.equal(o, ref)}")
        else:
            print(f"  rows {rows} {n}: rel err vs bf16 {((o.float() - ref.float()).norm() / ref.float().norm()).item():.4f}")
    ts = {n: [] for n in fs}
    for n, f in fs.items():
        for _ in range(3):
            f()
    for rep in range(15):  # interleaved
        for n, f in fs.items():
            t = time.perf_counter()
            f()
            ts[n].append(time.perf_counter() - t)
    for n in fs:
        s = min(ts[n])
        b = nbytes.get(n, bf)
        print(
            f"threads {torch.get_num_threads()} rows/expert {rows:2d} {n:18s} {s * 1e3:8.3f} ms  "
            f"{b / s / 1e9:6.1f} GB/s  {K * rows / s:8.0f} rows/s",
            flush=True,
        )
