#!/usr/bin/env python
"""Where kinject's per-layer overhead goes: rule-file variants side by side in one process.

``kinject bench overhead`` measures each row against its own HF run; rows measured minutes apart
on a noisy machine can differ by more than the effect looked for. This script builds plain HF
and one kinject model per variant (the ``kinject bench overhead`` model: Qwen3-MoE shape, random
weights, ``rules/klotski.yaml``, every weight on the host tier, KV on the device) and interleaves
all of them in every repeat, so each variant's ratio to HF is taken in the same minutes. It
checks that every variant gives HF's greedy tokens, then prints kinject / HF in thread CPU time
(medians) and the overhead per decoder-layer call. A variant is a group of ``--set`` overrides
separated by ``--``; the first group is the baseline. Example (what BENCHMARKS.md reports)::

    python examples/overhead_ablation.py --experts 8 --top-k 2 --repeats 11 -- \\
        -- pipeline.update_table=false -- rules.2.replace.kwargs.prefetch=none \\
        -- vars.weights=device \\
        -- vars.weights=device pipeline.update_table=false rules.2.replace.kwargs.prefetch=none
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kinject.bench.common import override_groups
from kinject.bench.overhead import random_batch, build_pair


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("variants", nargs="*", help="override groups separated by --; the first is the baseline")
    args, rest = ap.parse_known_args()
    variants = override_groups([*args.variants, *rest])
    torch.set_num_threads(1)

    ref, models = None, {}
    for v in variants:
        hf, model = build_pair(args.experts, args.top_k, hidden=256, layers=args.layers, moe_intermediate=128,
                               device="cpu", overrides=("vars.kv=device", *v))
        ref = ref or hf
        models[" ".join(v) or "(klotski.yaml, weights on the host tier)"] = model
    batch = random_batch(ref.config.vocab_size, 8, 32, "cpu")
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
               pad_token_id=ref.config.pad_token_id)
    times: dict[str, list[float]] = {name: [] for name in ["HF", *models]}
    with torch.inference_mode():
        want = ref.generate(**batch, **gen)
        for name, model in models.items():
            if not torch.equal(model.generate(**batch, **gen), want):
                raise SystemExit(f"variant {name!r}: greedy tokens differ from HF")
        for _ in range(args.repeats):
            for name, model in [("HF", ref), *models.items()]:
                t = time.thread_time()
                model.generate(**batch, **gen)
                times[name].append(time.thread_time() - t)
    hf = statistics.median(times["HF"])
    calls = (args.new_tokens + 1) * args.layers
    print(f"{args.experts} experts, top-{args.top_k}, {args.layers} layers, batch 8, {args.new_tokens} new tokens; "
          f"HF {hf * 1e3:.1f} ms per generate (thread CPU time, median of {args.repeats})")
    for name in models:
        k = statistics.median(times[name])
        print(f"  kinject / HF {k / hf:.3f}   +{(k - hf) / calls * 1e3:.3f} ms per layer call   {name}")


if __name__ == "__main__":
    main()
