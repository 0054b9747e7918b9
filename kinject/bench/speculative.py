"""``kinject bench speculative``: prompt-lookup decoding vs plain decoding at batch 1, offloaded
(docs/architecture.md, "Forwards that rewrite or only read positions").

At batch 1 a decode step computes one token, yet every expert its router picks must be on the
device (moved, or computed where it lives): the step costs about as much as the experts it touches.
Prompt-lookup decoding (transformers' ``prompt_lookup_num_tokens=k``) drafts up to ``k`` tokens by
matching the last n-gram against the prompt and verifies them in one forward of ``k + 1`` tokens:
each expert that forward needs moves once for every token it verifies, the way a batch shares it
(the rejected drafts are cropped from the KV, :meth:`kinject.kv.KVLayer.crop`). A repetitive prompt
(repeated import lines) is where its drafts are accepted.

Contenders, interleaved in one process on one loaded model per rule file (the same prompt): plain
greedy decoding and prompt-lookup decoding, under ``rules/hybrid.yaml`` (and ``rules/klotski.yaml``)
with the fixture's weights on the host behind an EMULATED host->device link and a device budget.
Columns: tokens/s (best and median of the repeats), model forwards per generated token, bytes over
the link per generated token (weights and KV), and whether the tokens equal the untouched model's.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

import torch

from kinject.bench.cpu import mib

logger = logging.getLogger(__name__)

# repeated import lines: the built-in model continues them (as code edits and summaries of a given
# text repeat it), so the n-grams prompt lookup drafts are mostly verified (about 2.8 tokens a forward)
PROMPT = "import os\nimport sys\nimport json\nimport re\n\nimport os\nimport sys\n"


def _generate(model, batch, pad: int, new: int, **kw):
    return model.generate(**batch, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad, **kw)


def bench(*, rules: list[str], lookup: int, bandwidth: float, budget: str, new_tokens: int, repeats: int,
          workdir: Path) -> list[str]:
    """The table's rows: per rule file, plain and prompt-lookup decoding, interleaved repeats."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import kinject
    from kinject.fixtures import tiny_moe_path

    path = tiny_moe_path()
    tok = AutoTokenizer.from_pretrained(path)
    batch = tok([PROMPT], return_tensors="pt")
    pad = tok.pad_token_id
    untouched = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference = _generate(untouched, batch, pad, new_tokens)
    del untouched
    modes = {"plain greedy": {}, f"prompt lookup (k={lookup})": {"prompt_lookup_num_tokens": lookup}}
    models = {}
    for name in rules:
        overrides = [f"pipeline.emulate_bandwidth={bandwidth}", f"pipeline.device_budget={budget}",
                     f"pipeline.offload_dir={workdir}/{name}"]
        model = kinject.from_pretrained(path, name, overrides, dtype=torch.float32)
        for kw in modes.values():                              # warm-up: first-call costs, the order learnt
            _generate(model, batch, pad, 2, **kw)
        models[name] = model
    runs: dict[tuple[str, str], list[dict]] = {(r, m): [] for r in rules for m in modes}
    for _ in range(repeats):                                   # interleaved: every contender once per round
        for name, model in models.items():
            rt = model.kinject
            for mode, kw in modes.items():
                rt.store.reset_stats()
                kv = rt.peek("attention")
                if kv is not None:
                    kv.stats.reset()
                step0 = rt.scheduler.step
                t0 = time.perf_counter()
                out = _generate(model, batch, pad, new_tokens, **kw)
                seconds = time.perf_counter() - t0
                moved = sum(rt.store.stats["bytes"].values()) + (kv.stats.counts.get("load_bytes", 0) if kv else 0)
                runs[(name, mode)].append({"s": seconds, "forwards": rt.scheduler.step - step0, "moved": moved,
                                           "same": bool(torch.equal(out, reference))})
    lines = []
    for (name, mode), got in runs.items():
        best = min(r["s"] for r in got)
        median = statistics.median(r["s"] for r in got)
        fastest = min(got, key=lambda r: r["s"])
        plain = min(r["s"] for r in runs[(name, "plain greedy")])
        lines.append(f"| {name} | {mode} | {new_tokens / best:.1f} | {new_tokens / median:.1f} | {plain / best:.2f}x | "
                     f"{fastest['forwards'] / new_tokens:.2f} | {mib(fastest['moved'] / new_tokens)} | "
                     f"{'✓' if all(r['same'] for r in got) else '✗'} |")
    for model in models.values():
        model.kinject.transfer.close()
    return lines


def main(args) -> int:
    torch.set_num_threads(args.threads)
    lines = bench(rules=args.rules, lookup=args.lookup, bandwidth=args.bandwidth, budget=args.budget,
                  new_tokens=args.new_tokens, repeats=args.repeats, workdir=Path(args.workdir))
    out = [(f"kinject bench speculative — batch 1, built-in model, float32, weights on host, host->device link "
            f"EMULATED at {args.bandwidth} GB/s, device budget {args.budget}, {args.new_tokens} new tokens, "
            f"{args.threads} torch thread(s), {args.repeats} interleaved repeats after a warm-up"),
           "", ("| rules | decoding | tokens/s (best) | tokens/s (median) | vs plain | forwards / token | "
                "moved / token | tokens = HF |"),
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | :---: |", *lines]
    text = "\n".join(out)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def add_arguments(s) -> None:
    s.add_argument("--rules", nargs="+", default=["hybrid", "klotski"], help="rule files (default hybrid klotski)")
    s.add_argument("--lookup", type=int, default=4, help="prompt_lookup_num_tokens: tokens drafted per step (4)")
    s.add_argument("--bandwidth", type=float, default=1.0, help="emulated host->device GB/s (default 1)")
    s.add_argument("--budget", default="6MiB", help="pipeline.device_budget (default 6MiB)")
    s.add_argument("--new-tokens", type=int, default=48)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--workdir", default="/tmp/kinject-bench-speculative")
    s.add_argument("--out", default=None, help="also write the table to this file")
