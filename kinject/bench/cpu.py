"""``kinject bench cpu``: the Klotski ablation ladder side by side, on the trained fixture.

One process, the same prompts and new tokens for every contender, float32, repeats
interleaved (contender A, B, C, then A, B, C again ...), medians reported. The host->device
link is EMULATED (``pipeline.emulate_bandwidth``) so transfers dominate as on a real
PCIe-attached GPU; every number is labelled so.

Rows: plain HF in RAM; accelerate's ``disk_offload`` (all weights in its offload folder, the
page cache kept: the real disk is not throttled, so it is the upper end of that baseline); the simple pipeline (each
decoder layer one unit, single batches of
bs); + multi-batch (one batch group of n*bs sequences per generate); + only hot experts
prefetched (one unit per expert); Klotski (+ hot experts first, cold in completion order);
Klotski + HQQ 4-bit. Columns: tokens/s, compute bubble %, bytes moved per step, peak device
bytes (store accounting), the roofline bound of that configuration and the share reached.

The bound (MoE-Lightning's HRM; docs/architecture.md, "Benchmarks and bounds") uses measured terms, step by step: each model forward
(the prefill, then every decode step) takes at least max(bytes its link moved / link bandwidth,
its compute busy seconds), and the steps run one after another, so tokens / the sum of those
maxima bounds the rate. The prefill is compute-bound and the decode steps link-bound: the
average of the whole run (``run-average bound``: tokens per step / max(bytes moved per step /
bandwidth, compute busy seconds per step), also reported) lets one phase's idle link hide the
other's, so it is looser.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

ACCELERATE = "accelerate disk_offload"


@dataclass(frozen=True)
class Rung:
    """One contender: plain HF, an accelerate baseline, or a kinject rule file (+ overrides).

    ``kind``: ``hf`` (every weight in memory), ``acc-disk`` (accelerate ``disk_offload``, page
    cache kept, link not emulated), ``acc-budget`` (accelerate's offload under ``device_budget``,
    its copies charged to the emulated link: :func:`kinject.bench.contenders.load_acc_budget`),
    ``kinject``. ``split``: generate in calls of ``bs`` sequences (a single-batch rung);
    ``per_call``: in calls of that many sequences instead (the batch a contender can run).
    ``budget``: this rung's device budget for weights, instead of the run's (a contender whose KV
    and activations share the device budget gets what they leave).
    ``rung``: a step of the paper's ladder (Table 3), each differing from the one before in one
    thing; the table says how much each climbs, and why where one cannot."""

    name: str
    rules: str | None = None
    overrides: tuple[str, ...] = ()
    kind: str = "kinject"
    split: bool = False
    rung: bool = False
    per_call: int | None = None
    budget: int | None = None


KV_DEVICE = "vars.kv=device"
FILL_LINK = "rules.2.replace.kwargs.fill_link=true"   # GroupedExperts: keep the link busy until the gate routes
PAPER_PREFETCH = ("vars.hot_probability=null", "vars.hot_prefetch_at=lookahead", "pipeline.prefetch_lookahead=2")
LADDER = [
    Rung("HF in RAM", kind="hf"),
    Rung(ACCELERATE, kind="acc-disk"),
    Rung("simple pipeline", "simple_pipeline", split=True, rung=True),
    Rung("+ multi-batch", "multibatch", rung=True),
    # the expert-aware rungs keep the KV where the rungs above keep it (the device), so each rung
    # differs from the one before only in how experts move; the paper's KV placement is its own row
    Rung("+ hot-expert prefetch", "hot_prefetch", (KV_DEVICE,), rung=True),
    Rung("Klotski (+ hot-first order)", "klotski", (KV_DEVICE,), rung=True),
    # the paper's prefetch: exactly K = top-k predicted experts, started while the layer's attention runs
    Rung("Klotski, paper's prefetch (K = top-k, during attention)", "klotski", (KV_DEVICE, *PAPER_PREFETCH)),
    Rung("Klotski + link filling", "klotski", (KV_DEVICE, FILL_LINK)),
    Rung("Klotski, K=6 hot experts", "klotski", (KV_DEVICE, "rules.2.replace.kwargs.hot_experts=6")),
    Rung("Klotski, KV on the host tier (paper placement)", "klotski"),
    Rung("Klotski + HQQ 4-bit", "klotski", (KV_DEVICE, "vars.quant={nbits: 4, group_size: 64}")),
]
QUICK = [LADDER[0], LADDER[2], LADDER[3], LADDER[5]]


@dataclass
class Row:
    name: str
    rules: str | None
    kind: str = "kinject"
    times: list[float] = field(default_factory=list)
    steps: int = 0                  # model forwards of the fastest run (its stats below, too)
    bytes_moved: int = 0            # host->device bytes of that run: weights + KV loads (accounting)
    peak: int = 0                   # device bytes of weights (kinject: store accounting; HF: all of them;
                                    # acc-budget: what stays + the largest module its hooks load at once)
    bubble: float = 0.0
    compute_s: float = 0.0
    phase_s: float = 0.0            # sum over the steps of max(link seconds, compute seconds) of that step
    wait_s: float = 0.0             # seconds the compute stream waited for weights (stall spans of kind "wait"; KV waits are "kv_wait")
    rung: bool = False              # a step of the ladder (see Rung)
    same_tokens: bool | None = None
    note: str = ""
    per_forward: int = 0            # acc-budget: bytes its hooks load at every model forward
    runtime: object = None          # kinject rows: model.kinject (its tracer holds the last run)
    tokens: torch.Tensor | None = None   # the last run's output ids (prompt + new tokens)
    per_call: int = 0               # sequences per generate call
    kv_peak: int = 0                # kinject rows with offloaded attention: peak device bytes of KV (KVStats.peak)
    calls: float | None = None      # Python calls per decode step (``run(count_calls=True)``), first call's sequences


def code_prompts(tok, n: int, prompt_len: int) -> dict:
    """Held-out-style Python prompts, left-padded to ``prompt_len`` tokens."""
    import argparse as _argparse
    import inspect
    import json as _json

    src = (inspect.getsource(_json) + inspect.getsource(_argparse)).split("\n")
    span = max(40, prompt_len // 3)            # ~3+ tokens a line: every prompt fills prompt_len
    texts = ["\n".join(src[i * 7:(i * 7) + span]) for i in range(n)]
    enc = tok(texts, return_tensors="pt", padding="max_length", truncation=True, max_length=prompt_len)
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def _weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _count_forwards(model) -> list[int]:
    """A forward hook counting the model's forwards (one per prefill or decode step)."""
    count = [0]

    def hook(*_) -> None:          # returning a value would replace the model's output
        count[0] += 1

    model.register_forward_hook(hook)
    return count


def run(model_dir: Path, *, bandwidth: float, new_tokens: int, prompt_len: int, repeats: int,
        workdir: Path, quick: bool = False, ladder: list[Rung] | None = None, batch: dict | None = None,
        budget: int | None = None, close: bool = True, min_time: float | None = None,
        dtype: torch.dtype = torch.float32, reference: Path | None = None,
        count_calls: bool = False) -> tuple[list[Row], dict]:
    """Load every rung of ``ladder`` (default: :data:`LADDER`, or :data:`QUICK`), warm each up (one
    token: kinject learns its operator order, every model pays its first-call costs), then time
    ``repeats`` interleaved greedy ``generate`` runs of the same prompts (``batch``, default
    n*bs held-out prompts of ``prompt_len`` tokens). ``budget``: ``pipeline.device_budget`` of
    every kinject rung and the budget of ``acc-budget`` rungs. ``min_time`` (seconds): after its
    first run, a rung whose runs add up to that much is not run again (long runs need fewer
    repeats; timeit's autorange idea). The first rung's tokens are the reference. ``close=False``
    leaves the kinject rows' transfer engines open (caller closes). ``dtype``: every contender's
    compute (and, for a float checkpoint, storage) dtype. ``reference``: the checkpoint the ``hf``
    rungs load (default ``model_dir``; a stored format's float reference where transformers does
    not dequantize it). A ``.gguf`` file loads through transformers' ``gguf_file``. ``count_calls``: after
    the timed runs, each row's Python calls per decode step (:attr:`Row.calls`, cProfile, untraced) on
    the sequences of its first call: what a token costs the host beyond the kernels."""
    import copy

    import kinject
    from kinject.rules import load_rules, resolve_rules_path
    from transformers import AutoTokenizer

    def hf_source(path: Path) -> tuple[Path, dict]:
        path = Path(path)
        return (path.parent, {"gguf_file": path.name}) if path.suffix == ".gguf" else (path, {})

    tok = AutoTokenizer.from_pretrained(hf_source(model_dir)[0], **hf_source(model_dir)[1])
    tok.padding_side = "left"
    klotski = load_rules(resolve_rules_path("klotski")).pipeline
    bs, n = klotski.micro_batch_size, klotski.n_batches
    batch = batch if batch is not None else code_prompts(tok, n * bs, prompt_len)
    sequences = batch["input_ids"].shape[0]
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
    ladder = ladder if ladder is not None else (QUICK if quick else LADDER)
    names = [r.name for r in ladder]
    assert len(set(names)) == len(names)
    rows, models, forwards = [], {}, {}
    hf = None
    load_s = warmup_s = 0.0

    def load_hf():
        from kinject.io.untouched import load_untouched

        return load_untouched(reference or model_dir, dtype, attn_implementation="eager")

    for rung in ladder:
        t0 = time.perf_counter()
        row = Row(rung.name, rung.rules, rung.kind, rung=rung.rung)
        rung_budget = rung.budget if rung.budget is not None else budget
        if rung.kind == "hf":
            m = hf = hf or load_hf()
            row.peak = _weight_bytes(m)
        elif rung.kind == "acc-disk":    # every weight on disk, loaded by accelerate's hooks per module forward
            from kinject.bench.contenders import load_acc_disk

            hf = hf or load_hf()
            m = load_acc_disk(model_dir, dtype, "eager", workdir=workdir, ref=hf, policy="keep").model
        elif rung.kind == "acc-budget":  # what fits the budget stays, the rest loaded per forward over the link
            from kinject.bench.contenders import load_acc_budget

            acc = load_acc_budget(copy.deepcopy(hf) if hf is not None else load_hf(), rung_budget, bandwidth)
            m, row.peak = acc.model, acc.resident + acc.largest
            row.per_forward = acc.offloaded
        else:
            overrides = [f"pipeline.emulate_bandwidth={bandwidth}",   # traced once after the timed runs
                         f"pipeline.offload_dir={workdir}/{Path(rung.rules).stem}",
                         *([f"pipeline.device_budget={rung_budget}"] if rung_budget is not None else []),
                         *rung.overrides]
            m = kinject.from_pretrained(model_dir, rung.rules, overrides, dtype=dtype, attn_implementation="eager")
            row.runtime = m.kinject
        if getattr(m, "kinject", None) is None:
            forwards[rung.name] = _count_forwards(m)
        t1 = time.perf_counter()
        load_s += t1 - t0
        m.generate(**{k: v[:bs] for k, v in batch.items()}, max_new_tokens=1, do_sample=False,
                   pad_token_id=tok.pad_token_id)           # warm-up; kinject learns the order, warms the table
        warmup_s += time.perf_counter() - t1
        models[rung.name] = m
        rows.append(row)
    t_runs = time.perf_counter()
    reference = None
    for rep in range(repeats):                                  # interleaved repeats
        for row, rung in zip(rows, ladder):
            if rep and min_time is not None and sum(row.times) >= min_time:
                continue
            m = models[row.name]
            rt = row.runtime
            if rt is not None:
                rt.tracer.clear()
                rt.store.reset_stats()
                kv = rt.peek("attention")
                if kv is not None:
                    kv.stats.reset()
                steps0 = rt.scheduler.step
            else:
                forwards[row.name][0] = 0
            # a single-batch rung: the same prompts as calls of bs sequences (per_call: of that many)
            row.per_call = min(rung.per_call or (bs if rung.split else sequences), sequences)
            chunks = [slice(i, i + row.per_call) for i in range(0, sequences, row.per_call)]
            t0 = time.perf_counter()
            outs = [m.generate(**{k: v[c] for k, v in batch.items()}, **gen) for c in chunks]
            row.times.append(time.perf_counter() - t0)
            width = max(o.shape[1] for o in outs)
            out = torch.cat([torch.nn.functional.pad(o, (width - o.shape[1], 0), value=tok.pad_token_id) for o in outs])
            if reference is None:
                reference = out
            row.same_tokens = bool(torch.equal(out, reference)) if row.same_tokens in (None, True) else False
            row.tokens = out
            if row.times[-1] > min(row.times):  # the stats are the fastest run's
                continue
            if rt is not None:
                row.steps = rt.scheduler.step - steps0
                row.bytes_moved = sum(rt.store.stats["bytes"].values()) + (
                    kv.stats.counts.get("load_bytes", 0) if kv is not None else 0)
                row.peak = rt.store.peak
                row.kv_peak = kv.stats.peak if kv is not None else 0
            else:
                row.steps = forwards[row.name][0]
                row.bytes_moved = row.per_forward * row.steps
    if count_calls:
        from kinject.bench.step_counts import calls_per_decode_step

        for row in rows:
            first = {k: v[:row.per_call] for k, v in batch.items()}
            row.calls = calls_per_decode_step(models[row.name], first, new_tokens, pad_token_id=tok.pad_token_id)
    for row in rows:       # the trace columns (bubble, compute, bound, waits): one more run, traced; the
        rt = row.runtime   # timed runs are not, as kinject runs by default (tracing costs Python per span)
        if rt is None:
            continue
        _traced_columns(row, models[row.name], batch, gen, sequences, bandwidth)
    meta = {"bs": bs, "n": n, "sequences": sequences, "new_tokens": new_tokens, "prompt_len": prompt_len,
            "bandwidth_gbs": bandwidth, "repeats": repeats, "budget": budget, "dtype": dtype,
            "weights": _weight_bytes(hf) if hf is not None else None,
            "load_s": load_s, "warmup_s": warmup_s, "run_s": time.perf_counter() - t_runs}
    if close:
        for row in rows:
            if row.runtime is not None:
                row.runtime.transfer.close()
    return rows, meta


def _traced_columns(row: Row, model, batch: dict, gen: dict, sequences: int, bandwidth: float) -> None:
    """``row``'s trace columns from one traced run of the same calls as its timed runs."""
    rt = model.kinject
    was = rt.tracer.enabled
    rt.tracer.enabled = True
    rt.tracer.clear()
    try:
        for i in range(0, sequences, row.per_call):
            model.generate(**{k: v[i:i + row.per_call] for k, v in batch.items()}, **gen)
        tr = rt.tracer.summary()
        row.bubble = tr.get("bubble_fraction", 0.0)
        row.compute_s = tr["busy_s"].get("compute", 0.0)
        row.phase_s = step_bound_seconds(rt.tracer, bandwidth * 1e9)
        row.wait_s = sum(e.end - e.start for e in rt.tracer.events() if e.stream == "stall" and e.kind == "wait")
    finally:
        rt.tracer.enabled = was


def table(rows: list[Row], meta: dict) -> str:
    tokens = meta["sequences"] * meta["new_tokens"]
    bw = meta["bandwidth_gbs"] * 1e9
    base = next((r for r in rows if r.name.startswith("simple")), None)
    base_tps = tokens / statistics.median(base.times) if base else None
    lines = ["| configuration | tokens/s | vs simple | compute bubble | moved / step | peak device | bound (tok/s) | % of bound "
             "| run-average bound (tok/s) | tokens = HF |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |"]
    for r in rows:
        tps = tokens / statistics.median(r.times)
        if r.kind == "acc-disk":
            lines.append(f"| {r.name} (disk, page cache kept) | {tps:.1f} | {tps / base_tps:.2f}x | | all weights per step | "
                         f"| | | | {'✓' if r.same_tokens else '✗'} |")
            continue
        if r.kind == "hf":
            lines.append(f"| {r.name} | {tps:.1f} | | | 0 (all in RAM) | | | | | reference |")
            continue
        per_step = r.bytes_moved / max(r.steps, 1)
        if r.runtime is None:        # acc-budget: no trace of its compute, so no bubble and no bound
            lines.append(f"| {r.name} | {tps:.1f} | {tps / base_tps:.2f}x | | {mib(per_step)} | {mib(r.peak)} | | | | "
                         f"{'✓' if r.same_tokens else '✗'} |")
            continue
        t_step = max(per_step / bw, r.compute_s / max(r.steps, 1))
        tok_per_step = tokens / max(r.steps, 1)
        average = tok_per_step / t_step if t_step else float("inf")
        bound = tokens / r.phase_s if r.phase_s else average
        lines.append(f"| {r.name} | {tps:.1f} | {tps / base_tps:.2f}x | {r.bubble:.0%} | {mib(per_step)} | "
                     f"{mib(r.peak)} | {bound:.1f} | {tps / bound:.0%} | {average:.1f} | "
                     f"{'✓' if r.same_tokens else '✗ (HQQ)' if 'HQQ' in r.name else '✗'} |")
    return "\n".join(lines + ladder_notes(rows, meta))


def ladder_notes(rows: list[Row], meta: dict) -> list[str]:
    """Lines under the table: how much each ladder rung climbs over the one before it, with both
    bounds; where one does not climb (< 2 %) and moves no fewer bytes, why, from the measurements:
    what it changes can only gain the time the rung above waited for weights, and how far the
    rung above already is from their shared bound."""
    tokens = meta["sequences"] * meta["new_tokens"]
    steps = [r for r in rows if r.rung and r.runtime is not None and r.times]
    if len(steps) < 2:
        return []
    out = ["", "Ladder (each rung differs from the one above it in one thing):"]
    for prev, cur in zip(steps, steps[1:]):
        a, b = (tokens / statistics.median(r.times) for r in (prev, cur))
        ba, bb = (tokens / r.phase_s if r.phase_s else float("nan") for r in (prev, cur))
        line = f"- {cur.name}: {b / a:.2f}x {prev.name} ({a:.1f} -> {b:.1f} tok/s; bound {ba:.1f} -> {bb:.1f})"
        per_a, per_b = (r.bytes_moved / max(r.steps, 1) for r in (prev, cur))
        if b < 1.02 * a and per_b >= 0.98 * per_a:
            step_ms = 1e3 * statistics.median(prev.times) / max(prev.steps, 1)
            wait_ms = 1e3 * prev.wait_s / max(prev.steps, 1)
            by_bound = ba / a                                         # what the shared bound leaves
            by_wait = step_ms / max(step_ms - wait_ms, 1e-9)          # every wait filled with compute
            limit = ("the bound: the link, not the wait, sets the step" if by_bound <= by_wait else
                     "the wait: even filled with compute, the step shrinks by no more than it")
            line += (f". It does not climb: it moves as many bytes ({mib(per_a)} -> {mib(per_b)} per step), so it "
                     f"shares the bound of the rung above, and changes only what runs while weights arrive. It could "
                     f"gain at most {min(by_bound, by_wait):.2f}x: {prev.name} already runs at {a / ba:.0%} of that "
                     f"bound (compute bubble {prev.bubble:.0%}) and waited {wait_ms:.2f} ms per step for weights "
                     f"({wait_ms / step_ms:.0%} of its {step_ms:.2f} ms step); what limits it is {limit}")
        out.append(line)
    first, last = steps[1] if len(steps) > 2 else steps[0], steps[-1]
    a, b = (tokens / statistics.median(r.times) for r in (first, last))
    out.append(f"- {last.name} / {first.name}: {b / a:.2f}x")
    return out


def step_bound_seconds(tracer, bandwidth: float) -> float:
    """Sum over the traced steps of max(bytes the link started moving in the step / ``bandwidth``
    (bytes/s), compute busy seconds in the step): the least time these steps can take one after
    another. A transfer counts in the step it starts in (one started between two steps: the next).
    0.0 without steps."""
    import bisect

    from kinject.trace import union_seconds

    steps = tracer.steps()
    if not steps:
        return 0.0
    starts = [a for a, _ in steps]
    nbytes = [0] * len(steps)
    compute: list[list[tuple[float, float]]] = [[] for _ in steps]
    for e in tracer.events():
        i = max(0, bisect.bisect_right(starts, e.start) - 1)
        if e.kind == "transfer":
            if i < len(steps) - 1 and e.start >= steps[i][1]:
                i += 1                                 # between two steps: for the next one
            nbytes[i] += e.nbytes
        elif e.stream == "compute":
            lo, hi = max(e.start, steps[i][0]), min(e.end, steps[i][1])
            if hi > lo:
                compute[i].append((lo, hi))
    return sum(max(b / bandwidth, union_seconds(c)) for b, c in zip(nbytes, compute))


def mib(b: float) -> str:
    return f"{b / 2**20:.2f} MiB"


def main(args, more: Callable[[Path], str] | None = None) -> int:
    """The ladder's table; ``more(model_dir)``: tables to print after it on the same model
    (``--formats``: :func:`kinject.bench.formats.cli`)."""
    from kinject.fixtures import tiny_moe_path

    torch.set_num_threads(args.threads)
    workdir = Path(args.workdir)
    if args.experts is not None:
        if args.model:
            raise SystemExit("--experts builds its own model: give either --model or --experts, not both")
        model_dir = many_experts_model(workdir, args.experts, args.top_k, args.expert_intermediate)
    else:
        model_dir = Path(args.model) if args.model else tiny_moe_path()
    rows, meta = run(model_dir, bandwidth=args.bandwidth, new_tokens=args.new_tokens, prompt_len=args.prompt_len,
                     repeats=args.repeats, workdir=workdir, quick=args.quick)
    head = (f"kinject bench cpu — model {model_dir.name}, {meta['sequences']} sequences (n={meta['n']} x bs={meta['bs']}), "
            f"prompt {meta['prompt_len']}, {meta['new_tokens']} new tokens, float32, weights on host, "
            f"host->device link EMULATED at {meta['bandwidth_gbs']} GB/s, median of {meta['repeats']} interleaved repeats")
    text = head + "\n\n" + table(rows, meta)
    if more is not None:
        text += "\n\n" + more(model_dir)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def add_arguments(s) -> None:
    s.add_argument("--model", default=None, help="model directory (default: the trained fixture)")
    s.add_argument("--bandwidth", type=float, default=1.0, help="emulated host->device GB/s (default 1)")
    s.add_argument("--new-tokens", type=int, default=16)
    s.add_argument("--prompt-len", type=int, default=64)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--workdir", default="/tmp/kinject-bench/cpu")
    s.add_argument("--quick", action="store_true", help="fewer rows (smoke test)")
    s.add_argument("--experts", type=int, default=None,
                   help="run on a random model shaped like the fixture but with this many (smaller) experts "
                        "per layer: the many-small-experts regime where a batch group uses few of them")
    s.add_argument("--top-k", type=int, default=4, help="with --experts: experts per token (default 4)")
    s.add_argument("--expert-intermediate", type=int, default=64,
                   help="with --experts: each expert's intermediate size (default 64)")
    s.add_argument("--formats", nargs="+", default=None, metavar="FORMAT",
                   help="after the ladder, a table of the Klotski rung on the model stored as bf16, fp8 (block "
                        "128x128), nvfp4 (compressed-tensors), gguf-q4_k (llama.cpp; a tiny Qwen3-MoE when "
                        "transformers' GGUF loading knows no such MoE) and/or mxfp4 (gpt-oss experts; a tiny "
                        "gpt-oss when the model is not one), checkpoints written to a temporary folder, tokens "
                        "checked against transformers' load of each checkpoint (e.g. --formats bf16 fp8 nvfp4 gguf-q4_k)")
    s.add_argument("--formats-bandwidth", type=float, default=None, metavar="GB/S",
                   help="the emulated link of the --formats table (default: --bandwidth); low enough that the "
                        "link, not compute, bounds the bf16 step")
    s.add_argument("--out", default=None, help="write the Markdown table here")


def many_experts_model(workdir: Path, experts: int, top_k: int, intermediate: int) -> Path:
    """The fixture's shape (layers, hidden, attention, tokenizer) with ``experts`` experts of
    ``intermediate`` width and top-``top_k`` routing, random weights (seed 0), saved once under
    ``workdir``; the router is random, so the correlation table has little to learn."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from kinject.fixtures import tiny_moe_path

    if experts < 2 or intermediate < 1:
        raise SystemExit(f"--experts must be >= 2 and --expert-intermediate >= 1, got {experts} and {intermediate}")
    if not 1 <= top_k <= experts:
        raise SystemExit(f"--top-k must be in [1, --experts={experts}], got {top_k}")
    out = workdir / f"many_experts_e{experts}_k{top_k}_i{intermediate}"
    if (out / "config.json").is_file():
        return out
    src = tiny_moe_path()
    config = AutoConfig.from_pretrained(src)
    config.num_local_experts, config.num_experts_per_tok, config.intermediate_size = experts, top_k, intermediate
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


# ---------------------------------------------------------------- KV offload

def bench_kv(args) -> int:
    """Long context: KV of every sequence on the host, attention per micro-batch (KV
    streamed over the EMULATED link), vs KV resident on the device; other weights equal. Then
    a mixed-attention model (linear attention + full attention) against a full-attention model of the same
    size: KV bytes moved per decode step (:func:`bench_kv_mixed`)."""
    import kinject
    from kinject.fixtures import tiny_moe_path
    from operators.attention import attention_group
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else tiny_moe_path()
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    batch = code_prompts(tok, args.sequences, args.prompt_len)
    gen = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
               pad_token_id=tok.pad_token_id, return_dict_in_generate=True)
    rows = {}
    for name, kv in (("KV resident on device", "device"), ("KV on host, micro-batched", "host")):
        m = kinject.from_pretrained(model_dir, "kv_offload",
                                    [f"vars.kv={kv}", "vars.weights=device", f"pipeline.micro_batch_size={args.bs}",
                                     f"pipeline.emulate_bandwidth={args.bandwidth}",
                                     f"pipeline.offload_dir={args.workdir}/kv_{kv}"],
                                    dtype=torch.float32, attn_implementation="eager")
        rows[name] = (m, [])
    outs, caches = {}, {}
    for _ in range(args.repeats):
        for name, (m, times) in rows.items():
            attention_group(m.kinject).stats.reset()
            t0 = time.perf_counter()
            result = m.generate(**batch, **gen)
            times.append(time.perf_counter() - t0)
            outs[name], caches[name] = result.sequences, result.past_key_values
    tokens = args.sequences * args.new_tokens
    ref = outs["KV resident on device"]
    lines = [f"kinject bench kv — model {model_dir.name}, {args.sequences} sequences, prompt {args.prompt_len}, "
             f"{args.new_tokens} new tokens, micro-batch {args.bs}, float32, weights resident, KV link EMULATED at "
             f"{args.bandwidth} GB/s, median of {args.repeats} interleaved repeats", "",
             "| KV placement | tokens/s | peak device KV | KV moved per generate | tokens = resident |",
             "| --- | ---: | ---: | ---: | :---: |"]
    for name, (m, times) in rows.items():
        group = attention_group(m.kinject)
        s = group.stats
        moved = s.counts.get("load_bytes", 0) + s.counts.get("store_bytes", 0)
        # resident: the whole cache lives on the device; offloaded: the streamed working set's peak
        peak = _held_bytes(caches[name]) if name.startswith("KV resident") else s.peak
        lines.append(f"| {name} | {tokens / statistics.median(times):.1f} | {mib(peak)} | {mib(moved)} | "
                     f"{'✓' if torch.equal(outs[name], ref) else '✗'} |")
        m.kinject.transfer.close()
    lines += ["", *bench_kv_mixed(args, batch["input_ids"].shape[0], args.prompt_len)]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


# Mixed vs full attention, same family and size: Qwen3-Next's pattern (3 gated-delta-net layers per
# full-attention layer) against the same model with every layer full attention.
MIXED_FAMILY = "qwen3_next"
MIXED_LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def bench_kv_mixed(args, sequences: int, prompt_len: int) -> list[str]:
    """KV bytes moved per decode step, mixed-attention model vs a full-attention model of the same size (same
    family, hidden size, layers, experts), KV on the host, attention and mixers per micro-batch; every
    row's greedy tokens checked against its untouched model."""
    import kinject
    from kinject.families import build_tiny_family_model
    from kinject.testing import tiny_tokenizer
    from operators.attention import attention_group

    tok = tiny_tokenizer()
    # random (seeded) token ids: the tiny tokenizer's corpus is shorter than a long prompt; bytes moved
    # depend on lengths only, and tokens are compared with the untouched model on the same ids
    ids = torch.randint(len(tok.all_special_ids), tok.vocab_size, (sequences, prompt_len),
                        generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    gen = dict(do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=None)
    mixers = r"(Attention|GatedDeltaNet)$"
    rules = {"pipeline": {"micro_batch_size": args.bs, "emulate_bandwidth": args.bandwidth,
                          "offload_dir": f"{args.workdir}/mixed"},
             "rules": [{"match": {"class_name": mixers},
                        "replace": {"class": "operators.attention.OffloadedAttention",
                                    "kwargs": {"weights": "device", "kv_cache": "host"}}}]}
    out = [f"Mixed vs full attention — {MIXED_FAMILY} (hidden 64, {len(MIXED_LAYERS)} layers, 8 experts, random "
           f"weights), {sequences} sequences, prompt {prompt_len}, {args.new_tokens} new tokens, micro-batch {args.bs}, "
           f"KV on host, link EMULATED at {args.bandwidth} GB/s, every mixer an OffloadedAttention", "",
           "| model | layers (attention / linear) | KV moved per decode step | KV stored on host after generate | "
           "recurrent + conv state (stays with compute) | tokens/s (one run) | tokens = untouched |",
           "| --- | --- | ---: | ---: | ---: | ---: | :---: |"]
    steps = []
    for name, layer_types in (("full attention", ["full_attention"] * len(MIXED_LAYERS)), ("mixed attention", MIXED_LAYERS)):
        model = build_tiny_family_model(MIXED_FAMILY, num_hidden_layers=len(layer_types), layer_types=layer_types,
                                        max_position_embeddings=max(512, prompt_len + args.new_tokens))
        ref = model.generate(**batch, max_new_tokens=args.new_tokens, **gen)
        kinject.optimize(model, rules)
        stats = attention_group(model.kinject).stats
        stats.reset()
        model.generate(**batch, max_new_tokens=1, **gen)                  # prefill only
        prefill = stats.counts["load_bytes"] + stats.counts["store_bytes"]
        stats.reset()
        t0 = time.perf_counter()
        res = model.generate(**batch, max_new_tokens=args.new_tokens, return_dict_in_generate=True, **gen)
        seconds = time.perf_counter() - t0
        moved = stats.counts["load_bytes"] + stats.counts["store_bytes"]
        per_step = (moved - prefill) / max(args.new_tokens - 1, 1)
        cache = res.past_key_values
        n_attn = sum(t != "linear_attention" for t in layer_types)
        out.append(f"| {name} | {n_attn} / {len(layer_types) - n_attn} | {mib(per_step)} | "
                   f"{mib(cache.stored_bytes()['host'])} | {mib(cache.state_bytes())} | "
                   f"{sequences * args.new_tokens / seconds:.1f} | {'✓' if torch.equal(res.sequences, ref) else '✗'} |")
        steps.append(per_step)
        model.kinject.transfer.close()
        kinject.restore(model)
    if steps[1]:
        out += ["", f"The mixed-attention model moves {steps[0] / steps[1]:.1f}x less KV per decode step than the full-attention "
                "model of the same size: its linear-attention layers keep fixed-size recurrent and conv states with "
                "the compute (exact), only its attention layer streams KV."]
    return out


def _held_bytes(obj, seen=None) -> int:
    """Bytes of the distinct tensor storages an object (a KV cache) holds, walking its attributes."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        st = obj.untyped_storage()
        if st.data_ptr() in seen:
            return 0
        seen.add(st.data_ptr())
        return st.nbytes()
    if isinstance(obj, (list, tuple)):
        return sum(_held_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(_held_bytes(x, seen) for x in obj.values())
    if hasattr(obj, "__dict__") and id(obj) not in seen and type(obj).__module__.startswith("kinject"):
        seen.add(id(obj))
        return sum(_held_bytes(v, seen) for k, v in vars(obj).items() if k not in ("transfer", "stats", "config"))
    return 0


def add_kv_arguments(s) -> None:
    s.add_argument("--model", default=None, help="model directory (default: the trained fixture)")
    s.add_argument("--sequences", type=int, default=16)
    s.add_argument("--bs", type=int, default=4, help="micro-batch size of the offloaded attention")
    s.add_argument("--prompt-len", type=int, default=768)
    s.add_argument("--new-tokens", type=int, default=16)
    s.add_argument("--bandwidth", type=float, default=4.0, help="emulated host<->device GB/s")
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--workdir", default="/tmp/kinject-bench/kv")
    s.add_argument("--out", default=None)


# ---------------------------------------------------------------- planner: predicted vs measured

def bench_plan(args) -> int:
    """Per n: the planner's predicted decode step time vs the measured one (same model, rules); then the
    ``n`` that ``pipeline.n_batches: auto`` picks, measured beside the best measured ``n``."""
    import kinject
    from kinject.plan.groups import plan_groups
    from kinject.plan import planner, profiler
    from kinject.fixtures import tiny_moe_path
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    model_dir = Path(args.model) if args.model else tiny_moe_path()
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    overrides = [f"pipeline.emulate_bandwidth={args.bandwidth}", f"pipeline.offload_dir={args.workdir}", *args.set]
    model = kinject.from_pretrained(model_dir, "klotski", overrides, dtype=torch.float32,
                                    attn_implementation="eager")
    rt = model.kinject
    bs = rt.pipeline.micro_batch_size
    context = args.prompt_len + args.new_tokens // 2
    ns, auto_n, coverage = list(args.n), None, None
    batches = {n: code_prompts(tok, n * bs, args.prompt_len) for n in ns}
    predicted: dict[int, list[dict]] = {}
    times: dict[int, list[float]] = {}
    for _ in range(args.repeats):     # each round re-profiles, then measures every n: both see the same load
        profile = profiler.measure_profile(model, bs=bs, refresh=True, prompt_len=args.prompt_len)   # the KV's length
        coverage = profiler.hot_coverage(model)
        if auto_n is None:            # what `n_batches: auto` runs, from the same profile
            auto_n = plan_groups(dataclasses.replace(rt.pipeline, n_batches="auto"), model, profile).n
            ns = list(dict.fromkeys([*ns, auto_n]))
            batches.setdefault(auto_n, code_prompts(tok, auto_n * bs, args.prompt_len))
        for n in ns:
            predicted.setdefault(n, []).append(planner.predict_step(profile, n, context=context, hot_coverage=coverage))
            times.setdefault(n, []).append(_decode_step(model, tok, batches[n], args.new_tokens))
    lines = [f"kinject bench plan — model {model_dir.name}, Klotski rules, bs={bs}, prompt {args.prompt_len}, "
             f"{args.new_tokens} new tokens, float32, link EMULATED at {args.bandwidth} GB/s, hot coverage "
             f"{coverage if coverage is not None else 'default'}; predicted = planner.predict_step from the profile "
             "the run measured (per layer the larger of two lanes: the thread's compute + its untraced work inside "
             "the layers + the wait for the layer's weights, and the link: the experts the prefetch policy moves, "
             "every micro-batch's KV at the step's context; plus the untraced work between steps); link wait = "
             "predicted - compute - untraced; measured = one decode step: (generate of 1 + T tokens - generate of 1) / T, "
             f"prefill excluded; {args.repeats} rounds of (re-profile, then every n), medians over the rounds "
             "(the ratio: the median of each round's ratio)", "",
             "| n | sequences | predicted step | compute | link wait | link | experts moved / layer | untraced "
             "| measured step | measured / predicted | measured tokens/s | (7) holds |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |"]
    measured = {n: statistics.median(t) for n, t in times.items()}
    rate = {n: n * bs / measured[n] for n in ns}
    ms = lambda x: f"{x * 1e3:.2f} ms"  # noqa: E731
    for n in ns:
        p = {k: statistics.median(d[k] for d in predicted[n]) for k in predicted[n][0]}
        ratio = statistics.median(t / d["step_s"] for t, d in zip(times[n], predicted[n]))
        r7 = planner.inequality_rows(profile, n, bs, hot_coverage=coverage, kv_in_eq7=profile.kv_bytes > 0)[-1]
        lines.append(f"| {n}{' (auto)' if n == auto_n else ''} | {n * bs} | {ms(p['step_s'])} | {ms(p['compute_s'])} | "
                     f"{ms(p['stall_s'])} | {ms(p['transfer_s'])} | {p['experts_moved']:.1f} | {ms(p['extra_s'])} | "
                     f"{ms(measured[n])} | {ratio:.2f} | {rate[n]:.1f} | {'✓' if r7.holds else '✗'} |")
    best = max(ns, key=rate.__getitem__)
    lines += ["", "| auto n | auto step | auto tokens/s | best measured n | best tokens/s | auto / best |",
              "| ---: | ---: | ---: | ---: | ---: | ---: |",
              f"| {auto_n} | {ms(measured[auto_n])} | {rate[auto_n]:.1f} | {best} | {rate[best]:.1f} | "
              f"{rate[auto_n] / rate[best]:.2f} |", "",
              "auto n = what `pipeline.n_batches: auto` runs (planner.throughput_n: the smallest n whose predicted "
              f"tokens/s is within {planner.AUTO_TOLERANCE * 100:g} % of the best predicted); best = the highest measured "
              "tokens/s of the n above."]
    rt.transfer.close()
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def _decode_step(model, tok, batch, new_tokens: int) -> float:
    """Seconds of one decode step of the batch group: a generate of ``1 + new_tokens`` tokens minus
    one of 1 token (the prefill and the first token), over ``new_tokens`` -- the quantity the
    planner predicts, without the prefill a whole-generate average mixes in."""
    def timed(tokens: int) -> float:
        t0 = time.perf_counter()
        model.generate(**batch, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                       pad_token_id=tok.pad_token_id)
        return time.perf_counter() - t0

    return (timed(1 + new_tokens) - timed(1)) / new_tokens


def add_plan_arguments(s) -> None:
    s.add_argument("--model", default=None, help="model directory (default: the trained fixture)")
    s.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    s.add_argument("--prompt-len", type=int, default=32)
    s.add_argument("--new-tokens", type=int, default=16)
    s.add_argument("--bandwidth", type=float, default=1.0)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    s.add_argument("--workdir", default="/tmp/kinject-bench/plan")
    s.add_argument("--out", default=None)
