"""``kinject demo``: why kinject exists, on the built-in model, offline, in seconds.

The built-in model (the trained tiny Mixtral fixture) under one device budget that counts every
byte a contender keeps on the device (weights, KV cache, activations), on a workload where the
KV matters (32 prompts of 128 tokens from the built-in corpus), greedy decoding for each:

1. untouched HF with every weight in memory: the reference, with the budget it would need;
2. accelerate's offload at the largest batch that fits the budget: for a batch of ``b``
   sequences its KV and activations sit on the device beside the weights, so ``infer_auto_device_map``
   places weights in what they leave (:func:`kinject.bench.contenders.acc_budget_placement`) and
   its ``cpu_offload`` hooks load every other module at each of its forwards; the demo tries
   every ``b`` from the whole prompt set down and keeps the largest whose total fits;
3. kinject Klotski (``rules/klotski.yaml`` with ``pipeline.prefill: layer``) at the planner's
   ``n`` and ``bs`` (:func:`klotski_plan`): the KV of every sequence in the host tier, only a
   micro-batch's on the device, and the prefill run layer by layer, each layer running the batch
   group one micro-batch at a time before the next layer loads (its weights move once for the
   group) with the group's hidden states in the host tier between layers, so its activations are
   one micro-batch's beside one copy of the group's hidden states and a batch group of ``n x bs``
   sequences fits where accelerate fits few; its weights get what its KV working buffers and
   activations leave of the budget. ``--prefill micro_batch``: one micro-batch at a time through
   the whole model instead (the weights move once per micro-batch in the prefill).

The link rate is a modelling choice. At 1 GB/s this CPU does roughly ten float32 FLOP per byte
the emulated link moves (untouched HF's row: about 10 GFLOP/s on one thread), where an H100 over
PCIe does about 10^4: the emulated link is far more generous to whoever moves more bytes (here
accelerate) than a GPU's would be; a slower one would make every run longer than a demo can take.

For each: the batch it runs, tokens/s, peak device bytes of weights (store accounting;
accelerate: what stays + the largest module it loads at once), KV (HF and accelerate: the cache
of their batch at the last token; Klotski: measured, ``KVStats.peak``) and activations (an
estimate from the config, the same formula for all: :func:`activation_bytes`), bytes moved
host->device per model forward, and whether the greedy tokens equal the reference's. There is no
GPU here, so the host->device link is EMULATED (``pipeline.emulate_bandwidth`` for kinject;
accelerate's hooks wait the same bytes / bandwidth before each module forward), and said so.

``kinject demo --model DIR`` runs the same comparison on any model directory, a checkpoint stored
quantized (FP8, MXFP4, compressed-tensors) included: the reference row is then transformers' own
load of it, and kinject keeps its storage bytes in the host tier and on the link.

The contenders are loaded, warmed up and timed by ``kinject bench cpu``'s machinery
(:func:`kinject.bench.cpu.run`); ``kinject bench cpu`` runs the full ladder with repeats.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kinject.errors import KinjectError

logger = logging.getLogger(__name__)

BUDGET_SHARE = 0.5          # of the model's weight bytes: the whole device budget, KV and activations included
BANDWIDTH = 1.0             # GB/s, the emulated host->device link
PROMPTS = 32                # prompts of the built-in corpus
PROMPT_LEN = 128            # tokens each
PREFILL = "layer"           # Klotski's prefill: layer (weights once per layer) or micro_batch (once per micro-batch)

HF, ACC, KLOTSKI = "untouched HF, all in memory", "accelerate offload", "kinject Klotski"


@dataclass
class DeviceBytes:
    """What one contender keeps on the device at its peak, by kind (bytes)."""

    weights: int
    kv: int
    activations: int
    # Klotski with decode chunks: its KV peak is a decode step's, beside a decode step's activations;
    # its prefill's (at most ``prefill_kv``) is beside ``activations``. Peak: the larger phase.
    decode_activations: int | None = None
    prefill_kv: int = 0

    @property
    def total(self) -> int:
        if self.decode_activations is None:
            return self.weights + self.kv + self.activations
        return self.weights + max(self.kv + self.decode_activations, self.prefill_kv + self.activations)


def kv_bytes(config, sequences: int, tokens: int, element: int = 4) -> int:
    """The KV cache of ``sequences`` sequences of ``tokens`` tokens over every layer (keys and values)."""
    return 2 * config.num_hidden_layers * sequences * config.num_key_value_heads * _head_dim(config) * tokens * element


def activation_bytes(config, sequences: int, tokens: int, attention_rows: int, element: int = 4) -> int:
    """Peak transient bytes of one decoder layer's prefill over ``sequences`` sequences of ``tokens``
    tokens, attention running ``attention_rows`` sequences at once (eager attention, a top-k MoE).

    An estimate from the config (a CPU has no device memory counter), the same for every contender:
    the layer's input, its normed copy and its output (3 x T x hidden, T = sequences x tokens), plus
    the larger of attention (q, k, v, keys and values repeated per head, scores and probabilities,
    output, per ``attention_rows`` sequences) and the experts (router logits, then per routed
    (token, expert) pair the gathered input, gate_up, activation and output rows), plus the last
    token's logits. Experts run over every token of the batch (kinject: of the whole batch group)."""
    h, hd, heads, kvh = config.hidden_size, _head_dim(config), config.num_attention_heads, config.num_key_value_heads
    experts, k = _num_experts(config), config.num_experts_per_tok
    inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    t = sequences * tokens
    hidden = 3 * t * h
    a = attention_rows * tokens
    attention = a * (heads * hd * 2 + kvh * hd * 2 + heads * hd * 2 + h) + 2 * attention_rows * heads * tokens * tokens
    moe = t * experts + t * k * (h + 2 * inter + inter + h)
    return (hidden + max(attention, moe) + sequences * config.vocab_size) * element


def largest_acc_batch(skeleton, config, budget: int, sequences: int, prompt_len: int,
                      tokens: int) -> tuple[int, DeviceBytes]:
    """The largest batch (1..``sequences``) accelerate's offload can run within ``budget`` device bytes,
    its KV (``tokens`` per sequence at the end) and activations (the prefill's, ``prompt_len``) counted:
    the weights get what they leave, placed by :func:`kinject.bench.contenders.acc_budget_placement`
    on ``skeleton`` (a meta-device model)."""
    from kinject.bench.contenders import acc_budget_peak

    for b in range(sequences, 0, -1):
        kv, act = kv_bytes(config, b, tokens), activation_bytes(config, b, prompt_len, b)
        room = budget - kv - act
        if room > 0 and (weights := acc_budget_peak(skeleton, room)) <= room:
            return b, DeviceBytes(weights, kv, act)
    raise KinjectError(f"demo: a device budget of {_mib(budget)} fits no batch of accelerate's offload "
                       f"(batch 1 needs {_mib(kv_bytes(config, 1, tokens) + activation_bytes(config, 1, prompt_len, 1))} "
                       "of KV and activations beside its largest layer); raise --budget")


def klotski_plan(model_dir: Path, rules: Path, overrides: tuple[str, ...], config, *, budget: int, sequences: int,
                 prompt_len: int, tokens: int, bandwidth: float, workdir: Path, prefill: str = PREFILL):
    """Klotski's ``n`` and ``bs`` from the planner under ``budget``, every kind counted (its memory
    model: resident weights, the layer in flight, one micro-batch's KV working buffers, the
    activations of one micro-batch's prefill or of the group's decode step), on profiles measured on
    this machine. ``bs``: the rule file's micro-batch size, or 2x or 4x it where that fits; for each,
    ``n`` is :func:`kinject.plan.planner.best_n`'s (its bound grows with the group). The largest group
    wins, of equal groups the larger ``bs``: the prefill runs one micro-batch at a time, so fewer
    micro-batches move the weights fewer times.
    Returns ``n``, ``bs`` and the activations of that batch group."""
    import torch

    import kinject
    from kinject.plan import planner, profiler

    model = kinject.from_pretrained(model_dir, str(rules), [f"pipeline.emulate_bandwidth={bandwidth}",
                                                            f"pipeline.offload_dir={workdir}/plan", *overrides,
                                                            f"pipeline.prefill={prefill}"],
                                    dtype=torch.float32, attn_implementation="eager")
    rt = model.kinject
    try:
        bs0 = rt.pipeline.micro_batch_size or 1
        first = profiler.measure_profile(model, bs=bs0, prompt_len=8, per_micro_batch=False)   # best_n: no step model
        best, failure = None, None
        for bs in (bs0, 2 * bs0, 4 * bs0):
            if bs > sequences:
                break
            constraints = _constraints(config, rt, budget, bs, prompt_len, tokens, prefill)
            if bs != bs0 and planner.memory_usage(dataclasses.replace(first, bs=bs), constraints, 1, cold_experts_q=0)[
                    "device_peak"] > budget:
                break                                   # its bytes alone (no timing in them) do not fit
            try:
                n = _planned_n(first if bs == bs0 else profiler.measure_profile(model, bs=bs, prompt_len=8,
                                                                                 per_micro_batch=False),
                               constraints, bs, max(1, sequences // bs))
            except KinjectError as exc:
                failure = failure or exc
                continue
            if best is None or n * bs > best[0] * best[1] or n * bs == best[0] * best[1] and bs > best[1]:
                best = (n, bs)
        if best is None:
            raise failure
    finally:
        rt.transfer.close()
    n, bs = best
    return n, bs, klotski_activation_bytes(config, n, bs, prompt_len, prefill=prefill)


def _constraints(config, rt, budget: int, bs: int, prompt_len: int, tokens: int, prefill: str = PREFILL):
    """The planner's memory constraints for Klotski at micro-batch ``bs`` (a prefill by micro-batch or
    by layer: :func:`klotski_activation_bytes`)."""
    from kinject.plan import planner

    per_seq_act = math.ceil(activation_bytes(config, bs, prompt_len, bs) / bs)
    per_seq_group = math.ceil(activation_bytes(config, bs, 1, bs) / bs) + config.vocab_size * 4
    return planner.Constraints(device_budget=budget, resident_bytes=rt.store.resident_external,
                               kv_bytes_per_seq=kv_bytes(config, 1, tokens), target_len=tokens,
                               activation_bytes_per_seq=per_seq_act, kv_on_device=False,
                               prefill_by_micro_batch=True, group_bytes_per_seq=per_seq_group,
                               group_prefill_bytes_per_seq=_layer_hidden_bytes(config, 1, prompt_len, prefill))


def _layer_hidden_bytes(config, sequences: int, prompt_len: int, prefill: str, element: int = 4) -> int:
    """``pipeline.prefill: layer``: the batch group's hidden states on the device beside one
    micro-batch's activations: the first layer's input (the embeddings) or the last layer's joined
    output; between layers they wait in the host tier (:class:`kinject.kv.HiddenStaging`). None by
    micro-batch."""
    return sequences * prompt_len * config.hidden_size * element if prefill == "layer" else 0


def klotski_activation_bytes(config, n: int, bs: int, prompt_len: int, element: int = 4,
                             prefill: str = PREFILL, prefill_chunk: int = 1) -> int:
    """Klotski's activations, the larger of its prefill's and a decode step of the whole batch group of
    ``n x bs``. ``prefill: micro_batch``: one micro-batch's prefill (:func:`activation_bytes` of ``bs``
    sequences) beside the last-token logits the earlier micro-batches returned; ``layer``: one layer
    call's activations (``prefill_chunk`` micro-batches: attention per micro-batch, the experts over
    all their tokens) beside the group's hidden states, that layer's input and output
    (:func:`_layer_hidden_bytes`), or at the end the model's final norm over the group's hidden states
    (in and out) beside its last-token logits."""
    chunk = activation_bytes(config, prefill_chunk * bs if prefill == "layer" else bs, prompt_len, bs, element)
    if prefill == "layer":
        group = _layer_hidden_bytes(config, n * bs, prompt_len, prefill, element)
        chunk = max(chunk + group, 2 * group + n * bs * config.vocab_size * element)
    else:
        chunk += (n - 1) * bs * config.vocab_size * element
    return max(chunk, activation_bytes(config, n * bs, 1, bs, element))


def largest_prefill_chunk(config, n: int, bs: int, prompt_len: int, element: int = 4) -> int:
    """``pipeline.prefill_chunk`` for a layer-wise prefill: the most micro-batches one layer call
    takes (each layer's experts then run once over their tokens instead of once per micro-batch)
    whose activations stay within what Klotski's activations take with one
    (:func:`klotski_activation_bytes`: the group's hidden states at the first and last layer, or a
    decode step's), so the grouping takes no byte from the weights' budget. The experts' rows per
    routed token (gathered input, gate_up, activation, output) outweigh attention's per micro-batch
    at the demo's prompt length, so the room, not attention, bounds it."""
    room = klotski_activation_bytes(config, n, bs, prompt_len, element, "layer")
    k = n
    while k > 1 and klotski_activation_bytes(config, n, bs, prompt_len, element, "layer", k) > room:
        k -= 1
    return k


def _planned_n(profile, constraints, bs: int, n_max: int) -> int:
    """The planner's ``n`` for the demo: of the ``n <= n_max`` whose memory fits the budget (its memory
    model, every expert of a layer landed), the one of the highest roofline bound
    (:func:`kinject.plan.planner.best_n`): the most tokens/s the budget allows, which is what the demo
    compares. With one micro-batch's prefill at a time, memory barely grows with ``n``, and each
    step's weights are shared by more sequences the larger the group."""
    from kinject.errors import PlanError
    from kinject.plan import planner

    try:
        n, bound = planner.best_n(profile, constraints, n_max=n_max)
    except PlanError as exc:
        raise KinjectError(f"demo: Klotski (bs={bs}): {exc}; raise --budget") from None
    logger.info("demo: bs=%d: planner n=%d (bound %.1f tokens/s, %s-bound)", bs, n, bound.tokens_per_s, bound.binding)
    return n


def run_demo(rules: str | None = None, overrides: list[str] | None = None, *, model: str | Path | None = None,
             batch: int = PROMPTS,
             prompt_len: int = PROMPT_LEN, new_tokens: int = 8, budget_share: float = BUDGET_SHARE,
             bandwidth: float = BANDWIDTH, repeats: int = 3, min_time: float | None = None, threads: int = 1,
             prefill: str = PREFILL,
             trace: str | None = None, plot: str | None = "kinject-demo.png", started: float | None = None) -> dict:
    """Run the three contenders, print the comparison (first lines) and draw the Klotski run.

    ``model``: a model directory instead of the built-in model, e.g. a checkpoint stored quantized
    (FP8, MXFP4, compressed-tensors): the reference is then transformers' own load of it (which
    dequantizes on a CPU) and kinject keeps its storage bytes in every tier.

    Returns ``rows`` (:class:`kinject.bench.cpu.Row`, in the order above), ``device`` (a
    :class:`DeviceBytes` per row), ``identical`` (every offload row gave the reference's greedy
    tokens), ``budget``, ``weights`` and ``timings`` (seconds per phase; ``started``: the
    ``time.perf_counter()`` the command line started at, so that its own start-up is counted too)."""
    t_start = time.perf_counter()
    timings: dict[str, float] = {"startup": t_start - started if started is not None else 0.0}
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kinject.app.run import load_tokenizer, default_model_path, default_rules, model_type
    from kinject.bench.cpu import Rung, code_prompts, run
    from kinject.bench.gpu import quiet_accelerate
    from kinject.rules import resolve_rules_path
    from kinject.testing import no_progress_bars

    model_dir = Path(model).expanduser() if model else default_model_path()
    model_type(model_dir)                    # a folder without config.json: one line, before any load
    klotski_rules = resolve_rules_path(rules) if rules else default_rules(model_dir)
    tok = load_tokenizer(model_dir)
    tok.padding_side = "left"
    inputs = code_prompts(tok, batch, prompt_len)          # the built-in corpus: Python sources, prompt_len tokens each
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):      # weight bytes and accelerate's placements without reading a weight
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    weights = sum(p.numel() * p.element_size() for p in skeleton.parameters())
    timings["import"] = time.perf_counter() - t_start    # transformers and the model's code, tokenizer
    budget = int(weights * budget_share)
    tokens = prompt_len + new_tokens - 1     # KV entries at the end: the last token's are never computed
    extra = tuple(overrides or ())
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)       # a tiny model: more intra-op threads only spin
    try:
        with tempfile.TemporaryDirectory(prefix="kinject-demo-") as workdir, no_progress_bars(), quiet_accelerate():
            t0 = time.perf_counter()
            acc_batch, acc_bytes = largest_acc_batch(skeleton, config, budget, batch, prompt_len, tokens)
            n, bs, k_act = klotski_plan(model_dir, klotski_rules, extra, config, budget=budget, sequences=batch,
                                        prompt_len=prompt_len, tokens=tokens, bandwidth=bandwidth, workdir=Path(workdir),
                                        prefill=prefill)
            chunk = largest_prefill_chunk(config, n, bs, prompt_len) if prefill == "layer" else 1
            timings["plan"] = time.perf_counter() - t0
            k_weights = budget - k_act - kv_working_bytes(config, bs, tokens)    # what KV and activations leave
            decode_act = activation_bytes(config, n * bs, 1, bs)
            kv_room = budget - k_weights - decode_act        # a decode step's KV: what weights and its activations leave
            ladder = [Rung(HF, kind="hf"),
                      Rung(ACC, kind="acc-budget", per_call=acc_batch, budget=budget - acc_bytes.kv - acc_bytes.activations),
                      Rung(KLOTSKI, str(klotski_rules), ("pipeline.decode_chunk=auto", f"pipeline.kv_budget={kv_room}",
                                                         *extra, f"pipeline.n_batches={n}", f"pipeline.micro_batch_size={bs}",
                                                         f"pipeline.prefill={prefill}", f"pipeline.prefill_chunk={chunk}"),
                           per_call=n * bs, budget=k_weights)]
            rows, meta = run(model_dir, bandwidth=bandwidth, new_tokens=new_tokens, prompt_len=prompt_len,
                             repeats=repeats, workdir=Path(workdir), ladder=ladder, batch=inputs, budget=budget,
                             close=False, min_time=min_time)
    finally:
        torch.set_num_threads(old_threads)
    hf, acc, klotski = rows
    device = [DeviceBytes(hf.peak, kv_bytes(config, batch, tokens), activation_bytes(config, batch, prompt_len, batch)),
              DeviceBytes(acc.peak, acc_bytes.kv, acc_bytes.activations),
              DeviceBytes(klotski.peak, klotski.kv_peak, k_act, decode_act, kv_working_bytes(config, bs, tokens))]
    meta.update(n=n, bs=bs, klotski_weights_budget=k_weights, prefill=prefill, prefill_chunk=chunk)
    timings.update(load=meta["load_s"], warmup=meta["warmup_s"], runs=meta["run_s"])
    try:
        _report(rows, device, meta, config, model_dir, tok, inputs, klotski_rules, timings, trace=trace, plot=plot,
                budget_share=budget_share, min_time=min_time, started=started, t_start=t_start)
    finally:
        klotski.runtime.transfer.close()
    return {"identical": acc.same_tokens and klotski.same_tokens, "rows": rows, "device": device, "budget": budget,
            "weights": weights, "timings": timings, "meta": meta}


def kv_working_bytes(config, bs: int, tokens: int) -> int:
    """Room for Klotski's KV on the device: the planner's memory model (micro-batch k computing,
    k+1 loading, the stores in flight before it), for one layer at ``tokens`` tokens."""
    from kinject.plan.planner import STORES_IN_FLIGHT

    return math.ceil((2 + STORES_IN_FLIGHT) * kv_bytes(config, bs, tokens) / config.num_hidden_layers)


def _report(rows, device, meta, config, model_dir, tok, inputs, klotski_rules, timings, *, trace, plot, budget_share,
            min_time, started, t_start) -> None:
    """Print the table, what it says, write the trace and the plot, and the wall-time breakdown."""
    budget, weights, bandwidth = meta["budget"], meta["weights"], meta["bandwidth_gbs"]
    batch, new_tokens = meta["sequences"], meta["new_tokens"]
    print(f"kinject demo: {_describe(model_dir, config)}, {weights / 2**20:.1f} MiB of float32 weights), {batch} "
          f"prompts of {meta['prompt_len']} tokens x {new_tokens} new tokens, greedy")
    print(f"device budget {_mib(budget)} ({budget_share:.0%} of the weights) for everything on the device: weights, "
          f"KV cache, activations; no GPU here, so the host->device link is EMULATED at {bandwidth:g} GB/s; "
          f"{_runs(rows, min_time)}")
    print(_table(rows, device, meta))
    print("  peak device = weights (accounting) + KV (HF, accelerate: their cache; Klotski: measured, the rest of its "
          "KV in the host tier) + activations (estimated from the config); Klotski: the larger of its prefill (its "
          f"activations beside at most {_mib(device[-1].prefill_kv)} of KV) and its decode steps (the KV peak beside "
          f"{_mib(device[-1].decode_activations or 0)} of a decode step's activations)")
    for line in _story(rows, device, meta):
        print(line)
    klotski = rows[-1]
    rt = klotski.runtime
    t0 = time.perf_counter()
    if trace:
        rt.tracer.to_chrome(trace)
        print(f"trace written to {trace} (open in https://ui.perfetto.dev)")
    if plot and rt.tracer.plot(plot, title=f"kinject demo: Klotski ({Path(klotski_rules).name}), n={meta['n']} x "
                                           f"bs={meta['bs']}, weights budget {_mib(meta['klotski_weights_budget'])}, link "
                                           f"EMULATED at {bandwidth:g} GB/s", budget=meta["klotski_weights_budget"]):
        print(f"pipeline plot of the Klotski run written to {plot}")
    timings["plot"] = time.perf_counter() - t0
    width = inputs["input_ids"].shape[1]
    last = tok.decode(inputs["input_ids"][0], skip_special_tokens=True).splitlines()[-1]
    sample = tok.decode(klotski.tokens[0, width:], skip_special_tokens=True)
    print(f"sample: ...{last!r} -> {sample!r}")
    timings["total"] = time.perf_counter() - t_start + timings["startup"]
    print(("demo wall time {total:.1f} s: " + ("command line + torch {startup:.1f}, " if started is not None else "")
           + "transformers + model code {import:.1f}, planning {plan:.1f}, loading the models {load:.1f}, "
           "warm-up {warmup:.1f}, timed runs {runs:.1f}, trace and plot {plot:.1f}").format(**timings))


def _describe(model_dir: Path, config) -> str:
    """``the built-in tiny_moe (mixtral, 6 layers x 8 experts`` or, for a given quantized checkpoint,
    ``DIR (gpt_oss stored mxfp4, ...``: what the reference row loads."""
    from kinject.app.run import default_model_path

    name = f"the built-in {model_dir.name}" if model_dir == default_model_path() else str(model_dir)
    quant = getattr(config, "quantization_config", None)
    stored = f" stored {quant['quant_method']}" if isinstance(quant, dict) and "quant_method" in quant else ""
    return f"{name} ({config.model_type}{stored}, {config.num_hidden_layers} layers x {_num_experts(config)} experts"


def _num_experts(config) -> int:
    """Routed experts per layer: Mixtral and gpt-oss say ``num_local_experts``, Qwen-MoE ``num_experts``,
    DeepSeek ``n_routed_experts``."""
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if getattr(config, key, None):
            return getattr(config, key)
    raise KinjectError(f"demo: {config.model_type} config names no expert count "
                       "(num_local_experts, num_experts, n_routed_experts)")


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


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


def moved_per_token(row, meta: dict) -> float:
    """Host->device bytes of the whole run per generated token (every contender runs all the prompts)."""
    return row.bytes_moved / (meta["sequences"] * meta["new_tokens"])


def _table(rows, device, meta: dict) -> str:
    lines = [f"  {'':28s} {'batch':>5s} {'tokens/s':>9s} {'peak device':>12s} {'= weights':>10s} {'+ KV':>9s} "
             f"{'+ activ.':>9s} {'moved/token':>12s}  greedy tokens identical"]
    for r, d in zip(rows, device):
        same = "reference" if r is rows[0] else ("yes" if r.same_tokens else "NO")
        lines.append(f"  {r.name:28s} {r.per_call:5d} {tokens_per_s(r, meta):9.1f} {_mib(d.total):>12s} "
                     f"{_mib(d.weights):>10s} {_mib(d.kv):>9s} {_mib(d.activations):>9s} "
                     f"{_mib(moved_per_token(r, meta)):>12s}  {same}")
    return "\n".join(lines)


def _story(rows, device, meta: dict) -> list[str]:
    """What the table says, in words, from the measured numbers."""
    hf, acc, klotski = rows
    d_hf, d_acc, d_k = device
    tps = {r.name: tokens_per_s(r, meta) for r in rows}
    ratio = tps[klotski.name] / tps[acc.name]
    budget = meta["budget"]
    link_s = klotski.bytes_moved / (meta["bandwidth_gbs"] * 1e9)
    seqs, n, bs = meta["sequences"], meta["n"], meta["bs"]
    fit = "all {n} fit" if acc.per_call == seqs else "{n} are the most that fit"
    groups = -(-seqs // klotski.per_call)
    out = [f"kinject Klotski makes {ratio:.2f}x the tokens/s of accelerate's offload ({'faster' if ratio >= 1 else 'slower'}) "
           f"at the same {_mib(budget)} budget and EMULATED link.",
           f"Why: accelerate keeps the KV and activations of its batch on the device beside its weights; of {seqs} "
           f"sequences {fit.format(n=acc.per_call)} ({_mib(d_acc.kv)} of KV, {_mib(d_acc.activations)} of activations, "
           f"{_mib(d_acc.weights)} of weights). Each of its forwards moves {_mib(moved_per_step(acc))} for "
           f"{acc.per_call} sequences, copies and compute one after the other: {_mib(moved_per_token(acc, meta))} per "
           f"generated token.",
           f"Klotski keeps every sequence's KV in the host tier ({_mib(d_hf.kv)} for all {seqs}, {_mib(d_k.kv)} of it "
           f"on the device at once) and {_prefill_words(meta, bs)} ({_mib(d_k.activations)}): the planner's "
           f"n={n} x bs={bs} = "
           f"{klotski.per_call} sequences fit{'' if groups == 1 else f' ({groups} batch groups)'} and share each "
           f"decode step's weight loads. It moves {_mib(moved_per_token(klotski, meta))} per generated token (its "
           f"prefill moves the weights once {'per layer' if meta['prefill'] == 'layer' else 'per micro-batch'}), "
           f"{link_s:.2f} s on the link against "
           f"{klotski.compute_s:.2f} s of compute, overlapped (compute idle {klotski.bubble:.0%}).",
           f"Per sequence, the prefill's activations take {_mib(d_acc.activations / acc.per_call)} of the device and "
           f"its KV {_mib(d_acc.kv / acc.per_call)}: " + (
               f"{_cap(d_acc)} accelerate's batch most; Klotski pays neither per sequence of its group." if
               acc.per_call < seqs else "the budget caps neither batch here: every prompt fits beside accelerate's "
                                         "weights."),
           f"Untouched HF makes {tps[hf.name] / tps[klotski.name]:.1f}x Klotski's tokens/s, but needs "
           f"{_mib(d_hf.total)} on the device ({d_hf.total / budget:.1f}x the budget): every weight there, nothing moved "
           f"({tps[hf.name] / tps[acc.name]:.1f}x accelerate's tokens/s)."]
    over = [r.name for r, d in zip(rows[1:], device[1:]) if d.total > budget]
    if over:
        out.append(f"WARNING: {', '.join(over)} went over the budget (see the table).")
    if not all(r.same_tokens for r in rows[1:]):
        out.append("WARNING: a contender's greedy tokens differ from the reference's (see the table).")
    return out


def _prefill_words(meta: dict, bs: int) -> str:
    """How Klotski's prefill keeps its activations small, in words."""
    if meta["prefill"] == "layer":
        k = meta.get("prefill_chunk", 1)
        at_once = f"one micro-batch of {bs}" if k == 1 else \
            f"{k} micro-batches of {bs} (attention per micro-batch, the experts once over their tokens)"
        return (f"prefills layer by layer, each layer running the group {at_once} at a time before "
                "the next layer loads, the group's hidden states in the host tier between layers, so its "
                f"activations are {'one micro-batch' if k == 1 else 'one layer call'}'s beside one copy of the "
                "group's hidden states")
    return f"prefills one micro-batch of {bs} at a time through the model, so its activations are one micro-batch's"


def _cap(d: DeviceBytes) -> str:
    """Which of the batch-sized kinds takes more of a contender's device bytes."""
    return "activations, more than the KV, cap" if d.activations >= d.kv else "the KV, more than activations, caps"
