"""kinject's KV cache: the keys and values of every sequence in a tier, served one micro-batch at a time.

:class:`KVCache` is a transformers :class:`~transformers.cache_utils.Cache` (so ``generate`` and the
mask code use it like a ``DynamicCache``: ``get_seq_length``, ``get_mask_sizes``, ``is_sliding``,
``crop``, ``reorder_cache``, ``batch_select_indices`` ...). What it stores differs: each layer
(:class:`KVLayer`) splits the batch rows into fixed micro-batch *chunks*, and keeps each chunk's
entries in a tier -- ``device``, ``host`` (pinned on CUDA) or ``disk`` (a file-backed tensor in
``offload_dir``). :class:`operators.attention.OffloadedAttention` drives one layer a micro-batch at
a time (Klotski Algorithm 1)::

    work = layer.load(j, q)         # kv_load channel: chunk j's past entries -> a device buffer
    K, V = view.update(k, v, idx)   # inside the model's attention: new entries appended, full KV back
    layer.commit(work)              # kv_store channel: chunk j's new entries -> their tier

Layout. Stored and device buffers are sequence-major, ``[tokens, rows, heads, dim]``, so a chunk's
past (``[:L]``) and its new entries (``[L:L+q]``) are contiguous: one ``non_blocking`` copy each
way, pinned host memory on CUDA. The attention gets ``buffer.permute(1, 2, 0, 3)``
(``[rows, heads, tokens, dim]``, innermost dim contiguous). Keys and values may differ in width
(DeepSeek MLA caches the latent ``kv_nope`` and ``k_pe`` as "key" and "value").

Ordering (no global synchronize): a load job first makes its stream wait on the chunk's previous
store (``TransferHandle.wait`` on the kv_load worker: a stream wait on CUDA); a store job is
submitted with ``wait_current=True`` (its stream waits for the attention that produced the
entries) and ``record_stream``-s what it reads; load results are ``record_stream``-ed on the
compute stream by ``TransferHandle.wait``. Memory backpressure: at most one store is in flight per
cache -- before making the next one's outgoing copy, ``commit`` waits (host, on that one store's
event) for the previous, which normally landed while the next micro-batch computed.

Device KV accounting (:class:`KVStats`, offloaded tiers): a micro-batch's working buffer (its past
+ room for the new entries) is counted from its load until its commit; new entries waiting for
their store (a copy, so the working buffer can go) are counted until the store lands. With loads
one micro-batch ahead and one store in flight, the peak is at most two working buffers plus one
micro-batch's outgoing entries (``KVStats.peak``). On the first step (prefill) nothing is loaded
and the working buffer holds only new entries, which are stored from it directly (then the peak is
two working buffers).

Policies per layer: full layers keep everything; sliding layers (GPT-OSS) keep the last
``sliding_window - 1`` entries in a ring, exactly like ``DynamicSlidingWindowLayer`` (same mask
sizes); :class:`StreamingKV` keeps sinks + a recent window.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import os
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

from kinject.errors import KinjectError

if TYPE_CHECKING:
    from kinject.trace import Tracer
    from kinject.engine.transfer import TransferEngine, TransferHandle

logger = logging.getLogger(__name__)

Tier = Literal["device", "host", "disk"]
TIERS = ("device", "host", "disk")
_FAR = 1 << 62          # "no such position" for sink slots not (yet) filled
_ids = itertools.count()


# ---------------------------------------------------------------------------------------- policy


@dataclass(frozen=True)
class StreamingKV:
    """StreamingLLM's KV policy: keep ``sink`` attention sinks and a recent ``window``.

    Rule (every token, prefill included): the query at slot ``t`` attends to the key at slot ``s``
    iff ``s`` is a real (non-padding) token, ``s <= t``, and ``s`` is one of the first ``sink`` real
    tokens of its row or ``s > t - window`` (the window counts the query itself). Sinks are per
    row -- with left padding the first real token, not slot 0. A layer therefore stores the row's
    sinks plus the last ``window - 1`` slots (a ring), never more.

    Positions: kinject keeps the *original* positions. StreamingLLM re-indexes positions inside the
    cache (RoPE applied after retrieval, distances capped at the cache size); transformers'
    attention modules apply RoPE to keys *before* ``cache.update``, and kinject runs those modules
    unchanged (DESIGN §3, §10.8), so cached keys carry the rotation of their original position and
    queries use their true position (from ``generate``'s ``position_ids``). Relative distances to
    the sinks therefore keep growing: fine within the model's trained context, and the difference
    from re-indexing beyond it. Works on full-attention layers; sliding layers (GPT-OSS) are already
    bounded and keep their own policy.

    The operator builds the attention mask for these layers itself (``attention_mask``): the kept
    slots are not a contiguous range, which transformers' mask code cannot express. Usable on any
    KV tier (``device``: no offload).
    """

    sink: int = 4
    window: int = 1024

    def __post_init__(self) -> None:
        if not (isinstance(self.sink, int) and self.sink >= 0):
            raise ValueError(f"StreamingKV sink must be an integer >= 0, got {self.sink!r}")
        if not (isinstance(self.window, int) and self.window >= 1):
            raise ValueError(f"StreamingKV window must be an integer >= 1, got {self.window!r}")

    @property
    def recent(self) -> int:
        """Entries kept in the recent ring between steps (the next query is the window's last)."""
        return self.window - 1

    def meta(self, mask2d: torch.Tensor | None, batch: int, total: int, device) -> "StreamingMeta":
        """Per-step facts about every slot ``< total`` of every row, from the 2-D padding mask."""
        if mask2d is None:
            real = torch.ones(batch, total, dtype=torch.bool, device=device)
        else:
            if tuple(mask2d.shape) != (batch, total):
                raise KinjectError(f"StreamingKV: the 2-D attention mask has shape {tuple(mask2d.shape)}, expected "
                                   f"({batch}, {total}) (rows, cached + new tokens)")
            real = mask2d.to(device=device, dtype=torch.bool)
        sinkflag = real & (real.long().cumsum(-1) <= self.sink)                      # [B, T+q]
        pos = torch.arange(total, device=device)
        cand = torch.where(sinkflag, pos, torch.full_like(pos, _FAR)).sort(-1).values  # [B, T+q]
        sink_abs = torch.full((batch, self.sink), _FAR, dtype=torch.long, device=device)
        n = min(self.sink, total)
        sink_abs[:, :n] = cand[:, :n]                                                   # [B, sink]
        return StreamingMeta(real, sinkflag, sink_abs)

    def attention_mask(self, meta: "StreamingMeta", rows: slice, seen: int, count: int, q: int, *,
                       sliding_window: int | None = None) -> torch.Tensor:
        """Boolean ``[b, 1, q, sink + count + q]`` mask for one micro-batch whose keys are laid out as
        ``[sinks | recent ring (slots seen-count .. seen-1) | new (slots seen .. seen+q-1)]``."""
        dev = meta.real.device
        real, sf = meta.real[rows], meta.sinkflag[rows]                                 # [b, T+q]
        b = real.shape[0]
        sink_abs = meta.sink_abs[rows]                                                  # [b, S]
        rec = torch.arange(seen - count, seen, device=dev)                              # [count]
        new = torch.arange(seen, seen + q, device=dev)                                  # [q]
        key_abs = torch.cat([sink_abs, rec.expand(b, -1), new.expand(b, -1)], 1)        # [b, K]
        ok = torch.cat([sink_abs < seen,                          # sinks stored before this step
                        real[:, rec] & ~sf[:, rec],               # ring copies of sinks are duplicates
                        real[:, new]], 1)                                               # [b, K]
        is_sink = torch.cat([torch.ones_like(sink_abs, dtype=torch.bool),
                             torch.zeros(b, count, dtype=torch.bool, device=dev), sf[:, new]], 1)
        t = new[None, :, None]                                                          # [1, q, 1]
        k = key_abs[:, None, :]                                                         # [b, 1, K]
        allowed = ok[:, None, :] & (k <= t) & (is_sink[:, None, :] | (k > t - self.window))
        if sliding_window is not None:
            allowed &= k > t - sliding_window
        return allowed[:, None]                                                         # [b, 1, q, K]

    def absorb_sinks(self, meta: "StreamingMeta", rows: slice, seen: int, q: int,
                     sinks: torch.Tensor, new: torch.Tensor) -> None:
        """Copy this step's new entries that are sinks into ``sinks`` (``[S, b, ...]``), in place.
        ``new``: ``[q, b, ...]``, the entries of slots ``seen .. seen+q-1``."""
        sink_abs = meta.sink_abs[rows]                                                  # [b, S]
        b, s = sink_abs.shape
        if s == 0:
            return
        take = (sink_abs >= seen) & (sink_abs < seen + q)                               # [b, S]
        idx = (sink_abs - seen).clamp(0, q - 1)                                         # [b, S]
        picked = new[idx, torch.arange(b, device=idx.device)[:, None]].transpose(0, 1)  # [S, b, ...]
        keep = take.t().reshape(s, b, *([1] * (new.dim() - 2)))
        sinks.copy_(torch.where(keep, picked, sinks))


@dataclass
class StreamingMeta:
    real: torch.Tensor       # [B, T+q] bool: slot holds a real token
    sinkflag: torch.Tensor   # [B, T+q] bool: slot is one of the row's first `sink` real tokens
    sink_abs: torch.Tensor   # [B, sink] long: slots of the sinks, _FAR where none (yet)


@dataclass(frozen=True)
class KVSpec:
    """Where one layer's KV lives and which policy it follows."""

    tier: Tier = "device"
    streaming: StreamingKV | None = None

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"KV tier must be one of {', '.join(TIERS)}, got {self.tier!r}")


def parse_kv_cache(value: Any) -> KVSpec:
    """An operator's ``kv_cache`` kwarg -> :class:`KVSpec`: ``"host"``, or a mapping
    ``{tier: host, policy: full|streaming, sink: 4, window: 1024}``."""
    if isinstance(value, str):
        return KVSpec(tier=value)
    if not isinstance(value, dict):
        raise ValueError(f"kv_cache must be a tier name or a mapping, got {value!r}")
    known = {"tier", "policy", "sink", "window"}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"kv_cache: unknown key {unknown[0]!r}; keys are {', '.join(sorted(known))}")
    policy = value.get("policy", "full")
    if policy not in ("full", "streaming"):
        raise ValueError(f"kv_cache.policy must be 'full' or 'streaming', got {policy!r}")
    if policy == "full" and ({"sink", "window"} & set(value)):
        raise ValueError("kv_cache: 'sink' and 'window' need policy: streaming")
    streaming = None
    if policy == "streaming":
        streaming = StreamingKV(**{k: value[k] for k in ("sink", "window") if k in value})
    return KVSpec(tier=value.get("tier", "host"), streaming=streaming)


# ---------------------------------------------------------------------------------------- accounting


class KVStats:
    """Device bytes of KV held by kinject for offloaded tiers (working buffers + outgoing entries),
    and transfer counters. Thread-safe: stores land on engine threads."""

    def __init__(self):
        self._lock = threading.Lock()
        self.resident = 0
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.peak = self.resident
            self.counts = {"loads": 0, "load_bytes": 0, "stores": 0, "store_bytes": 0, "micro_batches": 0,
                           "prefetch_hits": 0, "prefetch_stale": 0, "store_waits": 0, "load_stalls": 0}

    def hold(self, nbytes: int) -> None:
        with self._lock:
            self.resident += nbytes
            self.peak = max(self.peak, self.resident)

    def free(self, nbytes: int) -> None:
        with self._lock:
            self.resident -= nbytes

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def summary(self) -> dict:
        with self._lock:
            return {"resident": self.resident, "peak": self.peak, **self.counts}


# ---------------------------------------------------------------------------------------- storage


def _ring(start: int, n: int, cap: int) -> list[tuple[int, int]]:
    """Index ranges of ``n`` consecutive ring slots from ``start`` (at most two)."""
    if n <= 0:
        return []
    first = min(n, cap - start)
    out = [(start, start + first)]
    if n > first:
        out.append((0, n - first))
    return out


class KVChunk:
    """One micro-batch's rows of one layer: its stored entries (``ring``, ``[cap, b, ...]`` per
    part), its sinks (``[S, b, ...]``, streaming) and its last store (loads wait for it)."""

    def __init__(self, rows: slice):
        self.rows = rows
        self.size = rows.stop - rows.start
        self.ring: list[torch.Tensor] | None = None
        self.sinks: list[torch.Tensor] | None = None
        self.last_store: "TransferHandle | None" = None

    def __repr__(self) -> str:
        return f"KVChunk(rows={self.rows.start}:{self.rows.stop})"


class _Work:
    """A micro-batch's device working buffers ``[S + count + q, b, ...]`` per part, for one step."""

    __slots__ = ("j", "chunk", "past", "q", "stamp", "parts", "handle", "held", "fresh")

    def __init__(self, j: int, chunk: KVChunk, past: int, q: int, stamp: tuple):
        self.j, self.chunk, self.past, self.q, self.stamp = j, chunk, past, q, stamp
        self.parts: list[torch.Tensor] | None = None
        self.handle: "TransferHandle | None" = None
        self.held = 0                     # bytes counted in KVStats for these buffers
        self.fresh = False                # nothing stored yet: buffers are made by ``update``


class KVLayer(CacheLayerMixin):
    """One decoder layer's KV for all rows, chunked by micro-batch, in ``spec.tier``."""

    is_compileable = False
    supports_early_init = False

    def __init__(self, cache: "KVCache", idx: int, spec: KVSpec, sliding_window: int | None = None):
        super().__init__()
        self._cache = weakref.ref(cache)      # no reference cycle: disk files go with the cache
        self.idx = idx
        self.spec = spec
        self.is_sliding = sliding_window is not None
        self.sliding_window = sliding_window
        self.streaming = None if self.is_sliding else spec.streaming
        self.is_croppable = not (self.is_sliding or self.streaming)
        self.sink_len = self.streaming.sink if self.streaming else 0
        # ring capacity: fixed for sliding / streaming layers, growing (linear, head 0) for full ones
        self.fixed_cap = (sliding_window - 1 if self.is_sliding else
                          self.streaming.recent if self.streaming else None)
        self.cap = self.fixed_cap or 0
        self.seen = 0          # tokens processed (cumulative, like DynamicSlidingWindowLayer)
        self.count = 0         # recent entries stored: slots seen-count .. seen-1
        self.head = 0          # ring index of the oldest one
        self.steps = 0         # forward steps since reset (sinks may still change while < sink)
        self.chunks: list[KVChunk] = []
        self.shapes: list[tuple[tuple, torch.dtype]] | None = None   # per part: per-token shape, dtype
        self.prefetched: dict[int, _Work] = {}

    @property
    def cache(self) -> "KVCache":
        return self._cache()

    def __repr__(self) -> str:
        kind = "sliding" if self.is_sliding else "streaming" if self.streaming else "full"
        return f"KVLayer({self.idx}, {self.spec.tier}, {kind}, seen={self.seen})"

    # -- transformers' layer API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return self.sliding_window if self.is_sliding else -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.streaming:                 # the operator builds these layers' masks itself
            return self.seen + query_length, 0
        return self.count + query_length, self.seen - self.count

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Whole-batch update (a layer whose attention is not an ``OffloadedAttention``): every
        chunk in turn, synchronously; returns the full KV of all rows."""
        if self.streaming:
            raise KinjectError(f"layer {self.idx}: StreamingKV needs OffloadedAttention (it builds the mask)")
        q, b = key_states.shape[-2], key_states.shape[0]
        self.begin(q, b)
        keys, values = [], []
        for j, chunk in enumerate(self.chunks):
            work = self.acquire(self.load(j, q))
            k, v = MicroBatchView(self, work).update(key_states[chunk.rows], value_states[chunk.rows], self.idx)
            keys.append(k)
            values.append(v)
            self.commit(work)
        self.end_step(q)
        return torch.cat(keys), torch.cat(values)

    def reset(self) -> None:
        self._settle()
        self.chunks, self.shapes = [], None
        self.seen = self.count = self.head = self.steps = 0
        self.cap = self.fixed_cap or 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:           # legacy: the size to keep
            tokens_to_remove = tokens_to_remove - self.seen
        n = -tokens_to_remove
        if n <= 0:
            return
        if self.count < self.seen:
            raise KinjectError(f"layer {self.idx}: cannot crop {n} tokens, older entries were already evicted "
                               f"({'sliding window' if self.is_sliding else 'StreamingKV'})")
        n = min(n, self.seen)
        self.count -= n
        self.seen -= n

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise KinjectError("reorder rows through the KVCache (it re-chunks every layer), not one KVLayer")

    # -- the micro-batch protocol
    def begin(self, q: int, batch: int) -> None:
        """Start a step of ``q`` tokens for ``batch`` rows: chunks exist, linear storage fits."""
        rows = self.cache.chunk_rows(batch)
        if not self.chunks or (self.seen == 0 and self.chunks[0].ring is None):
            for w in self.prefetched.values():
                self._drop(w)
            self.prefetched.clear()
            self.chunks = [KVChunk(r) for r in rows]
        elif [c.rows for c in self.chunks] != rows:
            raise KinjectError(f"layer {self.idx}: batch changed from {self.chunks[-1].rows.stop} rows to {batch} "
                               "mid-generation (use batch_select_indices / reorder_cache)")
        if self.fixed_cap is None:
            need = self.count + q
            if self.chunks[0].ring is None:
                self.cap = max(self.cache.capacity or 0, need)
            elif need > self.cap:
                self._grow(max(2 * self.cap, need))

    def stamp(self, q: int) -> tuple:
        return (self.seen, q, self.cache.generation)

    def load(self, j: int, q: int) -> _Work:
        """Chunk ``j``'s past on the device (a prefetched load if one matches, else issued now)."""
        w = self.prefetched.pop(j, None)
        if w is not None:
            if w.stamp == self.stamp(q) and w.chunk is self.chunks[j]:
                self.cache.stats.count("prefetch_hits")
                return w
            self.cache.stats.count("prefetch_stale")
            self._drop(w)
        return self._issue(j, q)

    def prefetch(self, j: int, q: int) -> None:
        """Issue chunk ``j``'s load for a step of ``q`` tokens ahead of :meth:`load` (next layer)."""
        if j >= len(self.chunks) or j in self.prefetched or self.spec.tier == "device":
            return
        self.prefetched[j] = self._issue(j, q)

    def acquire(self, w: _Work) -> _Work:
        """Wait (by event on CUDA) until ``w``'s buffers have landed."""
        if w.handle is not None:
            h, w.handle = w.handle, None
            if not h.done():
                self.cache.stats.count("load_stalls")
                tracer = self.cache.tracer
                if tracer is not None:
                    with tracer.span("stall", f"wait kv L{self.idx} mb{w.j}", kind="wait", layer=self.idx):
                        w.parts = h.wait()
                else:
                    w.parts = h.wait()
            else:
                w.parts = h.wait()
        return w

    def _issue(self, j: int, q: int) -> _Work:
        chunk = self.chunks[j]
        w = _Work(j, chunk, self.sink_len + self.count, q, self.stamp(q))
        if chunk.ring is None and chunk.sinks is None:
            w.fresh = True                 # first step: the buffers are made by update()
            return w
        if self.spec.tier == "device":
            w.parts = self._device_window(chunk, w)
            return w
        segs = self._read_segments(chunk)
        dev, disk = self.cache.device, self.spec.tier == "disk"
        pin = disk and dev.type == "cuda"
        last, shapes, size, total = chunk.last_store, self.shapes, chunk.size, w.past + q

        def fn():
            if last is not None:
                last.wait()                # stream wait (CUDA) / worker wait (CPU) on the previous store
            out = []
            for (shape, dtype), part in zip(shapes, segs):
                buf = torch.empty((total, size, *shape), dtype=dtype, device=dev)
                for a, src in part:
                    buf[a:a + src.shape[0]].copy_(src.pin_memory() if pin else src, non_blocking=True)
                out.append(buf)
            return out

        nbytes = w.past * self.row_bytes(chunk)
        w.held = total * self.row_bytes(chunk)
        self.cache.stats.hold(w.held)
        self.cache.stats.count("loads")
        self.cache.stats.count("load_bytes", nbytes)
        w.handle = self.cache.transfer.submit("kv_load", fn, label=f"kv L{self.idx} mb{j}", nbytes=nbytes,
                                              tier=self.spec.tier, layer=self.idx)
        return w

    def _read_segments(self, chunk: KVChunk) -> list[list[tuple[int, torch.Tensor]]]:
        """Per part: (buffer offset, stored slice) in slot order: sinks, then the ring from its head."""
        out = []
        for p in range(len(self.shapes)):
            segs = [(0, chunk.sinks[p])] if self.sink_len else []
            at = self.sink_len
            for a, b in _ring(self.head, self.count, self.cap):
                segs.append((at, chunk.ring[p][a:b]))
                at += b - a
            out.append(segs)
        return out

    def _device_window(self, chunk: KVChunk, w: _Work) -> list[torch.Tensor]:
        """Device tier: a linear store is its own working buffer (appended in place); a ring is
        gathered in slot order into a new buffer."""
        if self.fixed_cap is None:
            return chunk.ring
        out = []
        for (shape, dtype), part in zip(self.shapes, self._read_segments(chunk)):
            buf = torch.empty((w.past + w.q, chunk.size, *shape), dtype=dtype, device=self.cache.device)
            for a, src in part:
                buf[a:a + src.shape[0]].copy_(src)
            out.append(buf)
        w.held = (w.past + w.q) * self.row_bytes(chunk)
        self.cache.stats.hold(w.held)
        return out

    def commit(self, w: _Work) -> None:
        """After the attention of chunk ``w.j``: sinks absorbed, new entries stored to the tier."""
        stats = self.cache.stats
        stats.count("micro_batches")
        if w.parts is None:                # the attention never called update (nothing to keep)
            self._drop(w)
            return
        chunk, q, past, parts = w.chunk, w.q, w.past, w.parts
        S = self.sink_len
        sinks_changed = bool(S) and self.steps < S
        if sinks_changed:
            meta = self.cache.meta(self.seen, q)
            for p in parts:
                self.streaming.absorb_sinks(meta, chunk.rows, self.seen, q, p[:S], p[past:past + q])
        if chunk.ring is None:
            self._allocate(chunk)
        m = q if self.fixed_cap is None else min(q, self.cap)
        writes = []                        # (stored slice, device slice)
        for p, part in enumerate(parts):
            src0 = past + q - m
            for a, b in _ring((self.head + self.count) % self.cap if self.cap else 0, m, self.cap):
                writes.append((chunk.ring[p][a:b], part[src0:src0 + b - a]))
                src0 += b - a
            if sinks_changed:
                writes.append((chunk.sinks[p], part[:S]))
        w.parts = None
        if self.spec.tier == "device":
            for dst, src in writes:
                if dst.data_ptr() != src.data_ptr():
                    dst.copy_(src)
            stats.free(w.held)
            return
        prev = self.cache.last_store
        if prev is not None and not prev.done():
            stats.count("store_waits")
            prev.wait(host=True)           # backpressure: one store in flight per cache
        if w.fresh:                        # the buffer holds only this step's entries: store from it
            out_bytes = w.held
        else:                              # keep only the new entries; the working buffer goes now
            writes = [(dst, src.clone()) for dst, src in writes]
            out_bytes = sum(src.numel() * src.element_size() for _, src in writes)
            stats.hold(out_bytes)
            stats.free(w.held)
        w.held = 0
        self._store(chunk, writes, out_bytes)

    def _store(self, chunk: KVChunk, writes: list, out_bytes: int) -> None:
        stats, dev = self.cache.stats, self.cache.device
        disk_cuda = self.spec.tier == "disk" and dev.type == "cuda"
        nbytes = sum(src.numel() * src.element_size() for _, src in writes)

        def fn():
            staged = []
            for dst, src in writes:
                if disk_cuda:              # via pinned staging, then into the file-backed tensor
                    tmp = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
                    tmp.copy_(src, non_blocking=True)
                    staged.append((dst, tmp))
                else:
                    dst.copy_(src, non_blocking=True)
                if src.is_cuda:
                    src.record_stream(torch.cuda.current_stream(src.device))
            if staged:
                torch.cuda.current_stream(dev).synchronize()   # this channel's stream only (worker thread)
                for dst, tmp in staged:
                    dst.copy_(tmp)

        handle = self.cache.transfer.submit("kv_store", fn, label=f"kv L{self.idx} rows {chunk.rows.start}:"
                                            f"{chunk.rows.stop}", nbytes=nbytes, tier="device", layer=self.idx,
                                            wait_current=True)
        stats.count("stores")
        stats.count("store_bytes", nbytes)
        handle.add_done_callback(lambda h, n=out_bytes: stats.free(n))
        chunk.last_store = self.cache.last_store = handle

    def end_step(self, q: int) -> None:
        """All chunks committed: advance the ring and the token count."""
        if self.fixed_cap is None:
            self.count += q
        elif self.cap:
            n = self.count + min(q, self.cap)
            if n > self.cap:
                self.head = (self.head + n - self.cap) % self.cap
                n = self.cap
            self.count = n
        self.seen += q
        self.steps += 1

    def abort(self, works) -> None:
        """A step failed midway: forget buffers (accounting) so the cache can be dropped cleanly."""
        for w in works:
            if w is not None:
                self._drop(w)
        for w in list(self.prefetched.values()):
            self._drop(w)
        self.prefetched.clear()

    def _drop(self, w: _Work) -> None:
        if w.held:
            self.cache.stats.free(w.held)
            w.held = 0
        w.parts = w.handle = None

    # -- storage
    def row_bytes(self, chunk: KVChunk) -> int:
        """Bytes of one token of all parts for ``chunk``'s rows."""
        per = 0
        for shape, dtype in self.shapes:
            n = dtype.itemsize
            for s in shape:
                n *= s
            per += n
        return per * chunk.size

    def _allocate(self, chunk: KVChunk) -> None:
        j = self.chunks.index(chunk)
        chunk.ring = [self.cache.alloc((self.cap, chunk.size, *shape), dtype, self.spec.tier,
                                       f"L{self.idx}_c{j}_p{p}_ring") for p, (shape, dtype) in enumerate(self.shapes)]
        if self.sink_len:
            chunk.sinks = [self.cache.alloc((self.sink_len, chunk.size, *shape), dtype, self.spec.tier,
                                            f"L{self.idx}_c{j}_p{p}_sinks", zero=True)
                           for p, (shape, dtype) in enumerate(self.shapes)]

    def _settle(self) -> None:
        """Wait for every store of this layer (rare paths: growth, row selection, reset)."""
        for c in self.chunks:
            if c.last_store is not None:
                c.last_store.wait(host=True)
        for w in list(self.prefetched.values()):
            self._drop(w)
        self.prefetched.clear()

    def _grow(self, cap: int) -> None:
        self._settle()
        for j, c in enumerate(self.chunks):
            new = []
            for p, old in enumerate(c.ring):
                t = self.cache.alloc((cap, *old.shape[1:]), old.dtype, self.spec.tier, f"L{self.idx}_c{j}_p{p}_ring")
                t[:self.count].copy_(old[:self.count])
                new.append(t)
            c.ring = new
        self.cap = cap

    def ordered(self) -> list[torch.Tensor] | None:
        """Per part, every row's stored entries in slot order, ``[S + count, B, ...]`` (settles stores)."""
        if not self.chunks or self.chunks[0].ring is None:
            return None
        self._settle()
        out = []
        for p in range(len(self.shapes)):
            cols = []
            for c in self.chunks:
                segs = ([c.sinks[p]] if self.sink_len else []) + \
                       [c.ring[p][a:b] for a, b in _ring(self.head, self.count, self.cap)]
                cols.append(torch.cat(segs) if segs else c.ring[p][:0])
            out.append(torch.cat(cols, 1))
        return out

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep / reorder / repeat rows (beam search, contrastive search, ...): rebuild the chunks."""
        data = self.ordered()
        rows = self.cache.rows_after_select
        if data is None:
            self.chunks = [KVChunk(r) for r in rows] if rows else []
            return
        data = [d.index_select(1, index.to(d.device)) for d in data]
        if [c.rows for c in self.chunks] != rows:          # same chunks (beam search): storage reused
            self.chunks = [KVChunk(r) for r in rows]
            if self.fixed_cap is None:
                self.cap = max(self.cap, self.count)
        for c in self.chunks:
            if c.ring is None:
                self._allocate(c)
            for p, d in enumerate(data):
                if self.sink_len:
                    c.sinks[p].copy_(d[:self.sink_len, c.rows])
                c.ring[p][:self.count].copy_(d[self.sink_len:, c.rows])
        self.head = 0

    def stored_bytes(self) -> int:
        n = 0
        for c in self.chunks:
            for t in (c.ring or []) + (c.sinks or []):
                n += t.numel() * t.element_size()
        return n


class MicroBatchView:
    """What the wrapped attention module gets as ``past_key_values`` for one micro-batch:
    ``update`` appends that micro-batch's new entries and returns its full KV."""

    def __init__(self, layer: KVLayer, work: _Work):
        self.layer = layer
        self.work = work

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layer.seen

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int | None = None,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        layer, w = self.layer, self.work
        if layer_idx is not None and layer_idx != layer.idx:
            raise KinjectError(f"micro-batch cache view of layer {layer.idx} updated for layer {layer_idx}")
        q, b = key_states.shape[-2], key_states.shape[0]
        if q != w.q or b != w.chunk.size:
            raise KinjectError(f"layer {layer.idx}: update with {b} rows x {q} tokens, expected "
                               f"{w.chunk.size} x {w.q}")
        news = (key_states.permute(2, 0, 1, 3), value_states.permute(2, 0, 1, 3))      # [q, b, H, D]
        if layer.shapes is None:
            layer.lazy_initialization(key_states, value_states)
            layer.shapes = [(tuple(x.shape[2:]), x.dtype) for x in news]
        if w.parts is None:                # first step: [sinks (zero) | new]
            w.parts = []
            for x in news:
                buf = torch.empty((w.past + q, *x.shape[1:]), dtype=x.dtype, device=x.device)
                buf[:w.past].zero_()
                w.parts.append(buf)
            w.held = (w.past + q) * layer.row_bytes(w.chunk)
            if layer.spec.tier != "device":
                layer.cache.stats.hold(w.held)
            else:
                w.held = 0
        for buf, x in zip(w.parts, news):
            buf[w.past:w.past + q].copy_(x)
        k, v = (buf[:w.past + q].permute(1, 2, 0, 3) for buf in w.parts)              # [b, H, S, D]
        return k, v


# ---------------------------------------------------------------------------------------- the cache


class KVCache(Cache):
    """kinject's cache for ``generate``: one :class:`KVLayer` per decoder layer.

    ``specs(layer_idx)`` gives each layer's :class:`KVSpec` (the operators' ``kv_cache``; layers
    without an ``OffloadedAttention`` get ``device``). ``micro_batch_size`` fixes the chunks
    (None: one chunk). ``capacity``: tokens to reserve per row for full layers (``generate``'s
    ``max_length - 1``; grows if exceeded). Sliding layers are read from the model config exactly
    as ``DynamicCache(config=...)`` reads them.
    """

    def __init__(self, config, *, specs: Callable[[int], KVSpec] | None = None, device: torch.device | str = "cpu",
                 transfer: "TransferEngine | None" = None, stats: KVStats | None = None,
                 micro_batch_size: int | None = None, capacity: int | None = None,
                 offload_dir: str | os.PathLike | None = None, tracer: "Tracer | None" = None):
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        reference = DynamicCache(config=text)            # transformers' own reading of the layer types
        specs = specs or (lambda i: KVSpec("device"))
        layers = []
        for i, ref in enumerate(reference.layers):
            if type(ref).__name__ not in ("DynamicLayer", "DynamicSlidingWindowLayer"):
                raise KinjectError(f"KVCache: layer {i} is a {type(ref).__name__}; only full and sliding "
                                   "attention layers are supported")
            window = getattr(ref, "sliding_window", None) if getattr(ref, "is_sliding", False) else None
            layers.append(KVLayer(self, i, specs(i), window))
        super().__init__(layers=layers)
        self.device = torch.device(device)
        if any(layer.spec.tier != "device" for layer in layers) and transfer is None:
            raise KinjectError("KVCache: offloaded KV tiers need a transfer engine")
        self.transfer = transfer
        self.stats = stats or KVStats()
        self.tracer = tracer
        self.micro_batch_size = micro_batch_size
        self.capacity = capacity
        self.generation = next(_ids)       # distinguishes prefetch stamps of different caches
        self.last_store: "TransferHandle | None" = None   # newest store of any layer (backpressure)
        self.rows: list[slice] | None = None
        self.rows_after_select: list[slice] | None = None
        self._mask2d: torch.Tensor | None = None
        self._meta: tuple | None = None
        self._dir: Path | None = None
        self._offload_dir = offload_dir
        self._finalizer = None

    def __repr__(self) -> str:
        return f"KVCache(rows={self.batch_size_rows}, micro_batch_size={self.micro_batch_size}, layers={self.layers})"

    @property
    def batch_size_rows(self) -> int:
        return self.rows[-1].stop if self.rows else 0

    def chunk_rows(self, batch: int) -> list[slice]:
        """The row slices of the micro-batches (fixed at the first step)."""
        if self.rows is None or (self.batch_size_rows != batch and not any(layer.seen for layer in self.layers)):
            bs = self.micro_batch_size or batch
            self.rows = [slice(i, min(i + bs, batch)) for i in range(0, batch, bs)]
        return self.rows

    # -- model-level hooks
    def begin_step(self, attention_mask: torch.Tensor | None) -> None:
        """Called before each model forward (``generate``'s 2-D padding mask, for StreamingKV)."""
        self._mask2d = attention_mask if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 \
            else None
        self._meta = None

    def meta(self, seen: int, q: int) -> StreamingMeta:
        key = (seen, q)
        if self._meta is None or self._meta[0] != key:
            policy = next(layer.streaming for layer in self.layers if layer.streaming)
            self._meta = (key, policy.meta(self._mask2d, self.batch_size_rows, seen + q, self._mask_device()))
        return self._meta[1]

    def _mask_device(self):
        return self._mask2d.device if self._mask2d is not None else self.device

    # -- transformers' cache API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states)

    def _select(self, index: torch.Tensor) -> None:
        index = index.long().cpu()
        batch = int(index.numel())
        bs = self.micro_batch_size or batch
        self.rows_after_select = [slice(i, min(i + bs, batch)) for i in range(0, batch, bs)]
        for layer in self.layers:
            layer.select_rows(index)
        self.rows = self.rows_after_select
        self.rows_after_select = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.rows:
            self._select(torch.arange(self.batch_size_rows).repeat_interleave(repeats))

    # -- storage
    def alloc(self, shape: tuple, dtype: torch.dtype, tier: str, name: str, *, zero: bool = False) -> torch.Tensor:
        """Storage for one chunk part in ``tier``: device memory, (pinned) host memory, or a
        file-backed tensor under ``offload_dir``."""
        if tier == "device":
            return (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=self.device)
        if tier == "host":
            pin = self.device.type == "cuda"
            return (torch.zeros if zero else torch.empty)(shape, dtype=dtype, pin_memory=pin)
        numel = 1
        for s in shape:
            numel *= s
        path = self._disk_dir() / f"{name}_{next(_ids)}.bin"
        t = torch.from_file(str(path), shared=True, size=max(numel, 1), dtype=dtype)    # zero-filled
        return t[:numel].view(shape)

    def _disk_dir(self) -> Path:
        if self._dir is None:
            root = Path(self._offload_dir).expanduser() if self._offload_dir else Path(tempfile.gettempdir())
            root.mkdir(parents=True, exist_ok=True)
            self._dir = Path(tempfile.mkdtemp(prefix=f"kv-{os.getpid()}-", dir=root))
            self._finalizer = weakref.finalize(self, shutil.rmtree, str(self._dir), True)
        return self._dir

    def stored_bytes(self) -> dict[str, int]:
        """Bytes of stored KV per tier."""
        out = dict.fromkeys(TIERS, 0)
        for layer in self.layers:
            out[layer.spec.tier] += layer.stored_bytes()
        return out


# ---------------------------------------------------------------------------------------- generate


class GenerateCache:
    """Makes ``model.generate`` use a :class:`KVCache` when it would build a default one.

    How: an instance attribute ``model._prepare_cache_for_generation`` shadows transformers' method
    (both in 5.17 .. 5.23: ``generate`` calls it once to put a cache in ``model_kwargs``). When the
    caller passed no ``past_key_values``, ``use_cache`` is on and no other ``cache_implementation``
    is asked for, it puts ``make_cache(model, capacity)`` there instead of a ``DynamicCache``;
    otherwise it calls the original. A forward pre-hook hands each step's 2-D padding mask to the
    cache (StreamingKV needs it). :meth:`detach` removes both exactly (a previous instance attribute,
    if any, is put back).
    """

    NAME = "_prepare_cache_for_generation"

    def __init__(self, make_cache: Callable[[Any, int | None], KVCache]):
        self.make_cache = make_cache
        self._saved: dict[int, tuple] = {}

    def attach(self, model) -> None:
        original = getattr(model, self.NAME, None)
        if original is None:
            logger.warning("kinject: this transformers version has no %s; generate keeps its own cache "
                           "(OffloadedAttention then runs whole batches)", self.NAME)
            return
        sig = inspect.signature(original)

        def prepare(*args, **kwargs):
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError:              # a transformers version calling it differently: leave it be
                return original(*args, **kwargs)
            gen = bound.arguments.get("generation_config")
            model_kwargs = bound.arguments.get("model_kwargs")
            if self._wanted(model, gen, model_kwargs):
                capacity = bound.arguments.get("max_cache_length")
                model_kwargs["past_key_values"] = self.make_cache(model, capacity)
                return None
            return original(*args, **kwargs)

        had = self.NAME in model.__dict__
        self._saved[id(model)] = (had, model.__dict__.get(self.NAME))
        model.__dict__[self.NAME] = prepare
        hook = model.register_forward_pre_hook(_begin_step, with_kwargs=True)
        self._saved[id(model)] += (hook,)

    def detach(self, model) -> None:
        saved = self._saved.pop(id(model), None)
        if saved is None:
            return
        had, previous, hook = saved
        hook.remove()
        if had:
            model.__dict__[self.NAME] = previous
        else:
            model.__dict__.pop(self.NAME, None)

    @staticmethod
    def _wanted(model, gen, model_kwargs) -> bool:
        if gen is None or not isinstance(model_kwargs, dict):
            return False
        if model_kwargs.get("past_key_values") is not None or getattr(gen, "use_cache", True) is False:
            return False
        if getattr(gen, "cache_implementation", None) not in (None, "dynamic"):
            return False
        if getattr(model.config, "is_encoder_decoder", False):
            return False
        supports = getattr(model, "_supports_default_dynamic_cache", None)
        return supports() if callable(supports) else True


def _begin_step(module, args, kwargs):
    cache = kwargs.get("past_key_values")
    if isinstance(cache, KVCache):
        cache.begin_step(kwargs.get("attention_mask"))
    return None
