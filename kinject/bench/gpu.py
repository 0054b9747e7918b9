"""``kinject bench gpu``: the Klotski ablation ladder against accelerate, on one CUDA GPU.

The model is Mixtral-8x7B-shaped (hidden 4096, intermediate 14336, 8 experts top-2, 32 heads /
8 KV heads, vocab 32000) with ``--layers`` decoder layers and random bfloat16 weights that are
never written anywhere: :class:`RandomIndex` has the interface ``kinject.io.loading`` uses from a
:class:`~kinject.io.checkpoint.CheckpointIndex` (``names``, ``source``, ``expert_source``,
``is_fused_expert``), and its sources fill tensors with seeded random values, straight into
pinned host memory, in parallel chunks. The model is built on the meta device and every
contender is made from the same index, so every contender's host tier holds *the same* pinned
tensors (one copy of the weights in host memory, whatever the number of contenders)::

    index = RandomIndex(meta_model, seed=0, pin=True)
    index.materialize()                                      # every tensor, chunks in parallel
    kinject.optimize(meta_model, "rules/klotski.yaml", overrides, checkpoint=index)

Memory-constrained, at equal memory (docs/architecture.md, "Benchmarks and bounds"):
``device_budget`` is the share of the model a ``--card-gib`` (24 GiB) card holds of the real
Mixtral-8x7B in bfloat16 (≈ 93 GB), applied to this model's bytes: ≈ 0.75 GiB per layer, 6.1 GiB
for 8 layers. It counts *everything* a contender keeps on the device -- weights, KV cache and
activations -- and every contender gets the same, and every weight in host memory. Before
anything loads, :mod:`kinject.bench.gpu_sizing` gives each contender its share and its batch: the
sequences per ``generate`` call (accelerate and the whole-layer rungs: the largest batch whose KV
and activations fit beside their weights; the batch group then runs as several calls) and, for
the Klotski rungs, the prefill micro-batch and chunk (``pipeline.prefill: layer``); a contender
that cannot fit is reported as such and never loaded. On CUDA the rows that run transformers'
layers then refit their batch on measured peaks (:func:`calibrate`). When the budget is below the
least every rung runs with, it is raised to that and the report says so.

Contenders, all in one process, the same prompts (random ids), the same number of new tokens
(``min_new_tokens``), the same dtype and attention kernel, repeats interleaved (the order rotates
every repeat), medians reported:

==============  ======================================================================================
``acc``         accelerate ``infer_auto_device_map(max_memory={gpu: what its batch's KV and
                activations leave of device_budget, "cpu": every weight})`` + ``dispatch_model``: what
                fits on the GPU stays there, the rest is CPU-offloaded (its hooks copy an offloaded
                module's weights in before its forward, synchronously); the batch group in calls of
                the largest batch that fits. Its CPU weights are the same pinned tensors.
``simple``      ``rules/simple_pipeline.yaml``: each decoder layer one unit, calls of at most ``bs``
``multibatch``  ``rules/multibatch.yaml``: the same units, as much of the group per call as fits
``hot``         ``rules/hot_prefetch.yaml``: + per-expert units, only hot experts prefetched
``klotski``     ``rules/klotski.yaml``: + hot experts first, cold ones in completion order
``hqq``         ``rules/klotski_hqq.yaml``: Klotski + HQQ 4-bit (group 64) attention, experts
==============  ======================================================================================

transformers' own experts run inside accelerate and the whole-layer rungs; on a GPU its
``generate`` decodes with ``batched_mm``, which copies the weights of every routed (token,
expert) pair (672 MiB per sequence for Mixtral-8x7B), so at a 24 GiB card's share those rows fit
only a few sequences per call; ``--hf-experts eager`` runs them one expert at a time instead.

``--time-limit`` counts the whole command from its start: the probes, filling the random weights
(about 30 s for 16.7 GiB), loading every contender (HQQ quantization about 30 s more), the
planner, the sizing probes and warm-ups, then the repeats. A row whose first repeat cannot fit
what is left is reported "not run" before any timed run; no repeat after the first starts that
would end after the limit.

``n`` comes from the planner (:func:`kinject.plan.profiler.measure_profile` on the Klotski contender
+ :func:`kinject.plan.planner.solve`, capped by ``--n-max`` to bound the run time; the plan and the
cap are printed). Columns as ``kinject bench cpu``: tokens/s (generated tokens / ``generate``
time, prefill included), ratio to the simple pipeline, compute bubble (tracer, GPU-timed),
bytes moved host->device per forward step (weights + KV loads; accelerate: offloaded parameter
bytes x forwards), the device budget, peak device memory (``torch.cuda.max_memory_allocated``,
reset before every run, other contenders' resident memory subtracted) and whether it stayed inside
the budget, host bytes of its weights, the roofline bound and its share reached.

Roofline (docs/architecture.md, "Benchmarks and bounds") per row: per forward step ``max(bytes moved / H2D bandwidth, FLOPs /
matmul peak)``, summed over the steps of the row's calls (the prefill step is usually
compute-bound, decode steps transfer-bound); bandwidth from a pinned host->device copy probe
(1 GiB, best of 5) and peak from a large bf16 matmul probe, both measured at start-up. FLOPs:
2 x active parameters per token (attention + gate + top-k experts) + attention over the context
+ lm_head for the logits computed.

``--device cpu`` runs everything on the CPU (small ``--hidden`` etc.): a DRY RUN that exercises
the code path, labelled so everywhere; its numbers are not measurements.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from kinject.bench import gpu_sizing as sizing
from kinject.bench.gpu_report import gib as _gib
from kinject.bench.gpu_report import reference, report
from kinject.bench.random_checkpoint import RandomIndex
from kinject.errors import KinjectError, PlanError
from kinject.formatting import format_bytes, format_seconds

logger = logging.getLogger(__name__)

# key, row name, rule file (None: accelerate)
LADDER = [
    ("acc", "accelerate device_map offload", None),
    ("simple", "simple pipeline", "simple_pipeline"),
    ("multibatch", "+ multi-batch", "multibatch"),
    ("hot", "+ hot-expert prefetch", "hot_prefetch"),
    ("klotski", "Klotski (+ hot-first order)", "klotski"),
    ("hqq", "Klotski + HQQ 4-bit", "klotski_hqq"),
]
KEYS = [k for k, _, _ in LADDER]
WORKLOADS = {"standard": (512, 32), "decode": (32, 128)}   # (prompt, new tokens): Klotski/FlexGen's; decode-heavy

# Mixtral-8x7B (the real model the budget is scaled from)
MIXTRAL = dict(hidden=4096, intermediate=14336, experts=8, top_k=2, heads=32, kv_heads=8, vocab=32000)
REAL_LAYERS = 32

# ============================================================================ model, budget, prompts


@dataclass(frozen=True)
class Shape:
    layers: int = 6
    hidden: int = MIXTRAL["hidden"]
    intermediate: int = MIXTRAL["intermediate"]
    experts: int = MIXTRAL["experts"]
    top_k: int = MIXTRAL["top_k"]
    heads: int = MIXTRAL["heads"]
    kv_heads: int = MIXTRAL["kv_heads"]
    vocab: int = MIXTRAL["vocab"]
    dtype: str = "bfloat16"
    seed: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def layer_params(self) -> dict[str, int]:
        h, hd = self.hidden, self.head_dim
        attn = 2 * h * self.heads * hd + 2 * h * self.kv_heads * hd
        return {"attention": attn, "gate": self.experts * h, "expert": 3 * h * self.intermediate, "norms": 2 * h}

    def layer_bytes(self) -> int:
        p = self.layer_params()
        return (p["attention"] + p["gate"] + self.experts * p["expert"] + p["norms"]) * self.itemsize

    def resident_bytes(self) -> int:
        """Embeddings, lm_head, final norm: what no rule of the ladder offloads."""
        return (2 * self.vocab * self.hidden + self.hidden) * self.itemsize

    def model_bytes(self, layers: int | None = None) -> int:
        return (self.layers if layers is None else layers) * self.layer_bytes() + self.resident_bytes()

    @property
    def itemsize(self) -> int:
        return getattr(torch, self.dtype).itemsize

    def is_mixtral(self) -> bool:
        return all(getattr(self, k) == v for k, v in MIXTRAL.items())

    def describe(self) -> str:
        what = "Mixtral-8x7B-shaped" if self.is_mixtral() else "Mixtral-type"
        return (f"{what} random model: {self.layers} layer{'s' * (self.layers > 1)}, hidden {self.hidden}, "
                f"intermediate {self.intermediate}, {self.experts} experts top-{self.top_k}, {self.heads} heads / "
                f"{self.kv_heads} KV heads, vocab {self.vocab}, {self.dtype}; {_gib(self.model_bytes())} of weights "
                f"(seed {self.seed}, never written to disk)")

    def config(self, attn: str):
        from transformers import MixtralConfig

        return MixtralConfig(
            hidden_size=self.hidden, intermediate_size=self.intermediate, num_hidden_layers=self.layers,
            num_local_experts=self.experts, num_experts_per_tok=self.top_k, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, head_dim=self.head_dim, vocab_size=self.vocab,
            tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            attn_implementation=attn)


def meta_model(shape: Shape, attn: str, experts: str | None = None) -> nn.Module:
    """The model with every parameter on the meta device (buffers real); ``experts``: transformers'
    experts implementation (None: its default, ``grouped_mm``)."""
    from transformers import AutoModelForCausalLM

    from kinject.io.loading import parameters_on_meta

    extra = {"experts_implementation": experts} if experts else {}
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(shape.config(attn), dtype=getattr(torch, shape.dtype),
                                                 attn_implementation=attn, **extra)
    return model.eval()


HF_EXPERTS = {"default": None, "eager": "eager"}     # --hf-experts -> transformers' experts_implementation


def device_budget(shape: Shape, card_gib: float, minimum: int | None = None) -> tuple[int, str]:
    """The share of the real bf16 Mixtral-8x7B a ``card_gib`` card holds, of this model's bytes;
    raised to the minimum the whole-layer rungs run with if below it: resident + one layer, or
    ``minimum`` (that + one sequence's KV and activations, :func:`minimum_budget`)."""
    real = Shape(layers=REAL_LAYERS, dtype="bfloat16")
    share = card_gib * 2**30 / real.model_bytes()
    budget = int(share * shape.model_bytes())
    how = f"{card_gib:g} GiB card / {real.model_bytes() / 1e9:.1f} GB bf16 Mixtral-8x7B = {share:.1%} of the model"
    floor = max(shape.resident_bytes() + shape.layer_bytes() * 65 // 64, minimum or 0)
    if budget < floor:
        what = ("the least every rung runs with (one sequence beside a whole-layer unit; a Klotski rung at "
                "micro-batch 1)" if minimum else "the minimum a whole-layer unit runs with")
        how += f"; raised from {_gib(budget)} to {_gib(floor)}, {what}"
        budget = floor
    return budget, how


def minimum_budget(shape: Shape, prompt_len: int, new_tokens: int, attn: str, group: int = 1,
                   batched_decode: bool = False) -> int:
    """The least budget every rung runs with: the simple pipeline's resident + one layer + one sequence's
    KV and activations, and a Klotski rung's at micro-batch 1 over a group of ``group`` sequences (its
    hidden states stay on the device beside each layer)."""
    whole = (shape.resident_bytes() + shape.layer_bytes() * 65 // 64 + sizing.kv_bytes(shape, 1, prompt_len + new_tokens)
             + sizing.hf_activation_bytes(shape, 1, prompt_len, attn == "eager", batched_decode))
    klotski = sizing.klotski_memory(shape, 0, group, 1, 1, prompt_len, new_tokens, attn == "eager")["device_peak"]
    return max(whole, klotski)


def prompts(shape: Shape, sequences: int, prompt_len: int, device) -> dict[str, torch.Tensor]:
    """Random token ids (4..vocab), no padding; the same for every contender."""
    g = torch.Generator().manual_seed(shape.seed + 1)
    ids = torch.randint(4, shape.vocab, (sequences, prompt_len), generator=g)
    return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids).to(device)}


# ============================================================================ probes and bound


def h2d_bandwidth(device: torch.device, nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Host->device bytes/s of one pinned copy (best of ``reps``); on CPU a memcpy (dry run)."""
    if device.type != "cuda":
        nbytes = min(nbytes, 64 << 20)
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        best = math.inf
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
        return nbytes / best
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    stream = torch.cuda.Stream(device=device)
    best = math.inf
    with torch.cuda.stream(stream):
        for i in range(reps + 1):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(stream)
            dst.copy_(src, non_blocking=True)
            b.record(stream)
            b.synchronize()                    # probe only, never in the hot path
            if i:                              # the first copy warms up
                best = min(best, a.elapsed_time(b) / 1e3)
    del src, dst
    return nbytes / best


def matmul_peak(device: torch.device, dtype: torch.dtype, reps: int = 10) -> float:
    """Achieved FLOP/s of a large square matmul at ``dtype`` (8192 on CUDA, 512 on CPU)."""
    n = 8192 if device.type == "cuda" else 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    if device.type != "cuda":
        a @ b
        t0 = time.perf_counter()
        for _ in range(max(2, reps // 4)):
            a @ b
        return 2.0 * n ** 3 * max(2, reps // 4) / (time.perf_counter() - t0)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    end.synchronize()
    return 2.0 * n ** 3 * reps / (start.elapsed_time(end) / 1e3)


# ============================================================================ contenders


@dataclass
class Row:
    key: str
    name: str
    rules: str | None
    model: nn.Module | None = None
    calls: int = 1                         # generate calls per run (ceil(sequences / rows))
    rows: int = 0                          # sequences per call (the largest that fits the budget: gpu_sizing)
    fit: sizing.Fit | None = None          # its share of the device budget and how it was sized
    times: list[float] = field(default_factory=list)
    steps: int = 0                         # forward steps of the last run
    bytes_moved: int = 0                   # host->device bytes of the last run
    peak: int | None = None                # device bytes, as if alone (max over runs)
    resident: int = 0                      # device bytes it holds between runs
    bubble: float | None = None
    prefetch_skipped: int = 0
    tokens: torch.Tensor | None = None     # greedy tokens of the last run (CPU)
    match: float | None = None             # share of generated tokens equal to the reference row's
    what: str = ""                         # placement, in words
    error: str | None = None
    accelerate: object = None              # kinject.bench.contenders.Contender (accounting hooks)


def _kinject_row(key: str, name: str, rules: str, shape: Shape, index: RandomIndex, overrides: list[str],
                 attn: str, device: torch.device, experts: str | None = None) -> Row:
    import kinject
    from kinject.rules import resolve_rules_path

    model = meta_model(shape, attn, experts)
    kinject.optimize(model, str(resolve_rules_path(rules)), overrides, checkpoint=index)   # HQQ solves on the GPU
    rt = model.kinject
    units = [u for u in rt.store.units.values() if u.offloaded]
    what = (f"{len(units)} host units of {_gib(max(u.wire_nbytes for u in units))} max, "
            f"{_gib(sum(u.wire_nbytes for u in units))} in all")
    return Row(key, name, rules, model, what=what)


def _accelerate_row(shape: Shape, index: RandomIndex, fit: sizing.Fit, attn: str, device: torch.device,
                    experts: str | None = None) -> Row:
    """accelerate's device_map with ``max_memory = fit.max_memory`` ({gpu: the room its batch's KV and
    activations leave of the device budget, "cpu": every weight}): offloaded modules are copied in by
    its hooks before each forward (synchronously). Accounting: kinject.bench.contenders.accelerate_contender
    (offloaded parameter bytes x model forwards)."""
    from accelerate import dispatch_model, infer_auto_device_map

    from kinject.bench.contenders import accelerate_contender
    from kinject.io.loading import materialise_rest

    model = meta_model(shape, attn, experts)
    materialise_rest(model, index, torch.device("cpu"), None)      # the shared (pinned) host tensors
    if device.type == "cuda":
        device_map = infer_auto_device_map(model, max_memory=accelerate_max_memory(fit, device),
                                           no_split_module_classes=list(model._no_split_modules or []),
                                           dtype=getattr(torch, shape.dtype))
        device_map = spell_out_root(model, device_map)
        on_disk = [k for k, v in device_map.items() if v == "disk"]
        if on_disk:
            raise ValueError(f"accelerate placed {', '.join(on_disk)} on disk under max_memory "
                             f"{accelerate_max_memory(fit, device)}: the compared placement keeps every weight in host memory")
        # force_hooks: a map with no entry on the GPU still runs there (not model.to("cpu"))
        dispatch_model(model, device_map=device_map, main_device=device.index or 0, force_hooks=True)
        on_gpu = [k for k, v in device_map.items() if v != "cpu"]
        what = (f"max_memory {{{device.index or 0}: {_gib(fit.store_budget)}, cpu: {_gib(fit.max_memory['cpu'])}}}; device_map: "
                f"{len(on_gpu)} of {len(device_map)} top-level entries on the GPU "
                f"({', '.join(on_gpu[:4])}{', ...' if len(on_gpu) > 4 else ''}), the rest CPU-offloaded")
    else:
        dispatch_model(model, device_map={"": "cpu"})
        what = "DRY RUN: main device cpu, so accelerate offloads nothing (all weights in RAM)"
    row = Row("acc", LADDER[0][1], None, model, what=what, fit=fit)
    row.accelerate = accelerate_contender("acc", what, model, [], "drop-before-run")
    return row


def spell_out_root(model: nn.Module, device_map: dict) -> dict:
    """``device_map`` with a root entry (``{"": "cpu"}``: the whole model in one place, which is what
    ``infer_auto_device_map`` returns when nothing fits the GPU) spelled out as one entry per top-level
    child. Why: ``dispatch_model`` collects a CPU-offloaded module's weights by name prefix, and the
    empty name matches none, so the first hook found no weight (a KeyError on the first forward)."""
    if "" not in device_map:
        return device_map
    names = [n for n, _ in model.named_children()] + [n for n, _ in model.named_parameters(recurse=False)]
    return dict.fromkeys(names + [n for n, _ in model.named_buffers(recurse=False)], device_map[""])


def accelerate_max_memory(fit: sizing.Fit, device: torch.device) -> dict:
    """accelerate's ``max_memory``: the device's share (keyed by its index, as accelerate wants) and the host's."""
    return {device.index or 0: fit.store_budget, "cpu": fit.max_memory["cpu"]}


def _device_bytes(model: nn.Module, device: torch.device) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type == device.type and not t.is_meta:
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)            # between timed runs only, never inside one


# ============================================================================ running


@dataclass
class Setup:
    shape: Shape
    device: torch.device
    bs: int
    n: int
    prompt_len: int
    new_tokens: int
    repeats: int
    budget: int
    budget_how: str
    bandwidth: float
    peak_flops: float
    attn: str
    hf_experts: str = "default"            # transformers' experts in accelerate and the whole-layer rungs
    plan_text: str = ""
    fill_s: float = 0.0
    repeats_done: int = 0
    stopped: str = ""
    started: float = field(default_factory=time.perf_counter)

    @property
    def dry(self) -> bool:
        return self.device.type != "cuda"

    @property
    def sequences(self) -> int:
        return self.n * self.bs

    @property
    def batched_decode(self) -> bool:
        """transformers' generate decodes with ``batched_mm`` (a weight copy per routed pair): on a GPU,
        with its default experts (gpu_sizing)."""
        return not self.dry and self.hf_experts == "default"


def plan_n(row: Row, setup: Setup, n_max: int) -> tuple[int, str]:
    """The planner's n for the Klotski contender (profile measured now), capped by ``n_max``."""
    from kinject.plan import planner, profiler

    model, rt = row.model, row.model.kinject
    profile = profiler.measure_profile(model, bs=setup.bs, refresh=True)
    stats = rt.peek("prefetch_stats")
    coverage = stats.coverage() if stats is not None else None
    target = setup.prompt_len + setup.new_tokens
    per_token = profile.meta.get("kv_bytes_per_token_layer", 0)         # measured: the KV is offloaded
    constraints = planner.Constraints(device_budget=setup.budget, resident_bytes=rt.store.resident_external,
                                      kv_bytes_per_seq=int(per_token * profile.num_layers * target), target_len=target)
    head = (f"planner on {row.name} (bs={setup.bs}, profile measured now): attention "
            f"{format_seconds(profile.t_attn)}, gate {format_seconds(profile.t_gate)}, expert "
            f"{format_seconds(profile.t_expert.fixed_s)} + {format_seconds(profile.t_expert.per_token_s)}/token; "
            f"one expert {format_bytes(profile.expert_bytes)} in {format_seconds(profile.t_load_expert or 0)}"
            f", link {format_bytes(profile.bandwidth or 0)}/s; hot coverage "
            f"{'default' if coverage is None else f'{coverage:.2f}'}")
    try:
        plan = planner.solve(profile, constraints, bs=setup.bs, hot_coverage=coverage or None, n_max=n_max,
                             strict=False, kv_in_eq7=profile.kv_bytes > 0)
        return plan.n, head + "\n" + planner.format_table(plan)
    except PlanError as exc:
        # no bubble-free n <= n_max (decode on a real link is transfer-bound: n ~ 100+), or no n fits the
        # memory model: the largest n <= n_max whose worst case (every expert of a layer landed) fits
        def fits(k: int) -> bool:
            m = planner.memory_usage(profile, constraints, k, cold_experts_q=profile.num_experts - profile.top_k)
            return m["device_peak"] <= setup.budget

        n = next((k for k in range(n_max, 0, -1) if fits(k)), 1)
        why = "the largest n <= --n-max that fits the planner's memory model" if fits(n) else \
            "no n fits the planner's memory model"
        rows = planner.inequality_rows(profile, n, setup.bs, coverage or None, kv_in_eq7=profile.kv_bytes > 0)
        table = "\n".join(f"  {r.name}: {format_seconds(r.lhs)} >= {format_seconds(r.rhs)} "
                          f"{'✓' if r.holds else '✗'}" for r in rows)
        return n, f"{head}\nplanner: {exc}\nusing n = {n} ({why}); the inequalities at n = {n}:\n{table}"


def timed_run(row: Row, batch: dict, setup: Setup) -> None:
    from kinject.bench.common import generate

    model, rt, dev = row.model, getattr(row.model, "kinject", None), setup.device
    chunks = [slice(i, i + row.rows) for i in range(0, setup.sequences, row.rows)]
    kv = rt.peek("attention") if rt is not None else None
    if rt is not None:
        rt.tracer.clear()
        rt.store.reset_stats()
        if kv is not None:
            kv.stats.reset()
        steps0 = rt.scheduler.step
        held = rt.store.resident_external + rt.store.used       # its own device bytes now
    else:
        row.accelerate.reset()
        held = row.resident
    gc.collect()
    _sync(dev)
    if dev.type == "cuda":
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    outs = [generate(model, {k: v[c] for k, v in batch.items()}, setup.new_tokens, 0) for c in chunks]
    _sync(dev)
    row.times.append(time.perf_counter() - t0)
    if rt is not None:            # outside the timing: the last step's prefetches (of the next step) must
        rt.transfer.synchronize(timeout=120)    # not land in, nor share the link with, the next contender's run
    row.tokens = torch.cat([o[:, -setup.new_tokens:] for o in outs]).cpu()
    if dev.type == "cuda":
        peak = torch.cuda.max_memory_allocated(dev) - base + held
    else:
        peak = rt.store.peak if rt is not None else None
    if peak is not None:
        row.peak = max(row.peak or 0, peak)
    if rt is not None:
        row.steps = rt.scheduler.step - steps0
        row.bytes_moved = rt.store.stats["bytes"]["host"] + (kv.stats.counts["load_bytes"] if kv is not None else 0)
        row.prefetch_skipped = rt.store.stats["prefetch_skipped"]
        row.bubble = rt.tracer.summary().get("bubble_fraction") if rt.tracer.enabled else None
    else:
        row.steps = setup.new_tokens * len(chunks)
        row.bytes_moved = row.accelerate.accounted()


def estimate_repeat_s(rows: list[Row], setup: Setup) -> float:
    """Seconds one repeat takes at least: every call's steps at the probed link bandwidth."""
    total = 0.0
    for r in rows:
        rt = getattr(r.model, "kinject", None)
        moved = (sum(u.wire_nbytes for u in rt.store.units.values() if u.offloaded) if rt is not None
                 else sum(p.numel() * p.element_size() for p in r.model.parameters() if p.is_meta))
        total += r.calls * setup.new_tokens * moved / setup.bandwidth
    return total


def size(key: str, setup: Setup, sequences: int, skeleton: nn.Module | None = None) -> sizing.Fit:
    """Contender ``key``'s share of the device budget for a group of ``sequences`` (gpu_sizing)."""
    shape, eager = setup.shape, setup.attn == "eager"
    args = (shape, setup.budget, sequences)
    if key == "acc":
        return sizing.size_accelerate(shape, skeleton if skeleton is not None else meta_model(shape, setup.attn),
                                      *args[1:], setup.prompt_len, setup.new_tokens,
                                      device_key=setup.device.index or 0, eager=eager,
                                      batched_decode=setup.batched_decode)
    if key in sizing.WHOLE_LAYER:
        cap = setup.bs if key == "simple" else sequences
        return sizing.size_whole_layer(key, *args, cap, setup.prompt_len, setup.new_tokens, eager=eager,
                                       batched_decode=setup.batched_decode)
    return sizing.size_klotski(key, *args, setup.bs, setup.prompt_len, setup.new_tokens, eager=eager)


def row_overrides(fit: sizing.Fit, setup: Setup) -> list[str]:
    """A kinject contender's pipeline settings: its store gets what its KV and activations leave of the
    budget; a Klotski rung prefills layer by layer in micro-batches of ``fit.micro_batch``."""
    out = [f"pipeline.device={setup.device}", f"pipeline.device_budget={fit.store_budget}",
           f"pipeline.micro_batch_size={fit.micro_batch or setup.bs}", "pipeline.offload_dir=null",
           "pipeline.trace=true", "pipeline.save_table=false"]
    if fit.key in sizing.KLOTSKI:
        out += ["pipeline.prefill=layer", f"pipeline.prefill_chunk={fit.prefill_chunk}"]
        if fit.kv_room:
            out += ["pipeline.decode_chunk=auto", f"pipeline.kv_budget={fit.kv_room}"]
    return out


def probe_peak(row: Row, batch: dict, rows: int, setup: Setup, tokens: int) -> int | None:
    """Peak device bytes of one ``generate`` of ``rows`` sequences (``tokens`` new tokens) counted as
    timed_run counts them; None on the CPU (no device counter)."""
    from kinject.bench.common import generate

    rt, dev = getattr(row.model, "kinject", None), setup.device
    held = rt.store.resident_external + rt.store.used if rt is not None else row.resident
    gc.collect()
    _sync(dev)
    if dev.type == "cuda":
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    generate(row.model, {k: v[:rows] for k, v in batch.items()}, tokens, 0)
    _sync(dev)
    if rt is not None:
        rt.transfer.synchronize(timeout=120)
    return torch.cuda.max_memory_allocated(dev) - base + held if dev.type == "cuda" else None


def calibrate(row: Row, batch: dict, setup: Setup, tokens: int, cap: int, probe=None) -> None:
    """CUDA: replace the estimated batch of a contender that runs transformers' layers (accelerate, the
    whole-layer rungs) by one fitted on measured peaks -- one sequence, then the estimated batch --
    and check the result, stepping down until its measured peak is within the budget. The probes
    generate ``tokens`` new tokens; the KV the rest of a run adds (``new_tokens - tokens`` per
    sequence) is counted on top. Raises KinjectError when one sequence alone exceeds the budget
    (reported before any timed run). ``probe``: :func:`probe_peak` (tests pass a model of it)."""
    probe = probe or probe_peak
    fit, budget = row.fit, setup.budget
    extra = sizing.kv_bytes(setup.shape, 1, max(0, setup.new_tokens - tokens))     # per sequence

    def peak_at(rows: int) -> float:
        try:
            return probe(row, batch, rows, setup, tokens) + rows * extra
        except torch.cuda.OutOfMemoryError:
            gc.collect()
            torch.cuda.empty_cache()
            return math.inf

    one = peak_at(1)
    if one > budget:
        raise KinjectError(f"does not fit: one sequence peaks at {_gib(one)} > the device budget {_gib(budget)}")
    rows, at = min(max(2, row.rows), cap), math.inf
    while rows > 1 and at == math.inf:
        at = peak_at(rows)
        if at == math.inf:
            rows //= 2
    fitted = sizing.rows_from_probes(budget, int(one), int(at), rows, cap) if rows > 1 else 1
    how = f"measured: {_gib(one)} at 1 sequence" + (f", {_gib(at)} at {rows}" if rows > 1 else "")
    peak = one
    while fitted > 1:                    # the line is a model: check it, step down while it was optimistic
        peak = peak_at(fitted)
        if peak <= budget:
            break
        shrink = 1 + int((fitted - 1) * (budget - one) / (peak - one)) if peak < math.inf else fitted // 2
        fitted = max(1, min(fitted - 1, shrink))
        peak = one
    fit.how = f"{how}; {fitted} fit(s), peak {_gib(peak)} (estimate was {row.rows})"
    fit.kv = sizing.kv_bytes(setup.shape, fitted, setup.prompt_len + setup.new_tokens)     # transformers' cache
    fit.activations = max(0, int(peak - fit.weights - fit.kv))
    fit.rows = fitted
    row.rows, row.calls = fitted, math.ceil(setup.sequences / fitted)
    logger.info("bench gpu: %s: %s", row.name, fit.how)


def fit_time_limit(live: list[Row], setup: Setup, left: float) -> list[Row]:
    """The rows whose first repeat fits the ``left`` seconds of --time-limit together (each row's at least
    its calls x steps x moved bytes over the probed bandwidth): the slowest are left out, each with a
    line saying so, before any timed run."""
    need = {r.key: estimate_repeat_s([r], setup) for r in live}
    keep = sorted(live, key=lambda r: need[r.key])
    while keep and sum(need[r.key] for r in keep) > left:
        r = keep.pop()
        r.error = (f"not run: one repeat needs >= {need[r.key]:.0f} s ({r.calls} generate calls at the probed "
                   f"{setup.bandwidth / 1e9:.1f} GB/s); --time-limit left {max(left, 0):.0f} s")
        logger.warning("bench gpu: %s %s", r.name, r.error)
    return [r for r in live if r.error is None]


def run(setup: Setup, keys: list[str], *, n: int | None, n_max: int, warmup_tokens: int,
        time_limit: float = 0.0, out: Path | None = None) -> list[Row]:
    shape, dev = setup.shape, setup.device
    dtype = getattr(torch, shape.dtype)
    skeleton = meta_model(shape, setup.attn)
    index = RandomIndex(skeleton, seed=shape.seed, dtype=dtype, pin=dev.type == "cuda")
    setup.fill_s = index.materialize()
    logger.info("bench gpu: random weights %s in %.1f s (%s)", _gib(index.nbytes), setup.fill_s,
                "pinned host memory" if index.pin else "host memory")
    most = (n or n_max) * setup.bs               # sized for the largest group the planner may choose
    rows: list[Row] = []
    for key, name, rules in LADDER:
        if key not in keys:
            continue
        fit = size(key, setup, most, skeleton)
        if not fit.fits:                         # reported before anything runs, never an OOM mid-run
            logger.warning("bench gpu: %s does not fit the device budget %s: %s", name, _gib(setup.budget), fit.why)
            rows.append(Row(key, name, rules, fit=fit, error=f"does not fit the device budget: {fit.why}"))
            continue
        before = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
        t0 = time.perf_counter()
        try:
            experts = HF_EXPERTS[setup.hf_experts] if key not in sizing.KLOTSKI else None
            row = (_accelerate_row(shape, index, fit, setup.attn, dev, experts) if rules is None
                   else _kinject_row(key, name, rules, shape, index, row_overrides(fit, setup), setup.attn, dev,
                                     experts))
        except Exception as exc:        # a contender that cannot load is a row with its error, not a crash
            logger.warning("bench gpu: %s failed to load: %s: %s", name, type(exc).__name__, exc)
            rows.append(Row(key, name, rules, fit=fit, error=f"load failed: {type(exc).__name__}: {str(exc)[:200]}"))
            continue
        row.fit = fit
        gc.collect()
        row.resident = (torch.cuda.memory_allocated(dev) - before if dev.type == "cuda"
                        else _device_bytes(row.model, dev))
        logger.info("bench gpu: loaded %s in %.1f s; %s", name, time.perf_counter() - t0, row.what)
        rows.append(row)
    live = [r for r in rows if r.error is None]

    planned = next((r for k in ("klotski", "hot", "hqq") for r in live if r.key == k), None)
    if n is not None:
        setup.n, setup.plan_text = n, f"n = {n} (--n, planner not run)"
    elif planned is not None:
        try:
            setup.n, setup.plan_text = plan_n(planned, setup, n_max)
        except Exception as exc:         # no plan is a note in the report, not a crash
            setup.n = n_max
            setup.plan_text = f"planner failed ({type(exc).__name__}: {exc}); using n = --n-max = {n_max}"
    else:
        setup.n, setup.plan_text = n_max, f"n = --n-max = {n_max} (no Klotski contender to plan with)"
    logger.info("bench gpu: %s", setup.plan_text)
    for r in rows:
        r.fit.sequences = setup.sequences
        cap = setup.bs if r.key == "simple" else setup.sequences
        r.rows = r.fit.rows = min(r.fit.rows, cap)
        r.calls = math.ceil(setup.sequences / r.rows) if r.rows else 0
    batch = prompts(shape, setup.sequences, setup.prompt_len, dev)

    for r in live:                       # warm-up: operator order, correlation table, kernels, allocator
        try:
            if dev.type == "cuda" and r.key not in sizing.KLOTSKI:
                calibrate(r, batch, setup, warmup_tokens, setup.bs if r.key == "simple" else setup.sequences)
            else:
                probe_peak(r, batch, r.rows, setup, warmup_tokens)
        except KinjectError as exc:
            r.error = str(exc)
            logger.warning("bench gpu: %s %s", r.name, r.error)
        except Exception as exc:
            r.error = f"warm-up failed: {type(exc).__name__}: {str(exc)[:200]}{_where(exc)}"
            logger.warning("bench gpu: %s %s", r.name, r.error)
    live = [r for r in live if r.error is None]
    if time_limit:
        live = fit_time_limit(live, setup, time_limit - (time.perf_counter() - setup.started))
    per_repeat = estimate_repeat_s(live, setup)
    logger.info("bench gpu: %d sequences x (%d prompt + %d new tokens); one repeat takes >= %.0f s at %.1f GB/s; "
                "%.0f s elapsed%s", setup.sequences, setup.prompt_len, setup.new_tokens, per_repeat,
                setup.bandwidth / 1e9, time.perf_counter() - setup.started,
                f" of --time-limit {time_limit:.0f} s" if time_limit else "")
    for rep in range(setup.repeats):
        elapsed = time.perf_counter() - setup.started
        last = sum(r.times[-1] for r in live if r.times) or per_repeat
        if time_limit and rep and elapsed + last > time_limit:
            setup.stopped = (f"stopped after {rep} of {setup.repeats} repeats: --time-limit {time_limit:.0f} s "
                             f"({elapsed:.0f} s elapsed, one repeat takes {last:.0f} s)")
            logger.warning("bench gpu: %s", setup.stopped)
            break
        k = rep % max(len(live), 1)
        for r in live[k:] + live[:k]:            # interleaved, the order rotating every repeat
            try:
                timed_run(r, batch, setup)
            except Exception as exc:
                r.error = f"repeat {rep + 1} failed: {type(exc).__name__}: {str(exc)[:200]}{_where(exc)}"
                logger.warning("bench gpu: %s %s", r.name, r.error)
                continue
            logger.info("bench gpu: repeat %d %-30s %7.2f s", rep + 1, r.name, r.times[-1])
        live = [r for r in live if r.error is None]
        setup.repeats_done = rep + 1
        _compare_tokens(rows)
        if out is not None:                      # partial results survive a kill
            out.write_text(report(rows, setup) + "\n")
    for r in rows:
        rt = getattr(r.model, "kinject", None)
        if rt is not None:
            rt.transfer.close()
    return rows


def _where(exc: BaseException) -> str:
    """The innermost frames of an exception (file:line function): an out-of-memory error says which
    code asked for the bytes."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)[-3:]
    return " (at " + " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames)) + ")" \
        if frames else ""


def _compare_tokens(rows: list[Row]) -> None:
    """Share of generated tokens equal to the reference row's (accelerate = plain HF modules)."""
    ref = reference(rows)
    for r in rows:
        if r.tokens is None:
            continue
        r.match = float((r.tokens == ref.tokens).float().mean()) if r.tokens.shape == ref.tokens.shape else 0.0


# ============================================================================ entry point


def main(args) -> int:
    started = time.perf_counter()
    if not args.quiet:
        logger.setLevel(logging.INFO)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise KinjectError("bench gpu: CUDA is not available; use --device cpu for a dry run")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise KinjectError(f"bench gpu: --device must be cuda[:i] or cpu, got {args.device!r}")
    keys = list(dict.fromkeys(k.strip() for k in args.contenders.split(",") if k.strip()))
    unknown = [k for k in keys if k not in KEYS]
    if unknown:
        raise KinjectError(f"bench gpu: unknown contender {unknown[0]!r}; contenders are {', '.join(KEYS)}")
    if "acc" in keys:
        try:
            import accelerate  # noqa: F401
        except ImportError:
            raise KinjectError("bench gpu: the accelerate contender needs accelerate (pip install 'kinject[bench]') "
                               "or --contenders without acc") from None
    prompt_len, new_tokens = WORKLOADS[args.workload]
    prompt_len = args.prompt_len or prompt_len
    new_tokens = args.new_tokens or new_tokens
    if min(args.layers, args.bs, args.repeats, prompt_len, new_tokens, args.n_max) < 1 or args.warmup_tokens < 1:
        raise KinjectError("bench gpu: --layers, --bs, --repeats, --prompt-len, --new-tokens, --n-max and "
                           "--warmup-tokens must be >= 1")
    shape = Shape(layers=args.layers, hidden=args.hidden, intermediate=args.intermediate, experts=args.experts,
                  top_k=args.top_k, heads=args.heads, kv_heads=args.kv_heads, vocab=args.vocab, dtype=args.dtype,
                  seed=args.seed)
    if shape.hidden % shape.heads:
        raise KinjectError(f"bench gpu: --hidden {shape.hidden} is not a multiple of --heads {shape.heads}")
    if args.device_budget:
        from kinject.rules import parse_size

        try:
            budget, how = parse_size(args.device_budget), "--device-budget"
        except ValueError as exc:
            raise KinjectError(f"bench gpu: --device-budget: {exc}") from None
    else:
        batched = device.type == "cuda" and args.hf_experts == "default"
        budget, how = device_budget(shape, args.card_gib, minimum_budget(shape, prompt_len, new_tokens, args.attn,
                                                                         (args.n or args.n_max) * args.bs, batched))
    t0 = time.perf_counter()
    bandwidth = h2d_bandwidth(device)
    peak = matmul_peak(device, getattr(torch, shape.dtype))
    logger.info("bench gpu: %s; H2D %.1f GB/s, matmul peak %.1f TFLOP/s (probes %.1f s); device_budget %s (%s)",
                "DRY RUN on cpu" if device.type != "cuda" else torch.cuda.get_device_name(device),
                bandwidth / 1e9, peak / 1e12, time.perf_counter() - t0, _gib(budget), how)
    setup = Setup(shape, device, args.bs, args.n or args.n_max, prompt_len, new_tokens, args.repeats, budget, how,
                  bandwidth, peak, args.attn, hf_experts=args.hf_experts, started=started)
    out = Path(args.out) if args.out else None
    from kinject.testing import no_progress_bars

    with no_progress_bars(), quiet_accelerate():
        rows = run(setup, keys, n=args.n, n_max=args.n_max, warmup_tokens=args.warmup_tokens,
                   time_limit=args.time_limit, out=out)
    text = report(rows, setup)
    print(text)
    if out is not None:
        out.write_text(text + "\n")
    return 0 if all(r.error is None for r in rows) else 1


@contextlib.contextmanager
def quiet_accelerate():
    """accelerate warns once per dispatch that offloaded parameters sit on the meta device."""
    log = logging.getLogger("accelerate.big_modeling")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def add_arguments(s) -> None:
    d = Shape()
    s.add_argument("--device", default="cuda:0", help="cuda:0 (default), or cpu for a DRY RUN (not a measurement)")
    s.add_argument("--layers", type=int, default=d.layers, help=f"decoder layers (default {d.layers}; Mixtral has 32)")
    for name in ("hidden", "intermediate", "experts", "top_k", "heads", "kv_heads", "vocab"):
        s.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name),
                       help=f"model shape (default: Mixtral-8x7B's, {getattr(d, name)})")
    s.add_argument("--seed", type=int, default=d.seed, help="seed of the random weights and prompts")
    s.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=d.dtype)
    s.add_argument("--card-gib", type=float, default=24.0,
                   help="emulated card: device_budget = its share of the real bf16 Mixtral-8x7B, of this model")
    s.add_argument("--device-budget", default=None, help="explicit device_budget (e.g. 6GiB), overriding --card-gib")
    s.add_argument("--bs", type=int, default=32, help="micro-batch size (Klotski's bs)")
    s.add_argument("--n", type=int, default=None, help="micro-batches per group (default: the planner's, <= --n-max)")
    s.add_argument("--n-max", type=int, default=4, help="cap on the planner's n (bounds the run time)")
    s.add_argument("--workload", choices=tuple(WORKLOADS), default="standard",
                   help="standard: prompt 512 / 32 new tokens (Klotski, FlexGen); decode: prompt 32 / 128 new")
    s.add_argument("--prompt-len", type=int, default=None, help="override the workload's prompt length")
    s.add_argument("--new-tokens", type=int, default=None, help="override the workload's new tokens")
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--warmup-tokens", type=int, default=2)
    s.add_argument("--contenders", default=",".join(KEYS), help=f"comma separated, from {', '.join(KEYS)}")
    s.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa")
    s.add_argument("--hf-experts", choices=tuple(HF_EXPERTS), default="default",
                   help="transformers' experts in accelerate and the whole-layer rungs: default (grouped_mm; on a GPU "
                        "generate decodes with batched_mm, a weight copy per routed pair, sized for) or eager "
                        "(one expert at a time, no copies)")
    s.add_argument("--time-limit", type=float, default=0.0,
                   help="seconds for the whole command, counted from its start: the probes, the random fill of the "
                        "weights (about 30 s for 16.7 GiB), loading every contender (HQQ quantization about 30 s), "
                        "the planner, the sizing probes and warm-ups, then the repeats; no repeat after the first "
                        "starts that would end after it (0: no limit); partial medians reported")
    s.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    s.add_argument("--out", metavar="FILE.md", help="also write the Markdown report there (after every repeat)")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
