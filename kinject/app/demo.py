"""``kinject demo``: why kinject exists, on the built-in model, offline, in seconds.

The built-in model (the trained tiny Mixtral fixture) under a device budget of a quarter of its
weights, four ways side by side in one run, the same prompts and greedy decoding for each:

1. untouched HF with every weight in memory: the reference (it does not fit the budget);
2. accelerate's offload at the same budget: ``infer_auto_device_map`` keeps what fits, its
   ``cpu_offload`` hooks load every other module at each of its forwards, then free it
   (:func:`kinject.bench.contenders.load_acc_budget`);
3. kinject's simple pipeline (``rules/simple_pipeline.yaml``), Klotski's ablation baseline: one
   unit per decoder layer, prefetched while the previous layer computes when the budget leaves
   room for two, single batches of ``micro_batch_size`` sequences (as ``kinject bench cpu`` runs it);
4. kinject Klotski (``rules/klotski.yaml``): one unit per expert, hot experts prefetched while
   attention runs, the rest as the router picks them, KV streamed per micro-batch.

For each: tokens/s, peak device bytes of weights (kinject: store accounting; accelerate: what
stays + the largest module it loads at once), bytes moved host->device per model forward
(weights + KV), and whether the greedy tokens equal the reference's. There is no GPU here, so
the host->device link is EMULATED (``pipeline.emulate_bandwidth`` for kinject; accelerate's hooks
wait the same bytes / bandwidth before each module forward), and said so.

``kinject demo --model DIR`` runs the same comparison on any model directory, a checkpoint stored
quantized (FP8, MXFP4, compressed-tensors) included: the reference row is then transformers' own
load of it, and kinject keeps its storage bytes in the host tier and on the link.

The contenders are loaded, warmed up and timed by ``kinject bench cpu``'s machinery
(:func:`kinject.bench.cpu.run`); ``kinject bench cpu`` runs the full ladder with repeats.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

BUDGET_SHARE = 0.25         # of the model's weight bytes
BANDWIDTH = 1.0             # GB/s, the emulated host->device link

HF, ACC, SIMPLE, KLOTSKI = ("untouched HF, all in memory", "accelerate offload at the budget",
                            "kinject simple pipeline", "kinject Klotski")


def run_demo(rules: str | None = None, overrides: list[str] | None = None, *, model: str | Path | None = None,
             batch: int = 8, new_tokens: int = 8, budget_share: float = BUDGET_SHARE, bandwidth: float = BANDWIDTH,
             repeats: int = 3, min_time: float | None = 1.0, threads: int = 1, trace: str | None = None,
             plot: str | None = "kinject-demo.png", started: float | None = None) -> dict:
    """Run the four contenders, print the comparison (first lines) and draw the Klotski run.

    ``model``: a model directory instead of the built-in model, e.g. a checkpoint stored quantized
    (FP8, MXFP4, compressed-tensors): the reference is then transformers' own load of it (which
    dequantizes on a CPU) and kinject keeps its storage bytes in every tier.

    Returns ``rows`` (:class:`kinject.bench.cpu.Row`, in the order above), ``identical`` (every
    kinject row gave the reference's greedy tokens), ``budget``, ``weights`` and ``timings``
    (seconds per phase; ``started``: the ``time.perf_counter()`` the command line started at, so
    that its own start-up, torch's import, is counted too)."""
    t_start = time.perf_counter()
    timings: dict[str, float] = {"startup": t_start - started if started is not None else 0.0}
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kinject.app.run import BUILTIN_PROMPTS, _load_tokenizer, default_model_path, default_rules, model_type
    from kinject.bench.cpu import Rung, run
    from kinject.bench.gpu import _quiet_accelerate
    from kinject.rules import resolve_rules_path
    from kinject.testing import _no_progress_bars

    model_dir = Path(model).expanduser() if model else default_model_path()
    model_type(model_dir)                    # a folder without config.json: one line, before any load
    klotski_rules = resolve_rules_path(rules) if rules else default_rules(model_dir)
    tok = _load_tokenizer(model_dir)
    inputs = tok(list(BUILTIN_PROMPTS)[:batch], return_tensors="pt", padding=True)
    inputs = {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]}
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):      # weight bytes without reading a weight
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    weights = sum(p.numel() * p.element_size() for p in skeleton.parameters())
    timings["import"] = time.perf_counter() - t_start    # transformers and the model's code, tokenizer
    budget = int(weights * budget_share)
    extra = tuple(overrides or ())
    ladder = [Rung(HF, kind="hf"), Rung(ACC, kind="acc-budget"),
              Rung(SIMPLE, str(resolve_rules_path("simple_pipeline")), extra, split=True),   # Klotski's baseline: single batches
              Rung(KLOTSKI, str(klotski_rules), extra)]
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)       # a tiny model: more intra-op threads only spin
    try:
        with tempfile.TemporaryDirectory(prefix="kinject-demo-") as workdir, _no_progress_bars(), _quiet_accelerate():
            rows, meta = run(model_dir, bandwidth=bandwidth, new_tokens=new_tokens, prompt_len=inputs["input_ids"].shape[1],
                             repeats=repeats, workdir=Path(workdir), ladder=ladder, batch=inputs, budget=budget,
                             close=False, min_time=min_time)
    finally:
        torch.set_num_threads(old_threads)
    timings.update(load=meta["load_s"], warmup=meta["warmup_s"], runs=meta["run_s"])
    try:
        _report(rows, meta, config, model_dir, tok, inputs, klotski_rules, timings, trace=trace, plot=plot,
                budget_share=budget_share, min_time=min_time, started=started, t_start=t_start)
    finally:
        for row in rows:
            if row.runtime is not None:
                row.runtime.transfer.close()
    kinject_rows = [r for r in rows if r.runtime is not None]
    return {"identical": all(r.same_tokens for r in kinject_rows), "rows": rows, "budget": budget,
            "weights": weights, "timings": timings, "meta": meta}


def _report(rows, meta, config, model_dir, tok, inputs, klotski_rules, timings, *, trace, plot, budget_share,
            min_time, started, t_start) -> None:
    """Print the table, what it says, write the trace and the plot, and the wall-time breakdown."""
    from kinject.app.run import BUILTIN_PROMPTS

    budget, weights, bandwidth = meta["budget"], meta["weights"], meta["bandwidth_gbs"]
    batch, new_tokens = meta["sequences"], meta["new_tokens"]
    print(f"kinject demo: {_describe(model_dir, config)}, {weights / 2**20:.1f} MiB of float32 weights), {batch} "
          f"prompts x {new_tokens} new tokens, greedy")
    print(f"device budget {budget / 2**20:.1f} MiB ({budget_share:.0%} of the weights); no GPU here, so the "
          f"host->device link is EMULATED at {bandwidth:g} GB/s; {_runs(rows, min_time)}")
    print(_table(rows, meta))
    kv = 2 * config.num_hidden_layers * batch * config.num_key_value_heads * _head_dim(config) * \
        (inputs["input_ids"].shape[1] + new_tokens) * 4
    print(f"  peak device: weights held on the device (accounting); the KV cache ({kv / 2**20:.1f} MiB) comes on top, "
          f"except in Klotski (KV on the host, streamed per micro-batch)")
    for line in _story(rows, meta):
        print(line)
    klotski = rows[-1]
    rt = klotski.runtime
    t0 = time.perf_counter()
    if trace:
        rt.tracer.to_chrome(trace)
        print(f"trace written to {trace} (open in https://ui.perfetto.dev)")
    if plot and rt.tracer.plot(plot, title=f"kinject demo: Klotski ({Path(klotski_rules).name}), budget "
                                           f"{budget / 2**20:.1f} MiB, link EMULATED at {bandwidth:g} GB/s", budget=budget):
        print(f"pipeline plot of the Klotski run written to {plot}")
    timings["plot"] = time.perf_counter() - t0
    sample = tok.decode(klotski.tokens[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"sample: {BUILTIN_PROMPTS[0]!r} -> {sample!r}")
    timings["total"] = time.perf_counter() - t_start + timings["startup"]
    print(("demo wall time {total:.1f} s: " + ("command line + torch {startup:.1f}, " if started is not None else "")
           + "transformers + model code {import:.1f}, loading the models {load:.1f}, warm-up {warmup:.1f}, "
           "timed runs {runs:.1f}, trace and plot {plot:.1f}").format(**timings))


def _describe(model_dir: Path, config) -> str:
    """``the built-in tiny_moe (mixtral, 6 layers x 8 experts`` or, for a given quantized checkpoint,
    ``DIR (gpt_oss stored mxfp4, ...``: what the reference row loads."""
    from kinject.app.run import default_model_path

    name = f"the built-in {model_dir.name}" if model_dir == default_model_path() else str(model_dir)
    quant = getattr(config, "quantization_config", None)
    stored = f" stored {quant['quant_method']}" if isinstance(quant, dict) and "quant_method" in quant else ""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    return f"{name} ({config.model_type}{stored}, {config.num_hidden_layers} layers x {experts} experts"


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _runs(rows, min_time: float | None) -> str:
    lo, hi = min(len(r.times) for r in rows), max(len(r.times) for r in rows)
    if hi == 1:
        return "one timed run each"
    enough = f" ({min_time:g} s of runs is enough)" if min_time is not None and lo < hi else ""
    return f"best of {lo if lo == hi else f'{lo}-{hi}'} interleaved timed runs each{enough}"


def tokens_per_s(row, meta: dict) -> float:
    """Generated tokens / the fastest of the row's timed runs (other processes only ever slow a run down)."""
    return meta["sequences"] * meta["new_tokens"] / min(row.times)


def moved_per_step(row) -> float:
    return row.bytes_moved / max(row.steps, 1)


def _table(rows, meta: dict) -> str:
    lines = [f"  {'':34s} {'seqs/call':>9s} {'tokens/s':>9s} {'peak device':>12s} {'moved/step':>11s}  "
             "greedy tokens identical"]
    for r in rows:
        same = "reference" if r is rows[0] else ("yes" if r.same_tokens else "NO")
        lines.append(f"  {r.name:34s} {r.per_call:9d} {tokens_per_s(r, meta):9.1f} {r.peak / 2**20:8.1f} MiB "
                     f"{moved_per_step(r) / 2**20:7.1f} MiB  {same}")
    return "\n".join(lines)


def _story(rows, meta: dict) -> list[str]:
    """What the table says, in words, from the measured numbers."""
    hf, acc, simple, klotski = rows
    tps = {r.name: tokens_per_s(r, meta) for r in rows}
    ratio = tps[klotski.name] / tps[acc.name]
    steps = max(klotski.steps, 1)
    link_s = moved_per_step(klotski) / (meta["bandwidth_gbs"] * 1e9)
    compute_s = klotski.compute_s / steps
    bound = meta["sequences"] * meta["new_tokens"] / steps / max(link_s, compute_s, 1e-9)
    out = [f"kinject Klotski makes {ratio:.2f}x the tokens/s of accelerate's offload ({'faster' if ratio >= 1 else 'slower'}) "
           f"at the same {meta['budget'] / 2**20:.1f} MiB budget and EMULATED link.",
           f"Per step Klotski moves {moved_per_step(klotski) / 2**20:.1f} MiB (accelerate {moved_per_step(acc) / 2**20:.1f}): "
           f"{link_s * 1e3:.0f} ms on the link and {compute_s * 1e3:.0f} ms of compute, which it overlaps and accelerate "
           f"runs one after the other; the longer of the two bounds Klotski at {bound:.0f} tokens/s, it reaches "
           f"{tps[klotski.name] / bound:.0%} (compute idle {klotski.bubble:.0%} of its run).",
           f"Klotski makes {tps[klotski.name] / tps[simple.name]:.2f}x the tokens/s of kinject's simple pipeline "
           f"(Klotski's baseline: whole layers moved, single batches of {simple.per_call}); `kinject bench cpu` shows "
           f"every step between the two.",
           f"Untouched HF makes {tps[hf.name] / tps[klotski.name]:.1f}x Klotski's tokens/s, but needs "
           f"{hf.peak / meta['budget']:.1f}x the budget: every weight on the device, nothing moved."]
    if not all(r.same_tokens for r in rows[1:]):
        out.append("WARNING: a contender's greedy tokens differ from the reference's (see the table).")
    return out
