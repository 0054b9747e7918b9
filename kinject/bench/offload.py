"""``kinject bench offload``: kinject's disk offload against accelerate's, on one CPU.

One process, every contender loaded side by side and run interleaved (docs/architecture.md, "Benchmarks and bounds"): the same
prompts, the same number of generated tokens, the same dtype and attention kernel, medians of
``--repeats`` timed ``generate`` calls each (the order rotates every repeat), greedy tokens
checked against the plain in-RAM model. The model is a Mixtral-shaped random model
(``kinject.testing``'s healthy init) written once with ``save_pretrained`` into ``--workdir``
and reused by later runs of the same shape.

``--wide``: a model bigger than RAM. The Qwen3-30B-A3B shape cut to 4 layers (:data:`WIDE`: 128
experts top-8 of 9.4 MB each in bfloat16, 4.83 GB of experts, one file in the per-expert layout),
batch 8 x 32 prompt tokens, the kinject rows' ``pipeline.host_budget`` a share of the experts'
bytes (``--host-budget``, 25 %) so their host cache cannot hold them, their ``pipeline.device_budget``
what a 24 GiB card holds of the real model (``--device-budget``, 42 % of the model's bytes: on a CPU
the device is RAM too, and without a budget it holds every layer prefetched ahead), and the page
cache dropped after every forward: every decode step reads from disk the routed experts the host cache does not
hold. accelerate has no cache of its own; it gets the same dropped page cache. The workdir needs
about 3x the checkpoint (accelerate's offload folders), the process more than the checkpoint in RAM
(``hf-ram``, the reference, holds every weight).

Contenders (``--contenders``, comma separated):

===========================  =================================================================================
``hf-ram``                   plain ``AutoModelForCausalLM.from_pretrained``, everything in RAM (reference)
``acc-disk``                 ``accelerate.disk_offload``: every weight in accelerate's offload folder
``acc-devmap``               ``from_pretrained(device_map=..., offload_folder=...)``: experts on "disk"
``kj-offload``               ``rules/offload.yaml`` + ``vars.weights=disk``: every module a disk unit
``kj-experts``               the same rule file, only the experts on disk (the rest resident), as acc-devmap
``kj-pipeline``              ``rules/simple_pipeline.yaml`` + ``vars.weights=disk``: whole layers
``kj-klotski``               ``rules/klotski.yaml`` + ``vars.weights=disk``: attention, gates, experts
``kj-klotski-experts``       the same rule file, only the experts on disk (per-expert units), as acc-devmap
``kj-klotski-experts-hqq4``  the same, the experts kept on disk as HQQ 4-bit (lossy: not a same-tokens row)
``kj-defaults``              ``rules/klotski.yaml`` + ``vars.experts=disk`` and nothing else: the budgets ``auto``
                             (the bench's ``--host-budget`` / ``--device-budget`` are not given to it)
``acc-maxmem``               accelerate ``device_map`` at kinject's memory: ``max_memory`` for the device (on a
                             CPU, RAM) = the kinject rows' ``device_budget`` + ``host_budget`` (``--device-budget``,
                             ``--host-budget``), the experts that do not fit on disk

Every kinject row but ``kj-defaults`` gets the bench's budgets, and ``null`` where none is given (no
host cache: the rows compare the disk path at the memory accelerate's rows have).
===========================  =================================================================================

Equal memory: every row prints its peak device bytes (kinject: the store's accounting of the weights it
holds at once, device copies and host cache entries together, since on a CPU both are RAM; accelerate:
the weights its device map keeps in memory; hf-ram: every weight) and its peak host RSS; a ratio
against accelerate at other memory than kinject's is labelled by the contender it is against.

A kinject contender followed by ``@KEY=VALUE`` overrides (``kj-offload@pipeline.prefetch_lookahead=3``)
is one more row, with those rule-file overrides added.

Page cache (``--page-cache``), the same for every contender: before every timed run the page
cache of every checkpoint and offload file is dropped (``posix_fadvise(DONTNEED)``). With
``drop-after-read`` (default) it is also dropped after every model forward, by the bench (a
forward hook), for every contender alike, so that every forward reads its offloaded weights from
the disk, as when the model does not fit in RAM. With ``drop-before-run`` only
the first forward of a run is cold; later forwards may be served from the page cache. With
``warm`` nothing is ever dropped (after the disk bandwidth is measured): the warm-up ``generate``
and earlier runs leave the pages cached, as for a model that fits in RAM and was used before.

Per contender: tokens/s (generated tokens / total ``generate`` time, prefill included), ratios
against the two accelerate contenders, disk bytes per generated token (measured: the process's
``read_bytes`` in ``/proc/self/io``; accounted: kinject's ``store.summary()["host_cache"]["disk_bytes"]``
(the disk units it read; a load its host cache served is no disk read),
accelerate's offloaded parameter bytes x model forwards, since its hooks load every offloaded
weight of a module before each of its forwards), a roofline bound ``tokens / max(disk bytes /
disk bandwidth, in-RAM generate time)`` and the share of it achieved, and the peak RSS the
contender would have alone (process baseline + what loading it added + the largest rise during
one of its runs). kinject rows with a host cache get its hits, misses and evictions per run (the
store's counters); kinject rows also get their timeline (disk busy, compute busy, time compute
waited for weights) from the runtime's tracer.

``--prefill`` (on with ``--wide``): every repeat also times each contender's cold prefill alone (a
``generate`` of one token, the page cache and kinject's host cache emptied first, whatever
``--page-cache`` says) against its disk bound, ``max(disk bytes it read / disk bandwidth, hf-ram's
prefill time)``: a prefill routes the batch's tokens to nearly every expert, so it is where reading
the whole checkpoint at the disk's sequential bandwidth shows (kinject rows with ``pipeline.trace``
also get the seconds their disk lane was busy).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from kinject.bench.common import (PeakRSS, disk_read_bytes, failure_line, median, rss_bytes, checkpoint_files, drop_page_cache,
                                  generate, provenance, same_prefix)
from kinject.bench.contenders import (Contender, drop_after_forward, load_acc_devmap, load_acc_disk, load_acc_maxmem,
                                      load_hf_ram)
from kinject.errors import KinjectError
from kinject.rules import resolve_rules_path

logger = logging.getLogger(__name__)

CONTENDERS = ("hf-ram", "acc-disk", "acc-devmap", "kj-offload", "kj-experts", "kj-pipeline", "kj-klotski",
              "kj-klotski-experts")                   # the default run: every row must give hf-ram's tokens
EXTRA_CONTENDERS = ("kj-klotski-experts-hqq4", "kj-defaults", "acc-maxmem")       # on request only
ACCELERATE = ("acc-disk", "acc-devmap", "acc-maxmem")
PAGE_CACHE_POLICIES = ("drop-after-read", "drop-before-run", "warm")


# ------------------------------------------------------------------------------------ config


# Per family: its name in words, the config keys of the expert width and the expert count, and
# whether head_dim is a config field (Qwen3-MoE derives it from hidden / heads).
FAMILIES = {
    "mixtral": ("Mixtral", "intermediate_size", "num_local_experts", True),
    "qwen3_moe": ("Qwen3-MoE", "moe_intermediate_size", "num_experts", False),
}


@dataclass(frozen=True)
class ModelShape:
    """The random MoE written to disk (defaults: a Mixtral, 6 layers, 1.22 GB in bfloat16)."""

    family: str = "mixtral"
    layers: int = 6
    hidden: int = 1024
    intermediate: int = 3584
    experts: int = 8
    top_k: int = 2
    heads: int = 16
    kv_heads: int = 4
    vocab: int = 32000
    dtype: str = "bfloat16"
    layout: str = "hub"          # hub: per-expert keys (save_pretrained's default); fused: 3-D experts
    seed: int = 0

    def key(self) -> str:
        return hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:10]

    def describe(self) -> str:
        return (f"{FAMILIES[self.family][0]}-shaped random model: {self.layers} layers, hidden {self.hidden}, "
                f"expert intermediate {self.intermediate}, {self.experts} experts top-{self.top_k}, {self.heads} heads / "
                f"{self.kv_heads} KV heads, vocab {self.vocab}, {self.dtype}, {self.layout} checkpoint layout; "
                f"experts {self.expert_bytes() / 1e9:.3g} GB")

    def expert_bytes(self) -> int:
        """Bytes of every routed expert (gate, up and down projections) in the checkpoint's dtype."""
        itemsize = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.layers * self.experts * 3 * self.hidden * self.intermediate * itemsize

    def config(self) -> dict:
        """The transformers config overrides that build this shape."""
        _, intermediate_key, experts_key, head_dim = FAMILIES[self.family]
        out = {"num_hidden_layers": self.layers, "hidden_size": self.hidden, intermediate_key: self.intermediate,
               experts_key: self.experts, "num_experts_per_tok": self.top_k, "num_attention_heads": self.heads,
               "num_key_value_heads": self.kv_heads, "vocab_size": self.vocab}
        return {**out, "head_dim": self.hidden // self.heads} if head_dim else out


# ``--wide``: the Qwen3-30B-A3B shape cut to 4 layers (9.4 MB per bf16 expert, 4.83 GB of experts),
# decoded with the host tier smaller than the experts: a model bigger than its RAM budget.
WIDE = ModelShape(family="qwen3_moe", layers=4, hidden=2048, intermediate=768, experts=128, top_k=8, heads=32,
                  kv_heads=4, vocab=32000)
WIDE_CONTENDERS = ("hf-ram", "acc-devmap", "acc-maxmem", "kj-defaults", "kj-klotski-experts")
WIDE_HOST_BUDGET = 0.25          # kinject's pipeline.host_budget, as a share of the experts' bytes
# kinject's pipeline.device_budget, as a share of the model's bytes: what a 24 GiB card holds of the real
# Qwen3-30B-A3B (30.5 B parameters, 61 GB in bfloat16), the budget a user of such a card would set (the
# way ``kinject bench gpu`` scales a 24 GiB card to its layers). On a CPU the "device" is RAM too: without
# a budget the rows' device copies (experts read from disk, prefetched layers ahead) grow unbounded.
WIDE_DEVICE_BUDGET = 24 * 2**30 / 61.1e9


@dataclass
class Workload:
    batch: int = 4
    prompt_len: int = 64
    new_tokens: int = 8
    repeats: int = 3
    warmup_tokens: int = 2
    attn: str = "sdpa"
    page_cache: str = "drop-after-read"
    host_budget: float | None = None     # kinject rows' pipeline.host_budget, a share of the experts' bytes
    device_budget: float | None = None   # kinject rows' pipeline.device_budget, a share of the model's bytes
    prefill: bool = False                # also time a cold prefill alone (one new token) per contender and repeat


# ------------------------------------------------------------------------------------ measurements


def device_budget_bytes(shape: ModelShape, share: float, ckpt: Path) -> int:
    """``share`` of the model's bytes (its checkpoint's), at least what the experts' rows need to run:
    every non-expert weight (resident) and one layer's experts (a prefill routes to most of them)."""
    model = sum(f.stat().st_size for f in checkpoint_files(ckpt))
    floor = model - shape.expert_bytes() + shape.expert_bytes() // shape.layers * 65 // 64
    return max(int(share * model), floor)


def disk_bandwidth(files: list[Path], rounds: int = 2, readers: tuple[int, ...] = (1, 2)) -> float:
    """Cold read bandwidth of ``files`` (bytes/s), best of ``rounds`` for each reader count in
    ``readers``: one reader reads the files in order in 64 MiB requests; ``n`` readers share those
    requests (reader ``i`` takes every ``n``-th, in file order), as kinject's ``n`` disk workers do
    (``pipeline.disk_workers``, default 2). The bound is the best the disk gave either way: a virtio
    disk may serve two requests in flight faster than one, and a bound one contender beats is no bound."""
    best = 0.0
    chunk = 64 << 20
    sizes = {f: f.stat().st_size for f in files}
    jobs = [(f, off, min(chunk, size - off)) for f, size in sizes.items() for off in range(0, size, chunk)]

    def read(share: list[tuple[Path, int, int]]) -> int:
        buf, n, fds = bytearray(chunk), 0, {}
        try:
            for f, off, size in share:
                fd = fds.get(f)
                if fd is None:
                    fd = fds[f] = os.open(f, os.O_RDONLY)
                got = 0
                while got < size and (k := os.preadv(fd, [memoryview(buf)[got:size]], off + got)):
                    got += k
                n += got
        finally:
            for fd in fds.values():
                os.close(fd)
        return n

    for _ in range(rounds):
        for n_readers in readers:
            drop_page_cache(files)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(n_readers) as pool:
                n = sum(pool.map(read, [jobs[i::n_readers] for i in range(n_readers)]))
            best = max(best, n / max(time.perf_counter() - t0, 1e-9))
    drop_page_cache(files)
    return best


def count_routed(model: torch.nn.Module) -> tuple[list[int], Callable[[], None]]:
    """Count, at every call of each ``*.experts`` module (transformers 5's experts take
    ``(hidden_states, top_k_index, top_k_weights)``), how many distinct experts its tokens route to:
    the experts a reader of only the routed ones needs per layer and forward. Returns the running
    count and the function that removes the hooks."""
    count = [0]

    def hook(_, args, kwargs) -> None:
        index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
        if isinstance(index, torch.Tensor):
            count[0] += int(index.unique().numel())                    # index: [tokens, top_k]

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True)
               for n, m in model.named_modules() if re.search(r"\.experts$", n)]
    return count, lambda: [h.remove() for h in handles]


def mapped_files(files: list[Path]) -> list[str]:
    """Those of ``files`` this process maps (their cached pages cannot be dropped)."""
    names = {str(f.resolve()) for f in files}
    try:
        with open("/proc/self/maps") as f:
            return sorted({p for p in (ln.split(None, 5)[-1].strip() for ln in f) if p in names})
    except OSError:
        return []


# ------------------------------------------------------------------------------------ model on disk


def prepare_checkpoint(shape: ModelShape, workdir: Path) -> Path:
    """Write the random model with ``save_pretrained`` (once per shape; reused when present)."""
    from kinject.testing import save_tiny_model

    path = workdir / f"{shape.family}-{shape.key()}"
    stamp = path / "kinject_bench.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == asdict(shape):
        logger.info("bench: reusing checkpoint %s", path)
        return path
    shutil.rmtree(path, ignore_errors=True)
    for stale in workdir.glob(f"{path.name}-*"):     # offload folders made from an older checkpoint
        shutil.rmtree(stale, ignore_errors=True)
    logger.info("bench: writing %s to %s", shape.describe(), path)
    t0 = time.perf_counter()
    save_tiny_model(shape.family, path, seed=shape.seed, dtype=getattr(torch, shape.dtype),
                    legacy_expert_keys=shape.layout == "hub", max_shard_size="50GB", **shape.config())
    stamp.write_text(json.dumps(asdict(shape), indent=1))
    logger.info("bench: checkpoint written in %.1f s", time.perf_counter() - t0)
    return path


def prompts(tokenizer, batch: int, prompt_len: int) -> dict[str, torch.Tensor]:
    """``batch`` deterministic prompts of exactly ``prompt_len`` tokens (no padding)."""
    from kinject.testing import tiny_prompts

    rows = []
    for i, text in enumerate(tiny_prompts(batch, min_words=prompt_len)):
        ids = tokenizer(text)["input_ids"][:prompt_len]
        if len(ids) < prompt_len:
            raise KinjectError(f"bench: prompt {i} has only {len(ids)} < {prompt_len} tokens")
        rows.append(ids)
    input_ids = torch.tensor(rows, dtype=torch.long)                     # [B, L]
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


# ------------------------------------------------------------------------------------ contenders


_KINJECT = {
    "kj-offload": ("offload.yaml", ["vars.weights=disk"], "every module on disk (per-module units)"),
    "kj-experts": ("offload.yaml", ["vars.weights=device", "rules.4.replace.kwargs.weights=disk"],
                   "experts on disk (per-module units), rest in RAM"),
    "kj-pipeline": ("simple_pipeline.yaml", ["vars.weights=disk"],
                    "decoder layers on disk (per-layer units), rest in RAM"),
    "kj-klotski": ("klotski.yaml", ["vars.weights=disk"],
                   "attention, gates, experts on disk (per-expert units), rest in RAM"),
    "kj-klotski-experts": ("klotski.yaml", ["vars.weights=device", "vars.experts=disk"],
                           "experts on disk (per-expert units), rest in RAM, as acc-devmap"),
    "kj-defaults": ("klotski.yaml", ["vars.experts=disk"],
                    "kinject defaults: klotski.yaml + vars.experts=disk, budgets auto"),
    "kj-klotski-experts-hqq4": ("klotski.yaml", ["vars.weights=device", "vars.experts=disk",
                                                         "rules.2.replace.kwargs.quant={nbits: 4, group_size: 64}"],
                                "experts on disk as HQQ 4-bit (lossy: tokens differ), rest in RAM"),
}


# what a row's weights column calls each operator's weights
_ROLES = {"GroupedExperts": "experts", "OffloadedAttention": "attention", "PrefetchGate": "routers",
          "OffloadedModule": "shared experts / dense MLPs"}


def placement(rt) -> str:
    """Where a loaded kinject model keeps its weights, read from its operators' tiers (not from the
    contender's name: a variant's overrides may have moved them), e.g. "experts host, attention device"."""
    tiers: dict[str, set] = {}
    for op in rt.operators:
        role = _ROLES.get(type(op).__name__, type(op).__name__)
        tiers.setdefault(role, set()).add(str(getattr(op, "weights", "?")))
    return ", ".join(f"{role} {'/'.join(sorted(t))}" for role, t in tiers.items()) + ", rest in RAM"


def rules_path(name: str) -> Path | None:
    p = resolve_rules_path(name)
    return p if p.is_file() else None


def load_kinject(name: str, ckpt: Path, dtype, attn: str, *, workdir: Path, policy: str,
                 host_budget: int | None = None, device_budget: int | None = None, **_) -> Contender:
    import kinject

    base, *extra = name.split("@")          # kj-offload@pipeline.prefetch_lookahead=3: a variant row
    rules, overrides, what = _KINJECT[base]
    path = rules_path(rules)
    if path is None:
        raise KinjectError(f"bench: rule file rules/{rules} not found")
    # offload_dir (HQQ caches, in-memory weights placed on disk) next to the checkpoint, kept across runs
    offload = [f"pipeline.offload_dir={workdir / (ckpt.name + '-kinject-offload')}"]
    # before the row's own overrides: an @pipeline.host_budget / @pipeline.device_budget wins; the
    # defaults row gets none (its budgets are auto), every other row the bench's (none given: null, no
    # host cache and no device budget, the memory acc-maxmem gets: equal_memory)
    if base != "kj-defaults":
        offload += [f"pipeline.{key}={'null' if value is None else value}"
                    for key, value in (("host_budget", host_budget), ("device_budget", device_budget))]
    model = kinject.from_pretrained(ckpt, str(path), offload + overrides + extra, dtype=dtype,
                                    attn_implementation=attn)
    rt = model.kinject
    if extra:           # a variant's overrides may move weights (@vars.experts=host): where they ended up
        what = f"{placement(rt)} ({base}@{'@'.join(extra)})"
    what = "; ".join([what, *(f"{key} {getattr(rt.pipeline, key) / 1e9:.3g} GB"
                              + (" (auto)" if key in rt.autos else "") for key in ("host_budget", "device_budget")
                              if getattr(rt.pipeline, key) is not None)])
    files = sorted(set(checkpoint_files(ckpt)) | {Path(f) for f in rt.store.disk_files()})
    drop_after_forward(model, files, policy)

    def reset():
        rt.store.reset_stats()
        rt.tracer.clear()
        stats = rt.peek("prefetch_stats")
        if stats is not None:
            stats.reset()

    def timeline() -> dict:
        spans: dict[str, list] = {"disk": [], "compute": [], "stall": []}
        for e in rt.tracer.events():
            if e.stream in spans:
                spans[e.stream].append((e.start, e.end))
        disk, compute, stall = (_merge(spans[k]) for k in ("disk", "compute", "stall"))
        stats = rt.peek("prefetch_stats")
        return {"disk": _length(disk), "compute": _length(compute), "stall": _length(stall),
                "both": _length(_intersect(disk, compute)),
                "precision": stats.precision() if stats is not None else None,
                "coverage": stats.coverage() if stats is not None else None}

    def cache() -> dict:
        st = rt.store.summary()
        return {**st["host_cache"], "copied_bytes": st["copied_bytes"]}

    return Contender(name, what, model, files, accounted=lambda: rt.store.summary()["host_cache"]["disk_bytes"],
                     reset=reset, close=rt.transfer.close, timeline=timeline if rt.tracer.enabled else None,
                     cache=cache, cool=rt.store.drop_host_cache, device_bytes=lambda: rt.store.memory_peak)


def _merge(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _intersect(xs: list[tuple[float, float]], ys: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intersection of two sorted lists of disjoint intervals."""
    out, i, j = [], 0, 0
    while i < len(xs) and j < len(ys):
        a, b = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        if a < b:
            out.append((a, b))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(spans) -> float:
    return sum(b - a for a, b in spans)


def load_contender(name: str, ckpt: Path, dtype, attn: str, **kw) -> Contender:
    loaders = {"hf-ram": load_hf_ram, "acc-disk": load_acc_disk, "acc-devmap": load_acc_devmap,
               "acc-maxmem": load_acc_maxmem}
    if name in loaders:
        return loaders[name](ckpt, dtype, attn, **kw)
    return load_kinject(name, ckpt, dtype, attn, **kw)


# ------------------------------------------------------------------------------------ running


def timed_run(c: Contender, batch: dict, work: Workload, pad_id: int, all_files: list[Path]) -> torch.Tensor:
    """One measured ``generate``: cold page cache (unless ``warm``), peak RSS, disk bytes (measured and accounted)."""
    if work.page_cache != "warm":
        drop_page_cache(all_files)
    if work.page_cache == "drop-before-run":     # a cold run: kinject's own RAM cache of the disk starts empty too
        c.cool()
    gc.collect()
    c.reset()
    before_rss, before_io = rss_bytes(), disk_read_bytes()
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        out = generate(c.model, batch, work.new_tokens, pad_id)
        c.times.append(time.perf_counter() - t0)
    after_io = disk_read_bytes()
    c.read_bytes.append(after_io - before_io if before_io is not None and after_io is not None else -1)
    c.accounted_bytes.append(c.accounted())
    if c.timeline is not None:
        c.timelines.append(c.timeline())
    if c.cache is not None:
        c.caches.append(c.cache())
    c.transient = max(c.transient, peak.peak - before_rss)
    return out


def timed_prefill(c: Contender, batch: dict, pad_id: int, all_files: list[Path]) -> None:
    """One measured cold prefill alone (``generate`` of one token: the batch's prompt through every layer
    once): page cache dropped and the contender's own cache emptied before it, whatever ``--page-cache``
    says, so that every weight it needs comes from the disk; its time and the disk bytes it read."""
    drop_page_cache(all_files)
    c.cool()
    gc.collect()
    c.reset()
    before_io = disk_read_bytes()
    t0 = time.perf_counter()
    generate(c.model, batch, 1, pad_id)
    c.prefill_times.append(time.perf_counter() - t0)
    after_io = disk_read_bytes()
    c.prefill_bytes.append(after_io - before_io if before_io is not None and after_io is not None else -1)
    if c.timeline is not None:
        c.prefill_disk_busy.append(c.timeline()["disk"])


def equal_memory(host_budget: int | None, device_budget: int | None) -> int:
    """The memory (bytes) the kinject rows other than ``kj-defaults`` hold for weights, and that
    ``acc-maxmem`` gets as ``max_memory``: their ``device_budget`` (on a CPU, RAM) + their host cache
    (``host_budget``); a budget not given is null for them (no cache, no device copies kept)."""
    return (host_budget or 0) + (device_budget or 0)


def run_bench(shape: ModelShape, work: Workload, contenders: list[str], workdir: Path) -> dict:
    """Prepare, load every contender, warm up, run the interleaved repeats; returns the raw results."""
    from kinject.testing import no_progress_bars

    with no_progress_bars():
        return _run_bench(shape, work, contenders, workdir)


def _run_bench(shape: ModelShape, work: Workload, contenders: list[str], workdir: Path) -> dict:
    from kinject.testing import tiny_tokenizer

    load_before = os.getloadavg()
    dtype = getattr(torch, shape.dtype)
    ckpt = prepare_checkpoint(shape, workdir)
    host_budget = None if work.host_budget is None else int(work.host_budget * shape.expert_bytes())
    device_budget = None if work.device_budget is None else device_budget_bytes(shape, work.device_budget, ckpt)
    ram_bytes = equal_memory(host_budget, device_budget)
    tok = tiny_tokenizer()
    batch = prompts(tok, work.batch, work.prompt_len)
    bandwidth = disk_bandwidth(checkpoint_files(ckpt))
    logger.info("bench: cold disk read bandwidth %.2f GB/s", bandwidth / 1e9)

    gc.collect()
    baseline = rss_bytes()
    loaded: list[Contender] = []
    failed: list[Contender] = []
    ref_model = None
    for name in contenders:
        before, t0 = rss_bytes(), time.perf_counter()
        try:
            c = load_contender(name, ckpt, dtype, work.attn, workdir=workdir, ref=ref_model, policy=work.page_cache,
                               host_budget=host_budget, device_budget=device_budget, ram_bytes=ram_bytes)
        except Exception as exc:   # a contender that cannot load is a row with its error, not a crash
            failed.append(Contender(name, "-", None, [], accounted=lambda: 0, error=failure_line("load failed", exc)))
            logger.warning("bench: %s %s", name, failed[-1].error)
            continue
        gc.collect()
        c.resident = max(0, rss_bytes() - before)
        logger.info("bench: loaded %s in %.1f s (+%.2f GiB RSS)", name, time.perf_counter() - t0, c.resident / 2**30)
        if name == "hf-ram":
            ref_model = c.model
        loaded.append(c)
    all_files = sorted({f for c in loaded for f in c.files} | set(checkpoint_files(ckpt)))
    if mapped := mapped_files(all_files):
        logger.warning("bench: still mapped, their page cache cannot be dropped: %s", ", ".join(mapped))

    reference, routed = None, None
    if ref_model is not None:
        count, remove = count_routed(ref_model)
        reference = generate(ref_model, batch, work.new_tokens, tok.pad_token_id)
        remove()
        routed = count[0] * shape.expert_bytes() // (shape.layers * shape.experts)
    for c in loaded:   # warm-up: kinject's scheduler learns the operator order on its first forward
        if c.model is ref_model or not work.warmup_tokens:
            continue
        try:
            out = generate(c.model, batch, work.warmup_tokens, tok.pad_token_id)
        except Exception as exc:
            c.error = failure_line("warm-up failed", exc)
            logger.warning("bench: %s %s", c.name, c.error)
            continue
        if reference is not None:
            c.tokens_ok &= torch.equal(out, reference[:, : out.shape[1]])

    running = [c for c in loaded if c.error is None]
    for r in range(work.repeats):
        k = r % max(len(running), 1)
        for c in running[k:] + running[:k]:      # interleaved, the order rotating every repeat
            try:
                out = timed_run(c, batch, work, tok.pad_token_id, all_files)
            except Exception as exc:
                c.error = failure_line(f"repeat {r + 1} failed", exc)
                logger.warning("bench: %s %s", c.name, c.error)
                running.remove(c)
                continue
            if reference is not None:
                c.tokens_ok &= torch.equal(out, reference)
                c.same_prefix = min(c.same_prefix, same_prefix(out, reference, work.prompt_len))
            logger.info("bench: repeat %d %-11s %6.2f s  %s", r + 1, c.name, c.times[-1],
                        "tokens ok" if c.tokens_ok else "TOKENS DIFFER")
        for c in (running[k:] + running[:k]) if work.prefill else ():
            try:
                timed_prefill(c, batch, tok.pad_token_id, all_files)
            except Exception as exc:
                c.error = failure_line(f"prefill {r + 1} failed", exc)
                logger.warning("bench: %s %s", c.name, c.error)
                running.remove(c)
                continue
            logger.info("bench: repeat %d %-11s prefill %6.2f s, %.2f GB read", r + 1, c.name, c.prefill_times[-1],
                        c.prefill_bytes[-1] / 1e9)
    for c in loaded:
        c.close()
    # the disk is shared (a VM's virtio disk: its bandwidth drifts with the neighbours' load);
    # measured before and after the runs, the roofline uses the better of the two
    after = disk_bandwidth(checkpoint_files(ckpt))
    logger.info("bench: cold disk read bandwidth after the runs %.2f GB/s", after / 1e9)
    return {"contenders": loaded + failed, "baseline": baseline, "bandwidth": max(bandwidth, after),
            "bandwidths": (bandwidth, after),
            "reference": reference is not None, "checkpoint": ckpt, "host_budget": host_budget,
            "device_budget": device_budget, "routed": routed, "ram_bytes": ram_bytes,
            "checkpoint_bytes": sum(f.stat().st_size for f in checkpoint_files(ckpt)),
            "threads": torch.get_num_threads(), "load": (load_before, os.getloadavg())}


# ------------------------------------------------------------------------------------ report


HEADER = ("| contender | weights | tok/s | median s (min-max) | best s | x acc-disk | x acc-devmap | x acc-maxmem "
          "| disk MB/token measured | MB/token accounted | copied / disk read | roofline tok/s | % of roofline "
          "| peak device GB | peak RSS GiB (est.) | tokens = hf-ram |")


def table(result: dict, work: Workload) -> str:
    """The Markdown results table, one row per contender."""
    cs: list[Contender] = result["contenders"]
    tokens = work.batch * work.new_tokens
    med = {c.name: median(c.times) for c in cs if c.times}
    by = {c.name: c for c in cs}
    t_compute = med.get("hf-ram")
    ncol = HEADER.count("|") - 1
    rows = [HEADER, "|" + "---|" * ncol]
    for c in cs:
        if not c.times:
            rows.append(f"| {c.name} | {c.what} | {c.error or 'not run'} |" + " |" * (ncol - 3))
            continue
        t = med[c.name]
        ratios = [f"{med[a] / t:.2f}x (best {min(by[a].times) / min(c.times):.2f}x)" if a in med else "-"
                  for a in ACCELERATE]
        rb, ab = median(c.read_bytes), median(c.accounted_bytes)
        measured = f"{rb / tokens / 1e6:.3g}" if rb >= 0 else "n/a"
        accounted = "-" if c.name == "hf-ram" else f"{ab / tokens / 1e6:.3g}"
        roof, pct = "-", "-"
        if t_compute is not None and c.name != "hf-ram":
            bound_t = max((rb if rb >= 0 else ab) / result["bandwidth"], t_compute)
            roof, pct = f"{tokens / bound_t:.2f}", f"{100 * bound_t / t:.0f}%"
        peak = (result["baseline"] + c.resident + c.transient) / 2**30
        ok = ("✓" if c.tokens_ok else f"✗ (first {100 * c.same_prefix:.0f}% same)") if result["reference"] else "?"
        if c.error:
            ok += f" ({c.error})"
        copied = "-"
        if c.caches and "copied_bytes" in c.caches[0]:
            cp, dk = median([x["copied_bytes"] for x in c.caches]), median([x["disk_bytes"] for x in c.caches])
            copied = f"{cp / 1e9:.3g} / {dk / 1e9:.3g} GB"
        device = f"{c.device_bytes() / 1e9:.3g}" if c.device_bytes is not None else "-"
        rows.append(f"| {c.name} | {c.what} | {tokens / t:.2f} | {t:.2f} ({min(c.times):.2f}-{max(c.times):.2f}) | "
                    f"{min(c.times):.2f} | {ratios[0]} | {ratios[1]} | {ratios[2]} | {measured} | {accounted} | {copied} "
                    f"| {roof} | {pct} | {device} | {peak:.2f} | {ok} |")
    return "\n".join(rows)


def timeline_table(result: dict) -> str:
    """kinject rows: where each run's time went (tracer busy seconds, medians over the repeats)."""
    rows = ["| kinject contender | generate s | disk busy s | compute busy s | disk and compute both busy s "
            "| share of compute overlapped | traced waits for weights s | expert prefetch precision "
            "| expert prefetch coverage |", "|---|---|---|---|---|---|---|---|---|"]
    for c in result["contenders"]:
        if not c.timelines:
            continue
        disk, comp, both, stall = (median([tl[k] for tl in c.timelines]) for k in ("disk", "compute", "both", "stall"))
        share = both / comp if comp > 0 else 0.0
        pred = []
        for k in ("precision", "coverage"):
            vals = [tl[k] for tl in c.timelines if tl.get(k) is not None]
            pred.append(f"{median(vals):.0%}" if vals else "-")
        rows.append(f"| {c.name} | {median(c.times):.2f} | {disk:.2f} | {comp:.2f} | {both:.2f} | {share:.0%} "
                    f"| {stall:.2f} | {pred[0]} | {pred[1]} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def prefill_table(result: dict) -> str:
    """``--prefill``: each contender's cold prefill alone against the disk bound, ``max(disk bytes it read /
    disk bandwidth, hf-ram's prefill time)``, by its median and by its best repeat (the bandwidth is the
    best of the disk's reads: best against best is the like-for-like share)."""
    cs = [c for c in result["contenders"] if c.prefill_times]
    floor = next((min(c.prefill_times) for c in cs if c.name == "hf-ram"), None)
    rows = ["| contender | cold prefill s (min-max) | disk GB read | disk bound s | % of the disk bound (median) "
            "| % of the disk bound (best) | disk lane busy (traced) |", "|---|---|---|---|---|---|---|"]
    for c in cs:
        t, best, rb = median(c.prefill_times), min(c.prefill_times), median(c.prefill_bytes)
        busy = f"{median(c.prefill_disk_busy):.2f} s" if c.prefill_disk_busy else "-"
        if c.name == "hf-ram" or rb < 0:
            rows.append(f"| {c.name} | {t:.2f} ({best:.2f}-{max(c.prefill_times):.2f}) | "
                        f"{'n/a' if rb < 0 else f'{rb / 1e9:.3g}'} | - | - | - | {busy} |")
            continue
        bound = max(rb / result["bandwidth"], floor or 0.0)
        rows.append(f"| {c.name} | {t:.2f} ({best:.2f}-{max(c.prefill_times):.2f}) | {rb / 1e9:.3g} "
                    f"| {bound:.2f} | {100 * bound / t:.0f}% | {100 * bound / best:.0f}% | {busy} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def cache_table(result: dict, work: Workload) -> str:
    """kinject rows with a host cache: how the disk tier's loads split between RAM and disk (the
    store's counters, medians over the repeats; the cache stays filled from one run to the next)."""
    tokens = work.batch * work.new_tokens
    rows = ["| kinject contender | host cache capacity GB | hits / run | misses / run | hit rate "
            "| evictions / run | disk GB / generated token (cache misses) | RAM GB / generated token (hits) "
            "| peak held GB (own + device budget's room lent on a CPU) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for c in result["contenders"]:
        if not c.caches or not (c.caches[0]["capacity"] or max(x["peak_bytes"] for x in c.caches)):
            continue
        hits, misses, evictions, disk, ram = (median([x[k] for x in c.caches])
                                              for k in ("hits", "misses", "evictions", "disk_bytes", "ram_bytes"))
        rate = f"{hits / (hits + misses):.0%}" if hits + misses else "-"
        rows.append(f"| {c.name} | {c.caches[0]['capacity'] / 1e9:.3g} | {hits:g} | {misses:g} | {rate} "
                    f"| {evictions:g} | {disk / tokens / 1e9:.3g} | {ram / tokens / 1e9:.3g} "
                    f"| {max(x['peak_bytes'] for x in c.caches) / 1e9:.3g} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def notes(result: dict, shape: ModelShape, work: Workload) -> str:
    tokens = work.batch * work.new_tokens
    (b1, b5, _), (a1, a5, _) = result["load"]
    cache = {"drop-after-read": "dropped before every timed run and after every model forward, "
                                "for every contender by the same forward hook",
             "drop-before-run": "dropped before every timed run only (kinject's own host cache emptied too); within a run "
                                "cached pages are reused by everyone",
             "warm": "never dropped: the warm-up generate and earlier runs leave the pages cached"}
    return "\n".join([
        f"- model: {shape.describe()}; checkpoint {result['checkpoint_bytes'] / 1e9:.2f} GB",
        f"- workload: batch {work.batch} x {work.prompt_len} prompt tokens, {work.new_tokens} new tokens "
        f"({tokens} generated tokens per run), greedy, attn {work.attn}, torch threads {result['threads']}, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}; median of {work.repeats} interleaved "
        f"repeats after a {work.warmup_tokens}-token warm-up",
        f"- page cache ({work.page_cache}): {cache[work.page_cache]}",
        f"- roofline: tokens / max(measured disk bytes / {result['bandwidth'] / 1e9:.2f} GB/s (best cold read of the "
        f"checkpoint, by one reader or two sharing its 64 MiB requests; {result['bandwidths'][0] / 1e9:.2f} GB/s before the runs, "
        f"{result['bandwidths'][1] / 1e9:.2f} after), hf-ram generate time); peak RSS (est.) = process baseline "
        f"{result['baseline'] / 2**30:.2f} GiB + RSS added by loading the contender + largest rise during one of its runs",
        "- disk bytes measured: /proc/self/io read_bytes; accounted: kinject store.summary()['host_cache']['disk_bytes'] "
        "(units read from disk, not the loads its host cache served), "
        "accelerate: offloaded parameter bytes x model forwards",
        *([] if not result.get("routed") else [
            f"- routed experts: {result['routed'] / tokens / 1e6:.3g} MB/generated token (in hf-ram's generate, "
            "the distinct experts each forward's batch routes to, per layer: what a reader of only the routed "
            "experts reads from disk without a cache)"]),
        *([] if result.get("host_budget") is None else [
            f"- kinject rows (not kj-defaults): pipeline.host_budget {result['host_budget'] / 1e9:.3g} GB = {work.host_budget:.0%} of "
            f"the experts' {shape.expert_bytes() / 1e9:.3g} GB (accelerate has no host cache of its own: "
            "its offloaded weights come from the page cache, dropped as above)"]),
        *([] if not result.get("ram_bytes") else [
            f"- acc-maxmem: max_memory {result['ram_bytes'] / 1e9:.3g} GB = the kinject rows' device_budget + "
            "host_budget, whole modules placed in layer order, the rest on disk; kj-defaults gets no budget from "
            "the bench (its own auto choices, in its weights column)"]),
        *([] if result.get("device_budget") is None else [
            f"- kinject rows (not kj-defaults): pipeline.device_budget {result['device_budget'] / 1e9:.3g} GB (--device-budget "
            f"{work.device_budget:.2f} of the model's bytes, at least the non-expert weights and one layer's experts; "
            "on a CPU the device is RAM: it bounds the experts read from disk and prefetched ahead)"]),
        f"- load average (1 min, 5 min) at start {b1:.2f}, {b5:.2f}; at end {a1:.2f}, {a5:.2f}",
    ])


def report(result: dict, shape: ModelShape, work: Workload) -> str:
    parts = [table(result, work), prefill_table(result), cache_table(result, work), timeline_table(result),
             notes(result, shape, work), provenance()]
    return "\n\n".join(p for p in parts if p)


# ------------------------------------------------------------------------------------ entry point


def bench_offload(args) -> int:
    """``kinject bench offload``: see the module docstring."""
    try:
        import accelerate  # noqa: F401
    except ImportError:
        raise KinjectError("bench offload needs accelerate: pip install 'kinject[bench]'") from None
    if not args.quiet:
        logger.setLevel(logging.INFO)
    shape, work = shape_and_workload(args)
    default = WIDE_CONTENDERS if args.wide else CONTENDERS
    names = list(dict.fromkeys(n.strip() for n in (args.contenders or ",".join(default)).split(",") if n.strip()))
    known = CONTENDERS + EXTRA_CONTENDERS
    unknown = [n for n in names if n.split("@")[0] not in known or "@" in n and not n.startswith("kj-")]
    if unknown:
        raise KinjectError(f"bench: unknown contender {unknown[0]!r}; contenders are {', '.join(known)}")
    if "hf-ram" in names:       # loaded first: the reference, and acc-disk writes its offload folder from it
        names.insert(0, names.pop(names.index("hf-ram")))
    if args.threads:
        torch.set_num_threads(args.threads)
    tmp = None
    if args.workdir:
        workdir = Path(args.workdir).expanduser()
        workdir.mkdir(parents=True, exist_ok=True)
    else:
        workdir = Path(tmp := tempfile.mkdtemp(prefix="kinject-bench-"))
    try:
        result = run_bench(shape, work, names, workdir)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    text = report(result, shape, work)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def shape_and_workload(args) -> tuple[ModelShape, Workload]:
    """The model shape and workload of the command line: every option left out takes the preset's
    value (``--wide``: :data:`WIDE`, batch 8 x 32 prompt tokens, host_budget 25 % of the experts,
    device_budget 42 % of the model)."""
    preset = WIDE if args.wide else ModelShape()
    shape = ModelShape(**{f: getattr(preset, f) if getattr(args, f, None) is None else getattr(args, f)
                          for f in preset.__dataclass_fields__})
    base = Workload(batch=8, prompt_len=32, new_tokens=8, host_budget=WIDE_HOST_BUDGET,
                    device_budget=WIDE_DEVICE_BUDGET, prefill=True) if args.wide else Workload()
    work = Workload(**{f: getattr(base, f) if getattr(args, f, None) is None else getattr(args, f)
                       for f in base.__dataclass_fields__})
    if min(work.repeats, work.batch, work.new_tokens, work.prompt_len) < 1 or work.warmup_tokens < 0:
        raise KinjectError("bench: --repeats, --batch, --new-tokens and --prompt-len must be >= 1")
    if work.host_budget is not None and work.host_budget <= 0:
        raise KinjectError(f"bench: --host-budget {work.host_budget} must be a share of the experts' bytes > 0")
    if work.device_budget is not None and work.device_budget <= 0:
        raise KinjectError(f"bench: --device-budget {work.device_budget} must be a share of the model's bytes > 0")
    return shape, work


def add_offload_arguments(s) -> None:
    """The ``kinject bench offload`` options (registered by ``kinject.app.cli``)."""
    d, w = ModelShape(), Workload()
    s.add_argument("--wide", action="store_true",
                   help="a model bigger than RAM: the Qwen3-30B-A3B shape with 4 layers (4.8 GB of experts), "
                        "kinject's host_budget below the experts' size and a 24 GiB card's device_budget, page cache "
                        "dropped after every forward; "
                        "every option below still overrides it")
    s.add_argument("--workdir", help="checkpoint and offload folders, kept and reused (default: a temp dir)")
    s.add_argument("--out", metavar="FILE.md", help="also write the Markdown report there")
    s.add_argument("--contenders",
                   help=f"comma separated, from {', '.join(CONTENDERS + EXTRA_CONTENDERS)} (default: "
                        f"{', '.join(CONTENDERS)}; with --wide {', '.join(WIDE_CONTENDERS)}); a kinject one may add "
                        "rule overrides, as another row: kj-offload@pipeline.prefetch_lookahead=3")
    s.add_argument("--page-cache", choices=PAGE_CACHE_POLICIES,
                   help=f"{w.page_cache} (default): every forward reads from disk (model larger than RAM); "
                        "drop-before-run: only each run's first forward is cold; warm: never dropped")
    s.add_argument("--host-budget", type=float, metavar="SHARE",
                   help="kinject rows: pipeline.host_budget as a share of the experts' bytes "
                        f"(default: none; with --wide {WIDE_HOST_BUDGET})")
    s.add_argument("--device-budget", type=float, metavar="SHARE",
                   help="kinject rows: pipeline.device_budget as a share of the model's bytes, raised to the "
                        "non-expert weights + one layer's experts if below (default: none; with --wide "
                        f"{WIDE_DEVICE_BUDGET:.2f}: what a 24 GiB card holds of the real Qwen3-30B-A3B in bf16)")
    s.add_argument("--family", choices=sorted(FAMILIES), help=f"model shape (default {d.family})")
    for name in ("layers", "hidden", "intermediate", "experts", "top_k", "heads", "kv_heads", "vocab"):
        s.add_argument("--" + name.replace("_", "-"), type=int, help=f"model shape (default {getattr(d, name)})")
    s.add_argument("--dtype", choices=("bfloat16", "float32", "float16"), help=f"default {d.dtype}")
    s.add_argument("--layout", choices=("hub", "fused"),
                   help="checkpoint experts: hub = per-expert keys (save_pretrained's default), fused = 3-D tensors")
    for name in ("batch", "prompt_len", "new_tokens", "repeats", "warmup_tokens"):
        s.add_argument("--" + name.replace("_", "-"), type=int, help=f"workload (default {getattr(w, name)})")
    s.add_argument("--attn", choices=("sdpa", "eager"), help=f"default {w.attn}")
    s.add_argument("--prefill", action=argparse.BooleanOptionalAction,
                   help="also time a cold prefill alone (one new token; page cache and kinject's host cache emptied "
                        "first) per contender and repeat, against the disk bound (default: on with --wide)")
    s.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    s.set_defaults(func=bench_offload)
