"""One decoder layer's KV, chunked by micro-batch, in a tier (:class:`KVLayer`), and the view the
wrapped attention gets for one micro-batch (:class:`MicroBatchView`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import CacheLayerMixin

from kinject.errors import KinjectError
from kinject.kv.spec import STORES_IN_FLIGHT, KVSpec

if TYPE_CHECKING:
    from kinject.engine.transfer_handles import TransferHandle
    from kinject.kv.arena import KVArena

logger = logging.getLogger(__name__)

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

    __slots__ = ("j", "chunk", "past", "q", "stamp", "parts", "handle", "held", "fresh", "local", "pending", "subs",
                 "reused", "written")

    def __init__(self, j: int, chunk: KVChunk, past: int, q: int, stamp: tuple, subs: list[KVChunk] | None = None):
        self.j, self.chunk, self.past, self.q, self.stamp = j, chunk, past, q, stamp
        self.subs = subs                  # a decode chunk: the micro-batches ``chunk`` spans (one buffer for all)
        self.parts: list[torch.Tensor] | None = None
        self.handle: "TransferHandle | None" = None
        self.held = 0                     # bytes counted in KVStats for these buffers
        self.fresh = False                # nothing stored yet: buffers are made by ``update``
        self.local = False                # host compute: the buffers are the stored KV (or a host window of it)
        self.pending = None               # host compute: the lane's copies of the new entries (HostLane.Pending)
        self.reused: list[torch.Tensor] = []   # working buffers to give back to the cache once committed (CPU)
        self.written = False              # the attention added its entries (``MicroBatchView.update``)


class KVLayer(CacheLayerMixin):
    """One decoder layer's KV for all rows, chunked by micro-batch, in ``spec.tier``."""

    is_compileable = False
    supports_early_init = False

    def __init__(self, arena: "KVArena", idx: int, spec: KVSpec, sliding_window: int | None = None):
        super().__init__()
        self.arena = arena                    # the buffers, traffic and row plan every layer of the cache shares
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
        # served in place like the device tier: the device tier, or the host tier where host memory is the
        # compute memory and nothing crosses a link (a CPU device, no emulated link; set by the cache)
        self.in_place = spec.tier == "device"
        self._head_major: dict[int, tuple[list, list[torch.Tensor]]] = {}   # chunk -> (its store, [b, H, S, D] views)
        self._step_writes = self._step_reads = 0    # this step's micro-batches that added entries / only read
        self._chunked_from: list | None = None      # the arena's row slices the chunks were made from

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
        for j, chunk in self.spans():
            work = self.acquire(self.load(j, q))
            k, v = MicroBatchView(self, work).update(key_states[chunk.rows], value_states[chunk.rows], self.idx)
            keys.append(k)
            values.append(v)
            self.commit(work)
        self.end_step(q)
        return torch.cat(keys), torch.cat(values)

    def reset(self) -> None:
        self._settle()
        self.chunks, self.shapes, self._chunked_from = [], None, None
        self.seen = self.count = self.head = self.steps = 0
        self.cap = self.fixed_cap or 0

    @property
    def keys(self) -> torch.Tensor | None:
        """Every row's stored keys, ``[B, H, S, D]`` in slot order (what ``DynamicLayer.keys`` holds),
        for a module that reads the layer directly instead of calling ``update``: joined from the
        chunks once their stores landed. None before the first step."""
        return self._joined(0)

    @keys.setter
    def keys(self, value) -> None:
        self._refuse_set("keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        """Every row's stored values (:attr:`keys`)."""
        return self._joined(1)

    @values.setter
    def values(self, value) -> None:
        self._refuse_set("values", value)

    def _joined(self, p: int) -> torch.Tensor | None:
        data = self.ordered()
        return None if data is None else data[p].permute(1, 2, 0, 3)

    def _refuse_set(self, name: str, value) -> None:
        if value is not None:              # (transformers' layer constructor sets None)
            raise KinjectError(f"layer {self.idx}: {self.arena.owner} set the cache layer's {name} directly; "
                               "kinject's KV changes only through update, crop, reset and row selection")

    def crop(self, tokens_to_remove: int) -> None:
        """``DynamicLayer.crop``: forget the newest ``-tokens_to_remove`` entries of every row (a
        positive value: the length to keep, the legacy form). One count serves every micro-batch
        chunk and tier, so the next step's loads read the kept entries and its new ones land right
        after them (stores land in order: a store still in flight for a dropped slot is overwritten
        by the later one); prefetched loads of the longer past are dropped. A layer that already
        evicted older entries (a sliding window past its size, StreamingKV) cannot give the cropped
        state back: refused, naming the model. The count may come as a 0-d tensor (transformers 5.17's
        assisted decoding passes ``candidate_length - n_matches`` with ``n_matches`` a tensor): taken
        as an int once here, so the layer's counts stay ints and its slices plain."""
        tokens_to_remove = int(tokens_to_remove)
        if tokens_to_remove > 0:           # legacy: the size to keep
            tokens_to_remove = tokens_to_remove - self.seen
        n = -tokens_to_remove
        if n <= 0:
            return
        if self.count < self.seen:
            raise KinjectError(f"{self.arena.owner}: cache layer {self.idx} cannot crop {n} tokens: its older entries "
                               f"were already evicted ({'sliding window' if self.is_sliding else 'StreamingKV'}); "
                               "generation modes that roll the cache back (assisted / prompt-lookup decoding) need "
                               "full attention layers kept whole")
        n = min(n, self.seen)
        self.count -= n
        self.seen -= n
        for w in self.prefetched.values():
            self._drop(w)
        self.prefetched.clear()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise KinjectError("reorder rows through the KVCache (it re-chunks every layer), not one KVLayer")

    # -- the micro-batch protocol
    def begin(self, q: int, batch: int) -> None:
        """Start a step of ``q`` tokens for ``batch`` rows: chunks exist, linear storage fits."""
        rows = self.arena.chunk_rows(batch)
        if not self.chunks or (self.seen == 0 and self.chunks[0].ring is None):
            for w in self.prefetched.values():
                self._drop(w)
            self.prefetched.clear()
            self._head_major.clear()
            self.chunks = [KVChunk(r) for r in rows]
            self._chunked_from = rows
        elif rows is not self._chunked_from and [c.rows for c in self.chunks] != rows:   # (the same list: checked)
            raise KinjectError(f"layer {self.idx}: batch changed from {self.chunks[-1].rows.stop} rows to {batch} "
                               "mid-generation (use batch_select_indices / reorder_cache)")
        if self.fixed_cap is None:
            need = self.count + q
            if self.chunks[0].ring is None:
                self.cap = max(self.arena.capacity or 0, need)
            elif need > self.cap:
                self._grow(max(2 * self.cap, need))

    def decode_chunk_bytes(self, k: int, rows: int, capacity: int | None) -> int:
        """Device KV this layer needs for decode chunks of ``k`` micro-batches of ``rows`` rows: two
        chunks' working buffers at its max length (``capacity``: the generate's), plus
        :data:`STORES_IN_FLIGHT` micro-batches' new entries (0 before its first step)."""
        if self.shapes is None or not self.chunks:
            return 0
        per_row = self.row_bytes(self.chunks[0]) // self.chunks[0].size     # one token of one sequence
        tokens = self.sink_len + (self.fixed_cap or max(capacity or 0, self.count)) + 1
        return (2 * k * tokens + STORES_IN_FLIGHT) * rows * per_row

    def window_fits(self, q: int) -> bool:
        """Whether a step of ``q`` tokens fits the storage as it is (:meth:`begin` grows it otherwise)."""
        return self.fixed_cap is not None or self.count + q <= self.cap

    def stamp(self, q: int) -> tuple:
        return (self.seen, q, self.arena.generation)

    def span(self, j: int) -> int:
        """Micro-batches the attention runs at once from chunk ``j`` this step: a decode chunk of
        :meth:`KVArena.decode_chunks` (their KV loaded as one buffer) where the layer's KV crosses a
        link and already holds entries (a decode step; a prefill's activations set the micro-batch);
        else 1."""
        if self.in_place or self.spec.compute == "host" or not self.seen or self.arena.window is not None:
            return 1
        k = self.arena.decode_chunks()
        return max(1, min(k, len(self.chunks) - j)) if j % k == 0 else 1

    def spans(self) -> list[tuple[int, KVChunk]]:
        """This step's attention calls: (first chunk, the rows it covers) for each."""
        if len(self.chunks) == 1:          # one micro-batch (batch 1, or no micro_batch_size): one call
            return [(0, self.chunks[0])]
        out, j = [], 0
        while j < len(self.chunks):
            n = self.span(j)
            first, last = self.chunks[j], self.chunks[j + n - 1]
            out.append((j, first if n == 1 else KVChunk(slice(first.rows.start, last.rows.stop))))
            j += n
        return out

    def load(self, j: int, q: int) -> _Work:
        """Chunk ``j``'s past on the device (a prefetched load if one matches, else issued now)."""
        w = self.prefetched.pop(j, None) if self.prefetched else None
        if w is not None:
            if w.stamp == self.stamp(q) and (w.subs or [w.chunk])[0] is self.chunks[j] \
                    and len(w.subs or [w.chunk]) == self.span(j):
                self.arena.stats.count("prefetch_hits")
                return w
            self.arena.stats.count("prefetch_stale")
            self._drop(w)
        return self._issue(j, q)

    def prefetch(self, j: int, q: int) -> None:
        """Issue chunk ``j``'s load for a step of ``q`` tokens ahead of :meth:`load` (next layer);
        nothing to load where the KV is served in place (device tier, host memory the compute
        memory) or read in place by host compute."""
        if self.in_place or self.spec.compute == "host" or j >= len(self.chunks) or j in self.prefetched:
            return
        self.prefetched[j] = self._issue(j, q)

    def acquire(self, w: _Work) -> _Work:
        """Wait (by event on CUDA) until ``w``'s buffers have landed."""
        if w.handle is not None:
            h, w.handle = w.handle, None
            if not h.done():
                self.arena.stats.count("load_stalls")
                tracer = self.arena.tracer
                if tracer is not None:
                    with tracer.span("stall", f"wait kv L{self.idx} mb{w.j}", kind="kv_wait", layer=self.idx):
                        w.parts = h.wait()
                else:
                    w.parts = h.wait()
            else:
                w.parts = h.wait()
        return w

    def computes_in_place(self) -> bool:
        """Whether this step's attention runs on the host against the stored KV (``compute: host``
        once the layer holds entries: every step after the prefill)."""
        return self.spec.compute == "host" and bool(self.chunks) and self.chunks[0].ring is not None

    def local(self, j: int, q: int) -> _Work:
        """Chunk ``j``'s KV where it is stored, for host compute (:meth:`computes_in_place`): a full
        layer's linear store itself (the new entries are appended in place), a ring or sinks gathered
        in slot order into a host window (host memory to host memory; committed back in place). No
        load, no store: the KV never crosses the link."""
        chunk = self.chunks[j]
        if chunk.last_store is not None:   # the prefill's store (computed on the device) has landed
            chunk.last_store.wait(host=True)
            chunk.last_store = None
        w = _Work(j, chunk, self.sink_len + self.count, q, self.stamp(q))
        w.local = True
        w.parts = chunk.ring if self.fixed_cap is None and not self.sink_len else \
            self._window(chunk, w, torch.device("cpu"), pin=self.arena.device.type == "cuda")
        return w

    def _issue(self, j: int, q: int) -> _Work:
        n = self.span(j)
        if n > 1:
            return self._issue_chunk(j, n, q)
        chunk = self.chunks[j]
        w = _Work(j, chunk, self.sink_len + self.count, q, self.stamp(q))
        if chunk.ring is None and chunk.sinks is None:
            w.fresh = True                 # first step: the buffers are made by update()
            return w
        if self.in_place:
            w.parts = self._device_window(chunk, w)
            if w.parts is not chunk.ring:      # (a linear store is its own buffer: nothing more is held)
                w.held = (w.past + w.q) * self.row_bytes(chunk)
                self.arena.stats.hold(w.held)
            return w
        self._submit_load(w, [chunk], f"kv L{self.idx} mb{j}")
        return w

    def _issue_chunk(self, j: int, n: int, q: int) -> _Work:
        """Load micro-batches ``j .. j+n-1`` (a decode chunk) into one device buffer per part,
        ``[past + q, rows, ...]``, each micro-batch's stored entries into its rows: one kv_load,
        the same bytes as their ``n`` loads."""
        subs = self.chunks[j:j + n]
        w = _Work(j, KVChunk(slice(subs[0].rows.start, subs[-1].rows.stop)), self.sink_len + self.count, q,
                  self.stamp(q), subs)
        self._submit_load(w, subs, f"kv L{self.idx} mb{j}-{j + n - 1}")
        return w

    def _submit_load(self, w: _Work, subs: list[KVChunk], label: str) -> None:
        """One kv_load filling ``w``'s device buffers (one per part, ``[past + q, rows of w.chunk, ...]``)
        with each of ``subs``' stored entries in its rows, after each one's last store landed; counted as
        ``len(subs)`` loads of the same bytes."""
        group = w.chunk
        segs = [self._read_segments(c) for c in subs]
        dev, disk = self.arena.device, self.spec.tier == "disk"
        pin = disk and dev.type == "cuda"
        lasts = list({id(c.last_store): c.last_store for c in subs if c.last_store is not None}.values())
        shapes, total = self.shapes, w.past + w.q
        bufs = self._working(w, total, group.size)

        def fn():
            for last in lasts:
                last.wait()                # stream wait (CUDA) / worker wait (CPU) on the previous stores
            out = []
            for p, ((shape, dtype), buf) in enumerate(zip(shapes, bufs)):
                if buf is None:
                    buf = torch.empty((total, group.size, *shape), dtype=dtype, device=dev)
                for c, chunk_segs in zip(subs, segs):
                    rows = slice(c.rows.start - group.rows.start, c.rows.stop - group.rows.start)
                    for a, src in chunk_segs[p]:
                        buf[a:a + src.shape[0], rows].copy_(src.pin_memory() if pin else src, non_blocking=True)
                out.append(buf)
            return out

        nbytes = w.past * self.row_bytes(group)
        w.held = total * self.row_bytes(group)
        self.arena.stats.hold(w.held)
        self.arena.stats.count("loads", len(subs))
        self.arena.stats.count("load_bytes", nbytes)
        w.handle = self.arena.transfer.submit("kv_load", fn, label=label, nbytes=nbytes, tier=self.spec.tier,
                                              layer=self.idx)

    def _working(self, w: _Work, total: int, rows: int) -> list[torch.Tensor | None]:
        """Per part, the buffer ``w``'s load fills (:meth:`KVArena.working`; None: the load allocates it)."""
        bufs = []
        for shape, dtype in self.shapes:
            buf, reused = self.arena.working(total, (rows, *shape), dtype)
            bufs.append(buf)
            if reused is not None:
                w.reused.append(reused)
        return bufs

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
        """Device tier (or a host tier in the compute memory, :attr:`local`): a linear store is its
        own working buffer (appended in place); a ring is
        gathered in slot order into a new buffer."""
        if self.fixed_cap is None:
            return chunk.ring
        return self._window(chunk, w, self.arena.device)

    def _window(self, chunk: KVChunk, w: _Work, device: torch.device, pin: bool = False) -> list[torch.Tensor]:
        """Chunk ``w.j``'s stored entries gathered in slot order (sinks, then the ring from its head)
        into a buffer on ``device`` with room for ``w.q`` new ones, ``[past + q, b, ...]`` per part."""
        out = []
        for (shape, dtype), part in zip(self.shapes, self._read_segments(chunk)):
            buf = torch.empty((w.past + w.q, chunk.size, *shape), dtype=dtype, device=device, pin_memory=pin)
            for a, src in part:
                buf[a:a + src.shape[0]].copy_(src)
            out.append(buf)
        return out

    def head_major(self, w: _Work) -> list[torch.Tensor]:
        """``[b, H, S, D]`` views of ``w``'s seq-major buffers ``[S, b, H, D]`` (what the attention reads
        and writes). Kept for a chunk's own store (a device-tier linear store is its working buffer,
        step after step) until the store is replaced; made anew for a step's own buffers."""
        parts = w.parts
        if parts is not w.chunk.ring:
            return [t.permute(1, 2, 0, 3) for t in parts]
        got = self._head_major.get(w.j)
        if got is None or got[0] is not parts:
            got = self._head_major[w.j] = (parts, [t.permute(1, 2, 0, 3) for t in parts])
        return got[1]

    def view(self, w: _Work) -> "MicroBatchView":
        """What the wrapped attention gets as its cache for chunk ``w.j``."""
        return HostView(self, w) if w.local else MicroBatchView(self, w)

    def commit(self, w: _Work) -> None:
        """After the attention of chunk ``w.j``: sinks absorbed, new entries stored to the tier (a
        decode chunk: :meth:`_commit_chunk`)."""
        if not w.written and w.q:         # the attention read its past and added nothing
            self._commit_read(w)
            return
        self._step_writes += 1
        if w.subs is not None:
            self._commit_chunk(w)
            return
        stats = self.arena.stats
        stats.count("micro_batches")
        if w.parts is None or w.q == 0:    # the attention never called update, or read only (cross-attention)
            self._drop(w)
            return
        chunk, q, past, parts = w.chunk, w.q, w.past, w.parts
        if w.pending is not None:          # host compute: the lane's copies of the new entries have landed
            w.pending.wait()
            w.pending = None
        S = self.sink_len
        if parts is chunk.ring and self.fixed_cap is None and not S:
            w.parts = None                 # a device-tier or host-compute linear store: update() appended in place
            if w.held:
                stats.free(w.held)
            return
        sinks_changed = self._absorb_sinks(chunk, parts, past, q, w.local)
        if chunk.ring is None:
            self._allocate(chunk)
        m = self._stored_entries(q)
        writes = self._writes(chunk, parts, past + q - m, m, [p[:S] for p in parts] if sinks_changed else None)
        w.parts = None
        if self.in_place or w.local:
            for dst, src in writes:
                if dst.data_ptr() != src.data_ptr():
                    dst.copy_(src)
            stats.free(w.held)
            return
        self.arena.wait_for_store_room()
        if w.fresh:                        # the buffer holds only this step's entries: store from it
            out_bytes = w.held
        else:                              # keep only the new entries; the working buffer goes now
            writes = [(dst, src.clone()) for dst, src in writes]
            out_bytes = sum(src.numel() * src.element_size() for _, src in writes)
            stats.hold(out_bytes)
            stats.free(w.held)
            self._give_back(w)
        w.held = 0
        self._store([chunk], chunk.rows, writes, out_bytes)

    def _commit_read(self, w: _Work) -> None:
        """:meth:`commit` of a micro-batch whose attention read its past without adding entries
        (DiffusionGemma's decoder re-forwards a block's positions at every denoising step, reading the
        prefix KV through :class:`PastEntries`): nothing is stored, and :meth:`end_step` does not
        advance the layer -- the working buffer's room for new entries holds nothing."""
        self.arena.stats.count("micro_batches", len(w.subs or [w.chunk]))
        self._step_reads += 1
        self._drop(w)
        self._give_back(w)

    def _commit_chunk(self, w: _Work) -> None:
        """:meth:`commit` of a decode chunk: each micro-batch's new entries (and changed sinks) go to
        its own storage from its rows of the chunk's buffer, the same bytes and the same accounting
        (per micro-batch, in order) as if each had been loaded alone, in one store job: the new
        entries cloned once for the chunk, one transfer and one landing instead of one per
        micro-batch (the per-step bookkeeping a chunk of n micro-batches saves, like its one load)."""
        stats, subs = self.arena.stats, w.subs
        parts, q, past, start = w.parts, w.q, w.past, w.chunk.rows.start
        w.parts, w.held = None, 0
        stats.count("micro_batches", len(subs))
        if parts is None or q == 0:        # the attention never called update: give back every buffer
            stats.free(sum((past + q) * self.row_bytes(c) for c in subs))
            return
        changed = [self._absorb_sinks(c, [t[:, c.rows.start - start:c.rows.stop - start] for t in parts], past, q, False)
                   if self.sink_len else False for c in subs]
        for c in subs:
            if c.ring is None:
                self._allocate(c)
        S, m = self.sink_len, self._stored_entries(q)
        self.arena.wait_for_store_room()
        new = [t[past + q - m:past + q].clone() for t in parts]          # the chunk's new entries, once
        sinks = [t[:S].clone() for t in parts] if any(changed) else None
        del parts
        self._give_back(w)
        writes, out_bytes = [], 0
        for c, sinks_changed in zip(subs, changed):
            rows = slice(c.rows.start - start, c.rows.stop - start)
            writes += self._writes(c, [t[:, rows] for t in new], 0, m,
                                   [t[:, rows] for t in sinks] if sinks_changed else None)
            out = (m + (S if sinks_changed else 0)) * self.row_bytes(c)
            stats.hold(out)
            stats.free((past + q) * self.row_bytes(c))
            out_bytes += out
        self._store(subs, w.chunk.rows, writes, out_bytes)

    def _give_back(self, w: _Work) -> None:
        """``w``'s reused working buffers to the cache: its KV is committed (the new entries cloned)."""
        if w.reused:
            self.arena.give_back(w.reused)
            w.reused = []

    def _absorb_sinks(self, chunk: KVChunk, parts: list[torch.Tensor], past: int, q: int, local: bool) -> bool:
        """StreamingKV's first steps: fold the step into ``chunk``'s sinks in its buffers ``parts``;
        whether the sinks changed (and must be stored)."""
        S = self.sink_len
        if not S or self.steps >= S:
            return False
        meta = self.arena.meta(self.seen, q)
        if local:
            meta = meta.to(parts[0].device)
        for p in parts:
            self.streaming.absorb_sinks(meta, chunk.rows, self.seen, q, p[:S], p[past:past + q])
        return True

    def _stored_entries(self, q: int) -> int:
        """Of a step's ``q`` new entries, how many the storage keeps (a ring keeps at most its capacity)."""
        return q if self.fixed_cap is None else min(q, self.cap)

    def _writes(self, chunk: KVChunk, srcs: list[torch.Tensor], at: int, m: int,
                sinks: list[torch.Tensor] | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(stored slice, source slice) pairs putting ``m`` new entries of ``chunk`` (rows ``at ..`` of
        ``srcs[p]``, per part) into its ring from the slot after its last, then ``sinks[p]`` into its sinks."""
        writes = []
        for p, src in enumerate(srcs):
            src0 = at
            for a, b in _ring((self.head + self.count) % self.cap if self.cap else 0, m, self.cap):
                writes.append((chunk.ring[p][a:b], src[src0:src0 + b - a]))
                src0 += b - a
            if sinks is not None:
                writes.append((chunk.sinks[p], sinks[p]))
        return writes

    def _store(self, chunks: list[KVChunk], rows: slice, writes: list, out_bytes: int) -> None:
        """One ``kv_store`` job of ``writes`` for ``chunks`` (covering ``rows``): each chunk's next
        load waits for it."""
        dev = self.arena.device
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

        handle = self.arena.submit_store(self.idx, rows, fn, nbytes, held=out_bytes, stores=len(chunks))
        for chunk in chunks:
            chunk.last_store = handle

    def end_step(self, q: int) -> None:
        """All chunks committed: advance the ring and the token count. During a prefill by
        micro-batch (``cache.window`` set) the cache advances every layer after the last chunk."""
        if self.arena.window is not None:
            return
        wrote, read = self._step_writes, self._step_reads
        self._step_writes = self._step_reads = 0
        if read:                           # a read-only forward: the layer holds what it held
            if wrote:
                raise KinjectError(f"{self.arena.owner}: cache layer {self.idx}: {wrote} micro-batches added "
                                   f"{q} entries and {read} only read their past in one forward")
            return
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
        self._step_writes = self._step_reads = 0

    def _drop(self, w: _Work) -> None:
        if w.held:
            self.arena.stats.free(w.held)
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
        chunk.ring = [self.arena.alloc((self.cap, chunk.size, *shape), dtype, self.spec.tier,
                                       f"L{self.idx}_c{j}_p{p}_ring") for p, (shape, dtype) in enumerate(self.shapes)]
        if self.sink_len:
            chunk.sinks = [self.arena.alloc((self.sink_len, chunk.size, *shape), dtype, self.spec.tier,
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
        self._head_major.clear()           # (the stores are about to be replaced: no view keeps them alive)

    def _grow(self, cap: int) -> None:
        self._settle()
        for j, c in enumerate(self.chunks):
            new = []
            for p, old in enumerate(c.ring):
                t = self.arena.alloc((cap, *old.shape[1:]), old.dtype, self.spec.tier, f"L{self.idx}_c{j}_p{p}_ring")
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
        rows = self.arena.rows_after_select
        self._chunked_from = None              # (the next begin compares the rows again)
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

    is_compileable = False

    def __init__(self, layer: KVLayer, work: _Work):
        self.layer = layer
        self.work = work

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layer.seen

    @property
    def layers(self) -> dict:
        """``layers[idx].keys / .values``: the micro-batch's past, for a module that reads the cache
        layer instead of updating it (:class:`PastEntries`)."""
        return {self.layer.idx: PastEntries(self)}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int | None = None,
               *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        layer, w = self.layer, self.work
        if layer_idx is not None and layer_idx != layer.idx:
            raise KinjectError(f"micro-batch cache view of layer {layer.idx} updated for layer {layer_idx}")
        q, b = key_states.shape[-2], key_states.shape[0]
        if q != w.q or b != w.chunk.size:
            raise KinjectError(f"layer {layer.idx}: update with {b} rows x {q} tokens, expected "
                               f"{w.chunk.size} x {w.q}")
        w.written = True
        if layer.shapes is None:
            layer.lazy_initialization(key_states, value_states)
            layer.shapes = [(tuple(x.shape[1:2]) + tuple(x.shape[3:]), x.dtype) for x in (key_states, value_states)]
        if w.parts is None:                # first step: [sinks (zero) | new]
            w.parts = []
            for x in (key_states, value_states):
                buf = torch.empty((w.past + q, b, x.shape[1], *x.shape[3:]), dtype=x.dtype, device=x.device)
                buf[:w.past].zero_()
                w.parts.append(buf)
            w.held = (w.past + q) * layer.row_bytes(w.chunk)
            if not layer.in_place:
                layer.arena.stats.hold(w.held)
            else:
                w.held = 0
        end = w.past + q
        keys, values = layer.head_major(w)                                            # [b, H, S, D] each
        self._write(keys, values, key_states, value_states)
        return keys.narrow(2, 0, end), values.narrow(2, 0, end)

    def _write(self, keys: torch.Tensor, values: torch.Tensor, key_states: torch.Tensor,
               value_states: torch.Tensor) -> None:
        """The step's new entries into the micro-batch's buffers (``[b, H, S, D]`` views)."""
        past, q = self.work.past, self.work.q
        keys.narrow(2, past, q).copy_(key_states)        # narrow: one dispatch, no index parsing
        values.narrow(2, past, q).copy_(value_states)


class PastEntries:
    """One micro-batch's stored entries of a layer, ``[b, H, past, D]`` views of its working buffer,
    for a module that reads them and keeps its own new keys / values to itself (DiffusionGemma's
    decoder concatenates the canvas to ``cache.layers[i].keys`` at every denoising step and never
    calls ``update``): a read-only forward, which :meth:`KVLayer.commit` neither stores nor counts
    (docs/architecture.md, "Forwards that rewrite or only read positions")."""

    def __init__(self, view: MicroBatchView):
        self.view = view

    def _part(self, p: int) -> torch.Tensor:
        layer, w = self.view.layer, self.view.work
        if w.parts is None:
            raise KinjectError(f"{layer.arena.owner}: cache layer {layer.idx} read before anything was stored in it")
        return layer.head_major(w)[p].narrow(2, 0, w.past)

    @property
    def keys(self) -> torch.Tensor:
        return self._part(0)

    @property
    def values(self) -> torch.Tensor:
        return self._part(1)

    def get_seq_length(self) -> int:
        return self.view.layer.seen


class HostView(MicroBatchView):
    """The cache view of a micro-batch whose attention runs on the host (``compute: host``):
    ``update`` returns the stored KV in place (host tensors) with the step's new entries queued into
    it on the host lane (:class:`kinject.engine.host_lane.HostLane`: device -> pinned storage,
    ``non_blocking``); whoever reads them on the host waits for the lane first (the host attention
    does, with its query; :meth:`KVLayer.commit` does in any case)."""

    def _write(self, keys, values, key_states, value_states) -> None:
        w = self.work
        past, q = w.past, w.q
        new = [part[past:past + q] for part in w.parts]            # [q, b, H, D] slices of the store
        w.pending = self.layer.arena.host_lane.to_host(
            [key_states.permute(2, 0, 1, 3), value_states.permute(2, 0, 1, 3)], out=new)
