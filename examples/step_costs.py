#!/usr/bin/env python
"""Real time per call in kinject's per-step bookkeeping, on the ``kinject bench cpu`` ladder model.

cProfile multiplies the cost of small Python functions several times over, so its ranking of
kinject's bookkeeping (prefetch predictions, store reservations, transfer handles) misleads. This
script instead wraps a fixed list of those functions with a ``perf_counter`` pair each (~0.3 µs),
runs ``--repeats`` greedy ``generate`` calls of the Klotski rule file on the 64-expert ladder
model (``kinject bench cpu --experts``), and prints milliseconds per generate, calls per generate
and microseconds per call of each, inclusive (a function's time includes what it calls). Example (the run
BENCHMARKS.md reports under *Ablations*)::

    python examples/step_costs.py --bandwidth 1000 --repeats 5
"""

from __future__ import annotations

import argparse
import collections
import functools
import tempfile
import time
from pathlib import Path

import torch

WATCHED = {
    "kinject.engine.store:TensorStore": ["prefetch_many", "fetch_many", "fetch", "acquire_many", "release_many",
                                         "discard", "_start_copies"],
    "kinject.engine.transfer:TransferEngine": ["_submit_timed", "submit_many"],
    "kinject.engine.scheduler:Scheduler": ["enter"],
    "kinject.engine.prefetch:CorrelationTable": ["predict", "observe", "_apply_pending"],
    "operators.experts:ExpertRouting": ["route", "prefetch_next"],
    "operators.experts:GroupedExperts": ["prefetch_units", "queue_loads"],
    "operators.expert_order:ExpertOrder": ["schedule", "_discard_unused"],
}


def _watch(totals: dict, calls: collections.Counter) -> None:
    import importlib

    for where, names in WATCHED.items():
        module, cls_name = where.split(":")
        cls = getattr(importlib.import_module(module), cls_name)
        for name in names:
            fn, key = getattr(cls, name), f"{cls_name}.{name}"

            def timed(*args, _fn=fn, _key=key, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    totals[_key] += time.perf_counter() - t0
                    calls[_key] += 1

            setattr(cls, name, functools.wraps(fn)(timed))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--expert-intermediate", type=int, default=64)
    p.add_argument("--bandwidth", type=float, default=1000.0, help="emulated host->device GB/s")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "kinject-bench" / "cpu"),
                   help="where the ladder model is written and reused (default: as kinject bench cpu)")
    p.add_argument("--set", dest="overrides", nargs="*", default=[], help="rule-file overrides")
    a = p.parse_args()

    import kinject
    from kinject.bench.cpu import code_prompts, many_experts_model
    from transformers import AutoTokenizer

    torch.set_num_threads(1)
    model_dir = many_experts_model(Path(a.workdir), a.experts, a.top_k, a.expert_intermediate)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    batch = code_prompts(tok, 8, 64)
    gen = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=tok.pad_token_id)
    totals: dict = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    _watch(totals, calls)
    model = kinject.from_pretrained(model_dir, "klotski", [f"pipeline.emulate_bandwidth={a.bandwidth}", "vars.kv=device",
                                                           f"pipeline.offload_dir={a.workdir}/step_costs", *a.overrides],
                                    dtype=torch.float32, attn_implementation="eager")
    model.generate(**batch, **gen)                 # warm-up: the operator order, the table
    totals.clear()
    calls.clear()
    t0 = time.perf_counter()
    for _ in range(a.repeats):
        model.generate(**batch, **gen)
    wall = (time.perf_counter() - t0) / a.repeats
    print(f"{model_dir.name}, link EMULATED at {a.bandwidth} GB/s, {a.repeats} generates: "
          f"{wall * 1e3:.1f} ms per generate (8 sequences, prompt 64, 16 new tokens)\n")
    print("| function (inclusive) | ms / generate | calls / generate | µs / call |")
    print("| --- | ---: | ---: | ---: |")
    for key, s in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"| {key} | {s / a.repeats * 1e3:.2f} | {calls[key] / a.repeats:.1f} | {s / calls[key] * 1e6:.1f} |")


if __name__ == "__main__":
    main()
