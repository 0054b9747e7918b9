"""The Runtime: everything kinject attaches to one model, reachable as ``model.kinject``.

It owns the parsed rules, the injection report, the registered operators, and the one
store, transfer engine, scheduler and tracer every operator of the model shares. It is the
interface operators talk to and imports none of them (nor the injection or loading code).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Protocol

import torch

from kinject.engine import memory
from kinject.engine.scheduler import Scheduled, Scheduler
from kinject.engine.store import TensorStore
from kinject.formatting import format_bytes
from kinject.engine.transfer import TransferEngine
from kinject.stacks import Stacks, find_stacks
from kinject.trace import Tracer

logger = logging.getLogger(__name__)


class Rules(Protocol):
    """What the runtime reads of a parsed rule file (``kinject.rules.RuleSet`` is one)."""

    path: str | None
    pipeline: Any
    rules: list


class RuntimeOperator(Scheduled, Protocol):
    """What the runtime and its scheduler ask of an operator (``operators.base.Operator`` is one):
    its module key, its position, and the scheduler's prefetch questions. The runtime names operators
    only through this interface; it imports none of them."""

    layer: int | None


class Runtime:
    def __init__(self, ruleset: "Rules", checkpoint=None, *, mem_reader=None):
        p = ruleset.pipeline
        self.rules = ruleset
        self.device = torch.device(p.device)
        if self.device.type == "cuda" and self.device.index is None:
            # one GPU for everything, fixed now: the store, the KV cache and the transfer engine compare
            # tensors' devices with this one (a tensor's is always indexed), and a later change of the
            # current device must not split weights and KV across GPUs
            self.device = torch.device("cuda", torch.cuda.current_device())
        # ``auto`` budgets resolved once, now (kinject/engine/memory.py); ``self.pipeline`` holds the
        # bytes chosen, ``self.autos`` what each auto chose and why (report())
        self.autos: dict[str, memory.Choice] = {}
        watch = None
        if p.host_budget == "auto":
            self.autos["host_budget"], watch = memory.auto_host_budget(reader=mem_reader or memory.mem_available)
        if p.device_budget == "auto":
            self.autos["device_budget"] = memory.auto_device_budget(self.device, p.kv_budget)
        if self.autos:
            p = dataclasses.replace(p, **{k: c.value for k, c in self.autos.items()})
        self.pipeline = p
        self.dtype = getattr(torch, p.dtype) if p.dtype else None
        self.checkpoint = checkpoint    # kinject.io.checkpoint.CheckpointIndex when built by from_pretrained
        self.operators: list["RuntimeOperator"] = []
        self.stacks = Stacks([])        # the model's stacks of blocks: :meth:`find_stacks` before operators are built
        self.injection = None           # kinject.inject.InjectionReport of the optimize that made it
        self.claims: list = []          # inject.Claim per swapped module, in walk order
        self.tracer = Tracer(enabled=p.trace, device=self.device)
        self.transfer = TransferEngine(self.device, emulate_bandwidth=p.emulate_bandwidth, tracer=self.tracer,
                                       disk_workers=p.disk_workers, inline=True)
        self.store = TensorStore(self.device, self.transfer, device_budget=p.device_budget,
                                 offload_dir=p.offload_dir, policy=p.release_policy,
                                 drop_page_cache=p.drop_page_cache, read_ahead_layers=p.disk_read_ahead_layers,
                                 readahead=p.disk_readahead, host_budget=p.host_budget, memory_watch=watch)
        if p.trace:                     # the memory line of the trace's plot; untraced runs skip the call
            self.store.on_memory = lambda nbytes: self.tracer.counter("device_bytes", nbytes)
        self.scheduler = Scheduler(self.store, self.tracer, lookahead=p.prefetch_lookahead)
        self._hooks: list = []
        self._shared: dict = {}
        self._model_hooks: list = []    # (attach(model), detach(model)) pairs added by operators
        self.reporters: list = []       # callables returning report lines (operators add theirs)
        self.residency = None           # the residency plan (pipeline.keep_resident), made at attach_model
        if self.device.type == "cpu" and p.host_gemv != "torch":
            # a CPU model's one-row linears (host_gemv.py), RMSNorms (host_norm.py) and rotary embeddings
            # (host_rotary.py; with fast, a decode step's attention too: host_sdpa.py) in compiled
            # calls; each attach returns the modules its detach restores
            fast = p.host_gemv == "fast"
            self._on_model_modules(lambda model: _host_gemv().attach_linears(model, fast),
                                   lambda modules: _host_gemv().detach_linears(modules))
            # (after them: a decode step's top-k router in one call over its rebound forward, decode_router.py)
            self._on_model_modules(lambda model: _decode_router().attach_routers(model, fast),
                                   lambda modules: _decode_router().detach_routers(modules))
            self._on_model_modules(lambda model: _host_norm().attach_norms(model),
                                   lambda modules: _host_norm().detach_norms(modules))
            self._on_model_modules(lambda model: _host_rotary().attach_rotary(model, attention=fast),
                                   lambda modules: _host_rotary().detach_rotary(modules))
            # (after them: a decode step's attention forward making their calls in one, decode_attention.py)
            self._on_model_modules(lambda model: _decode_attention().attach_attention(model, fast),
                                   lambda modules: _decode_attention().detach_attention(modules))

    def _on_model_modules(self, attach, detach) -> None:
        """:meth:`on_model` for an ``attach(model) -> modules`` whose ``detach(modules)`` undoes it."""
        modules: list = []
        self.on_model(lambda model: modules.extend(attach(model)),
                      lambda model: (detach(modules), modules.clear()))

    def on_model(self, attach, detach) -> None:
        """Register model-level setup for when every operator is attached (e.g. a KV-cache
        operator making ``model.generate`` supply its cache); ``detach`` is its exact inverse.
        Attach functions run in registration order, detach functions in reverse."""
        self._model_hooks.append((attach, detach))

    def peek(self, key: str):
        """The shared object under ``key`` if an operator made one, else None (for reports)."""
        return self._shared.get(key)

    def shared(self, key: str, factory):
        """One object per runtime under ``key``, made by ``factory()`` on first use.

        How operators share state (the expert correlation table, prefetch statistics)
        without the runtime knowing what it is."""
        if key not in self._shared:
            self._shared[key] = factory()
        return self._shared[key]

    def checkpoint_source(self, name: str):
        """Disk reference for a meta-device tensor of a model built by ``from_pretrained``."""
        if self.checkpoint is None:
            raise ValueError(f"parameter {name!r} is on the meta device and no checkpoint is attached")
        return self.checkpoint.source(name)

    # -- positions (operators ask; the stacks are found once, before any operator is built)
    def find_stacks(self, model: torch.nn.Module) -> None:
        """Find ``model``'s stacks of repeated blocks (:mod:`kinject.stacks`)."""
        self.stacks = find_stacks(model)
        logger.info("kinject: %r", self.stacks)

    def position(self, key: str, moe: bool = False) -> int | None:
        """The pipeline position of module ``key`` as an integer in execution order (None outside
        every stack); ``moe``: a router or experts module (its MoE block is a position of its own
        where one block holds several)."""
        return self.stacks.ordinal(key, moe)

    # -- model lifecycle (called by optimize / restore)
    def attach_model(self, model: torch.nn.Module) -> None:
        """Every operator is attached: account the rest of the model, refuse a placement
        that cannot fit, and mark step boundaries (one model forward = one step)."""
        self.store.resident_external = self._external_bytes(model)
        self.store.peak = self.store.used + self.store.resident_external
        self.store.check_fits()
        if self.pipeline.keep_resident:
            from kinject.engine.residency import plan_residency

            self.residency = plan_residency(self.store)
            self.store.peak = self.store.used + self.store.resident_external
        self._hooks = [
            model.register_forward_pre_hook(self._begin_step, with_kwargs=True),
            model.register_forward_hook(lambda *_: self.scheduler.end_step(), always_call=True),
        ]
        self._wrap_generate(model)
        done = []
        try:
            for attach, detach in self._model_hooks:
                attach(model)
                done.append(detach)
        except BaseException:
            for detach in reversed(done):
                detach(model)
            for h in self._hooks:
                h.remove()
            self._hooks = []
            self._unwrap_generate(model)
            raise

    def _begin_step(self, _module, args: tuple, kwargs: dict) -> None:
        self.store.fit_host_cache()     # (memory other processes took since the last step: give it back)
        first = kwargs.get("input_ids")
        if first is None:
            first = kwargs.get("inputs_embeds")
        if first is None and args:
            first = args[0]
        self.scheduler.begin_step(tuple(first.shape) if isinstance(first, torch.Tensor) else None)

    def detach_model(self, model: torch.nn.Module) -> None:
        """Exact inverse of :meth:`attach_model` (and shuts the transfer workers down)."""
        for _, detach in reversed(self._model_hooks):
            detach(model)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._unwrap_generate(model)
        self.transfer.close()

    def _wrap_generate(self, model: torch.nn.Module) -> None:
        """While ``model.generate`` runs, the scheduler knows how many forwards it makes at most
        (:func:`_forwards_of_generate`): its last forward does not prefetch the first layers of a step
        that never comes. When it returns (or raises), prefetched units nobody holds are dropped
        (``free`` policy; a generate that stopped early at EOS prefetched such a step). An instance attribute shadows
        the method; :meth:`_unwrap_generate` puts back what was there."""
        original = getattr(model, "generate", None)
        if not callable(original):
            self._generate_saved = None
            return
        self._generate_saved = ("generate" in model.__dict__, model.__dict__.get("generate"))

        @functools.wraps(original)
        def generate(*args, **kwargs):
            self.scheduler.forwards_left = _forwards_of_generate(model, kwargs)
            self.scheduler.generating = True
            try:
                return original(*args, **kwargs)
            finally:
                self.scheduler.forwards_left = None
                self.scheduler.generating = False
                self.store.discard_idle()
                self.store.fit_host_cache()     # (entries in use during the last step are idle now)

        model.__dict__["generate"] = generate

    def _unwrap_generate(self, model: torch.nn.Module) -> None:
        saved, self._generate_saved = getattr(self, "_generate_saved", None), None
        if saved is None:
            return
        had, previous = saved
        if had:
            model.__dict__["generate"] = previous
        else:
            model.__dict__.pop("generate", None)

    def _external_bytes(self, model: torch.nn.Module) -> int:
        """Device bytes of model tensors no store unit owns (norms, embeddings, ...)."""
        owned = {t.untyped_storage().data_ptr() for u in self.store.units.values() if u.device
                 for t in u.device.values()}
        seen, total = set(), 0
        for t in list(model.parameters()) + list(model.buffers()):
            if t.is_meta or t.device.type != self.device.type:
                continue
            st = t.untyped_storage()
            if st.data_ptr() in seen or st.data_ptr() in owned or st.nbytes() <= t.element_size():
                continue
            seen.add(st.data_ptr())
            total += st.nbytes()
        return total

    # -- operator registry (called from Operator.attach / detach)
    def register(self, op: "RuntimeOperator") -> None:
        self.operators.append(op)

    def unregister(self, op: "RuntimeOperator") -> None:
        self.operators = [o for o in self.operators if o is not op]

    # -- reporting
    def summary(self) -> dict:
        return {
            "rules_file": self.rules.path,
            "device": str(self.device),
            "operators": len(self.operators),
            "matches": {r.index: len(self.injection.matches.get(r.index, [])) for r in self.rules.rules}
            if self.injection else {},
        }

    def report(self, file=None) -> str:
        """Human-readable summary of the plan; printed to ``file`` (stdout by default) and returned."""
        lines = [f"kinject runtime  rules={self.rules.path}  device={self.device}"
                 + ("  [host->device link EMULATED at %g GB/s]" % self.pipeline.emulate_bandwidth
                    if self.transfer.emulated else "")]
        if self.injection is not None:
            lines.append(str(self.injection))
        lines.extend(c.line() for c in self.autos.values())
        st = self.store.summary()
        lines.append("store: " + ", ".join(f"{t} {format_bytes(b)}" for t, b in st["tier_bytes"].items())
                     + f"; budget {format_bytes(st['budget'])}; peak device {format_bytes(st['peak_bytes'])}"
                     + f"; loads {st['loads']}; moved " + ", ".join(f"{t} {format_bytes(b)}" for t, b in st["bytes"].items())
                     + f"; copied {format_bytes(st['copied_bytes'])} (the rest used in place)")
        if st["tier_bytes"]["disk"]:
            c = st["host_cache"]
            lines.append(f"host cache of the disk tier: {c['hits']} hits, {c['misses']} misses; read from disk "
                         f"{format_bytes(c['disk_bytes'])}, served from RAM {format_bytes(c['ram_bytes'])}; "
                         f"holds {format_bytes(c['held_bytes'])} "
                         f"of {format_bytes(c['capacity'])} (pipeline.host_budget less the host tier"
                         + (f", less what MemAvailable no longer spares: gave back {format_bytes(c['shrunk_bytes'])}"
                            if c.get("shrunk_bytes") else "")
                         + (f"; plus the device budget's free room, lent on a CPU: {format_bytes(c['lendable_bytes'])} now"
                            if c.get("lendable_bytes") else "") + f"), peak {format_bytes(c['peak_bytes'])}, "
                         f"{c['evictions']} evictions")
        if self.residency is not None:
            lines.append(self.residency.report_line())
        if self.tracer.enabled:
            tr = self.tracer.summary()
            lines.append(f"trace: compute bubble {tr.get('bubble_fraction', 0.0):.1%}; events {sum(tr.get('event_counts', {}).values())}")
        for reporter in self.reporters:
            lines.extend(reporter())
        text = "\n".join(lines)
        print(text, file=file)
        return text

    def __repr__(self) -> str:
        return f"Runtime(rules={self.rules.path!r}, device={self.device}, operators={len(self.operators)})"


# generate options under which one generated token is not one model forward
_MANY_FORWARDS_PER_TOKEN = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "penalty_alpha",
                            "dola_layers", "custom_generate")


def _forwards_of_generate(model: torch.nn.Module, kwargs: dict) -> int | None:
    """How many forwards of ``model`` a ``generate(**kwargs)`` makes at most: ``max_new_tokens`` (one
    forward per new token, the prefill included), from the call or the generation config it uses;
    None where that is not known (only ``max_length``, assisted or contrastive decoding). Only a
    prefetch hint: a wrong count costs a prefetch, never a token."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    if any(kwargs.get(k) or getattr(config, k, None) for k in _MANY_FORWARDS_PER_TOKEN):
        return None
    n = kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def _decode_attention():
    from kinject.engine import decode_attention
    return decode_attention


def _decode_router():
    from kinject.engine import decode_router
    return decode_router


def _host_gemv():
    from kinject.engine import host_gemv
    return host_gemv


def _host_norm():
    from kinject.engine import host_norm
    return host_norm


def _host_rotary():
    from kinject.engine import host_rotary
    return host_rotary
