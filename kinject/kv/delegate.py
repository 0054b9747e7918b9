"""Every cache-layer kind kinject does not specialise, served through transformers' own class, one
instance per micro-batch chunk (docs/architecture.md, "Mixed layer kinds").

transformers builds one cache-layer object per decoder layer (``DynamicCache(config=...)``): full and
sliding attention (kinject's :class:`~kinject.kv.layer.KVLayer` serves those), and every other kind
a mixed-attention or sparse-attention family needs -- ``LinearAttentionLayer`` (conv + recurrent states of
Mamba / gated-delta-net / short-conv mixers), the mixed ``LinearAttentionAnd{Full,SlidingWindow}
AttentionLayer``, ``DynamicIndexedLayer`` (DSA indexer keys), a family's own compressed layers
(DeepSeek-V4) ... :class:`DelegatedLayer` serves any of them without knowing them:

* **one object of the family's class per micro-batch chunk** (a copy of the fresh reference layer),
  so each micro-batch sees only its own rows of every state -- conv, recurrent, KV, indexer;
* the wrapped mixer gets, as its cache, a :class:`ChunkView`: a transformers ``Cache`` whose layer
  ``layer_idx`` *is* that chunk's object, so every cache method the family calls
  (``update``, ``update_conv_state``, ``get_recurrent_state``, ``update_indexer``,
  ``layers[i].store_compression_weights`` ...) runs the family's own code on the chunk's rows;
* whole-batch calls (a mixer no rule wrapped, a sibling module such as Inkling's short
  convolutions, ``generate``'s bookkeeping) are split by chunk rows and joined again;
* ``isinstance`` answers as for the reference class (``type(ref).register``), so transformers'
  ``Cache`` methods and mask code classify the layer as they would classify their own.

Tiers. A chunk object's tensors that grow with the context -- keys / values of the attention part,
indexer keys, compressed KV and their buffers: every tensor attribute except the fixed-size
``conv_states`` / ``recurrent_states`` of ``LinearAttentionCacheLayerMixin`` -- live in the layer's
KV tier between steps (host, or a file-backed tensor on disk): loaded on the ``kv_load`` channel
before the chunk's micro-batch (prefetched one chunk ahead, and chunk 0 by the previous layer), and
stored on ``kv_store`` after it. Only tensors the step replaced are stored: one that grew along
one dimension and still starts with what was loaded (these kinds rebuild them by concatenation) is
kept growth-dimension-first in a buffer with room, and only its new entries are stored, as for full
layers; anything else (a sliding window that moved, a drained buffer) is stored whole. The
fixed-size recurrent and conv states stay with the compute, in the chunk objects.

StreamingKV is a policy of full attention layers (:class:`KVLayer`); delegated kinds keep their own
(exact) behaviour.
"""

from __future__ import annotations

import copy
import functools
import logging
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin, LinearAttentionLayer

from kinject.engine.transfer import reading_syncs
from kinject.errors import KinjectError
from kinject.kv.spec import KVSpec

if TYPE_CHECKING:
    from kinject.engine.transfer_handles import TransferHandle
    from kinject.kv.arena import KVArena

logger = logging.getLogger(__name__)

# Instance attributes of transformers' linear-attention mixin: conv / recurrent states (fixed size,
# one per row) and their flags. They stay with the compute; every other tensor is context.
_FIXED = frozenset(vars(LinearAttentionLayer(number_of_states=1)))

Path = tuple[str, Any]          # (attribute, dict key or None)


def _context_tensors(obj) -> list[tuple[Path, torch.Tensor]]:
    """The tensors of a cache-layer object that grow with the context (see module docstring)."""
    out = []
    for name, value in vars(obj).items():
        if name in _FIXED or name.startswith("__"):
            continue
        if isinstance(value, torch.Tensor):
            if value.dim() > 0 and value.numel() > 0:
                out.append(((name, None), value))
        elif isinstance(value, dict):
            for key, t in value.items():
                if isinstance(t, torch.Tensor) and t.dim() > 0 and t.numel() > 0:
                    out.append(((name, key), t))
    return out


def _fixed_tensors(obj) -> list[torch.Tensor]:
    out = []
    for name in _FIXED:
        value = getattr(obj, name, None) if name in vars(obj) else None
        if isinstance(value, dict):
            out += [t for t in value.values() if isinstance(t, torch.Tensor)]
    return out


def _set_path(obj, path: Path, value) -> None:
    name, key = path
    if key is None:
        setattr(obj, name, value)
    else:
        getattr(obj, name)[key] = value


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------------------------------- chunks


class _Part:
    """One micro-batch chunk: its rows, its own object of the family's layer class, the tier copies
    of that object's context tensors (``stored``: path -> view of a flat tier buffer) and its last
    store (loads wait for it)."""

    def __init__(self, rows: slice, obj):
        self.rows = rows
        self.size = rows.stop - rows.start
        self.obj = obj
        self.stored: dict[Path, torch.Tensor] = {}
        self.flat: dict[Path, torch.Tensor] = {}          # path -> flat tier buffer (capacity)
        self.seq: dict[Path, tuple[int, torch.Tensor]] = {}   # path -> (growth dim, [capacity, *rest] buffer)
        self.version = 0                                    # bumped by every commit (prefetch stamps)
        self.last_store: "TransferHandle | None" = None

    def __repr__(self) -> str:
        return f"_Part(rows={self.rows.start}:{self.rows.stop}, {type(self.obj).__name__})"


class _DWork:
    """A chunk's context tensors on the device for one micro-batch."""

    __slots__ = ("j", "part", "stamp", "handle", "loaded", "held")

    def __init__(self, j: int, part: _Part, stamp: tuple):
        self.j, self.part, self.stamp = j, part, stamp
        self.handle: "TransferHandle | None" = None
        self.loaded: dict[Path, torch.Tensor] = {}
        self.held = 0


# ---------------------------------------------------------------------------------------- the layer


class DelegatedLayer:
    """A cache layer of any kind, served by one object of its own class per micro-batch chunk.

    Speaks kinject's micro-batch protocol (``begin / load / prefetch / acquire / view / commit /
    end_step / abort``, as :class:`~kinject.kv.layer.KVLayer`) and transformers' layer protocol for
    whole-batch calls (any method of the reference class: split by rows, run per chunk, joined).
    Build with :func:`delegated_layer`.
    """

    is_compileable = False
    supports_early_init = False
    streaming = None                      # StreamingKV applies to full attention layers only

    def __init__(self, arena: "KVArena", idx: int, spec: KVSpec, reference):
        self.arena = arena                # the buffers, traffic and row plan every layer of the cache shares
        self.idx = idx
        self.spec = spec
        self.template = reference        # a fresh object of the family's class (never updated)
        self.kind = type(reference).__name__
        self.parts: list[_Part] = []
        self.prefetched: dict[int, _DWork] = {}
        self.steps = 0

    @property
    def chunks(self) -> list[_Part]:
        return self.parts

    @property
    def seen(self) -> int:
        """Non-zero once the chunks hold data (forward steps served, or 1 after whole-batch calls)."""
        return self.steps or int(any(p.version or p.stored for p in self.parts))

    def __repr__(self) -> str:
        return f"DelegatedLayer({self.idx}, {self.kind}, {self.spec.tier}, parts={len(self.parts)})"

    # -- transformers' layer protocol: answers from chunk 0 (every chunk has the same lengths)
    def _first(self):
        return self.parts[0].obj if self.parts else self.template

    def get_seq_length(self) -> int:
        return self._first().get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._first().get_mask_sizes(query_length)

    def get_max_length(self) -> int:
        return self._first().get_max_length()

    def reset(self) -> None:
        self._settle()
        self.parts = []
        self.steps = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise KinjectError("reorder rows through the KVCache (it re-chunks every layer), not one layer")

    def __getattr__(self, name: str):
        # Only called for attributes not found normally: the reference class's methods and state.
        if name.startswith("__") or "template" not in self.__dict__:
            raise AttributeError(name)
        value = getattr(self.template, name)
        if callable(value):
            return functools.partial(self._call_split, name)
        if not self.parts:
            return value
        values = [getattr(p.obj, name) for p in self.parts]
        sizes = [p.size for p in self.parts]
        if name in _FIXED and isinstance(values[0], dict) and len(self.parts) > 1:
            return {key: self._shared(name, key, [v.get(key) for v in values]) for key in values[0]}
        if isinstance(values[0], (torch.Tensor, dict)):
            self._wait_stores()            # tier copies being written: read them once landed
        return _join(values, sizes)

    def _shared(self, name: str, key, values: list):
        """All rows of a fixed-size state as one tensor whose row slices *are* the chunks' states, so
        a whole-batch caller that updates it in place (``causal_conv1d_update`` on the conv state
        ``get_conv_state`` returned) updates every chunk."""
        if not all(isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == p.size
                   for t, p in zip(values, self.parts)):
            return _join(values, [p.size for p in self.parts])
        base = values[0]._base
        if base is not None and base.dim() > 0 and base.shape[0] == self.parts[-1].rows.stop and all(
                t._base is base and t.data_ptr() == base[p.rows].data_ptr() and t.shape == base[p.rows].shape
                for t, p in zip(values, self.parts)):
            return base
        whole = torch.cat(values, 0)
        for p in self.parts:
            getattr(p.obj, name)[key] = whole[p.rows]
        return whole

    def _call_split(self, name: str, *args, **kwargs):
        """A whole-batch call of the family's method ``name``: each chunk's rows of every batch-major
        tensor argument go to that chunk's object (loaded from its tier and stored back around the
        call); results are joined along the batch."""
        batch = _batch_of(args, kwargs)
        if batch is None and not self.parts:   # e.g. activate_past_recording: chunks made later copy it
            return getattr(self.template, name)(*args, **kwargs)
        if batch is not None:
            self._ensure_parts(batch)
        total = self.parts[-1].rows.stop
        if batch is not None and batch != total:
            raise KinjectError(f"layer {self.idx} ({self.kind}): {name} called with {batch} rows, the cache has {total}")
        context = self.spec.tier != "device" and _touches_context(type(self.template), name)
        results = []
        for j, part in enumerate(self.parts):
            if context:
                work = self.acquire(self.load(j, 0))
            else:                          # a linear-attention state method: the tier copies stand as they are
                work = _DWork(j, part, ())
                work.loaded = dict(part.stored)
            try:
                a = [_rows(x, part.rows, total) for x in args]
                kw = {k: _rows(v, part.rows, total) for k, v in kwargs.items()}
                results.append(getattr(part.obj, name)(*a, **kw))
            except BaseException:
                self.abort([work])
                raise
            self.commit(work, count=False)
        return _join(results, [p.size for p in self.parts])

    # -- the micro-batch protocol
    def _ensure_parts(self, batch: int) -> None:
        rows = self.arena.chunk_rows(batch)
        if not self.parts or (not self.seen and [p.rows for p in self.parts] != rows):
            self._drop_prefetched()
            self.parts = [_Part(r, copy.deepcopy(self.template)) for r in rows]
        elif [p.rows for p in self.parts] != rows:
            raise KinjectError(f"layer {self.idx}: batch changed from {self.parts[-1].rows.stop} rows to {batch} "
                               "mid-generation (use batch_select_indices / reorder_cache)")

    def begin(self, q: int, batch: int) -> None:
        self._ensure_parts(batch)

    def _stamp(self, part: _Part) -> tuple:
        return (id(part), part.version, self.arena.generation)

    def load(self, j: int, q: int) -> _DWork:
        w = self.prefetched.pop(j, None)
        if w is not None:
            if w.part is self.parts[j] and w.stamp == self._stamp(w.part):
                self.arena.stats.count("prefetch_hits")
                return w
            self.arena.stats.count("prefetch_stale")
            self._drop(w)
        return self._issue(j)

    def prefetch(self, j: int, q: int = 0) -> None:
        if j >= len(self.parts) or j in self.prefetched or self.spec.tier == "device" or not self.parts[j].stored:
            return
        self.prefetched[j] = self._issue(j)

    def _issue(self, j: int) -> _DWork:
        part = self.parts[j]
        w = _DWork(j, part, self._stamp(part))
        if self.spec.tier == "device" or not part.stored:
            return w
        sources: dict[int, torch.Tensor] = {}            # one load per stored tensor (K = V share one)
        for t in part.stored.values():
            sources.setdefault(id(t), t)
        dev, pin = self.arena.device, self.spec.tier == "disk" and self.arena.device.type == "cuda"
        last = part.last_store

        def fn():
            if last is not None:
                last.wait()
            return {k: _device_copy(t, dev, pin) for k, t in sources.items()}

        nbytes = sum(_nbytes(t) for t in sources.values())
        w.held = nbytes
        stats = self.arena.stats
        stats.hold(nbytes)
        stats.count("loads")
        stats.count("load_bytes", nbytes)
        w.handle = self.arena.transfer.submit("kv_load", fn, label=f"kv L{self.idx} mb{j}", nbytes=nbytes,
                                              tier=self.spec.tier, layer=self.idx)
        return w

    def acquire(self, w: _DWork) -> _DWork:
        """Wait for ``w``'s load, then point the chunk object's context tensors at the device copies."""
        if w.handle is not None:
            h, w.handle = w.handle, None
            if not h.done():
                self.arena.stats.count("load_stalls")
            copies = h.wait()
            for path, t in w.part.stored.items():
                dev = copies[id(t)]
                _set_path(w.part.obj, path, dev)
                w.loaded[path] = dev
        return w

    def view(self, w: _DWork) -> "ChunkView":
        """What the wrapped mixer gets as its cache for chunk ``w.j``."""
        return ChunkView(self.arena.layers, self.idx, w.part.obj)

    def commit(self, w: _DWork, *, count: bool = True) -> None:
        """After chunk ``w.j``'s micro-batch: context tensors it replaced go to the tier; those it kept
        point back at their tier copies."""
        stats, part = self.arena.stats, w.part
        if count:
            stats.count("micro_batches")
        if self.spec.tier == "device":
            part.version += 1
            return
        writes: list[tuple[torch.Tensor, torch.Tensor] | _Grown] = []
        placed: dict[int, torch.Tensor] = {}
        current = _context_tensors(part.obj)
        for path, t in current:
            if id(t) in placed:                            # the same tensor under two names (K = V)
                _set_path(part.obj, path, placed[id(t)])
                part.stored[path] = placed[id(t)]
            elif w.loaded.get(path) is t:                  # untouched this step: its tier copy stands
                _set_path(part.obj, path, part.stored[path])
                placed[id(t)] = part.stored[path]
            else:
                dst, parts = self._place(part, path, t, w.loaded.get(path))
                writes += parts
                _set_path(part.obj, path, dst)
                part.stored[path] = placed[id(t)] = dst
        live = {path for path, _ in current}
        dropped = [p for p in part.stored if p not in live]             # dropped by the family (reset ...)
        for path in dropped:
            del part.stored[path]
        if writes or dropped:
            part.version += 1                                           # prefetched loads of the old copies are stale
        out_bytes = sum(_nbytes(_copy(write, assume_same=True)[1]) for write in writes)
        stats.free(w.held)
        w.held = 0
        w.loaded = {}
        if not writes:
            return
        self.arena.wait_for_store_room()
        stats.hold(out_bytes)

        def fn():
            copies = [_copy(write) for write in writes]
            for dst, src in copies:
                dst.copy_(src, non_blocking=True)
                if src.is_cuda:
                    src.record_stream(torch.cuda.current_stream(src.device))
            if any(dst.device.type == "cpu" and src.is_cuda for dst, src in copies):
                torch.cuda.current_stream(src.device).synchronize()

        part.last_store = self.arena.submit_store(self.idx, part.rows, fn, out_bytes, held=out_bytes)

    def _place(self, part: _Part, path: Path, t: torch.Tensor, old: torch.Tensor | None):
        """Where ``t`` (the new value of ``path``) goes in the tier, and the copies that put it there.

        A tensor that grew along one dimension from what was loaded (``old``, the same values as its
        tier copy) and still starts with exactly those values -- keys / values of an attention part,
        indexer keys, compressed KV, all rebuilt by concatenation -- is kept with that dimension
        leading in a buffer with room to grow, and only its new entries are stored. Anything else
        (a sliding window that moved, a buffer that drained, a first step) is stored whole. Whether a
        grown tensor kept its start is left to the store job (:class:`_Grown`): both ways it lands in
        the same buffer."""
        d = _growth_dim(old, t)
        seq = part.seq.get(path)
        if d is not None and seq is not None and seq[0] == d and part.stored.get(path) is not None:
            n0, n1 = old.shape[d], t.shape[d]
            buf = self._seq_buffer(part, path, d, t, n1, keep=n0)
            new, whole = (buf[n0:n1], t.narrow(d, n0, n1 - n0).movedim(d, 0)), (buf[:n1], t.movedim(d, 0))
            return buf[:n1].movedim(0, d), [_Grown(_starts_with(t, d, old), new, whole)]
        if d is not None:                  # it grows: from now on, growth dimension first
            part.flat.pop(path, None)
            n1 = t.shape[d]
            buf = self._seq_buffer(part, path, d, t, n1, keep=0)
            return buf[:n1].movedim(0, d), [(buf[:n1], t.movedim(d, 0))]
        part.seq.pop(path, None)
        dst = self._room(part, path, t)
        return dst, [(dst, t)]

    def _seq_buffer(self, part: _Part, path: Path, d: int, t: torch.Tensor, n: int, *, keep: int) -> torch.Tensor:
        """The chunk's ``[capacity, *rest]`` tier buffer for ``path`` (growth dim ``d`` first), with room
        for ``n`` entries; its first ``keep`` entries carried over when it has to grow."""
        rest = tuple(t.shape[:d]) + tuple(t.shape[d + 1:])
        seq = part.seq.get(path)
        if seq is not None and seq[0] == d and seq[1].dtype == t.dtype and tuple(seq[1].shape[1:]) == rest \
                and seq[1].shape[0] >= n:
            return seq[1]
        cap = max(2 * n, 16)
        j = self.parts.index(part) if part in self.parts else 0
        buf = self.arena.alloc((cap, *rest), t.dtype, self.spec.tier, f"L{self.idx}_c{j}_{path[0]}_{path[1]}_seq")
        if keep and seq is not None:
            if part.last_store is not None:
                part.last_store.wait(host=True)
            buf[:keep].copy_(seq[1][:keep])
        part.seq[path] = (d, buf)
        return buf

    def _room(self, part: _Part, path: Path, t: torch.Tensor) -> torch.Tensor:
        """A view shaped like ``t`` into the chunk's flat tier buffer for ``path`` (grown x2 as needed)."""
        flat = part.flat.get(path)
        n = t.numel()
        if flat is None or flat.dtype != t.dtype or flat.numel() < n:
            if flat is not None and part.last_store is not None:
                part.last_store.wait(host=True)
            cap = max(n, 2 * flat.numel() if flat is not None and flat.dtype == t.dtype else n)
            j = self.parts.index(part) if part in self.parts else 0
            flat = self.arena.alloc((cap,), t.dtype, self.spec.tier, f"L{self.idx}_c{j}_{path[0]}_{path[1]}")
            part.flat[path] = flat
        return flat[:n].view(t.shape)

    def end_step(self, q: int) -> None:
        self.steps += 1

    def abort(self, works) -> None:
        for w in works:
            if w is not None:
                self._restore(w)
                self._drop(w)
        self._drop_prefetched()

    def _restore(self, w: _DWork) -> None:
        for path in w.loaded:
            if path in w.part.stored:
                _set_path(w.part.obj, path, w.part.stored[path])
        w.loaded = {}

    def _drop(self, w: _DWork) -> None:
        if w.held:
            self.arena.stats.free(w.held)
            w.held = 0
        w.handle = None

    def _drop_prefetched(self) -> None:
        for w in list(self.prefetched.values()):
            if w.handle is not None:
                w.handle.wait(host=True)
            self._drop(w)
        self.prefetched.clear()

    def _wait_stores(self) -> None:
        for p in self.parts:
            if p.last_store is not None:
                p.last_store.wait(host=True)

    def _settle(self) -> None:
        self._wait_stores()
        self._drop_prefetched()

    # -- generate's bookkeeping
    def select_rows(self, index: torch.Tensor) -> None:
        """Keep / reorder / repeat rows: all chunks joined into one object of the family's class,
        then each new chunk takes its rows through the family's own ``reorder_cache``."""
        rows = self.arena.rows_after_select
        if not self.parts:
            return
        self._settle()
        works = [self.acquire(self.load(j, 0)) for j in range(len(self.parts))]
        merged = _join_objects([p.obj for p in self.parts], [p.size for p in self.parts])
        for w in works:
            self._drop(w)
        self.parts = []
        for r in rows:
            obj = _shallow_copy(merged)
            obj.reorder_cache(index[r].to(self.arena.device))
            _own_kept_tensors(obj, merged)
            part = _Part(r, obj)
            self.parts.append(part)
            self.commit(_DWork(len(self.parts) - 1, part, ()), count=False)

    def stored_bytes(self) -> int:
        """Bytes of context tensors in the tier (device tier: on the device)."""
        n = 0
        for p in self.parts:
            tensors = p.stored.values() if self.spec.tier != "device" else [t for _, t in _context_tensors(p.obj)]
            n += sum(_nbytes(t) for t in {id(t): t for t in tensors}.values())
        return n

    def state_bytes(self) -> int:
        """Bytes of fixed-size recurrent / conv states (they stay with the compute)."""
        return sum(_nbytes(t) for p in self.parts for t in _fixed_tensors(p.obj))


@functools.lru_cache(maxsize=None)
def _delegate_class(ref_cls: type) -> type:
    """``DelegatedLayer`` specialised for ``ref_cls``, registered as its virtual subclass so
    transformers' ``isinstance`` checks (``Cache.get_seq_length``, ``is_linear``, ``update_conv_state``
    ...) classify it as they classify ``ref_cls``."""
    cls = type(f"Delegated{ref_cls.__name__}", (DelegatedLayer,), {"__module__": __name__})
    register = getattr(ref_cls, "register", None)
    if callable(register) and isinstance(ref_cls, type) and hasattr(ref_cls, "_abc_impl"):
        register(cls)
    else:
        logger.warning("kinject: cache layer class %s is not an ABC; isinstance checks will not see it",
                       ref_cls.__name__)
    return cls


def delegated_layer(arena: "KVArena", idx: int, spec: KVSpec, reference) -> DelegatedLayer:
    """The delegating cache layer for ``reference`` (a fresh layer object from ``DynamicCache``)."""
    return _delegate_class(type(reference))(arena, idx, spec, reference)


# ---------------------------------------------------------------------------------------- the view


class ChunkView(Cache):
    """The cache a wrapped mixer sees for one micro-batch: transformers' ``Cache`` over the cache's
    layers (``layers``), with layer ``idx`` replaced by the chunk's own object of the family's class."""

    def __init__(self, layers: list, idx: int, obj):
        layers = list(layers)
        layers[idx] = obj
        super().__init__(layers=layers)
        self.idx = idx

    def __repr__(self) -> str:
        return f"ChunkView(layer {self.idx}: {type(self.layers[self.idx]).__name__})"


# ---------------------------------------------------------------------------------------- helpers


def _device_copy(t: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    """A contiguous copy of tier tensor ``t`` on ``device`` (non-blocking; ``pin``: through pinned memory).

    A tensor kept growth dimension first is a permuted view of its buffer (``buf[:n].movedim(0, d)``):
    it is copied in its memory order -- one dense block, so a host->device copy is one DMA straight
    from the pinned tier memory -- and its logical layout restored on the device. Copied as it is, a
    strided host source would first be gathered into a pageable host temporary, synchronously. To a
    CPU device, one strided copy is cheaper (there is no DMA)."""
    order = list(range(t.dim()))
    if device.type != "cpu" and not t.is_contiguous():
        by_stride = sorted(order, key=t.stride, reverse=True)
        if t.permute(by_stride).is_contiguous():
            order = by_stride
    dense = t.permute(order)
    out = torch.empty(dense.shape, dtype=t.dtype, device=device)
    out.copy_(dense.pin_memory() if pin else dense, non_blocking=True)
    if order == sorted(order):
        return out
    return out.permute(sorted(range(t.dim()), key=order.__getitem__)).contiguous()


class _Grown(NamedTuple):
    """The store of a tensor that grew along its growth dimension (``(tier slice, device tensor)``
    pairs): only its ``new`` entries if it still starts with the values it was loaded with, else
    ``whole``. ``same`` is read by the store job (:func:`_starts_with`)."""

    same: bool | torch.Tensor
    new: tuple[torch.Tensor, torch.Tensor]
    whole: tuple[torch.Tensor, torch.Tensor]


def _copy(write: tuple[torch.Tensor, torch.Tensor] | _Grown, *, assume_same: bool = False):
    """The (destination, source) a store copies for one write: for a grown tensor, as ``same`` says
    (on a GPU reading it waits for the comparison: the store job does), or with ``assume_same`` its
    new entries (what the accounting counts, without reading ``same``)."""
    if not isinstance(write, _Grown):
        return write
    return write.new if assume_same or write.same else write.whole


def _starts_with(t: torch.Tensor, d: int, old: torch.Tensor) -> bool | torch.Tensor:
    """Whether ``t`` starts with ``old`` along ``d``: a bool where comparing is free (CPU tensors), else
    a 0-dim bool tensor on ``t``'s device, read by the store job on its worker: ``torch.equal`` here
    would make the compute thread wait for the device every micro-batch."""
    prefix = t.narrow(d, 0, old.shape[d])
    return torch.eq(prefix, old).all() if reading_syncs(t) else torch.equal(prefix, old)


def _growth_dim(old: torch.Tensor | None, new: torch.Tensor) -> int | None:
    """The one dimension along which ``new`` is longer than ``old`` (all others equal), if any."""
    if old is None or old.dim() != new.dim() or old.dtype != new.dtype:
        return None
    diff = [i for i, (a, b) in enumerate(zip(old.shape, new.shape)) if a != b]
    return diff[0] if len(diff) == 1 and new.shape[diff[0]] > old.shape[diff[0]] else None


def _touches_context(cls: type, name: str) -> bool:
    """Whether method ``name`` of ``cls`` may read context tensors: False only where it is transformers'
    linear-attention implementation (conv / recurrent states only) that ``cls`` does not override."""
    owner = next((c for c in cls.__mro__ if name in vars(c)), None)
    return owner not in (LinearAttentionLayer, LinearAttentionCacheLayerMixin)


def _batch_of(args, kwargs) -> int | None:
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return x.shape[0]
    return None


def _rows(x, rows: slice, batch: int):
    if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == batch:
        return x[rows]
    return x


def _join(values: list, sizes: list[int]):
    """Per-chunk results joined along the batch: tensors whose first dim is the chunk's size are
    concatenated, tuples / dicts element-wise, anything else is chunk 0's."""
    first = values[0]
    if len(values) == 1:
        return first
    if isinstance(first, torch.Tensor):
        if all(isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == s for v, s in zip(values, sizes)):
            return torch.cat(values, 0)
        return first
    if isinstance(first, tuple):
        return tuple(_join([v[i] for v in values], sizes) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _join([v[k] for v in values], sizes) for k in first}
    return first


def _join_objects(objs: list, sizes: list[int]):
    """One object of the family's class holding every chunk's rows."""
    merged = _shallow_copy(objs[0])
    for name, value in vars(objs[0]).items():
        if isinstance(value, (torch.Tensor, dict)):
            setattr(merged, name, _join([vars(o)[name] for o in objs], sizes))
    return merged


def _own_kept_tensors(obj, merged) -> None:
    """Give ``obj`` (a new chunk's copy of ``merged``, after the family's ``reorder_cache``) its own
    copy of every tensor the reorder left as ``merged``'s: without rows to select (a count of the
    tokens seen, transformers 5.25's ``LinearAttentionLayer.cumulative_length_linear``) every new
    chunk would share it, and an update in place (``add_`` each step) would count once per chunk."""
    kept = {id(v) for v in vars(merged).values() if isinstance(v, torch.Tensor)}
    kept |= {id(t) for v in vars(merged).values() if isinstance(v, dict) for t in v.values()
             if isinstance(t, torch.Tensor)}
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor) and id(value) in kept:
            setattr(obj, name, value.clone())
        elif isinstance(value, dict):
            for key, t in value.items():
                if isinstance(t, torch.Tensor) and id(t) in kept:
                    value[key] = t.clone()


def _shallow_copy(obj):
    new = copy.copy(obj)
    for name, value in vars(obj).items():
        if isinstance(value, dict):
            setattr(new, name, dict(value))
    return new
