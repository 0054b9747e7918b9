#!/usr/bin/env python
"""What the Klotski rung of ``kinject bench cpu --experts E`` spends its time on: rule-file
variants of it side by side in one process.

``kinject bench cpu`` reports each rung's share of its roofline bound; this script says where the
rest goes. It builds the bench's many-experts model (the fixture's shape with ``--experts`` experts
of width 64 and top-``--top-k`` routing), one ``rules/klotski.yaml`` model per variant (weights on
the host tier, KV on the device, the host->device link EMULATED at ``--bandwidth`` GB/s, as the
bench's Klotski row), checks that every variant gives the first one's greedy tokens, and prints
each variant's milliseconds per ``generate`` (8 sequences, prompt 64, 16 new tokens; medians of
interleaved repeats) and its ratio to the first. A variant is a group of ``--set`` overrides
separated by ``--``; the first group is the baseline. Example (what BENCHMARKS.md reports)::

    python examples/ladder_ablation.py --bandwidth 1000 --repeats 15 -- \\
        -- vars.weights=device -- rules.2.replace.kwargs.prefetch=none -- pipeline.update_table=false
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch


def main() -> None:
    import kinject
    from kinject.bench.common import override_groups
    from kinject.bench.cpu import code_prompts, many_experts_model
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--bandwidth", type=float, default=4.0, help="emulated host->device GB/s")
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "kinject-bench" / "cpu"))
    ap.add_argument("variants", nargs="*", help="override groups separated by --; the first is the baseline")
    args, rest = ap.parse_known_args()
    variants = override_groups([*args.variants, *rest])
    torch.set_num_threads(1)

    model_dir = many_experts_model(Path(args.workdir), args.experts, args.top_k, 64)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    batch = code_prompts(tok, 8, 64)
    gen = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
    models = {}
    with tempfile.TemporaryDirectory() as offload:
        for i, v in enumerate(variants):
            name = " ".join(v) or "(klotski.yaml, weights on the host tier)"
            models[name] = kinject.from_pretrained(
                model_dir, "rules/klotski.yaml",
                [f"pipeline.emulate_bandwidth={args.bandwidth}", "vars.kv=device", f"pipeline.offload_dir={offload}/{i}", *v],
                dtype=torch.float32, attn_implementation="eager")
        want = None
        for name, model in models.items():                  # warm-up, and every variant's tokens
            got = model.generate(**batch, **gen)
            want = got if want is None else want
            if not torch.equal(got, want):
                raise SystemExit(f"variant {name!r} gives other tokens than the baseline")
        times: dict[str, list[float]] = {name: [] for name in models}
        for _ in range(args.repeats):
            for name, model in models.items():
                t0 = time.perf_counter()
                model.generate(**batch, **gen)
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(next(iter(times.values())))
    print(f"{args.experts} experts top-{args.top_k}, link EMULATED at {args.bandwidth:g} GB/s, "
          f"median of {args.repeats} interleaved repeats, tokens identical")
    print("| variant | ms / generate | vs baseline |\n| --- | ---: | ---: |")
    for name, t in times.items():
        m = statistics.median(t)
        print(f"| {name} | {m * 1e3:.1f} | {m / base:.3f} |")


if __name__ == "__main__":
    main()
