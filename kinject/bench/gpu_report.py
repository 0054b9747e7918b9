"""The Markdown report of ``kinject bench gpu``: the table (one row per contender: its batch, tokens/s,
the device budget, its peak and whether it stayed inside, host bytes, the roofline bound), the
notes that say how each number was measured and sized, and the provenance block.

Why apart from the runner: the runner (:mod:`kinject.bench.gpu`) loads, sizes and times the
contenders; this module only reads what they recorded (rows with ``key``, ``name``, ``rows``,
``calls``, ``times``, ``peak``, ``fit`` ...; a setup with the shape, budget and probes), so either
can change without the other (docs/architecture.md, "Benchmarks and bounds")."""

from __future__ import annotations

import statistics
import time
from datetime import datetime, timezone

import torch


def step_flops(shape, rows: int, tokens: int, context: int) -> float:
    """FLOPs of one forward of ``rows`` sequences with ``tokens`` new tokens each after ``context``
    cached ones: 2 x active parameters per token, attention over the (causal) context, and the
    lm_head for the last token of each row (what ``generate`` computes)."""
    p = shape.layer_params()
    active = p["attention"] + p["gate"] + shape.top_k * p["expert"]
    attn_pairs = tokens * context + tokens * (tokens + 1) / 2            # (query, key) pairs per row
    per_layer = 2 * active * tokens + 4 * attn_pairs * shape.heads * shape.head_dim
    return rows * (shape.layers * per_layer + 2 * shape.hidden * shape.vocab)


def row_bound(shape, *, calls: int, rows: int, prompt_len: int, new_tokens: int, bytes_per_step: float,
              bandwidth: float, peak: float) -> tuple[float, str]:
    """Roofline tokens/s of ``calls`` generates of ``rows`` sequences: every step costs
    max(bytes / bandwidth, FLOPs / peak) (planner.roofline_bound), summed over the steps."""
    from kinject.plan.planner import roofline_bound

    total, binding = 0.0, {}
    for d in range(new_tokens):                    # step 0: prefill; then one token per step
        tokens, context = (prompt_len, 0) if d == 0 else (1, prompt_len + d - 1)
        b = roofline_bound(tokens_per_step=rows * (tokens if d == 0 else 1), bytes_per_step=bytes_per_step,
                           bandwidth=bandwidth, flops_per_step=step_flops(shape, rows, tokens, context),
                           peak_flops=peak)
        total += b.step_s
        binding.setdefault("prefill" if d == 0 else "decode", b.binding)
    tokens = calls * rows * new_tokens
    what = binding.get("decode", binding["prefill"])
    if "decode" in binding and binding["prefill"] != binding["decode"]:
        what += f" (prefill {binding['prefill']})"
    return tokens / (calls * total), what


def reference(rows: list) -> object | None:
    """The row tokens are compared with: accelerate (plain transformers modules), else the first run."""
    done = [r for r in rows if r.tokens is not None]
    return next((r for r in done if r.key == "acc"), None) or next((r for r in done), None)


def table(rows: list, setup) -> str:
    shape = setup.shape
    med = {r.key: statistics.median(r.times) for r in rows if r.times}
    tokens = setup.sequences * setup.new_tokens
    base = med.get("simple")
    lines = ["| configuration | sequences per call | tokens/s | vs simple | median s (min-max) | compute bubble | "
             "moved / step | device budget | peak device | inside budget | host bytes | bound (tok/s) | bound by | "
             "% of bound | tokens = ref |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- | ---: | ---: |"]
    for r in rows:
        per_call = _per_call(r)
        host = gib(r.fit.host) if r.fit is not None else "n/a"
        if not r.times:
            lines.append(f"| {r.name} | {per_call} | {r.error or 'not run'} |" + " |" * 5
                         + f" {gib(setup.budget)} | n/a | n/a | {host} |" + " |" * 4)
            continue
        t = med[r.key]
        tps = tokens / t
        per_step = r.bytes_moved / max(r.steps, 1)
        bound, by = row_bound(shape, calls=r.calls, rows=r.rows, prompt_len=setup.prompt_len,
                              new_tokens=setup.new_tokens, bytes_per_step=per_step, bandwidth=setup.bandwidth,
                              peak=setup.peak_flops)
        peak = "n/a" if r.peak is None else gib(r.peak)
        bubble = "n/a" if r.bubble is None else f"{r.bubble:.0%}"
        match = "" if r.match is None else f"{r.match:.1%}"
        if r.error:
            match += f" ({r.error})"
        lines.append(f"| {r.name} | {per_call} | {tps:.1f} | {tps / (tokens / base) if base else float('nan'):.2f}x | "
                     f"{t:.2f} ({min(r.times):.2f}-{max(r.times):.2f}) | {bubble} | {gib(per_step)} | "
                     f"{gib(setup.budget)} | {peak} | {inside_budget(r, setup)} | {host} | "
                     f"{bound:.1f} | {by} | {tps / bound:.0%} | {match} |")
    return "\n".join(lines)


def _per_call(r) -> str:
    if r.fit is None or not r.rows:
        return "-" if r.fit is None else "0 (does not fit)"
    out = f"{r.rows} x {r.calls} call{'s' * (r.calls > 1)}"
    if r.fit.micro_batch:
        chunk = min(r.fit.prefill_chunk, max(1, r.rows // r.fit.micro_batch))
        out += f", micro-batch {r.fit.micro_batch}" + (f", prefill chunk {chunk}" if chunk > 1 else "")
    return out


def inside_budget(r, setup) -> str:
    """Whether the row's measured peak (weights, KV and activations) stayed within the device budget;
    when not, by how much and what the sizing had given each part."""
    if setup.dry or r.peak is None:
        return "n/a (no device counter)"
    if r.peak <= setup.budget:
        return "yes"
    f = r.fit
    parts = "" if f is None else (f": the sizing gave weights {gib(f.weights)} + KV {gib(f.kv)} + activations "
                                  f"{gib(f.activations)} ({f.how}); the excess is what the run allocated beyond "
                                  f"that model")
    return f"no, {gib(r.peak - setup.budget)} over{parts}"


def notes(rows: list, setup) -> str:
    s = setup
    skipped = ", ".join(f"{r.name} {r.prefetch_skipped}" for r in rows if r.prefetch_skipped)
    ref = reference(rows)
    out = [
        f"- model: {s.shape.describe()}; random fill {s.fill_s:.1f} s",
        f"- device_budget {gib(s.budget)} ({s.budget_how}); 'peak device' = "
        + ("torch.cuda.max_memory_allocated over the run (reset before it) - memory allocated at its start + "
           "the contender's own resident bytes (other contenders' memory excluded), max over repeats"
           if not s.dry else "store accounting (DRY RUN: no CUDA)"),
        f"- workload: {s.sequences} sequences (n={s.n} x bs={s.bs}), each row in generate calls of its 'sequences "
        f"per call' (the largest batch whose weights, KV and activations fit the device budget; the simple pipeline "
        f"at most bs, a Klotski rung the whole group in micro-batches), prompt {s.prompt_len} random "
        f"tokens, {s.new_tokens} new tokens (greedy, min_new_tokens), {s.shape.dtype}, attn {s.attn}; median of "
        f"{s.repeats_done} interleaved repeats (order rotating)" + (f"; {s.stopped}" if s.stopped else ""),
        f"- transformers' experts in accelerate and the whole-layer rungs: {s.hf_experts} ("
        + ("grouped_mm prefill; on a GPU generate decodes with batched_mm, a copy of the weights of every routed "
           "(token, expert) pair" if s.hf_experts == "default" else "one expert at a time, no weight copies")
        + "); the Klotski rungs compute their experts themselves",
        "- equal memory: every row gets the same device budget for weights, KV and activations together "
        "(accelerate: max_memory = what its batch's KV and activations leave, cpu = every weight; kinject: "
        "pipeline.device_budget = the same; Klotski rungs prefill layer by layer) and every weight in host memory "
        "(one shared pinned copy; 'host bytes' = the weights each row keeps there); 'inside budget' compares the "
        "measured peak with the budget",
        f"- roofline: per forward step max(moved bytes / {s.bandwidth / 1e9:.1f} GB/s, FLOPs / "
        f"{s.peak_flops / 1e12:.1f} TFLOP/s), summed over the row's steps; "
        + ("H2D bandwidth from a pinned 1 GiB host->device copy (best of 5), peak from an 8192^3 bf16 matmul"
           if not s.dry else "DRY RUN: 'bandwidth' is a CPU memcpy and the peak a 512^3 matmul: not a roofline"),
        "- moved / step: host->device bytes per forward (kinject: store weight bytes + KV loads of OffloadedAttention;"
        " accelerate: offloaded parameter bytes x forwards)",
        f"- tokens = ref: share of generated tokens equal to those of {ref.name if ref else '-'} (accelerate runs "
        "the plain HF modules); random weights give near-tied logits, so bf16 rounding differences between "
        "batch shapes / kernels can flip a greedy choice and everything after it: on a GPU < 100% is not by "
        "itself a bug; HQQ changes the weights",
    ]
    if skipped:
        out.append(f"- prefetches skipped by the budget (store keeps room for one on-demand unit): {skipped}")
    for r in rows:
        if r.fit is not None:
            f = r.fit
            share = (f"max_memory device {gib(f.store_budget)}" if f.max_memory is not None
                     else f"store budget {gib(f.store_budget)}" if f.store_budget is not None else "")
            out.append(f"- {r.name}: sized {f.rows} sequence(s) per call: weights {gib(f.weights)} + KV {gib(f.kv)} "
                       f"+ activations {gib(f.activations)} = {gib(f.total)} of {gib(f.budget)} ({f.how})"
                       + (f"; {share}" if share else "") + (f"; {f.why}" if f.why else ""))
        if r.what:
            out.append(f"- {r.name}: {r.what}")
    return "\n".join(out)


def provenance(setup) -> str:
    from kinject.bench.common import command_line, package_version, host_facts, sh

    if setup.device.type == "cuda":
        props = torch.cuda.get_device_properties(setup.device)
        driver = sh("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader").splitlines()
        gpu = (f"{torch.cuda.get_device_name(setup.device)} ({props.total_memory / 2**30:.0f} GiB, "
               f"{props.multi_processor_count} SMs), driver {driver[0] if driver else '?'}, CUDA {torch.version.cuda}")
    else:
        gpu = "no GPU (DRY RUN on the CPU)"
    f = host_facts()
    return "\n".join([
        f"- machine: {f['host']}, {gpu}; {f['cpu']}, {f['cpus']} CPUs, {f['mem_gib']:.0f} GiB RAM",
        f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; total bench time "
        f"{time.perf_counter() - setup.started:.0f} s",
        f"- command: `{command_line()}`",
        f"- commit: {f['commit']}{f['dirty']}; torch {torch.__version__}, transformers {package_version('transformers')}, "
        f"accelerate {package_version('accelerate')}, hqq {package_version('hqq')}",
    ])


def report(rows: list, setup) -> str:
    s = setup
    where = (f"DRY RUN on {s.device} — exercises the code path, NOT a measurement" if s.dry
             else f"{torch.cuda.get_device_name(s.device)}")
    head = (f"kinject bench gpu — {where}: {s.shape.layers}-layer {s.shape.dtype} "
            f"{'Mixtral-8x7B-shaped' if s.shape.is_mixtral() else 'Mixtral-type'} random model, weights in "
            f"{'pinned ' if not s.dry else ''}host memory, device_budget {gib(s.budget)}, {s.sequences} sequences "
            f"(n={s.n} x bs={s.bs}), prompt {s.prompt_len}, {s.new_tokens} new tokens, H2D "
            f"{s.bandwidth / 1e9:.1f} GB/s, matmul peak {s.peak_flops / 1e12:.1f} TFLOP/s, median of "
            f"{s.repeats_done} interleaved repeats")
    return "\n\n".join([head, table(rows, s), "```\n" + s.plan_text + "\n```", notes(rows, s), provenance(s)])


def gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB" if abs(b) >= 2**30 else f"{b / 2**20:.1f} MiB"
