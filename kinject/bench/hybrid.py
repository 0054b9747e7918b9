"""``kinject bench hybrid``: experts computed where they live vs. moved, by batch size.

For each model (the trained fixture and the 64-expert ladder model, :func:`kinject.bench.cpu.many_experts_model`)
and each batch size (1, 4, 16, 64 sequences in one ``generate``), interleaved in one process on the same
prompts: the model resident (HF in RAM), accelerate's offload under the same device budget, Klotski
(``rules/klotski.yaml``), hybrid (``rules/hybrid.yaml``: the budget kept for what runs every step,
embeddings / lm_head and experts computed where they live by Fiddler's rule per layer, expert and
step) and hybrid with ``vars.attention_compute=host`` (attention over the host KV where it lives:
then only activations cross the link).
All offloading contenders use the same ``device_budget`` and the same EMULATED host->device link; host
compute is real CPU time. Columns: tokens/s, bytes over the link per step (weights, KV and the
activations of whatever computes on the host, both ways), hybrid's choice per layer (experts computed on the host /
moved, per step), and the share of the three-resource bound each reached: per step max(link seconds,
device compute, host compute) -- on a CPU-only machine the device and the host are the same cores, so
there the two compute lanes share it (max(link, the time either is busy)). The crossover batch is the first batch
where Klotski is at least as fast as hybrid (measured) and where hybrid's plan moves more experts than it
computes on the host (chosen).

On a CPU-only machine the emulated "device" is the host's own cores running the same kernel, so moving
an expert only adds its link time: the decision compares the link's two costs alone (an expert's rows'
activations both ways vs. its bytes, ``PlacementCosts.same_cores``), keeps every cold expert of a decode
step on the host at every batch size here, and moves experts only where their rows outweigh them (a long
prefill). The crossover it would find on a GPU (device compute much cheaper per row) does not appear.
"""

from __future__ import annotations

import logging
import statistics
from pathlib import Path

import torch

from kinject.bench.cpu import Row, Rung, mib, code_prompts, many_experts_model, run
from kinject.trace import union_seconds

logger = logging.getLogger(__name__)

BATCHES = (1, 4, 16, 64)
QUICK_BATCHES = (1, 4)


def ladder(batch: int) -> list[Rung]:
    """The contenders at ``batch`` sequences: Klotski's groups of ``n`` micro-batches of ``bs`` (``bs``
    a quarter of the batch, at least 1: n = 4 as klotski.yaml's default, n = 1 at batch 1)."""
    bs = max(1, batch // 4)
    groups = (f"pipeline.micro_batch_size={bs}", f"pipeline.n_batches={batch // bs}")
    return [Rung("resident (HF in RAM)", kind="hf"),
            Rung("accelerate offload", kind="acc-budget"),
            Rung("Klotski", "klotski", groups),
            Rung("hybrid", "hybrid", groups),
            Rung(HOST_ATTENTION, "hybrid", (*groups, "vars.kv=host", "vars.attention_compute=host"))]


HOST_ATTENTION = "hybrid, host attention"


def activation_bytes_per_step(row: Row) -> float:
    """Bytes of activations moved per step between the device and host compute: experts' rows and
    embeddings / lm_head in and out (the link's ``activations`` tier in the last run's trace), host
    attention's queries, new KV entries and outputs (its host lane, averaged over every step run)."""
    rt = row.runtime
    steps = max(len(rt.tracer.steps()), 1)
    traced = sum(e.nbytes for e in rt.tracer.events() if e.kind == "transfer" and getattr(e, "tier", None) == "activations")
    group = rt.peek("attention")
    lane = getattr(group, "_lane", None)
    laned = (lane.stats["to_host_bytes"] + lane.stats["to_device_bytes"]) / max(rt.scheduler.step, 1) if lane else 0.0
    return traced / steps + laned


def three_resource_seconds(tracer, bandwidth: float, shared_cores: bool) -> float:
    """Sum over the traced steps of max(link seconds, device compute, host compute) -- the least
    time the steps can take with the link, the device and the host all busy at once; with
    ``shared_cores`` (a CPU device: host and device compute on the same cores, one thread) max(link,
    the time either lane is busy). A transfer counts in the step it starts in."""
    import bisect

    steps = tracer.steps()
    if not steps:
        return 0.0
    starts = [a for a, _ in steps]
    nbytes = [0] * len(steps)
    lanes = {"compute": [[] for _ in steps], "host_compute": [[] for _ in steps]}
    for e in tracer.events():
        i = max(0, bisect.bisect_right(starts, e.start) - 1)
        if e.kind == "transfer":
            nbytes[i + (1 if i < len(steps) - 1 and e.start >= steps[i][1] else 0)] += e.nbytes
        elif e.stream in lanes:
            lo, hi = max(e.start, steps[i][0]), min(e.end, steps[i][1])
            if hi > lo:
                lanes[e.stream][i].append((lo, hi))
    total = 0.0
    for i, b in enumerate(nbytes):
        dev, host = lanes["compute"][i], lanes["host_compute"][i]
        busy = union_seconds(dev + host) if shared_cores else max(union_seconds(dev), union_seconds(host))
        total += max(b / bandwidth, busy)
    return total


def choice_per_layer(row: Row) -> str:
    """Hybrid's choice per MoE layer over the run: experts computed on the host / moved, per step."""
    rt = row.runtime
    r = rt.peek("expert_routing")
    if r is None:
        return ""
    parts = []
    for layer, op in sorted((k, v) for k, v in r.experts.items() if isinstance(k, int)):
        io = r.io.get(layer, {"steps": 0, "loads": 0})
        steps = max(io["steps"], 1)
        host = op.host.stats["experts"] if op.host is not None else 0
        parts.append(f"L{layer} {host / steps:.1f}/{io['loads'] / steps:.1f}")
    return " ".join(parts)


def bench_model(model_dir: Path, *, batches, bandwidth: float, budget: int, new_tokens: int, prompt_len: int,
                repeats: int, workdir: Path) -> tuple[list[str], dict]:
    """The table rows of one model, and per batch the (Klotski, hybrid) tokens/s and hybrid's share of
    experts on the host (for the crossover)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    lines, points = [], {}
    for b in batches:
        batch = code_prompts(tok, b, prompt_len)
        rows, meta = run(model_dir, bandwidth=bandwidth, new_tokens=new_tokens, prompt_len=prompt_len,
                         repeats=repeats, workdir=workdir / f"b{b}", ladder=ladder(b), batch=batch, budget=budget,
                         close=False, count_calls=True)
        tokens = b * new_tokens
        tps = {r.name: tokens / statistics.median(r.times) for r in rows}
        for r in rows:
            lines.append(_line(model_dir.name, b, r, tokens, tps, bandwidth))
        hyb = max((r for r in rows if r.rules == "hybrid"), key=lambda r: tps[r.name])   # the faster hybrid row
        host = sum(op.host.stats["experts"] for op in hyb.runtime.peek("expert_routing").experts.values()
                   if op.host is not None)
        loads = sum(s["loads"] for s in hyb.runtime.peek("expert_routing").io.values())
        points[b] = (tps["Klotski"], tps[hyb.name], host / max(host + loads, 1))
        for r in rows:
            if r.runtime is not None:
                r.runtime.transfer.close()
    return lines, points


def _line(model: str, b: int, r: Row, tokens: int, tps: dict, bandwidth: float) -> str:
    per_step = r.bytes_moved / max(r.steps, 1) + (activation_bytes_per_step(r) if r.runtime is not None else 0)
    same = "✓" if r.same_tokens else "✗"
    calls = f"{r.calls:,.0f}" if r.calls is not None else ""
    if r.runtime is None:
        moved = "0 (all in RAM)" if r.kind == "hf" else mib(per_step)
        return (f"| {model} | {b} | {r.name} | {tps[r.name]:.1f} | {tps[r.name] / tps['Klotski']:.2f}x | {moved} | | | "
                f"{calls} | {same} |")
    shared = r.runtime.device.type == "cpu"
    secs = three_resource_seconds(r.runtime.tracer, bandwidth * 1e9, shared)
    bound = f"{tps[r.name] / (tokens / secs):.0%}" if secs else ""
    choice = choice_per_layer(r) if r.rules == "hybrid" else ""
    return (f"| {model} | {b} | {r.name} | {tps[r.name]:.1f} | {tps[r.name] / tps['Klotski']:.2f}x | {mib(per_step)} | "
            f"{bound} | {choice} | {calls} | {same} |")


def crossover(points: dict) -> str:
    """Where the crossover lies, measured and chosen (see the module docstring)."""
    measured = next((b for b, (k, h, _) in sorted(points.items()) if k >= h), None)
    chosen = next((b for b, (_, _, share) in sorted(points.items()) if share < 0.5), None)
    say = lambda b: f"batch {b}" if b is not None else f"none up to batch {max(points)}"   # noqa: E731
    return f"crossover: measured (Klotski >= hybrid) {say(measured)}; chosen (hybrid moves more than it computes on the host) {say(chosen)}"


def main(args) -> int:
    from kinject.fixtures import tiny_moe_path
    from kinject.rules import parse_size

    torch.set_num_threads(args.threads)
    workdir = Path(args.workdir)
    budget = parse_size(args.budget)
    batches = tuple(args.batches) if args.batches else QUICK_BATCHES if args.quick else BATCHES
    models = [tiny_moe_path()] if args.quick else \
        [tiny_moe_path(), many_experts_model(workdir, args.experts, args.top_k, args.expert_intermediate)]
    out = [f"kinject bench hybrid — budget {mib(budget)}, host->device link EMULATED at {args.bandwidth} GB/s "
           f"(host compute: real CPU time, {args.threads} torch thread(s)), prompt {args.prompt_len}, "
           f"{args.new_tokens} new tokens, float32, weights on host, median of {args.repeats} interleaved repeats",
           "", "| model | batch | contender | tokens/s | vs Klotski | moved / step | % of 3-resource bound | "
           "hybrid: host/moved experts per step, per layer | Python calls / decode step | tokens = HF |",
           "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: | :---: |"]
    notes = []
    for model_dir in models:
        lines, points = bench_model(model_dir, batches=batches, bandwidth=args.bandwidth, budget=budget,
                                    new_tokens=args.new_tokens, prompt_len=args.prompt_len, repeats=args.repeats,
                                    workdir=workdir / model_dir.name)
        out += lines
        notes.append(f"- {model_dir.name}: {crossover(points)}")
    text = "\n".join(out + [""] + notes)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def add_arguments(s) -> None:
    s.add_argument("--batches", type=int, nargs="+", default=None, help=f"default {' '.join(map(str, BATCHES))} "
                   f"({' '.join(map(str, QUICK_BATCHES))} with --quick)")
    s.add_argument("--bandwidth", type=float, default=1.0, help="emulated host->device GB/s (default 1)")
    s.add_argument("--budget", default="6MiB", help="device budget of every offloading contender (default 6MiB)")
    s.add_argument("--new-tokens", type=int, default=16)
    s.add_argument("--prompt-len", type=int, default=32)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--experts", type=int, default=64, help="experts of the ladder model (default 64)")
    s.add_argument("--top-k", type=int, default=4)
    s.add_argument("--expert-intermediate", type=int, default=64)
    s.add_argument("--workdir", default="/tmp/kinject-bench/hybrid")
    s.add_argument("--quick", action="store_true", help="the fixture only, batches 1 and 4 (smoke test)")
    s.add_argument("--out", default=None, help="write the Markdown table here")
