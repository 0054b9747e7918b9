"""kinject's :class:`KVCache`: a transformers ``Cache`` whose layers keep every sequence's KV in a tier,
served one micro-batch at a time (the overview is in :mod:`kinject.kv`)."""

from __future__ import annotations

import logging
import os
import weakref
from typing import TYPE_CHECKING, Callable

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

try:                                        # a layer that holds nothing (newer than transformers 5.17)
    from transformers.cache_utils import DummyLayer
except ImportError:
    class DummyLayer:                       # stand-in: no 5.17 cache makes one, so isinstance is never true
        pass

from kinject.engine.host_lane import HostLane
from kinject.errors import KinjectError
from kinject.kv.arena import KVArena
from kinject.kv.delegate import DelegatedLayer, delegated_layer
from kinject.kv.layer import KVLayer
from kinject.kv.spec import TIERS, KVSpec, KVStats
from kinject.kv.streaming import StreamingMeta

if TYPE_CHECKING:
    from kinject.trace import Tracer
    from kinject.engine.transfer import TransferEngine

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------- the cache


class KVCache(Cache):
    """kinject's cache for ``generate``: one layer per decoder layer, of the kind transformers builds.

    The layer kinds are transformers' own reading of the config (``DynamicCache(config=...)``):
    full and sliding attention layers become :class:`KVLayer` (tiers, streaming, micro-batch
    chunks); ``DummyLayer`` (no cache) stays as it is; every other kind -- linear attention,
    state-space, conv, mixed linear + attention, indexed (DSA), a family's own compressed layers --
    becomes a :class:`~kinject.kv.delegate.DelegatedLayer`: one object of the family's class per
    micro-batch chunk, its context-sized tensors in the tier.

    ``specs(layer_idx)`` gives each layer's :class:`KVSpec` (the operators' ``kv_cache`` and
    ``compute``; layers without an ``OffloadedAttention`` get ``device``). ``host_lane`` carries
    the activations of ``compute: host`` layers (made here if not given). ``micro_batch_size`` fixes the chunks
    (None: one chunk). ``capacity``: tokens to reserve per row for full layers (``generate``'s
    ``max_length - 1``; grows if exceeded).
    """

    def __init__(self, config, *, specs: Callable[[int], KVSpec] | None = None, device: torch.device | str = "cpu",
                 transfer: "TransferEngine | None" = None, stats: KVStats | None = None,
                 micro_batch_size: int | None = None, capacity: int | None = None,
                 offload_dir: str | os.PathLike | None = None, tracer: "Tracer | None" = None,
                 host_lane: "HostLane | None" = None, decode_chunk: int | str = 1, kv_budget: int | None = None,
                 owner: str = "the model"):
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        reference = DynamicCache(config=text)            # transformers' own reading of the layer types
        specs = specs or (lambda i: KVSpec("device"))
        device = torch.device(device)
        arena = KVArena(device=device, transfer=transfer, stats=stats or KVStats(), tracer=tracer,
                        host_lane=host_lane or HostLane(device), micro_batch_size=micro_batch_size,
                        capacity=capacity, offload_dir=offload_dir, decode_chunk=decode_chunk, kv_budget=kv_budget,
                        owner=owner)
        layers = [self._layer_for(arena, i, ref, specs(i)) for i, ref in enumerate(reference.layers)]
        super().__init__(layers=layers)
        self.arena = arena                 # what the layers share: buffers, traffic, the row plan
        arena.layers = layers
        # the files of disk-tier chunks go with the cache, and the layers let go of the arena they hold
        self._finalizer = weakref.finalize(self, arena.close)
        if any(getattr(layer, "spec", KVSpec()).tier != "device" for layer in layers) and transfer is None:
            raise KinjectError("KVCache: offloaded KV tiers need a transfer engine")
        if transfer is not None and transfer.inline:     # host memory is the compute memory, no link: no copies
            for layer in layers:
                if isinstance(layer, KVLayer) and layer.spec.tier == "host":
                    layer.in_place = True

    # the arena's settings and row plan, as the cache's (read and set by generate and the operators)
    device = property(lambda self: self.arena.device)
    transfer = property(lambda self: self.arena.transfer)
    stats = property(lambda self: self.arena.stats)
    tracer = property(lambda self: self.arena.tracer)
    host_lane = property(lambda self: self.arena.host_lane)
    micro_batch_size = property(lambda self: self.arena.micro_batch_size)
    capacity = property(lambda self: self.arena.capacity)
    recent_stores = property(lambda self: self.arena.recent_stores)
    rows = property(lambda self: self.arena.rows)
    owner = property(lambda self: self.arena.owner)    # the model class the cache serves (named in refusals)

    @property
    def window(self) -> range | None:
        """The chunks a prefill by micro-batch / layer computes now (None: all)."""
        return self.arena.window

    @window.setter
    def window(self, value: range | None) -> None:
        self.arena.window = value

    @property
    def layer_rows(self) -> list[slice] | None:
        """A layer-wise prefill's chunks (each layer splits its call)."""
        return self.arena.layer_rows

    @layer_rows.setter
    def layer_rows(self, value: list[slice] | None) -> None:
        self.arena.layer_rows = value

    @staticmethod
    def _layer_for(arena: KVArena, i: int, ref, spec: KVSpec):
        """kinject's layer for transformers' reference layer ``ref`` of layer ``i``."""
        if type(ref) in (DynamicLayer, DynamicSlidingWindowLayer):          # the kinds kinject specialises
            window = ref.sliding_window if ref.is_sliding else None
            return KVLayer(arena, i, spec, window)
        if isinstance(ref, DummyLayer):                                     # holds nothing
            return ref
        if spec.compute == "host":
            raise KinjectError(host_compute_refusal(i, ref))
        if spec.streaming is not None:
            logger.info("KVCache: layer %d is a %s; StreamingKV applies to full attention layers only, this "
                        "layer keeps its own exact states", i, type(ref).__name__)
        return delegated_layer(arena, i, spec, ref)

    @staticmethod
    def host_computable(ref) -> bool:
        """Whether host compute (``compute: host``) serves transformers' cache layer ``ref``: the
        full and sliding attention layers kinject stores itself."""
        return type(ref) in (DynamicLayer, DynamicSlidingWindowLayer) or isinstance(ref, DummyLayer)

    def kinds(self) -> list[str]:
        """transformers' cache-layer class of every layer (what ``DynamicCache`` would hold)."""
        out = []
        for layer in self.layers:
            if isinstance(layer, KVLayer):
                out.append("DynamicSlidingWindowLayer" if layer.is_sliding else "DynamicLayer")
            elif isinstance(layer, DelegatedLayer):
                out.append(layer.kind)
            else:
                out.append(type(layer).__name__)
        return out

    def __repr__(self) -> str:
        return f"KVCache(rows={self.batch_size_rows}, micro_batch_size={self.micro_batch_size}, layers={self.layers})"

    @property
    def batch_size_rows(self) -> int:
        return self.arena.batch_size_rows

    def chunk_rows(self, batch: int) -> list[slice]:
        """The row slices of the micro-batches (:meth:`KVArena.chunk_rows`)."""
        return self.arena.chunk_rows(batch)

    def decode_chunks(self) -> int:
        """Micro-batches a decode step's attention runs at once (:meth:`KVArena.decode_chunks`)."""
        return self.arena.decode_chunks()

    def decode_chunk_bytes(self, k: int) -> int:
        """Device KV of decode chunks of ``k`` micro-batches (:meth:`KVArena.decode_chunk_bytes`)."""
        return self.arena.decode_chunk_bytes(k)

    # -- prefill by micro-batch (:class:`kinject.kv.generate.MicroBatchPrefill`)
    def windowable(self) -> bool:
        """Whether a prefill can run one chunk's rows at a time through the model: every layer a
        full or sliding :class:`KVLayer` (or one that holds nothing). StreamingKV builds its masks
        from the whole batch's rows, and other layer kinds keep per-chunk state objects: those
        prefill the batch group at once."""
        return all(isinstance(layer, DummyLayer) or isinstance(layer, KVLayer) and layer.streaming is None
                   for layer in self.layers)

    def end_windows(self, q: int) -> None:
        """Every chunk has prefilled its ``q`` tokens: advance each layer once (a layer's
        :meth:`KVLayer.end_step` waits for this while :attr:`window` is set)."""
        for layer in self.layers:
            if isinstance(layer, KVLayer) and layer.chunks:
                layer.end_step(q)

    # -- model-level hooks
    def begin_step(self, attention_mask: torch.Tensor | None, q: int | None = None) -> None:
        """Called before each model forward (``generate``'s 2-D padding mask, for StreamingKV; ``q``:
        the forward's tokens per row, when known: :meth:`_load_first_ahead`).

        The guard where a forward's positions meet the cache: a 2-D mask covers every position of the
        sequence so far, the cached ones and the forward's ``q``, so its length must be what the
        cache holds plus ``q``. Shorter, the forward's positions overlap cached ones or go back
        (a rewrite of positions the cache already holds, with no ``crop`` first); longer, they skip
        some. Either way the forward would attend over KV that is not its sequence's: refused,
        naming the model, before any layer runs (``crop`` first rolls the cache back consistently:
        :meth:`KVLayer.crop`; docs/architecture.md, "Forwards that rewrite or only read positions")."""
        self.arena.begin_step(attention_mask)
        if q and self.arena.mask2d is not None:
            self.check_positions(self.arena.mask2d.shape[1], q)
        if q:
            self._load_first_ahead(q)

    def check_positions(self, length: int, q: int) -> None:
        """Refuse a forward of ``q`` tokens whose sequence (cached + new) is ``length`` tokens long
        where the cache holds another number of positions (:meth:`begin_step`)."""
        held = self.get_seq_length()
        if not held or length == held + q:
            return
        what = (f"re-forwards {held + q - length} of the {held} positions the cache holds (positions overlap or go "
                f"back; roll the cache back with crop() first)" if length < held + q else
                f"skips {length - held - q} positions after the {held} the cache holds")
        raise KinjectError(f"{self.arena.owner}: a forward of {q} tokens with a {length}-token attention mask {what}; "
                           "kinject never computes it on KV of other positions")

    def _load_first_ahead(self, q: int) -> None:
        """Issue a step's first KV load (the first layer's first chunk, a step after the prefill) as the
        model forward begins, not when its first attention is reached after the embeddings, masks and
        norms: the link has had nothing to do since the previous step's last transfer (the load
        cannot start earlier: the step may never come). The attention then finds it prefetched (same
        step, same tokens); not where its layer would first grow its storage (that drops loads)."""
        for layer in self.layers:
            if isinstance(layer, KVLayer):
                if layer.seen and layer.window_fits(q):
                    layer.prefetch(0, q)
                return

    def meta(self, seen: int, q: int) -> StreamingMeta:
        return self.arena.meta(seen, q)

    # -- transformers' cache API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def _select(self, index: torch.Tensor) -> None:
        index = index.long().cpu()
        batch, arena = int(index.numel()), self.arena
        bs = arena.micro_batch_size or batch
        arena.rows_after_select = [slice(i, min(i + bs, batch)) for i in range(0, batch, bs)]
        for layer in self.layers:
            if hasattr(layer, "select_rows"):           # DummyLayer holds no rows
                layer.select_rows(index)
        arena.rows = arena.rows_after_select
        arena.rows_after_select = None

    @property
    def batch_size(self) -> int:
        return self.batch_size_rows or -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.rows:
            self._select(torch.arange(self.batch_size_rows).repeat_interleave(repeats))

    # -- storage
    def stored_bytes(self) -> dict[str, int]:
        """Bytes of stored KV per tier."""
        out = dict.fromkeys(TIERS, 0)
        for layer in self.layers:
            if hasattr(layer, "stored_bytes"):
                out[layer.spec.tier] += layer.stored_bytes()
        return out

    def state_bytes(self) -> int:
        """Bytes of fixed-size recurrent / conv states (delegated kinds): they stay with the compute."""
        return sum(layer.state_bytes() for layer in self.layers if isinstance(layer, DelegatedLayer))


def host_compute_refusal(i: int, ref) -> str:
    """Why layer ``i`` (transformers' cache layer ``ref``) cannot compute its attention on the host."""
    return (f"compute: host: cache layer {i} is a {type(ref).__name__}; attention on the host over the "
            f"host KV serves full and sliding attention layers (DynamicLayer, DynamicSlidingWindowLayer). "
            f"Keep compute: device for this layer (its states are served per micro-batch on the device)")
