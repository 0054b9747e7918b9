"""``OffloadedAttention``: attention weights in a tier, KV cache in a tier, micro-batched (Klotski §5).

Wraps a transformers attention module (``self.base``: any family -- GQA, q/k norms, biases,
GPT-OSS sinks and sliding layers, DeepSeek MLA) and runs **its own forward** once per micro-batch
of ``pipeline.micro_batch_size`` rows (None: the whole batch), Klotski's Algorithm 1 for the
non-expert part of a layer::

    load(0)                                  # usually already issued by the previous layer
    for j in micro-batches:
        load(j + 1)   (last j: the next layer's micro-batch 0)      # kv_load channel
        wait load(j); base(rows j, past_key_values=view j)          # compute
        store new entries of j                                      # kv_store channel

so micro-batch ``j+1``'s KV is loaded and ``j-1``'s new entries stored while ``j`` computes. When
no layer's KV crosses a link (every layer's on the device, or the host tier in the compute memory
of a CPU with no emulated link) there is nothing to overlap: the cache has one chunk and the
module runs once on the whole batch group (:meth:`AttentionGroup.micro_batch_size`). The
view is what the module sees as its cache (``past_key_values``, ``cache_params`` -- whichever
argument holds a transformers ``Cache``): for full and sliding layers a
:class:`kinject.kv.MicroBatchView`, whose ``update(k, v, layer_idx)`` appends that micro-batch's new
entries and returns its full KV; for every other cache-layer kind (linear attention, state-space,
conv, indexed / DSA, compressed) a :class:`kinject.kv.ChunkView`, a ``Cache`` whose layer is the
micro-batch chunk's own object of the family's layer class. So the operator wraps any attention or
token mixer (MLA, sparse / indexed attention, Mamba, gated delta nets, short convolutions).
Row-wise arguments (hidden states, position embeddings, 4-D masks, position ids: any tensor whose
first dimension is the batch) are sliced per micro-batch; broadcast ones (first dimension 1) are
passed as they are. Everything downstream (router, experts) sees the whole batch group at once.

Cache: ``model.generate`` gets a :class:`kinject.kv.cache.KVCache` through
:class:`kinject.kv.cache.GenerateCache` (installed on the model with ``runtime.on_model``). With any
other cache object (a plain ``model(**batch)`` makes a ``DynamicCache``) the operator runs the
module on the whole batch against that cache, unchanged; with ``use_cache=False`` it still
micro-batches.

Weights: one store unit per module, prefetched by the scheduler like ``OffloadedModule``.

Rule kwargs: ``weights: device|host|disk`` (default host); ``kv_cache: device|host|disk`` or
``{tier: host, policy: streaming, sink: 4, window: 1024}`` (:class:`kinject.kv.cache.StreamingKV`);
``compute: device|host`` (default device): where the attention core reads the KV.

Host compute (``compute: host``, KV tier host; MoE-Lightning's CGOPipe). The prefill runs on the
device as above: its query is as long as the prompt, so its attention is compute-bound and the
device is the fast side, and its KV is new entries made on the device, stored once. Every later
step runs the attention core on the host against the stored KV in place
(:mod:`operators.host_attention`): per micro-batch the query, the new key / value entries and the
mask go to the host, the output comes back, and the KV never crosses the link -- no KV load, no
KV store, no next-layer KV prefetch. Full, sliding and StreamingKV layers are served; any other
cache-layer kind is refused when the model is optimized, naming the layer. An attention with no
KV cache (an encoder, a vision tower) has nothing to read in place and runs on the device.

Shared per-runtime state: ``"attention"`` (:class:`AttentionGroup`: operators by layer, KV
statistics, the generate hook).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import inspect
import logging
import weakref
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from kinject.errors import KinjectError
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache

from kinject.kv import (DelegatedLayer, GenerateCache, HiddenStaging, KVCache, KVSpec, KVStats, MicroBatchPrefill,
                        parse_kv_cache)
from kinject.kv.cache import host_compute_refusal
from kinject.kv.encdec import CrossCacheView, EncoderDecoderView
from kinject.engine.host_lane import HostLane
from kinject.formatting import format_bytes
from kinject.engine.encode import parse_quant
from operators.base import Operator, ParamBinding, check_quant_kwarg
from operators.host_attention import HostAttention

if TYPE_CHECKING:
    from kinject.runtime import Runtime

logger = logging.getLogger(__name__)


class AttentionGroup:
    """The runtime's ``OffloadedAttention`` operators by (stack, cache layer index), their KV
    statistics, and the hook that makes ``generate`` use a :class:`KVCache` built from their
    ``kv_cache`` specs. A vision tower's block 0, an encoder's layer 0 and the decoder's layer 0
    are different operators: only the decoder's receives the cache, and the cache layer ``i``
    takes its spec from the last stack (in execution order) with an attention at index ``i``."""

    def __init__(self, runtime: "Runtime"):
        self.runtime = runtime
        self.ops: dict[tuple[str, int], "OffloadedAttention"] = {}
        self.cross: dict[tuple[str, int], "OffloadedAttention"] = {}   # a decoder block's cross-attention
        self._next: dict["OffloadedAttention", "OffloadedAttention | None"] = {}   # op -> next_after(op)
        self._by_idx: dict[int, "OffloadedAttention"] | None = None
        self.stats = KVStats()
        self._last_cache = None                     # weak reference to the newest KVCache (inspection)
        self._lane: HostLane | None = None
        self.hook = GenerateCache(self.make_cache, self.make_cross_cache)
        runtime.on_model(self.check_host_layers, self._close_lane)
        runtime.on_model(self.hook.attach, self.hook.detach)
        if runtime.pipeline.prefill == "micro_batch":     # activations of one micro-batch, not the group's
            prefill = MicroBatchPrefill(between=self._next_step)
            runtime.on_model(prefill.attach, prefill.detach)
        elif runtime.pipeline.prefill == "layer":         # the same, with each layer's weights loaded once
            prefill = MicroBatchPrefill(layers=self.decoder_layers, hold=runtime.store.hold,
                                        stage=HiddenStaging(runtime.transfer), chunk=runtime.pipeline.prefill_chunk)
            runtime.on_model(prefill.attach, prefill.detach)
        runtime.reporters.append(self.report_lines)

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        """The modules a layer-wise prefill splits by chunk: the parent of each attention operator
        that owns a cache layer (the decoder layer holding it, whatever its family calls it)."""
        out = []
        for op in self.by_index().values():
            try:
                out.append(model.get_submodule(op.key.rsplit(".", 1)[0]) if "." in op.key else None)
            except AttributeError:
                out.append(None)
            if out[-1] is None:
                raise KinjectError(f"pipeline.prefill: layer: attention operator {op.key} has no parent layer "
                                   "in the model; use prefill: micro_batch")
        return out

    def _next_step(self) -> None:
        """Between two chunks of a prefill by micro-batch: each chunk's forward is a pipeline step."""
        self.runtime.scheduler.end_step()
        self.runtime.scheduler.begin_step()

    @property
    def lane(self) -> HostLane:
        """The host-compute lane every cache of this runtime shares (its CUDA stream made once)."""
        if self._lane is None:
            self._lane = HostLane(self.runtime.device)
        return self._lane

    def _close_lane(self, model: nn.Module) -> None:
        if self._lane is not None:
            self._lane.close()

    def check_host_layers(self, model: nn.Module) -> None:
        """At optimize: every ``compute: host`` operator that will own a cache layer owns one host
        compute serves (full or sliding attention); else a :class:`KinjectError` naming it."""
        hosts = {i: op for i, op in self.by_index().items() if op.kv.compute == "host"}
        if not hosts:
            return
        config = model.config
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        reference = DynamicCache(config=text).layers
        for i, op in sorted(hosts.items()):
            ref = reference[i] if i < len(reference) else None
            if ref is None or not KVCache.host_computable(ref):
                raise KinjectError(f"{op.key}: {host_compute_refusal(i, ref)}")

    def add(self, op: "OffloadedAttention") -> None:
        slot = (op.stack, op.layer_idx)
        if slot in self.ops and self.ops[slot] is not op and self.cross.get(slot, op) is op \
                and op.takes_encoder_states:
            # a second attention of the block, taking the encoder's states: its cross-attention (found
            # after the self-attention in the module tree, as every encoder-decoder family defines them)
            self.cross[slot] = op
            self._changed()
            return
        if slot in self.ops and self.ops[slot] is not op:
            raise KinjectError(f"two attention operators claim layer {op.layer_idx} of stack {op.stack!r}: "
                               f"{self.ops[slot].key!r} and {op.key!r}")
        self.ops[slot] = op
        self._changed()

    def remove(self, op: "OffloadedAttention") -> None:
        if self.cross.get((op.stack, op.layer_idx)) is op:
            del self.cross[(op.stack, op.layer_idx)]
            self._changed()
        elif self.ops.get((op.stack, op.layer_idx)) is op:
            del self.ops[(op.stack, op.layer_idx)]
            self._changed()

    def _changed(self) -> None:
        self._next.clear()
        self._by_idx = None

    def by_index(self) -> dict[int, "OffloadedAttention"]:
        """Cache layer index -> the operator whose spec that cache layer takes: of several stacks
        with an attention at one index, the one that runs last (the decoder after its towers)."""
        if self._by_idx is None:
            order = {s.path: n for n, s in enumerate(self.runtime.stacks)}
            self._by_idx = {}
            for (stack, idx), op in sorted(self.ops.items(), key=lambda kv: (order.get(kv[0][0], -1), kv[0][1])):
                self._by_idx[idx] = op
        return self._by_idx

    def spec(self, layer_idx: int) -> KVSpec:
        op = self.by_index().get(layer_idx)
        return op.kv if op is not None else KVSpec("device")

    def cross_spec(self, layer_idx: int) -> KVSpec:
        """The cross-attention cache layer's spec: its operator's tier and policy, read on the device
        (it is read whole every step; host compute serves self-attention)."""
        ops = [op for (_, idx), op in self.cross.items() if idx == layer_idx]
        return dataclasses.replace(ops[-1].kv, compute="device", streaming=None) if ops else KVSpec("device")

    def next_after(self, op: "OffloadedAttention") -> "OffloadedAttention | None":
        """The attention operator of the next layer of ``op``'s stack that has one (asked per layer
        per step: kept until an operator is added or removed)."""
        if op not in self._next:
            later = [i for (stack, i) in self.ops if stack == op.stack and i > op.layer_idx]
            self._next[op] = self.ops[(op.stack, min(later))] if later else None
        return self._next[op]

    def micro_batch_size(self) -> int | None:
        """Rows per KV chunk: ``pipeline.micro_batch_size`` when some layer's KV crosses a link;
        None (one chunk: attention runs once on the whole batch group) when nothing does -- every
        layer's KV on the device, or in the host tier in the compute memory (a CPU device with no
        emulated link: the transfer engine runs inline, host KV is used in place; disk KV is still
        read by the disk workers beside the compute, so it keeps its chunks). Micro-batches
        exist to overlap KV transfers with compute; with nothing to overlap they only multiply the
        attention calls (each re-reads the attention weights and adds its per-call work: at the
        Qwen3-30B-A3B width, batch 8 in micro-batches of 2 ran 4x the attention matmuls of one
        call). ``pipeline.prefill: micro_batch`` keeps its chunks: it asks for them to bound the
        prefill's activations, not for overlap."""
        pipeline = self.runtime.pipeline
        ops = [*self.ops.values(), *self.cross.values()]
        if all(op.kv.tier == "device" for op in ops):
            return None
        in_place = self.runtime.transfer.inline and all(op.kv.tier in ("device", "host") for op in ops)
        if in_place and pipeline.prefill != "micro_batch":
            return None
        return pipeline.micro_batch_size

    def make_cache(self, model: nn.Module, capacity: int | None = None) -> KVCache:
        rt = self.runtime
        cache = KVCache(model.config, specs=self.spec, device=rt.device, transfer=rt.transfer, stats=self.stats,
                        micro_batch_size=self.micro_batch_size(), capacity=capacity,
                        offload_dir=rt.pipeline.offload_dir, tracer=rt.tracer, host_lane=self.lane,
                        decode_chunk=rt.pipeline.decode_chunk, kv_budget=rt.pipeline.kv_budget,
                        owner=type(model).__name__)
        self._last_cache = weakref.ref(cache)
        return cache

    def make_cross_cache(self, model: nn.Module) -> KVCache | None:
        """The cross-attention cache of an encoder-decoder ``generate`` (:mod:`kinject.kv.encdec`);
        None (transformers' own caches, the operators run whole batches against them) unless every
        decoder layer's cross-attention is an operator: an unwrapped one reads its layer's tensors."""
        crossed = {idx for (_, idx) in self.cross}
        if not crossed or crossed != set(self.by_index()):
            logger.info("kinject: cross-attention operators on layers %s of %s: generate keeps transformers' "
                        "encoder-decoder cache", sorted(crossed), sorted(self.by_index()))
            return None
        rt = self.runtime
        return KVCache(model.config, specs=self.cross_spec, device=rt.device, transfer=rt.transfer, stats=self.stats,
                       micro_batch_size=self.micro_batch_size(), offload_dir=rt.pipeline.offload_dir,
                       tracer=rt.tracer, host_lane=self.lane, owner=type(model).__name__)

    @property
    def last_cache(self) -> KVCache | None:
        """The cache of the latest ``generate`` call while someone still holds it."""
        return self._last_cache() if self._last_cache is not None else None

    def report_lines(self) -> list[str]:
        if not self.ops:
            return []
        s = self.stats.summary()
        specs = {(op.kv.tier, op.kv.streaming) for op in self.ops.values()}
        what = "; ".join(f"{tier}" + (f" streaming(sink={st.sink}, window={st.window})" if st else "")
                         for tier, st in sorted(specs, key=str))
        return [f"kv cache: {what}; micro-batch {self.micro_batch_size() or 'whole batch'}; "
                f"{s['micro_batches']} micro-batch steps; loads {s['loads']} ({format_bytes(s['load_bytes'])}), "
                f"stores {s['stores']} ({format_bytes(s['store_bytes'])}); next-layer prefetch hits {s['prefetch_hits']}; "
                f"peak device KV {format_bytes(s['peak'])}"] + self._host_lines() + self._kind_lines()

    def _host_lines(self) -> list[str]:
        """The host-compute lane: what ran there, what crossed, what did not."""
        hosts = sorted((op for op in self.ops.values() if op.host is not None), key=lambda op: op.key)
        if not hosts:
            return []
        calls = sum(op.host.stats["calls"] for op in hosts)
        read = sum(op.host.stats["kv_bytes_read"] for op in hosts)
        lane = self.lane.stats
        return [f"host attention (compute: host, {len(hosts)} layers): {calls} micro-batch calls on the host lane "
                f"over the host KV in place, KV read there {format_bytes(read)}, KV moved for them 0 B; activations to the "
                f"host {format_bytes(lane['to_host_bytes'])} (queries, new entries, masks), back {format_bytes(lane['to_device_bytes'])}"]

    def _kind_lines(self) -> list[str]:
        """Cache-layer kinds of the latest cache other than full / sliding: how each is served."""
        cache = self.last_cache
        if cache is None:
            return []
        delegated = [layer for layer in cache.layers if isinstance(layer, DelegatedLayer)]
        if not delegated:
            return []
        kinds: dict[str, list[int]] = {}
        for layer in delegated:
            kinds.setdefault(layer.kind, []).append(layer.idx)
        what = ", ".join(f"{k} (layers {', '.join(map(str, v))})" for k, v in kinds.items())
        return [f"kv cache kinds served through their own class per micro-batch: {what}; context tensors "
                f"{format_bytes(sum(layer.stored_bytes() for layer in delegated))} in their KV tier; fixed-size "
                f"recurrent / conv states {format_bytes(cache.state_bytes())} stay with the compute"]


def attention_group(runtime: "Runtime") -> AttentionGroup:
    return runtime.shared("attention", lambda: AttentionGroup(runtime))


class OffloadedAttention(Operator):
    def __init__(self, base: nn.Module, *, key: str, runtime: "Runtime",
                 weights: Literal["device", "host", "disk"] = "host",
                 kv_cache: Literal["device", "host", "disk"] | dict = "host", quant: dict | None = None,
                 compute: Literal["device", "host"] = "device"):
        super().__init__(base, key=key, runtime=runtime)
        self.weights = weights
        self.kv = dataclasses.replace(parse_kv_cache(kv_cache), compute=compute)
        self.host = HostAttention(base, key) if compute == "host" else None   # the attention core's host side
        self.quant = parse_quant(quant)      # a stored format (HQQ, fp8, int4, ...): moved as stored, decoded before use
        found = runtime.stacks.block_of(key)
        if found is None:
            raise ValueError(f"{key!r}: not inside any stack of repeated blocks (a ModuleList of layers); "
                             f"the model's stacks: {runtime.stacks!r}")
        self.stack = found[0]                    # the stack of blocks it belongs to
        idx = getattr(base, "layer_idx", None)
        self.layer_idx = idx if isinstance(idx, int) else found[1]   # its cache layer, when it has one
        self.binding = ParamBinding(base, runtime, key)
        self._sig = inspect.signature(base.forward)
        self._names = list(self._sig.parameters)
        # a cross-attention takes the encoder's states (the registry tells it from the block's self-attention)
        self.takes_encoder_states = "key_value_states" in self._names
        # every parameter can be passed by name: the call's arguments are one flat dict (positional
        # ones named), no ``Signature.bind`` per call; otherwise bound, and called back through it
        kinds = {p.kind for p in self._sig.parameters.values()}
        self._flat = not kinds & {inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL}
        self._positional = [n for n, p in self._sig.parameters.items()
                            if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]
        self._group: AttentionGroup | None = None    # the runtime's attention group, while attached
        self._cache_name: str | None = None          # the argument that held the Cache last call

    @classmethod
    def check_kwargs(cls, kwargs: dict) -> None:
        check_quant_kwarg(kwargs)
        try:
            spec = parse_kv_cache(kwargs.get("kv_cache", "host"))
        except (ValueError, TypeError) as exc:
            err = ValueError(str(exc))
            err.key = "kv_cache"
            raise err from None
        try:
            dataclasses.replace(spec, compute=kwargs.get("compute", "device"))
        except ValueError as exc:
            err = ValueError(str(exc))
            err.key = "compute"
            raise err from None

    # -- lifecycle
    def attach(self) -> None:
        self.binding.take(self.weights, layer=self.layer, quant=self.quant)
        self._group = attention_group(self.runtime)
        self._group.add(self)
        super().attach()

    def detach(self) -> nn.Module:
        attention_group(self.runtime).remove(self)
        self._group = None
        self.binding.give_back()
        return super().detach()

    def prefetch_units(self) -> list:
        return self.binding.prefetch_units()

    def prefetch_settled(self) -> bool:
        return self.binding.settled()

    def offloads(self) -> bool:
        return self.binding.offloaded

    def extra_repr(self) -> str:
        st = self.kv.streaming
        kv = self.kv.tier + (f", streaming(sink={st.sink}, window={st.window})" if st else "")
        return f"key={self.key!r}, weights={self.weights!r}, kv_cache={kv}, compute={self.kv.compute!r}"

    # -- compute
    def forward(self, *args, **kwargs):
        scheduler = self.runtime.scheduler
        scheduler.enter(self, paced=True)       # booked at the micro-batches' module calls (:meth:`_call`)
        if not args and self._flat:
            arguments = kwargs                  # (a fresh dict per call: this call's own to change)
        elif self._flat and len(args) <= len(self._positional):
            arguments = dict(zip(self._positional, args))
            if arguments.keys() & kwargs.keys():
                raise TypeError(f"{self.key}: multiple values for {sorted(arguments.keys() & kwargs.keys())}")
            arguments.update(kwargs)
        else:
            arguments = self._sig.bind(*args, **kwargs).arguments
        try:
            with self.binding.in_use():
                return self._run(arguments)
        finally:
            if scheduler.pacing is not None:
                scheduler.pace_end()

    def _run(self, arguments: dict) -> Any:
        hidden = arguments[self._names[0]]                                  # [B, q, H]
        batch, q = hidden.shape[0], hidden.shape[1]
        name = self._cache_name                      # where the last call held its Cache (one name per module)
        cache = arguments.get(name) if name is not None else None
        if isinstance(cache, KVCache):               # kinject's own cache, where it was last call: the common step
            return self._run_cached(arguments, cache, name, batch, q)
        name, cache = _cache_arg(arguments)          # past_key_values, cache_params, ...: whatever holds a Cache
        self._cache_name = name if isinstance(cache, Cache) else None
        if isinstance(cache, EncoderDecoderCache) and isinstance(cache.self_attention_cache, KVCache) \
                and isinstance(cache.cross_attention_cache, KVCache):
            return self._run_encoder_decoder(arguments, cache, name, batch, q)
        if cache is None and hidden.dim() < 3 or cache is not None and not isinstance(cache, KVCache):
            # someone else's cache; or a tower's packed tokens ([T, H], cu_seqlens): no rows to split
            with self.runtime.tracer.span("compute", self.key, layer=self.layer):
                return self._call(arguments)
        if cache is None:
            bs = self.runtime.pipeline.micro_batch_size or batch
            outs, shared = [], _SharedWrites.of(arguments, batch)
            for r0 in range(0, batch, bs):
                rows = slice(r0, min(r0 + bs, batch))
                args = _slice_rows(arguments, rows, batch)
                if shared is not None:
                    shared.give(args, rows)
                with self.runtime.tracer.span("compute", f"{self.key} rows {rows.start}:{rows.stop}", layer=self.layer):
                    outs.append(self._call(args))
            sizes = [len(range(batch)[r0:r0 + bs]) for r0 in range(0, batch, bs)]
            if shared is not None:
                shared.join(sizes)
            return _cat(outs, sizes)
        return self._run_cached(arguments, cache, name, batch, q)

    def _run_encoder_decoder(self, arguments: dict, cache: EncoderDecoderCache, name: str, batch: int, q: int) -> Any:
        """A decoder attention of an encoder-decoder ``generate``: self-attention over its KV as any
        decoder's; cross-attention (called with ``key_value_states``) over the encoder KV, stored
        once at the first step and read per micro-batch after (:mod:`kinject.kv.encdec`)."""
        states = _get(arguments, "key_value_states")
        if states is None:
            return self._run_cached(arguments, cache.self_attention_cache, name, batch, q,
                                    wrap=lambda view: EncoderDecoderView(view, cache.cross_attention_cache,
                                                                         dict(cache.is_updated)))
        stored = bool(cache.is_updated.get(self.layer_idx))
        out = self._run_cached(arguments, cache.cross_attention_cache, name, batch, 0 if stored else states.shape[1],
                               wrap=lambda view: EncoderDecoderView(cache.self_attention_cache, CrossCacheView(view),
                                                                    dict(cache.is_updated)))
        cache.is_updated[self.layer_idx] = True
        return out

    def _run_cached(self, arguments: dict, cache: KVCache, name: str, batch: int, q: int, wrap=None) -> Any:
        """Run the module per micro-batch against ``cache``'s layer (Klotski Algorithm 1); ``wrap``
        turns a micro-batch's view into what the module expects as its cache (encoder-decoder)."""
        rt, group = self.runtime, self._group or attention_group(self.runtime)
        layers = cache.layers
        # a layer that holds nothing (DummyLayer), or none at all: transformers 5.17 makes no cache layer for
        # Gemma 4's layers that read another layer's K/V (they sit past the cache's last layer)
        layer = layers[self.layer_idx] if self.layer_idx < len(layers) else None
        if not hasattr(layer, "begin"):
            with rt.tracer.span("compute", self.key, layer=self.layer):
                return self._call(arguments)
        layer.begin(q, batch)
        spans = layer.spans() if hasattr(layer, "spans") else list(enumerate(layer.chunks))   # (first chunk, rows)
        nxt = group.next_after(self)
        local = self.host is not None and layer.computes_in_place()     # attention on the host, KV in place
        base = 0                                     # the cache row this call's first row is
        if cache.window is not None:                 # a prefill by micro-batch / layer: this call holds its window's rows
            if len(cache.window) == 1:
                return self._run_whole(arguments, cache, layer, name, q, nxt, wrap, cache.window[0])
            spans, local = [(j, layer.chunks[j]) for j in cache.window], False    # a prefill computes on the device
            base = spans[0][1].rows.start
        elif len(spans) == 1 and layer.streaming is None and spans[0][1].size == batch and not local:
            return self._run_whole(arguments, cache, layer, name, q, nxt, wrap)
        if local and self.host.overlaps(cache.host_lane, len(spans)):
            return self._run_host_overlapped(arguments, cache, layer, name, batch, q, nxt, wrap)
        works: dict[int, Any] = {} if local else {spans[0][0]: layer.load(spans[0][0], q)}
        work = None
        outs, shared = [], _SharedWrites.of(arguments, batch)
        rt.scheduler.pace_parts(len(spans))     # the weights ahead, a share behind each micro-batch's KV load
        try:
            for i, (j, chunk) in enumerate(spans):
                if i + 1 < len(spans):
                    if not local:
                        works[spans[i + 1][0]] = layer.load(spans[i + 1][0], q)
                else:
                    _prefetch_next_layer(cache, nxt, q, spans[0][0])
                work = layer.local(j, q) if local else layer.acquire(works.pop(j))
                args = self._chunk_arguments(arguments, cache, layer, chunk, work, name, batch, q, wrap, base, shared)
                label = f"{self.key} rows {chunk.rows.start}:{chunk.rows.stop}"
                with rt.tracer.span("compute", label, layer=self.layer):
                    if local:
                        with self.host.call(cache.host_lane, rt.tracer, label, self.layer):
                            outs.append(self._call(args))
                    else:
                        outs.append(self._call(args))
                layer.commit(work)
                work = None
        except BaseException:
            layer.abort([*works.values(), work])
            raise
        layer.end_step(q)
        if shared is not None:
            shared.join([c.size for _, c in spans])
        return _cat(outs, [c.size for _, c in spans])

    def _chunk_arguments(self, arguments: dict, cache: KVCache, layer, chunk, work, name: str, batch: int, q: int,
                         wrap, base: int = 0, shared: "_SharedWrites | None" = None) -> dict:
        """The module's arguments for micro-batch ``chunk`` (its ``work``): its rows (``base``: the
        cache row the call's first row is), its own copy of the mappings it may write for later layers
        (``shared``), its cache view (wrapped), and under StreamingKV the mask of its kept slots."""
        rows = slice(chunk.rows.start - base, chunk.rows.stop - base)
        whole = rows.start == 0 and rows.stop == batch
        args = arguments if whole else _slice_rows(arguments, rows, batch)   # bound anew per call
        if shared is not None:
            shared.give(args, rows)
        view = layer.view(work)                  # the chunk's cache: its KV, or its own layer object
        _put(args, name, wrap(view) if wrap is not None else view)
        if layer.streaming is not None:
            mask = self._streaming_mask(cache, layer, chunk.rows, q, _get(args, "attention_mask"),
                                        arguments[self._names[0]].dtype)
            _put(args, "attention_mask", mask)
        return args

    def _run_host_overlapped(self, arguments: dict, cache: KVCache, layer, name: str, batch: int, q: int, nxt,
                             wrap) -> Any:
        """Host compute with the micro-batches pipelined (CGOPipe): each micro-batch's module call
        runs on a host-lane worker, and the next one starts as soon as it has handed its query to the
        host -- so the device computes micro-batch j+1's projections (and j-1's output projection)
        while the host computes j's attention. Outputs join in order; then every micro-batch commits."""
        rt, chunks = self.runtime, layer.chunks
        rt.scheduler.pace_end()                 # (the module calls below run on the host lane's thread)
        works, jobs, shared = [], [], _SharedWrites.of(arguments, batch)
        with self.host.overlapping(cache.host_lane, rt.tracer, self.layer) as start:
            try:
                for j, chunk in enumerate(chunks):
                    if j + 1 == len(chunks):
                        _prefetch_next_layer(cache, nxt, q)
                    works.append(layer.local(j, q))
                    args = self._chunk_arguments(arguments, cache, layer, chunk, works[-1], name, batch, q, wrap,
                                                 shared=shared)
                    label = f"{self.key} rows {chunk.rows.start}:{chunk.rows.stop}"
                    jobs.append(start(functools.partial(self._traced_call, args, label), label))
                outs = [job.result() for job in jobs]
            except BaseException:
                for job in jobs:                     # none left running (with the host config) before the buffers go
                    job.exception()
                layer.abort(works)
                raise
        for work in works:
            layer.commit(work)
        layer.end_step(q)
        if shared is not None:
            shared.join([c.size for c in chunks])
        return _cat(outs, [c.size for c in chunks])

    def _traced_call(self, args: dict, label: str) -> Any:
        with self.runtime.tracer.span("compute", label, layer=self.layer):
            return self._call(args)

    def _run_whole(self, arguments: dict, cache: KVCache, layer, name: str, q: int, nxt, wrap=None,
                   j: int = 0) -> Any:
        """:meth:`_run_cached` for one chunk ``j`` holding every row of the call (every KV on the
        device, ``micro_batch_size`` unset, or a prefill by micro-batch): the same protocol calls --
        load, the next layer's same chunk prefetched, acquire, the module on its view, commit --
        without the per-chunk loop, row slicing or a trace name formatted when nothing is traced
        (the common decode step)."""
        work = layer.load(j, q)
        _prefetch_next_layer(cache, nxt, q, j)
        try:
            work = layer.acquire(work)
            view = layer.view(work)
            _put(arguments, name, wrap(view) if wrap is not None else view)
            tracer = self.runtime.tracer
            if tracer.enabled:
                rows = getattr(work, "chunk", layer.chunks[j]).rows     # a decode chunk's: all its micro-batches'
                with tracer.span("compute", f"{self.key} rows {rows.start}:{rows.stop}", layer=self.layer):
                    out = self._call(arguments)
            else:
                out = self._call(arguments)
            layer.commit(work)
        except BaseException:
            layer.abort([work])
            raise
        layer.end_step(q)
        return out

    def _streaming_mask(self, cache: KVCache, layer, rows: slice, q: int, given, dtype) -> torch.Tensor:
        meta = cache.meta(layer.seen, q)
        allowed = layer.streaming.attention_mask(meta, rows, layer.seen, layer.count, q)   # [b, 1, q, K] bool
        impl = getattr(getattr(self.base, "config", None), "_attn_implementation", "eager")
        if isinstance(given, torch.Tensor) and given.dtype == torch.bool or given is None and impl == "sdpa":
            return allowed
        if isinstance(given, torch.Tensor) and given.is_floating_point() or impl == "eager":
            dtype = given.dtype if isinstance(given, torch.Tensor) else dtype
            zero = torch.zeros((), dtype=dtype, device=allowed.device)
            return torch.where(allowed, zero, torch.finfo(dtype).min)
        raise KinjectError(f"{self.key}: StreamingKV needs eager or sdpa attention (a 4-D mask), "
                           f"not {impl!r}")

    def _call(self, arguments: dict) -> Any:
        scheduler = self.runtime.scheduler
        if scheduler.pacing is not None:
            scheduler.pace()                     # this call's KV is issued: the next share of the weights ahead
        if self._flat:                   # arguments by name, as :meth:`forward` collected them
            return self._base(**arguments)
        bound = inspect.BoundArguments(self._sig, arguments)
        return self._base(*bound.args, **bound.kwargs)


# ------------------------------------------------------------------------------------- helpers


def _prefetch_next_layer(cache: KVCache, nxt: "OffloadedAttention | None", q: int, j: int = 0) -> None:
    """Issue the next attention layer's KV chunk ``j`` (its first, or the one a prefill by
    micro-batch computes) while this layer's last chunk computes."""
    if nxt is not None and nxt.layer_idx < len(cache.layers) and hasattr(cache.layers[nxt.layer_idx], "begin"):
        cache.layers[nxt.layer_idx].prefetch(j, q)


def _cache_arg(arguments: dict) -> tuple[str, Any]:
    """The argument holding the cache (``past_key_values`` for attention, ``cache_params`` for most
    state-space mixers, ...): the first whose value is a transformers ``Cache``; else the first of
    the usual names the forward takes, with no cache."""
    for k, v in arguments.items():
        if isinstance(v, Cache):
            return k, v
        if isinstance(v, dict):            # **kwargs of the module's forward
            for kk, vv in v.items():
                if isinstance(vv, Cache):
                    return kk, vv
    for k in _CACHE_NAMES:
        if _get(arguments, k) is not None or k in arguments:
            return k, None
    return "past_key_values", None


_CACHE_NAMES = ("cache", "past_key_values", "cache_params", "past_key_value", "layer_past")


def _get(arguments: dict, name: str):
    if name in arguments:
        return arguments[name]
    for v in arguments.values():       # **kwargs of the module's forward
        if isinstance(v, dict) and name in v:
            return v[name]
    return None


def _put(arguments: dict, name: str, value) -> None:
    if name in arguments:
        arguments[name] = value
        return
    for v in arguments.values():
        if isinstance(v, dict) and name in v:
            v[name] = value
            return
    arguments[name] = value


class _SharedWrites:
    """The mappings a module's call may write for the layers after it, seen by its micro-batches.

    Why: transformers passes some layers a mapping they fill for later ones in the same forward
    (``KVSharingDict``, a ``UserDict``: Gemma 4's and Kolibri 1.1's layers that store their keys and
    values for a later layer that has none of its own, and reads them whole-batch, its cache a
    ``DummyLayer``). Run micro-batch by micro-batch, every micro-batch would write the same entry and
    the last one's rows would win: the later layer would read another batch's rows, or fail on their
    count. Instead each micro-batch gets a copy holding its rows of every entry, and once all have run
    each entry they wrote goes into the call's mapping with their rows joined in order: what the
    whole-batch call writes (docs/architecture.md, "Mixed layer kinds")."""

    def __init__(self, batch: int, mappings: dict[tuple, collections.UserDict]):
        self.batch = batch
        self.mappings = mappings               # path (name, or **kwargs' name and name) -> the call's mapping
        self.given: list[dict[tuple, tuple[dict, collections.UserDict]]] = []   # per micro-batch, in order

    @classmethod
    def of(cls, arguments: dict, batch: int) -> "_SharedWrites | None":
        """The shared mappings among ``arguments`` (and the **kwargs dict of the forward), if any."""
        found = {}
        for name, value in arguments.items():
            if isinstance(value, collections.UserDict):
                found[(name,)] = value
            elif isinstance(value, dict):
                found.update({(name, k): v for k, v in value.items() if isinstance(v, collections.UserDict)})
        return cls(batch, found) if found else None

    def give(self, args: dict, rows: slice) -> None:
        """Put into ``args`` (one micro-batch's, rows ``rows``) its own copy of each mapping."""
        mine = {}
        for path, whole in self.mappings.items():
            entries = {k: _rows(v, rows, self.batch) for k, v in whole.items()}
            own = copy.copy(whole)
            own.data = dict(entries)
            if len(path) == 1:
                args[path[0]] = own
            else:
                args[path[0]] = {**args[path[0]], path[1]: own}
            mine[path] = (entries, own)
        self.given.append(mine)

    def join(self, sizes: list[int]) -> None:
        """Every entry the micro-batches (``sizes`` rows each) wrote, into the call's mapping."""
        for path, whole in self.mappings.items():
            wrote = [{k: v for k, v in own.items() if k not in entries or v is not entries[k]}
                     for entries, own in (g[path] for g in self.given)]
            for key in set().union(*wrote):
                if not all(key in w for w in wrote):
                    raise KinjectError(f"{path[-1]}[{key!r}] was written by some micro-batches of a call and not by "
                                       "others: its rows cannot be joined")
                whole[key] = _cat([w[key] for w in wrote], sizes)
        self.given = []


def _slice_rows(arguments: dict, rows: slice, batch: int) -> dict:
    """A copy of the bound arguments with every batch-major tensor cut to ``rows``."""
    return {k: _rows(v, rows, batch) for k, v in arguments.items()}


def _rows(x, rows: slice, batch: int):
    if isinstance(x, torch.Tensor):
        return x[rows] if x.dim() > 0 and x.shape[0] == batch and batch > 1 else x
    if isinstance(x, tuple):
        return tuple(_rows(v, rows, batch) for v in x)
    if isinstance(x, list):
        return [_rows(v, rows, batch) for v in x]
    if isinstance(x, dict):
        return {k: (v if k in _CACHE_NAMES else _rows(v, rows, batch)) for k, v in x.items()}
    return x


def _cat(outs: list, sizes: list[int]):
    """Micro-batch outputs joined along the batch (tensors; tuples element-wise; None stays None).
    A tensor whose first dimension is not its micro-batch's rows is the same for every row (T5's
    position bias ``[1, H, q, K]``): the first micro-batch's is returned."""
    first = outs[0]
    if len(outs) == 1:
        return first
    if isinstance(first, torch.Tensor):
        if any(o.dim() == 0 or o.shape[0] != n for o, n in zip(outs, sizes)):
            return first
        return torch.cat(outs, 0)
    if isinstance(first, tuple):
        return tuple(_cat([o[i] for o in outs], sizes) if all(o[i] is not None for o in outs) else None
                     for i in range(len(first)))
    return first
