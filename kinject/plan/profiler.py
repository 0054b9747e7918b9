"""Measure a planner :class:`~kinject.plan.planner.Profile` from a short calibration run.

Klotski §7 stage 1 ("measure the computation times and transmission durations of the
model's various layers; cache the results locally"). Instead of timing hand-built inputs
per model family, kinject runs the optimized model itself for a few decode steps at the
configured micro-batch size and reads the trace: every operator's compute span (roles from
the operator type: experts, gate, attention), each expert's compute against its token
count (least-squares line), and the link bandwidth from the transfer events. So any model
that has rules can be profiled, and the numbers come from the same code path that runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from kinject.errors import PlanError
from kinject.plan.profile import ExpertCost, Profile

logger = logging.getLogger(__name__)

PROFILE_VERSION = 6               # 2: device bytes of units in use (stored + dequantized); 3: untraced step work; 4: host compute;
                                  # 5: link stalls (the compute the weights' link time overlaps), warm decode calibration;
                                  # 6: the untraced work between the layers of two steps (the step boundary)


def operator_role(op) -> str:
    """``experts`` / ``gate`` / ``attention`` / ``other``, from what the operator wraps."""
    from operators.experts import GroupedExperts
    from operators.gate import PrefetchGate

    if isinstance(op, GroupedExperts):
        return "experts"
    if isinstance(op, PrefetchGate):
        return "gate"
    if "Attention" in type(op.base).__name__:
        return "attention"
    return "other"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu:{platform.machine()}:{platform.processor() or 'unknown'}:{torch.get_num_threads()}t"


def profile_cache_path(model, bs: int, prompt_len: int, per_micro_batch: bool = True) -> Path:
    """``<offload_dir or ~/.cache/kinject>/profiles/<hash>.json``, keyed by hardware, model
    shape, dtype, placement/quantization (the rule file) and the link emulation."""
    rt = model.kinject
    cfg = model.config
    units = sorted((u.name, u.tier, u.wire_nbytes) for u in rt.store.units.values())
    ident = {"v": PROFILE_VERSION, "device": device_name(rt.device), "model_type": cfg.model_type,
             "config": {k: getattr(cfg, k, None) for k in ("hidden_size", "num_hidden_layers", "vocab_size",
                                                              "intermediate_size", "moe_intermediate_size")},
             "dtype": str(next(model.parameters()).dtype), "units": units, "bs": bs, "prompt_len": prompt_len,
             "per_micro_batch": per_micro_batch,
             "emulate_bandwidth": rt.pipeline.emulate_bandwidth}
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:16]
    root = Path(rt.pipeline.offload_dir).expanduser() if rt.pipeline.offload_dir else Path("~/.cache/kinject").expanduser()
    return root / "profiles" / f"{digest}.json"


def measure_profile(model, *, bs: int, device: Any = None, prompt_len: int = 8, decode_steps: int = 4,
                    refresh: bool = False, seed: int = 0, per_micro_batch: bool = True) -> Profile:
    """Profile ``model`` (optimized by kinject, with GroupedExperts rules) at micro-batch ``bs``.
    ``per_micro_batch=False`` skips the second calibration run (two micro-batches) that measures the
    untraced work each further micro-batch adds and the link stalls at a second point (what
    :func:`kinject.plan.planner.predict_step` uses).

    Cached on disk (:func:`profile_cache_path`); ``refresh=True`` re-measures."""
    rt = getattr(model, "kinject", None)
    if rt is None:
        raise PlanError("measure_profile needs a model optimized by kinject (kinject.optimize / from_pretrained)")
    path = profile_cache_path(model, bs, prompt_len, per_micro_batch)
    if path.is_file() and not refresh:
        try:
            return Profile.load(path)
        except Exception as exc:      # a stale or broken cache is re-measured, never trusted
            logger.warning("profile cache %s unreadable (%s); re-profiling", path, exc)
    roles = {op.key: operator_role(op) for op in rt.operators}
    experts_ops = [op for op in rt.operators if roles[op.key] == "experts"]
    if not experts_ops:
        raise PlanError("the planner needs GroupedExperts operators (per-expert units); "
                        f"the rules {rt.rules.path} have none — use rules/klotski.yaml")
    events, steps = _calibration_events(model, bs, prompt_len, decode_steps, seed)
    profile = _profile_from(model, events, roles, experts_ops, bs)
    _add_kv(profile, events, bs)
    profile.meta["hot_probability"] = _hot_probability(rt)
    profile.meta["context"] = prompt_len + decode_steps
    _add_step_terms(profile, model, events, steps, bs, prompt_len, decode_steps, seed, per_micro_batch, roles)
    path.parent.mkdir(parents=True, exist_ok=True)
    profile.save(path)
    logger.info("profile cached at %s", path)
    return profile


def _add_kv(profile: Profile, events, bs: int) -> None:
    """KV terms from the KV transfers the calibration run really made (OffloadedAttention):
    one micro-batch's KV load at the profiled context (median kv_load), and the bytes one
    token of one sequence adds to one layer's cache (the smallest kv_store is a decode step
    of one micro-batch: bs rows x 1 token)."""
    loads = [e.nbytes for e in events if e.stream == "kv_load" and e.nbytes]
    stores = [e.nbytes for e in events if e.stream == "kv_store" and e.nbytes]
    if loads:
        profile.kv_bytes = int(statistics.median(loads))
        if profile.bandwidth:
            profile.t_load_kv = profile.kv_bytes / profile.bandwidth
    if stores:
        per_token = min(stores) / bs
        profile.meta["kv_bytes_per_token_layer"] = per_token
        if profile.bandwidth:
            profile.t_store_kv = min(stores) / profile.bandwidth


def hot_coverage(model) -> float | None:
    """The share of routed tokens the prefetched hot experts took so far (the runtime's prefetch
    statistics), or None before any: the planner's ``hot_coverage``."""
    stats = model.kinject.peek("prefetch_stats")
    return (stats.coverage() or None) if stats is not None else None


def _hot_probability(rt) -> float | None:
    """The experts operators' ``hot_probability`` (the prefetch moves every expert a group uses with at
    least this probability, beyond the K hot ones), or None."""
    values = {getattr(op, "hot_probability", None) for op in rt.operators if operator_role(op) == "experts"}
    return values.pop() if len(values) == 1 else None


CALIBRATION_GROUPS = (1, 4, 8)     # micro-batches of the calibration runs that measure the step's terms
CALIBRATION_REPEATS = 2            # each, interleaved


def _add_step_terms(profile: Profile, model, events, steps, bs: int, prompt_len: int, decode_steps: int,
                    seed: int, per_micro_batch: bool = True, roles: dict[str, str] | None = None) -> None:
    """What a decode step costs beyond the operators' compute, from calibration runs of
    :data:`CALIBRATION_GROUPS` micro-batches:

    * untraced work (:func:`untraced_step_s` over :func:`decode_windows`; KV bookkeeping, row slicing,
      the Python between micro-batches and operators, ``generate``'s loop are in no compute span),
      fitted as a line in the number of micro-batches: ``extra_compute_s`` at one,
      ``meta["untraced_per_micro_batch_s"]`` per further one; the part of it between two steps' layers
      (:func:`boundary_step_s`: embeddings, the lm_head, ``generate``'s loop) likewise,
      ``meta["untraced_boundary_s"]`` and ``meta["untraced_boundary_per_micro_batch_s"]``: the rest runs
      inside the layers, beside the link;
    * ``t_attn``: the median attention span of one micro-batch over every run (Klotski's t_cA); and
      a layer's attention over the whole group as a line in the micro-batches,
      ``meta["attn_first_s"]`` for one, ``meta["attn_per_micro_batch_s"]`` per further one (the first
      micro-batch of a layer pays for what the next ones find warm);
    * the link stalls (:func:`link_overlap_steps`): ``meta["link_overlap_s"]``, the compute the engine runs
      while a layer's weights cross the link.

    The runs are measured in the process whose steps they predict and interleaved
    (:data:`CALIBRATION_REPEATS` rounds over the group sizes), each term the median over the decode
    steps of its runs: a loaded machine slows both sides alike, and one slow step or run moves neither.
    ``per_micro_batch=False`` (or KV not chunked by micro-batch): the first run alone."""
    groups = CALIBRATION_GROUPS if per_micro_batch and any(e.stream == "kv_load" for e in events) else (1,)
    untraced: dict[int, list[float]] = {m: [] for m in groups}
    boundary: dict[int, list[float]] = {m: [] for m in groups}
    layer_attention: dict[int, list[float]] = {m: [] for m in groups}
    overlaps: list[float] = []
    attention: list[float] = []

    def add(m: int, evs, sts) -> None:
        windows = decode_windows(sts)
        untraced[m] += [untraced_step_s(evs, [w]) for w in windows]
        boundary[m] += [boundary_step_s(evs, w) for w in windows]
        overlaps.extend(link_overlap_steps(profile, evs, windows))
        spans = [e for e in evs if e.stream == "compute" and roles
                 and roles.get(e.name.split(" rows ")[0]) == "attention"]
        attention.extend(e.end - e.start for e in spans)
        layer_attention[m] += [sum(e.end - e.start for e in spans if a <= e.start < b) / profile.num_layers
                               for a, b in windows]

    add(1, events, steps)
    for rep in range(CALIBRATION_REPEATS if len(groups) > 1 else 1):
        for m in groups:
            if rep or m > 1:
                add(m, *_calibration_events(model, bs, prompt_len, decode_steps, seed, rows=m * bs))
    if attention:
        profile.t_attn = statistics.median(attention)
    if overlaps:
        profile.meta["link_overlap_s"] = max(statistics.median(overlaps), 0.0)
    measured = [m for m in groups if untraced[m]]      # one decode step has no window: nothing to fit

    def line(samples: dict[int, list[float]]) -> ExpertCost:       # seconds vs micro-batches, medians
        return ExpertCost.fit([float(m) for m in measured], [statistics.median(samples[m]) for m in measured])

    if measured:
        total, edge = line(untraced), line(boundary)
        profile.extra_compute_s = total(1.0)
        profile.meta["untraced_boundary_s"] = min(edge(1.0), profile.extra_compute_s)
        if len(measured) > 1:
            profile.meta["untraced_per_micro_batch_s"] = total.per_token_s
            profile.meta["untraced_boundary_per_micro_batch_s"] = edge.per_token_s
            attn = line(layer_attention)
            if attn(1.0) > 0:
                profile.meta["attn_first_s"], profile.meta["attn_per_micro_batch_s"] = attn(1.0), attn.per_token_s


def link_overlap_steps(profile: Profile, events, steps: list[tuple[float, float]]) -> list[float]:
    """Per step, the seconds of compute per layer that overlapped the link time of the layer's weights:
    the link time of what crossed it for the layers (weights on ``prefetch`` / ``ondemand`` plus one
    micro-batch's KV, per layer) minus the time the compute waited (``stall`` spans, per layer). The
    engine issues a layer's weights in one burst and its next micro-batch's KV queues behind them, so a
    layer stalls ``max(0, that link time - the overlap)`` whatever ``n``: what
    :func:`kinject.plan.planner.predict_step` adds. Empty without a measured link."""
    if not profile.bandwidth:
        return []
    layers, out = profile.num_layers, []
    for a, b in steps:
        inside = [e for e in events if a <= e.start < b]
        weights = sum(e.nbytes for e in inside if e.kind == "transfer" and e.stream in ("prefetch", "ondemand"))
        kv = [e.nbytes for e in inside if e.stream == "kv_load" and e.nbytes]
        ahead = (weights / layers + (statistics.median(kv) if kv else 0)) / profile.bandwidth
        stall = sum(e.end - e.start for e in inside if e.stream == "stall") / layers
        out.append(ahead - stall)
    return out


def decode_windows(steps: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The decode steps of a ``generate`` as the caller sees them: from one decode forward's start to
    the next one's (the forward and ``generate``'s own loop between forwards: logits processing, the
    cache update), the prefill (the first forward) excluded."""
    return [(a, b) for (a, _), (b, _) in zip(steps[1:], steps[2:])]


def untraced_step_s(events, steps: list[tuple[float, float]], streams: tuple[str, ...] = ("compute", "stall")) -> float:
    """Median seconds per step outside every traced compute span and every wait for a transfer:
    the step's work no operator records (embeddings, norms, the lm_head, ``generate``'s own loop, the
    Python between operators). It is paid once per step whatever the pipeline overlaps. ``streams``:
    the lanes whose spans count as recorded work (add ``host_compute`` where the host computes in the
    step's own thread: a CPU runtime's host experts)."""
    spans = sorted((e.start, e.end) for e in events if e.stream in streams)
    out = []
    for a, b in steps:
        busy, until = 0.0, a
        for start, end in spans:
            if end <= until or start >= b:
                continue
            start, end = max(start, until), min(end, b)
            busy += end - start
            until = end
        out.append(max((b - a) - busy, 0.0))
    return statistics.median(out) if out else 0.0


def boundary_step_s(events, step: tuple[float, float]) -> float:
    """Seconds of a step window outside its layers: before the first traced compute or wait and after the
    last (embeddings, the final norm and lm_head, ``generate``'s loop). Nothing of the step itself is in
    flight then, so the link overlaps it only with what the last layer left queued."""
    a, b = step
    spans = [(e.start, e.end) for e in events if e.stream in ("compute", "stall") and a <= e.start < b]
    if not spans:
        return b - a
    return (min(s for s, _ in spans) - a) + max(b - max(e for _, e in spans), 0.0)


def _calibration_events(model, bs: int, prompt_len: int, steps: int, seed: int, rows: int | None = None):
    """The trace events and the step windows of a ``steps``-token decode of ``rows`` sequences
    (default ``bs``: one micro-batch) after a warm-up."""
    rt = model.kinject
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, cfg.vocab_size, (rows or bs, prompt_len), generator=g).to(rt.device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
    was = rt.tracer.enabled
    rt.tracer.enabled = True
    try:
        model.generate(ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1, **kw)   # learn the order, warm
        #   the decode path too (its first steps grow buffers and fill caches a measured step never pays)
        rt.tracer.clear()
        model.generate(ids, max_new_tokens=steps + 1, min_new_tokens=steps + 1, **kw)
        return rt.tracer.events(), rt.tracer.steps()
    finally:
        rt.tracer.enabled = was
        rt.tracer.clear()


def _profile_from(model, events, roles: dict[str, str], experts_ops, bs: int) -> Profile:
    rt = model.kinject
    cfg = model.config
    compute = [e for e in events if e.stream == "compute"]

    def role_of(name: str) -> str | None:      # "<op key>" or "<op key> rows a:b" (per micro-batch)
        return roles.get(name) or roles.get(name.split(" rows ")[0])

    def median_of(role: str) -> float:
        spans = [e.end - e.start for e in compute if role_of(e.name) == role]
        return statistics.median(spans) if spans else 0.0

    # grouped expert compute (one event per group of g experts, n tokens, d seconds): the
    # per-expert model t(tokens) = a + b * tokens is fitted on the group's mean point (n/g, d/g),
    # i.e. d = g * a + b * n -- what one more expert in a group costs, not one call per expert
    expert_points = [(e.args["tokens"] / len(e.args["experts"]), (e.end - e.start) / len(e.args["experts"]))
                     for e in compute if e.args and e.args.get("experts") and e.args.get("tokens")]
    host_cost = _host_cost(events) or _calibrated_host_cost(rt)
    if not expert_points and host_cost is not None and rt.device.type == "cpu":
        cost = host_cost            # every expert ran on the host: on a CPU device the same cores and kernel
    elif not expert_points:
        raise PlanError("calibration run recorded no expert compute events on the device (is tracing on? with "
                        "every expert computed on the host, profile with vars.experts_compute=auto or device)")
    else:
        cost = ExpertCost.fit([float(t) for t, _ in expert_points], [s for _, s in expert_points])

    bandwidth = link_bandwidth(events, rt.transfer)

    def unit_bytes(role: str, kind: str = "wire_nbytes") -> int:
        """Mean bytes of a ``role`` unit: moved per load (``wire_nbytes``: stored, e.g. FP8 values +
        scales), on the device while in use (``nbytes``), or of the weights computed with (``compute_nbytes``)."""
        sizes = []
        for op in rt.operators:
            if roles[op.key] != role:
                continue
            units = op.units if role == "experts" else ([op.binding.unit] if getattr(op, "binding", None) else [])
            sizes += [getattr(u, kind) for u in units if u is not None]
        return int(statistics.mean(sizes)) if sizes else 0

    attn_b, gate_b, expert_b = unit_bytes("attention"), unit_bytes("gate"), unit_bytes("experts")
    itemsize = next(model.parameters()).element_size()
    top_k = int(getattr(cfg, "num_experts_per_tok", 2))
    flops_per_token = 2.0 * (unit_bytes("attention", "compute_nbytes")
                             + top_k * unit_bytes("experts", "compute_nbytes")) / itemsize
    load = (lambda b: b / bandwidth) if bandwidth else (lambda b: 0.0)
    quant = sorted({str(u.quant[next(iter(u.quant))][2]) for u in rt.store.units.values() if u.quant})
    return Profile(
        bs=bs, t_attn=median_of("attention"), t_gate=median_of("gate"), t_expert=cost,
        num_experts=experts_ops[0].num_experts, top_k=top_k, num_layers=len(experts_ops), tokens_per_seq=1,
        attn_bytes=attn_b, gate_bytes=gate_b, expert_bytes=expert_b, attn_device_bytes=unit_bytes("attention", "nbytes"),
        gate_device_bytes=unit_bytes("gate", "nbytes"), expert_device_bytes=unit_bytes("experts", "nbytes"),
        t_load_attn=load(attn_b), t_load_gate=load(gate_b), t_load_expert=load(expert_b),
        bandwidth=bandwidth, peak_flops=_peak_flops(rt.device, next(model.parameters()).dtype),
        flops_per_token=flops_per_token, device=device_name(rt.device),
        t_host_expert=host_cost, activation_bytes_per_row=cfg.hidden_size * itemsize if host_cost else 0,
        same_cores=bool(host_cost) and rt.device.type == "cpu",
        model=f"{cfg.model_type}:h{cfg.hidden_size}:L{cfg.num_hidden_layers}",
        hidden_size=cfg.hidden_size, dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
        quant=",".join(quant), meta={"emulated_link": rt.transfer.emulated, "expert_points": len(expert_points),
                                     "measured_at": time.strftime("%Y-%m-%d %H:%M:%S")})


def _host_cost(events) -> ExpertCost | None:
    """Host compute of one expert vs its rows, fitted like the device's from the ``host_compute`` lane (experts
    computed where they live, ``compute: host / auto``); None when the rules computed none there."""
    points = [(e.args["tokens"] / len(e.args["experts"]), (e.end - e.start) / len(e.args["experts"]))
              for e in events if e.stream == "host_compute" and e.args and e.args.get("experts") and e.args.get("tokens")]
    if not points:
        return None
    return ExpertCost.fit([float(t) for t, _ in points], [s for _, s in points])


def _calibrated_host_cost(rt) -> ExpertCost | None:
    """Where the calibration run moved every expert (host compute measured slower), the host line the
    experts operators measured before deciding (:class:`kinject.engine.costs.PlacementCosts`): the
    plan still weighs host compute, as the running model does. None without host compute rules."""
    costs = rt.peek("placement_costs")
    if costs is None or not costs.host.known:
        return None
    return ExpertCost(*costs.host.coefficients())


# streams whose transfers cross the host->device link (kv_store goes the other way; disk reads
# are real I/O beside it)
_H2D_STREAMS = ("prefetch", "ondemand", "kv_load")


def link_bandwidth(events, transfer) -> float | None:
    """Host->device bytes/s. An emulated link runs at exactly its configured rate (1e9 bytes/s
    per GB/s). A real one: the bytes of the calibration run's host->device transfers over the
    time the link was busy -- the *union* of their spans. Summing the spans instead counts a
    transfer queued behind another (channels share one link) for its waiting time too: with a
    prefetch and an on-demand load in flight it measured a third of the rate the link gave."""
    if getattr(transfer, "emulate_bandwidth", None):
        return float(transfer.emulate_bandwidth) * 1e9
    moved = sorted(((e.start, e.end, e.nbytes) for e in events
                    if e.kind == "transfer" and e.stream in _H2D_STREAMS and e.nbytes > 0 and e.end > e.start))
    if not moved:
        return None
    busy, until = 0.0, float("-inf")
    for start, end, _ in moved:                      # union of [start, end) intervals
        if end > until:
            busy += end - max(start, until)
            until = end
    return sum(n for _, _, n in moved) / busy


def _peak_flops(device: torch.device, dtype: torch.dtype, n: int = 512, reps: int = 5) -> float:
    """Achieved matmul FLOP/s at the model's dtype: the compute side of the roofline."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)       # profiling only, never in the hot path
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 2.0 * n ** 3 * reps / (time.perf_counter() - t0)
