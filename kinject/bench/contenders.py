"""The baselines kinject is compared with, loaded the same way by every suite: plain HF with
every weight in RAM, accelerate's ``disk_offload`` and accelerate's ``device_map`` offload."""

from __future__ import annotations

import gc
import logging
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from kinject.bench.common import checkpoint_files, drop_page_cache
from kinject.errors import KinjectError

logger = logging.getLogger(__name__)


@dataclass
class Contender:
    name: str
    what: str                                   # where the weights live, in words
    model: nn.Module | None
    files: list[Path]                           # files its offloaded reads come from
    accounted: Callable[[], int]                # disk bytes read since the last reset, by its own accounting
    reset: Callable[[], None] = lambda: None
    close: Callable[[], None] = lambda: None
    timeline: Callable[[], dict] | None = None  # kinject: tracer busy seconds of the last run
    cache: Callable[[], dict] | None = None     # kinject: the store's host cache counters of the last run
    cool: Callable[[], None] = lambda: None     # forget what its own caches hold (a cold run: kinject's host cache)
    resident: int = 0                           # RSS that loading it added
    times: list[float] = field(default_factory=list)
    read_bytes: list[int] = field(default_factory=list)
    accounted_bytes: list[int] = field(default_factory=list)
    timelines: list[dict] = field(default_factory=list)
    caches: list[dict] = field(default_factory=list)
    prefill_times: list[float] = field(default_factory=list)    # cold prefill alone (``--prefill``)
    prefill_bytes: list[int] = field(default_factory=list)      # disk bytes those prefills read (measured)
    prefill_disk_busy: list[float] = field(default_factory=list)  # kinject, traced: seconds its disk lane was busy
    transient: int = 0                          # largest RSS rise during one of its runs
    tokens_ok: bool = True
    same_prefix: float = 1.0                    # lowest share of generated tokens equal to hf-ram's before the first difference
    error: str | None = None
    device_bytes: Callable[[], int] | None = None   # peak device bytes of the last run (CPU: bytes of weights in RAM)


def own_memory(model: nn.Module) -> None:
    """Copy every materialised tensor out of transformers' ``mmap`` of the checkpoint: pages mapped
    by the process cannot be dropped from the page cache, and would serve the other contenders'
    "disk" reads from RAM."""
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            if not t.is_meta:
                t.data = t.data.clone()
    gc.collect()


def load_hf_ram(ckpt: Path, dtype, attn: str, **_) -> Contender:
    from kinject.io.untouched import load_untouched

    model = load_untouched(ckpt, dtype, attn_implementation=attn)
    own_memory(model)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return Contender("hf-ram", "all in RAM", model, [], accounted=lambda: 0, device_bytes=lambda: weights)


def accelerate_contender(name: str, what: str, model: nn.Module, files: list[Path], policy: str) -> Contender:
    """Accounting for accelerate: every parameter its hooks offloaded (left on meta) is loaded
    from disk before each forward of its module, i.e. once per model forward."""
    offloaded = sum(p.numel() * p.element_size() for p in model.parameters() if p.is_meta)
    forwards = [0]

    def count(*_):
        forwards[0] += 1

    model.register_forward_hook(count)
    drop_after_forward(model, files, policy)
    kept = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)   # in memory throughout
    return Contender(name, what, model, files, accounted=lambda: offloaded * forwards[0],
                     reset=lambda: forwards.__setitem__(0, 0), device_bytes=lambda: kept)


def drop_after_forward(model: nn.Module, files: list[Path], policy: str) -> None:
    """``drop-after-read``: drop ``files`` from the page cache after every model forward (a
    forward hook), the same for every contender, so each forward reads its weights from disk."""
    if policy == "drop-after-read":
        def drop(*_) -> None:             # a hook returning a value would replace the model's output
            drop_page_cache(files)
        model.register_forward_hook(drop)


def load_acc_disk(ckpt: Path, dtype, attn: str, *, workdir: Path, ref: nn.Module | None, policy: str,
                  **_) -> Contender:
    """``accelerate.disk_offload`` on a model whose parameters were never materialised; the offload
    folder is written once (with ``offload_state_dict``, as ``disk_offload`` itself does)."""
    from accelerate import disk_offload
    from accelerate.utils import offload_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    from kinject.io.loading import parameters_on_meta

    folder = workdir / f"{ckpt.name}-accelerate-disk-offload"
    if not (folder / "index.json").is_file():
        if ref is None:
            raise KinjectError("bench: acc-disk needs hf-ram in the same run to write its offload folder once")
        logger.info("bench: writing accelerate's offload folder %s", folder)
        offload_state_dict(str(folder), ref.state_dict())
    config = AutoConfig.from_pretrained(ckpt)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn).eval()
    disk_offload(model, str(folder), execution_device=torch.device("cpu"))
    return accelerate_contender("acc-disk", "all weights on disk (accelerate .dat files)", model,
                                 sorted(folder.glob("*.dat")), policy)


def experts_on_disk_map(model: nn.Module, pattern: str = r"\.experts$") -> dict[str, str]:
    """accelerate ``device_map``: modules whose name matches ``pattern`` on "disk", the rest on "cpu"."""
    disk = {n for n, _ in model.named_modules() if n and re.search(pattern, n)}
    device_map: dict[str, str] = {}

    def visit(prefix: str, module) -> None:
        for attr, child in module.named_children():
            name = f"{prefix}.{attr}" if prefix else attr
            if name in disk:
                device_map[name] = "disk"
            elif any(d.startswith(name + ".") for d in disk):
                visit(name, child)
            else:
                device_map[name] = "cpu"

    visit("", model)
    return device_map


def equal_memory_map(model: nn.Module, ram_bytes: int, pattern: str = r"\.experts$") -> tuple[dict[str, str], int]:
    """accelerate ``device_map`` holding the memory kinject holds: every module kinject keeps in memory
    (all but the experts) on "cpu", then experts modules on "cpu" in layer order while the total fits
    ``ram_bytes`` (accelerate places whole modules: a fused experts module is one), the rest on "disk"
    where kinject's tiers put the experts. Returns the map and the bytes it keeps in memory."""
    device_map = experts_on_disk_map(model, pattern)
    size = {n: sum(p.numel() * p.element_size() for p in model.get_submodule(n).parameters()) for n in device_map}
    kept = sum(b for n, b in size.items() if device_map[n] == "cpu")
    for name in [n for n, where in device_map.items() if where == "disk"]:
        if kept + size[name] <= ram_bytes:
            device_map[name] = "cpu"
            kept += size[name]
    return device_map, kept


def load_acc_maxmem(ckpt: Path, dtype, attn: str, *, workdir: Path, policy: str, ram_bytes: int | None = None,
                    **_) -> Contender:
    """``from_pretrained(device_map=..., offload_folder=...)`` at kinject's memory: ``max_memory`` for the
    device (on a CPU: RAM) = kinject's ``device_budget`` + its host cache (``ram_bytes``), placed by
    :func:`equal_memory_map`; the experts that do not fit on "disk", as kinject's tiers put them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if ram_bytes is None:
        raise KinjectError("bench: acc-maxmem needs kinject's budgets (--device-budget / --host-budget, or auto)")
    folder = workdir / f"{ckpt.name}-accelerate-max-memory"
    shutil.rmtree(folder, ignore_errors=True)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt), dtype=dtype)
    device_map, kept = equal_memory_map(skeleton, ram_bytes)
    on_disk = sum(1 for where in device_map.values() if where == "disk")
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, attn_implementation=attn, device_map=device_map,
                                                 offload_folder=str(folder)).eval()
    own_memory(model)
    written = sorted(folder.glob("*")) if folder.is_dir() else []
    return accelerate_contender("acc-maxmem", f"max_memory {ram_bytes / 1e9:.3g} GB = kinject's budgets: "
                                 f"{kept / 1e9:.3g} GB in RAM, {on_disk} experts modules on disk", model,
                                 checkpoint_files(ckpt) + written, policy)


def load_acc_devmap(ckpt: Path, dtype, attn: str, *, workdir: Path, policy: str, **_) -> Contender:
    """``from_pretrained(device_map=..., offload_folder=...)`` with the experts on "disk". transformers
    reads offloaded tensors in place from a fused checkpoint; from a hub (per-expert) one it writes
    the fused experts into ``offload_folder`` first."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = workdir / f"{ckpt.name}-accelerate-device-map"
    shutil.rmtree(folder, ignore_errors=True)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ckpt))
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype, attn_implementation=attn,
                                                 device_map=experts_on_disk_map(skeleton),
                                                 offload_folder=str(folder)).eval()
    own_memory(model)
    written = sorted(folder.glob("*")) if folder.is_dir() else []
    where = "offload_folder" if written else "checkpoint, in place"
    return accelerate_contender("acc-devmap", f"experts on disk ({where}), rest in RAM", model,
                                 checkpoint_files(ckpt) + written, policy)


@dataclass
class BudgetedOffload:
    """accelerate's CPU offload under a device budget, its host->device copies charged to an
    emulated link (what ``device_map`` + ``max_memory`` does on a GPU machine, made measurable on a
    CPU-only one): ``resident`` bytes stay on the device, every other module's weights are put
    there by accelerate's hooks at each of its forwards, and taken away after."""

    model: nn.Module
    resident: int                   # bytes accelerate's device map keeps on the device
    offloaded: int                  # bytes its hooks load at every model forward
    largest: int                    # the largest module weights loaded at once


def acc_budget_placement(model: nn.Module, budget: int) -> tuple[list[str], dict[int, int], int]:
    """Where accelerate's offload puts ``model``'s weights under a device ``budget`` (bytes), without
    changing the model: ``infer_auto_device_map`` places whole no-split modules on the device up to
    ``budget``, the others are offloaded. Returns the offloaded module names, the own weight bytes of
    every module under them (by ``id``: what its hook loads at each of its forwards) and the weight
    bytes that stay on the device (a weight tied into an offloaded module, lm_head = embed_tokens,
    does not stay). Works on a meta-device model too (sizes only), so a caller can try many budgets
    cheaply."""
    from accelerate import infer_auto_device_map

    dmap = infer_auto_device_map(model, max_memory={"cpu": max(budget, 0), "disk": 1 << 50},
                                 no_split_module_classes=getattr(model, "_no_split_modules", None) or [])
    offloaded = [name for name, where in dmap.items() if where == "disk"]
    leaves: dict[int, int] = {}
    moved: dict[int, int] = {}              # offloaded parameters, by id: a tied one counted once
    for name in offloaded:
        for leaf in model.get_submodule(name).modules():
            own = {id(p): p.numel() * p.element_size() for p in leaf.parameters(recurse=False)}
            if own:
                leaves.setdefault(id(leaf), sum(own.values()))
                moved.update(own)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return offloaded, leaves, total - sum(moved.values())


def acc_budget_peak(model: nn.Module, budget: int) -> int:
    """Peak device bytes of weights accelerate's offload of ``model`` under ``budget`` holds: what
    stays resident plus the largest module its hooks load at once."""
    _, leaves, resident = acc_budget_placement(model, budget)
    return resident + max(leaves.values(), default=0)


def load_acc_budget(model: nn.Module, budget: int, bandwidth: float | None) -> BudgetedOffload:
    """Offload ``model`` (in place) with accelerate as :func:`acc_budget_placement` places it:
    ``cpu_offload`` hooks every offloaded module (weights kept in host memory, loaded at each
    forward). ``bandwidth`` (GB/s): each hooked module's forward first waits its bytes / bandwidth,
    synchronously, as accelerate's blocking copies do on a real link (:class:`EmulatedCopies`:
    over the run, exactly that long)."""
    from accelerate import cpu_offload

    offloaded, leaves, resident = acc_budget_placement(model, budget)
    if bandwidth:
        link = EmulatedCopies(bandwidth)
        for name in offloaded:
            for leaf in model.get_submodule(name).modules():
                if id(leaf) in leaves:
                    leaf.register_forward_pre_hook(lambda *_, n=leaves[id(leaf)]: link.copy(n))
    for name in offloaded:
        cpu_offload(model.get_submodule(name), execution_device=torch.device("cpu"))
    return BudgetedOffload(model, resident=resident, offloaded=sum(leaves.values()),
                           largest=max(leaves.values(), default=0))


class EmulatedCopies:
    """Blocking host->device copies over an emulated ``bandwidth`` GB/s link, in the caller's thread.

    ``time.sleep`` wakes late on a busy machine; a copy that overslept pays it back in the next
    ones (they sleep that much less), so the copies of a run add up to bytes / bandwidth, as real
    blocking copies would, and not to that plus the machine's scheduling delays (what kinject's
    transfer engine does for its own emulated link, too)."""

    def __init__(self, bandwidth: float):
        self.bandwidth = bandwidth
        self.debt = 0.0                     # seconds overslept so far, not yet paid back

    def copy(self, nbytes: int) -> None:
        want = nbytes / (self.bandwidth * 1e9) - self.debt
        if want <= 0:
            self.debt = -want
            return
        t0 = time.perf_counter()
        time.sleep(want)
        self.debt = max(0.0, time.perf_counter() - t0 - want)
