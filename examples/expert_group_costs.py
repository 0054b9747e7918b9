#!/usr/bin/env python
"""What one group of experts costs, per backend: the numbers behind ``compute_group``'s choices.

Klotski's hot-first order computes a layer's experts in groups: the ones on the device first,
then cold ones as they land, often a few experts far apart among many. The grouped GEMM runs
over a stacked ``[span, ...]`` view of the experts' weights; on a CPU torch's kernel runs one
matrix product per expert of the span, empty or not, so a thin group pays for the experts
between its members. This script times, for random groups of ``g`` experts among ``--experts``
(one row each by default: a decode step), the grouped GEMM over every expert, over the group's
own span, and one mm per expert, on the ladder model's shapes, and checks all three give the same
bits. Example (what BENCHMARKS.md reports)::

    python examples/expert_group_costs.py --experts 64 --groups 2 4 6 10 18 30
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from operators.expert_compute import ExpertMath, _CPU_SPREAD, _spread_thin, compute_group, stacked_views


def _time(fn, repeats: int) -> float:
    for _ in range(max(10, repeats // 50)):
        fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=64)
    p.add_argument("--rows", type=int, default=1, help="rows (tokens) per expert")
    p.add_argument("--groups", type=int, nargs="+", default=[2, 4, 6, 10, 18, 30], help="group sizes")
    p.add_argument("--repeats", type=int, default=3000)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    E, H, I = a.experts, a.hidden, a.intermediate
    up, down = torch.randn(E, 2 * I, H, generator=g), torch.randn(E, H, I, generator=g)
    math = ExpertMath(up="gate_up_proj", down="down_proj", transposed=False, post=None,
                      activation=lambda h: torch.nn.functional.silu(h[..., :I]) * h[..., I:])
    every = [{"gate_up_proj": up[e], "down_proj": down[e]} for e in range(E)]
    whole = stacked_views(math, every)
    rng = random.Random(0)
    print(f"{E} experts, hidden {H}, intermediate {I}, {a.rows} row(s) per expert, torch {torch.__version__}, "
          f"{a.threads} thread(s); microseconds per group (up + activation + down)\n")
    print("| experts in group | span | grouped GEMM, all experts | grouped GEMM, the span | one mm per expert "
          f"| chosen (span > {_CPU_SPREAD} x group: loop) |")
    print("| ---: | ---: | ---: | ---: | ---: | --- |")
    for n in a.groups:
        ids = sorted(rng.sample(range(E), n))
        counts = [a.rows] * n
        x = torch.randn(sum(counts), H, generator=g)
        w = [every[e] for e in ids]
        outs = {}

        def run(name, **kw):
            outs[name] = compute_group(math, w, ids, counts, x, **kw)
            return _time(lambda: compute_group(math, w, ids, counts, x, **kw), a.repeats) * 1e6

        span = run("span", backend="grouped_mm", stacked=whole)
        loop = run("loop", backend="loop")
        full = _full_span(math, w, ids, counts, x, whole, a.repeats, outs)
        assert all(torch.equal(o, outs["loop"]) for o in outs.values()), "backends disagree"
        chosen = "loop" if _spread_thin(ids, x.device) else "grouped GEMM"
        print(f"| {n} | {ids[-1] - ids[0] + 1} | {full:.1f} | {span:.1f} | {loop:.1f} | {chosen} |")


def _full_span(math, w, ids, counts, x, whole, repeats, outs) -> float:
    """The grouped GEMM over every expert's stacked view (what a group cost before it took its span)."""
    from operators.expert_compute import _grouped

    outs["all"] = _grouped(math, whole, ids, counts, x, 0)
    return _time(lambda: _grouped(math, whole, ids, counts, x, 0), repeats) * 1e6


if __name__ == "__main__":
    main()
