"""``kinject bench overhead``: what kinject's own bookkeeping costs, as a function of the experts.

A Qwen3-MoE-shaped random model (hidden 256, 4 layers by default; ``--wide``: the Qwen3-30B-A3B
width in bfloat16, where the experts' compute dwarfs the bookkeeping) is run twice in one process,
interleaved, on the same prompts and the same weight tensors: plain HF ``generate`` and ``rules/klotski.yaml``
with **every weight in the host tier and no emulated link** (so on a CPU nothing is moved and
the difference is pure overhead: units acquired and released, routing statistics, the
correlation table, expert ordering). Two setups per (experts, top-k):

* ``weights`` -- the weights on the host tier, the KV cache on the device: Klotski's schedule
  with nothing to overlap for attention, so it runs once on the whole batch group. This is
  the bookkeeping the pipeline adds per layer.
* ``weights+kv`` -- the rule file as it is: the KV of every sequence on the host tier too. On
  CUDA attention runs once per micro-batch (``pipeline.micro_batch_size``) to overlap KV loads
  with compute, and each step copies the KV in and its new entries out: the price of the paper's
  placement, shown apart from the bookkeeping. On a CPU with no link the host tier is the compute
  memory: the KV is used in place and attention runs once on the whole batch (nothing to overlap).

The table gives, per row, the time of kinject / HF (medians of ``--repeats``), the same ratio per
repeat (kinject and HF run back to back: their median and quartiles, which a machine whose speed
drifts during the run disturbs least), the ratio of the fastest run of each (noise only ever adds
time, so on a shared machine the best run is the least disturbed estimate), whether the greedy tokens are identical,
store acquire calls per forward step (one per unit acquired
alone, one per batch of units acquired together), and the same ratio in process CPU time
(robust to a loaded machine).

``--counts`` adds what a noisy machine cannot blur: the aten ops and the Python calls kinject adds
to HF's per layer-step (one generate of each under a ``TorchDispatchMode`` and under cProfile), and
a table of Python calls and milliseconds per decode step, HF and kinject, at batch 1 and batch 8
(:func:`kinject.bench.step_counts.decode_step_counts`).

``--real-counts deepseek_v3``: DeepSeek-V3's counts (61 layers, 256 experts top-8, 1 shared, 3 dense)
at tiny width, in memory and from disk, with setup times (:mod:`kinject.bench.step_counts`).

On CUDA (``--device cuda``, or automatically when present) the same table also counts
kernel launches per step (``torch.profiler``), for kinject and for HF: on a GPU this
structure is launch-bound, so launches per step is the number that has to scale with layers,
not experts x micro-batches.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

import torch

from kinject.bench.common import shared_weights_twin

logger = logging.getLogger(__name__)

DEFAULT_SHAPES = ((8, 2), (64, 6), (128, 8))
SETUPS = {"weights": ("vars.kv=device",), "weights+kv": ()}     # name -> rule-file overrides


def build_pair(experts: int, top_k: int, *, hidden: int, layers: int, moe_intermediate: int, device: str,
               rules: str = "klotski", overrides: tuple[str, ...] = (), dtype: torch.dtype = torch.float32,
               heads: int = 4, kv_heads: int = 2, vocab: int | None = None):
    """(HF model, kinject model): one set of random weights, shared (the kinject model is a twin whose
    parameters point at HF's tensors: half the memory, which a real-width shape needs), kinject's
    with every weight on the host tier."""
    import kinject
    from kinject.testing import build_tiny_model

    cfg = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
               intermediate_size=4 * hidden, moe_intermediate_size=moe_intermediate, num_experts=experts,
               num_experts_per_tok=top_k, **({"vocab_size": vocab} if vocab else {}))
    ref = build_tiny_model("qwen3_moe", dtype=dtype, draw_in_dtype=dtype != torch.float32, **cfg)
    model = shared_weights_twin(ref)                # before ref moves: on CUDA kinject's host tier must get host tensors
    ref.to(device)                    # (Module.to gives ref's parameters new data; the twin's keep theirs)
    kinject.optimize(model, f"rules/{rules}.yaml" if not rules.endswith(".yaml") else rules,
                     [f"pipeline.device={device}", "vars.weights=host", "pipeline.update_table=true", *overrides])
    if device != "cpu":
        model.to(device)
    return ref, model


def random_batch(vocab: int, batch: int, prompt: int, device: str, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (batch, prompt), generator=g)
    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _launches(model, batch: dict, gen: dict) -> int:
    """CUDA kernel launches of one generate (torch.profiler, CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model.generate(**batch, **gen)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _exact_counts(model, batch: dict, gen: dict) -> tuple[int, int]:
    """(aten ops, Python calls) of one generate: exact, so comparable across machines and runs
    where timings on a noisy machine are not."""
    import cProfile
    import pstats

    from torch.utils._python_dispatch import TorchDispatchMode

    class _Ops(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            _Ops.n += 1
            return func(*args, **(kwargs or {}))

    with _Ops():
        model.generate(**batch, **gen)
    prof = cProfile.Profile()
    prof.enable()
    model.generate(**batch, **gen)
    prof.disable()
    return _Ops.n, sum(v[1] for v in pstats.Stats(prof).stats.values())


def measure(experts: int, top_k: int, *, hidden: int = 256, layers: int = 4, moe_intermediate: int = 128,
            batch: int = 8, prompt: int = 32, new_tokens: int = 24, repeats: int = 3, device: str = "cpu",
            overrides: tuple[str, ...] = (), counts: bool = False, **shape) -> dict:
    """One row: medians of interleaved repeats, kinject / HF, identical tokens, counts per step.
    ``shape``: more of :func:`build_pair`'s model (``dtype``, ``heads``, ``kv_heads``, ``vocab``)."""
    ref, model = build_pair(experts, top_k, hidden=hidden, layers=layers, moe_intermediate=moe_intermediate,
                            device=device, overrides=overrides, **shape)
    rt = model.kinject
    inputs = random_batch(ref.config.vocab_size, batch, prompt, device)
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
               pad_token_id=ref.config.pad_token_id)
    with torch.inference_mode():
        model.generate(**inputs, max_new_tokens=2, do_sample=False, pad_token_id=ref.config.pad_token_id)  # learn order
        ref.generate(**inputs, max_new_tokens=2, do_sample=False, pad_token_id=ref.config.pad_token_id)
        times = {"hf": [], "kinject": []}
        cpu = {"hf": [], "kinject": []}
        outs = {}
        acquires = [0]
        store_acquire = rt.store.acquire
        store_many = getattr(rt.store, "acquire_many", None)

        def counting(unit, *a, **kw):
            acquires[0] += 1
            return store_acquire(unit, *a, **kw)

        def counting_many(units, *a, **kw):
            acquires[0] += 1
            return store_many(units, *a, **kw)

        for rep in range(repeats):
            for name, m in (("hf", ref), ("kinject", model)):
                _sync(device)
                if name == "kinject":
                    steps0 = rt.scheduler.step
                    acquires[0] = 0
                    rt.store.acquire = counting
                    if store_many is not None:
                        rt.store.acquire_many = counting_many
                t0, c0 = time.perf_counter(), time.process_time()
                outs[name] = m.generate(**inputs, **gen)
                _sync(device)
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
                if name == "kinject":
                    rt.store.acquire = store_acquire
                    if store_many is not None:
                        rt.store.acquire_many = store_many
                    steps = rt.scheduler.step - steps0
        row = {"experts": experts, "top_k": top_k,
               "hf_s": statistics.median(times["hf"]), "kinject_s": statistics.median(times["kinject"]),
               "same": bool(torch.equal(outs["hf"], outs["kinject"])),
               "steps": steps, "acquires_per_step": acquires[0] / max(steps, 1)}
        row["ratio"] = row["kinject_s"] / row["hf_s"]
        # best of the repeats: on a shared machine noise only ever adds time, so the fastest run of
        # each is the least disturbed estimate of what it costs (timeit's advice)
        row["best_ratio"] = min(times["kinject"]) / min(times["hf"])
        row["cpu_ratio"] = statistics.median(cpu["kinject"]) / statistics.median(cpu["hf"])
        # each repeat's kinject / HF, the two measured back to back: a machine whose speed drifts
        # during the run moves both alike (the ratio of medians above mixes different moments)
        paired = sorted(k / h for k, h in zip(times["kinject"], times["hf"]))
        row["paired_ratio"] = statistics.median(paired)
        q = statistics.quantiles(paired, n=4, method="inclusive") if len(paired) > 1 else [paired[0]] * 3
        row["paired_iqr"] = (q[0], q[2])
        if counts:                       # beyond HF, per layer-step (forward steps x decoder layers)
            (ops_hf, calls_hf), (ops_kj, calls_kj) = _exact_counts(ref, inputs, gen), _exact_counts(model, inputs, gen)
            row["ops_per_layer_step"] = (ops_kj - ops_hf) / (steps * layers)
            row["calls_per_layer_step"] = (calls_kj - calls_hf) / (steps * layers)
        if device.startswith("cuda"):
            row["launches_hf"] = _launches(ref, inputs, gen) / steps
            row["launches_kinject"] = _launches(model, inputs, gen) / steps
    rt.transfer.close()
    return row


def table(rows: list[dict]) -> str:
    cuda = any("launches_hf" in r for r in rows)
    counted = any("ops_per_layer_step" in r for r in rows)
    head = ("| experts | top-k | on the host tier | HF s | kinject s | kinject / HF | kinject / HF (CPU time) "
            "| kinject / HF per repeat: median (quartiles) | kinject / HF, best of repeats "
            "| store acquire calls / step | tokens = HF |")
    sep = "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |"
    if counted:
        head += " aten ops / layer-step beyond HF | Python calls / layer-step beyond HF |"
        sep += " ---: | ---: |"
    if cuda:
        head += " launches / step (HF) | launches / step (kinject) |"
        sep += " ---: | ---: |"
    lines = [head, sep]
    for r in rows:
        line = (f"| {r['experts']} | {r['top_k']} | {r.get('setup', '')} | {r['hf_s']:.3f} | {r['kinject_s']:.3f} | "
                f"{r['ratio']:.2f} | "
                f"{r['cpu_ratio']:.2f} | {r['paired_ratio']:.2f} ({r['paired_iqr'][0]:.2f}–{r['paired_iqr'][1]:.2f}) | "
                f"{r['best_ratio']:.2f} | {r['acquires_per_step']:.1f} | {'✓' if r['same'] else '✗'} |")
        if counted:
            line += f" {r.get('ops_per_layer_step', 0):.1f} | {r.get('calls_per_layer_step', 0):.0f} |"
        if cuda:
            line += f" {r.get('launches_hf', 0):.0f} | {r.get('launches_kinject', 0):.0f} |"
        lines.append(line)
    return "\n".join(lines)


def _shape(text: str) -> tuple[int, int]:
    """``EXPERTSxTOPK`` (e.g. ``128x8``) as two ints; a one-line error naming the bad value."""
    try:
        experts, top_k = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"kinject bench overhead: --shapes takes EXPERTSxTOPK pairs such as 128x8, got {text!r}") from None
    if not 1 <= top_k <= experts:
        raise SystemExit(f"kinject bench overhead: --shapes {text}: top-k must be in [1, experts]")
    return experts, top_k


def _device(text: str) -> str:
    """``--device``: cpu or cuda[:N], CUDA only where torch sees it; a one-line error otherwise."""
    try:
        kind = torch.device(text).type
    except RuntimeError:
        kind = None
    if kind not in ("cpu", "cuda"):
        raise SystemExit(f"kinject bench overhead: --device must be cpu or cuda[:N], got {text!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"kinject bench overhead: --device {text}, but torch sees no CUDA device here")
    return text


# The default shape (small experts: the bookkeeping shows) and ``--wide``: the Qwen3-30B-A3B width
# (kinject bench offload's WIDE: hidden 2048, 128 experts top-8, MoE intermediate 768, 32 heads / 4 KV
# heads, 4 layers; bfloat16, 4.8 GB of experts held once, shared by both models) at the bigger-than-RAM workload's width.
SMALL = dict(shapes=DEFAULT_SHAPES, hidden=256, layers=4, moe_intermediate=128, heads=4, kv_heads=2, vocab=None,
             batch=8, prompt_len=32, new_tokens=24, dtype="float32")


def _wide() -> dict:
    from kinject.bench.offload import WIDE

    return dict(shapes=((WIDE.experts, WIDE.top_k),), hidden=WIDE.hidden, layers=WIDE.layers,
                moe_intermediate=WIDE.intermediate, heads=WIDE.heads, kv_heads=WIDE.kv_heads, vocab=WIDE.vocab,
                batch=8, prompt_len=32, new_tokens=8, dtype=WIDE.dtype)


def main(args) -> int:
    torch.set_num_threads(args.threads)
    device = _device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.real_counts:
        from kinject.bench.step_counts import real_counts_rows, real_counts_table

        rows = real_counts_rows(args.real_counts, batch=args.batch or 8, prompt=args.prompt_len or 32,
                                new_tokens=args.new_tokens or 8, repeats=args.repeats)
        text = (f"kinject bench overhead --real-counts {args.real_counts}: rules/klotski.yaml vs HF, batch "
                f"{args.batch or 8}, prompt {args.prompt_len or 32} -> {args.new_tokens or 8} new tokens, bfloat16, "
                f"{torch.get_num_threads()} threads, best of {args.repeats} interleaved after a warm-up\n\n"
                + real_counts_table(rows))
        print(text)
        if args.out:
            Path(args.out).write_text(text + "\n")
        return 0
    preset = _wide() if args.wide else SMALL
    for name, value in preset.items():            # what the command line leaves unset
        if getattr(args, name) is None:
            setattr(args, name, value)
    shapes = [_shape(s) for s in args.shapes] if isinstance(args.shapes[0], str) else list(args.shapes)
    dtype = getattr(torch, args.dtype)
    rows = []
    for experts, top_k in shapes:
        for setup in args.setups:
            row = measure(experts, top_k, hidden=args.hidden, layers=args.layers,
                          moe_intermediate=args.moe_intermediate, batch=args.batch, prompt=args.prompt_len,
                          new_tokens=args.new_tokens, repeats=args.repeats, device=device,
                          overrides=(*SETUPS[setup], *args.set), counts=args.counts, dtype=dtype,
                          heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab)
            rows.append({"setup": setup, **row})
            logger.info("%s", rows[-1])
    head = (f"kinject bench overhead — Qwen3-MoE shape, hidden {args.hidden}, {args.layers} layers, MoE intermediate "
            f"{args.moe_intermediate}, {args.heads} heads / {args.kv_heads} KV heads, batch {args.batch}, prompt "
            f"{args.prompt_len} -> {args.new_tokens} new tokens, {args.dtype}, device {device} "
            f"({torch.get_num_threads()} threads), rules/klotski.yaml with every "
            f"weight on the host tier (no emulated link; `weights`: KV on the device, `weights+kv`: KV on the host "
            f"tier too, {_micro_batches(args, device)}) vs plain HF generate, median of {args.repeats} interleaved repeats")
    text = head + "\n\n" + table(rows)
    if args.counts:
        text += "\n\n" + _decode_counts(args, shapes[0], dtype, device)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def _decode_counts(args, shape: tuple[int, int], dtype, device: str) -> str:
    """Per decode step at batch 1 and batch 8: Python calls and ms, HF and kinject (``weights`` setup)."""
    from kinject.bench.step_counts import decode_step_counts, decode_table

    experts, top_k = shape
    ref, model = build_pair(experts, top_k, hidden=args.hidden, layers=args.layers,
                            moe_intermediate=args.moe_intermediate, device=device,
                            overrides=(*SETUPS["weights"], *args.set), dtype=dtype, heads=args.heads,
                            kv_heads=args.kv_heads, vocab=args.vocab)
    counts = {b: decode_step_counts({"hf": ref, "kinject": model}, random_batch(ref.config.vocab_size, b, args.prompt_len,
                                                                           device), repeats=args.repeats)
              for b in (1, 8)}
    model.kinject.transfer.close()
    return (f"Per decode step ({experts} experts top-{top_k}, `weights` setup; calls: cProfile, exact; ms: best of "
            f"{args.repeats}, (generate of 8 tokens - of 1) / 7):\n\n" + decode_table(counts))


def _micro_batches(args, device) -> str:
    """How ``weights+kv`` runs attention: per micro-batch where its KV crosses a link; on a CPU
    with no emulated link the host KV is used in place and attention runs on the whole batch."""
    from kinject.rules import load_rules

    p = load_rules("rules/klotski.yaml", list(args.set)).pipeline
    if not p.micro_batch_size:
        return "attention on the whole batch"
    if torch.device(device).type != "cuda" and not p.emulate_bandwidth:
        return "KV used in place, attention on the whole batch (no KV crosses a link)"
    return f"attention per micro-batch of {p.micro_batch_size} rows"


def add_arguments(s) -> None:
    s.add_argument("--shapes", nargs="+", default=None, metavar="EXPERTSxTOPK",
                   help="(experts, top-k) pairs, e.g. 8x2 64x6 128x8 (the default; --wide: 128x8)")
    s.add_argument("--wide", action="store_true",
                   help="the Qwen3-30B-A3B width (hidden 2048, 128 experts top-8, MoE intermediate 768, 4 layers, "
                        "bfloat16), batch 8, prompt 32 -> 8 new tokens; the options below still override it")
    s.add_argument("--hidden", type=int, default=None, help="default 256 (--wide: 2048)")
    s.add_argument("--layers", type=int, default=None, help="default 4")
    s.add_argument("--moe-intermediate", type=int, default=None, help="default 128 (--wide: 768)")
    s.add_argument("--heads", type=int, default=None, help="attention heads, default 4 (--wide: 32)")
    s.add_argument("--kv-heads", type=int, default=None, help="KV heads, default 2 (--wide: 4)")
    s.add_argument("--vocab", type=int, default=None, help="default: the built-in tokenizer's (--wide: 32000)")
    s.add_argument("--dtype", default=None, choices=("float32", "bfloat16"), help="default float32 (--wide: bfloat16)")
    s.add_argument("--batch", type=int, default=None, help="default 8")
    s.add_argument("--prompt-len", type=int, default=None, help="default 32")
    s.add_argument("--new-tokens", type=int, default=None, help="default 24 (--wide: 8)")
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--setups", nargs="+", default=list(SETUPS), choices=list(SETUPS),
                   help="what lives on the host tier: weights (KV on the device), weights+kv (the rule file as is)")
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--counts", action="store_true",
                   help="also count aten ops and Python calls per layer-step beyond HF (exact: one generate each)")
    s.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a rule-file key")
    s.add_argument("--out", default=None, help="write the Markdown table here")
    s.add_argument("--real-counts", default=None, choices=("deepseek_v3",),
                   help="a release's unit counts at tiny width (deepseek_v3: 61 layers, 256 experts top-8, 1 shared, "
                        "3 dense), in memory and from disk, with setup times")
