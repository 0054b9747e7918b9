"""``kinject demo``: why kinject exists, on the built-in model, offline, in seconds.

The built-in model (the trained tiny Mixtral fixture) under a device budget of a quarter of its
weights, four ways side by side in one run, the same prompts and greedy decoding for each:

1. untouched HF with every weight in memory: the reference (it does not fit the budget);
2. accelerate's offload at the same budget: ``infer_auto_device_map`` keeps what fits, its
   ``cpu_offload`` hooks load every other module at each of its forwards, then free it;
3. kinject's simple pipeline (``rules/simple_pipeline.yaml``): one unit per decoder layer,
   prefetched while the previous layer computes, batches of ``micro_batch_size`` sequences;
4. kinject Klotski (``rules/klotski.yaml``): the batch group shares every weight loaded, one unit
   per expert, hot experts prefetched while attention runs, the rest as the router picks them.

For each: tokens/s, peak device bytes (store accounting; accelerate: what stays + the largest
module it loads at once), bytes moved host->device per model forward, and whether the greedy
tokens equal the reference. There is no GPU here, so the host->device link is EMULATED
(``pipeline.emulate_bandwidth`` for kinject; accelerate's hooks wait the same bytes / bandwidth
before each module forward), and said so. ``kinject bench cpu`` measures the full ladder with
repeats; this is one run of each.
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

BUDGET_SHARE = 0.25         # of the model's weight bytes
BANDWIDTH = 1.0             # GB/s, the emulated host->device link


@dataclass
class Row:
    name: str
    seconds: float
    tokens: int
    peak: int | None            # device bytes, accounting
    moved_per_step: float       # host->device bytes per model forward
    identical: bool

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def run_demo(rules: str | None = None, overrides: list[str] | None = None, *, batch: int = 8,
             new_tokens: int = 16, budget_share: float = BUDGET_SHARE, bandwidth: float = BANDWIDTH,
             trace: str | None = None, plot: str | None = "kinject-demo.png") -> dict:
    import kinject
    from kinject.app.run import BUILTIN_PROMPTS, _load_tokenizer, default_model_path, default_rules
    from kinject.bench.contenders import load_acc_budget
    from kinject.rules import load_rules, resolve_rules_path
    from transformers import AutoModelForCausalLM

    t_start = time.perf_counter()
    model_dir = default_model_path()
    klotski_rules = resolve_rules_path(rules) if rules else default_rules(model_dir)
    tok = _load_tokenizer(model_dir)
    inputs = tok(list(BUILTIN_PROMPTS)[:batch], return_tensors="pt", padding=True)
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)

    def load_hf():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()

    hf = load_hf()
    weights = sum(p.numel() * p.element_size() for p in hf.parameters())
    budget = int(weights * budget_share)
    workdir = Path(tempfile.mkdtemp(prefix="kinject-demo-"))
    common = [f"pipeline.device_budget={budget}", f"pipeline.emulate_bandwidth={bandwidth}"]

    def load_kinject(rule_file, extra):
        m = kinject.from_pretrained(model_dir, rule_file, [*common, f"pipeline.offload_dir={workdir}", *extra],
                                    dtype=torch.float32, attn_implementation="eager")
        m.generate(**_rows(inputs, slice(0, 1)), max_new_tokens=1, do_sample=False,
                   pad_token_id=tok.pad_token_id)           # learn the order, warm the correlation table
        m.kinject.tracer.clear()
        m.kinject.store.reset_stats()
        return m

    rows = []
    t0 = time.perf_counter()
    reference = hf.generate(**inputs, **gen)
    rows.append(Row("untouched HF, all in memory", time.perf_counter() - t0, batch * new_tokens, weights, 0.0, True))

    acc = load_acc_budget(load_hf(), budget, bandwidth)
    t0 = time.perf_counter()
    out = acc.model.generate(**inputs, **gen)
    rows.append(Row("accelerate offload (cpu_offload hooks)", time.perf_counter() - t0, batch * new_tokens,
                    acc.resident + acc.largest, float(acc.offloaded), torch.equal(out, reference)))

    simple = load_kinject(resolve_rules_path("simple_pipeline"), [])
    bs = load_rules(klotski_rules, overrides).pipeline.micro_batch_size or batch
    rows.append(_timed("kinject simple pipeline", simple, inputs, gen, reference, chunk=bs))
    model = load_kinject(klotski_rules, list(overrides or []))
    rows.append(_timed("kinject Klotski", model, inputs, gen, reference, chunk=None))

    print(f"kinject demo: {model_dir.name}, a {hf.config.model_type} of {weights / 2**20:.1f} MiB (float32), "
          f"{batch} prompts x {new_tokens} new tokens, greedy")
    print(f"device budget {budget / 2**20:.1f} MiB ({budget_share:.0%} of the weights); "
          f"host->device link EMULATED at {bandwidth:g} GB/s (no GPU here)")
    print(_table(rows))
    fastest_offload = max(rows[1:3], key=lambda r: r.tokens_per_s)
    print(f"Klotski: {rows[3].tokens_per_s / fastest_offload.tokens_per_s:.2f}x {fastest_offload.name} "
          f"under the same budget and link; untouched HF needs {weights / budget:.1f}x the budget.")
    bubble = model.kinject.tracer.bubble_fraction("compute")
    print(f"Klotski rules {klotski_rules}: compute bubble {bubble:.0%}; `kinject bench cpu` for the full ladder "
          f"with repeats, model.kinject.report() for the rest")
    if trace:
        model.kinject.tracer.to_chrome(trace)
        print(f"trace written to {trace} (open in https://ui.perfetto.dev)")
    if plot and model.kinject.tracer.plot(plot, title=f"kinject demo: Klotski ({Path(klotski_rules).name}), "
                                                      f"budget {budget / 2**20:.1f} MiB, link EMULATED {bandwidth:g} GB/s"):
        print(f"pipeline plot written to {plot}")
    sample = tok.decode(reference[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"sample continuation: {sample!r}")
    print(f"demo wall time {time.perf_counter() - t_start:.1f} s (load and warm-up included)")
    for m in (simple, model):
        m.kinject.transfer.close()
    return {"identical": all(r.identical for r in rows[2:]), "rows": rows, "budget": budget, "weights": weights}


def _rows(inputs: dict, rows: slice) -> dict:
    return {k: v[rows] for k, v in inputs.items()}


def _timed(name: str, model, inputs: dict, gen: dict, reference: torch.Tensor, *, chunk: int | None) -> Row:
    """One timed ``generate`` over all prompts (in calls of ``chunk`` sequences when given)."""
    n = inputs["input_ids"].shape[0]
    parts = [slice(i, i + chunk) for i in range(0, n, chunk)] if chunk else [slice(0, n)]
    rt = model.kinject
    steps0 = rt.scheduler.step
    t0 = time.perf_counter()
    out = torch.cat([model.generate(**_rows(inputs, p), **gen) for p in parts])
    seconds = time.perf_counter() - t0
    steps = max(1, rt.scheduler.step - steps0)
    moved = sum(rt.store.stats["bytes"].values()) / steps
    return Row(name, seconds, n * gen["max_new_tokens"], rt.store.peak, moved, torch.equal(out, reference))


def _table(rows: list[Row]) -> str:
    lines = [f"  {'':40s} {'tokens/s':>9s} {'peak device':>12s} {'moved/step':>11s}  greedy tokens identical"]
    for r in rows:
        same = "reference" if r is rows[0] else ("yes" if r.identical else "NO")
        lines.append(f"  {r.name:40s} {r.tokens_per_s:9.1f} {r.peak / 2**20:9.1f} MiB {r.moved_per_step / 2**20:7.2f} MiB  {same}")
    return "\n".join(lines)
