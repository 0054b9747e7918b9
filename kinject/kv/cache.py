"""kinject's :class:`KVCache`: a transformers ``Cache`` whose layers keep every sequence's KV in a tier,
served one micro-batch at a time (the overview is in :mod:`kinject.kv`)."""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import tempfile
import weakref
from collections import deque
from pathlib import Path
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
from kinject.kv.delegate import DelegatedLayer, delegated_layer
from kinject.kv.layer import KVLayer
from kinject.kv.spec import STORES_IN_FLIGHT, TIERS, KVSpec, KVStats
from kinject.kv.streaming import StreamingMeta

if TYPE_CHECKING:
    from kinject.trace import Tracer
    from kinject.engine.transfer import TransferEngine, TransferHandle

logger = logging.getLogger(__name__)

_ids = itertools.count()
# references to a tensor storage (views included; torch's, private): a reused working buffer must have
# none but its own, as many as a lone tensor's (measured here; without the call buffers are not reused)
_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _references(t: torch.Tensor) -> int:
    return _use_count(t.untyped_storage()._cdata)


_ALONE = _references(torch.empty(1)) if _use_count is not None else None      # (the argument holds it)


def _unshared(t: torch.Tensor) -> bool:
    """Whether no view of ``t``'s memory is alive but ``t`` itself."""
    return _references(t) <= _ALONE


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
        layers = []
        for i, ref in enumerate(reference.layers):
            layers.append(self._layer_for(i, ref, specs(i)))
        super().__init__(layers=layers)
        self.device = torch.device(device)
        self.owner = owner                 # the model class the cache serves (named in refusals)
        if any(getattr(layer, "spec", KVSpec()).tier != "device" for layer in layers) and transfer is None:
            raise KinjectError("KVCache: offloaded KV tiers need a transfer engine")
        self.transfer = transfer
        if transfer is not None and transfer.inline:     # host memory is the compute memory, no link: no copies
            for layer in layers:
                if isinstance(layer, KVLayer) and layer.spec.tier == "host":
                    layer.in_place = True
        # activations of host-computed attention (``compute: host`` layers) to and from the host
        self.host_lane = host_lane or HostLane(self.device)
        self.stats = stats or KVStats()
        self.tracer = tracer
        self.micro_batch_size = micro_batch_size
        self.capacity = capacity
        self.decode_chunk = decode_chunk   # micro-batches per decode attention call: an int, or "auto"
        self.kv_budget = kv_budget         # device bytes for KV working buffers (None: unbounded)
        self._decode_k: int | None = None
        self.generation = next(_ids)       # distinguishes prefetch stamps of different caches
        # the newest stores of any layer, newest last (backpressure: kinject.kv.layer.wait_for_store_room)
        self.recent_stores: deque[TransferHandle] = deque(maxlen=STORES_IN_FLIGHT)
        self.rows: list[slice] | None = None
        self.window: range | None = None   # the chunks a prefill by micro-batch / layer computes now (None: all)
        self.layer_rows: list[slice] | None = None   # a layer-wise prefill's chunks (each layer splits its call)
        self.rows_after_select: list[slice] | None = None
        self._mask2d: torch.Tensor | None = None
        self._meta: tuple | None = None
        self._dir: Path | None = None
        self._offload_dir = offload_dir
        self._finalizer = None
        self._spare: dict[tuple, list[torch.Tensor]] = {}   # a CPU device's given-back working buffers

    def _layer_for(self, i: int, ref, spec: KVSpec):
        """kinject's layer for transformers' reference layer ``ref`` of layer ``i``."""
        if type(ref) in (DynamicLayer, DynamicSlidingWindowLayer):          # the kinds kinject specialises
            window = ref.sliding_window if ref.is_sliding else None
            return KVLayer(self, i, spec, window)
        if isinstance(ref, DummyLayer):                                     # holds nothing
            return ref
        if spec.compute == "host":
            raise KinjectError(host_compute_refusal(i, ref))
        if spec.streaming is not None:
            logger.info("KVCache: layer %d is a %s; StreamingKV applies to full attention layers only, this "
                        "layer keeps its own exact states", i, type(ref).__name__)
        return delegated_layer(self, i, spec, ref)

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
        return self.rows[-1].stop if self.rows else 0

    def chunk_rows(self, batch: int) -> list[slice]:
        """The row slices of the micro-batches (fixed at the first step; during a prefill by
        micro-batch, whose forwards see one chunk's rows, the whole batch's)."""
        if self.window is not None:
            return self.rows
        if self.rows is None or (self.batch_size_rows != batch and not any(getattr(layer, "seen", 0)
                                                                            for layer in self.layers)):
            bs = self.micro_batch_size or batch
            self.rows = [slice(i, min(i + bs, batch)) for i in range(0, batch, bs)]
        return self.rows

    # -- decode chunks (:meth:`KVLayer.span`)
    def decode_chunks(self) -> int:
        """Micro-batches a decode step's attention runs at once (``pipeline.decode_chunk``), decided
        at the first decode step, when every layer's entry shapes are known: the micro-batch size is
        set by the prefill's activations, a decode step's are tiny, so its attention can take ``k``
        micro-batches' KV as one chunk where two chunks (one computing, one loading) and the stores in
        flight fit ``kv_budget`` at the generate's max length (:meth:`decode_chunk_bytes`). ``auto``:
        the fewest attention calls such ``k`` allow, in chunks as even as they go; a set ``k`` that
        does not fit is an error."""
        if self._decode_k is None:
            self._decode_k = self._decide_decode_chunks()
        return self._decode_k

    def decode_chunk_bytes(self, k: int) -> int:
        """Device KV of decode chunks of ``k`` micro-batches: two chunks' working buffers at the
        longest layer's max length, plus :data:`STORES_IN_FLIGHT` micro-batches' new entries."""
        bs = self.micro_batch_size or self.batch_size_rows
        worst = 0
        for layer in self.layers:
            if isinstance(layer, KVLayer) and layer.shapes is not None and layer.chunks:
                per_row = layer.row_bytes(layer.chunks[0]) // layer.chunks[0].size     # one token of one sequence
                tokens = layer.sink_len + (layer.fixed_cap or max(self.capacity or 0, layer.count)) + 1
                worst = max(worst, (2 * k * tokens + STORES_IN_FLIGHT) * bs * per_row)
        return worst

    def _decide_decode_chunks(self) -> int:
        n = len(self.rows or [])
        if self.decode_chunk == 1 or n <= 1:
            return 1
        if self.decode_chunk == "auto":
            k = n
            while k > 1 and self.kv_budget is not None and self.decode_chunk_bytes(k) > self.kv_budget:
                k -= 1
            return -(-n // -(-n // k))       # as many calls as k makes, with chunks as even as they go
        k = min(int(self.decode_chunk), n)
        if self.kv_budget is not None and (need := self.decode_chunk_bytes(k)) > self.kv_budget:
            raise KinjectError(f"pipeline.decode_chunk: {self.decode_chunk} micro-batches of "
                               f"{self.micro_batch_size} rows need {need} bytes of device KV (two chunks at the "
                               f"generate's max length and the stores in flight), pipeline.kv_budget is "
                               f"{self.kv_budget}; set a smaller value or auto")
        return k

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
        :meth:`KVLayer.crop`)."""
        self._mask2d = attention_mask if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 \
            else None
        self._meta = None
        if q and self._mask2d is not None:
            self.check_positions(self._mask2d.shape[1], q)
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
        raise KinjectError(f"{self.owner}: a forward of {q} tokens with a {length}-token attention mask {what}; "
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
        key = (seen, q)
        if self._meta is None or self._meta[0] != key:
            policy = next(layer.streaming for layer in self.layers if getattr(layer, "streaming", None))
            self._meta = (key, policy.meta(self._mask2d, self.batch_size_rows, seen + q, self._mask_device()))
        return self._meta[1]

    def _mask_device(self):
        return self._mask2d.device if self._mask2d is not None else self.device

    # -- transformers' cache API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def _select(self, index: torch.Tensor) -> None:
        index = index.long().cpu()
        batch = int(index.numel())
        bs = self.micro_batch_size or batch
        self.rows_after_select = [slice(i, min(i + bs, batch)) for i in range(0, batch, bs)]
        for layer in self.layers:
            if hasattr(layer, "select_rows"):           # DummyLayer holds no rows
                layer.select_rows(index)
        self.rows = self.rows_after_select
        self.rows_after_select = None

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

    def working(self, length: int, rest: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A ``[length, *rest]`` working buffer for a KV load, and what to :meth:`give_back` once its
        micro-batches are committed. On a CPU device one of ``capacity`` tokens is kept and reused
        (its first ``length``), step after step, as a CUDA caching allocator reuses device memory:
        a fresh one of megabytes each load costs its pages' faults and zero-filling every time. A
        given-back buffer is reused only once no view of it is alive (whoever called the attention
        may keep the keys and values it returned: :meth:`KVLayer.update` joins them). The KV
        accounting (:class:`~kinject.kv.spec.KVStats`) counts ``length`` tokens either way. On CUDA
        (None, None) the load allocates on its channel's stream itself."""
        if self.device.type != "cpu" or _use_count is None:
            return None, None
        key = (rest, dtype)
        spare = self._spare.get(key)
        while spare:
            buf = spare.pop()
            if buf.shape[0] >= length and _unshared(buf):
                return buf[:length], buf
        buf = torch.empty((max(length, self.capacity or 0), *rest), dtype=dtype, device=self.device)
        return buf[:length], buf

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        """Working buffers of :meth:`working` nothing reads any more (their KV committed)."""
        for buf in buffers:
            self._spare.setdefault((tuple(buf.shape[1:]), buf.dtype), []).append(buf)

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
