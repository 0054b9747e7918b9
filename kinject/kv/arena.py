"""The KV arena: what every layer of one :class:`~kinject.kv.cache.KVCache` shares, handed to each layer.

The cache's layers (:class:`~kinject.kv.layer.KVLayer`, :class:`~kinject.kv.delegate.DelegatedLayer`)
store their micro-batches' KV in a tier and stream them through device working buffers. What they
share lives here, in one object each layer gets at construction (docs/architecture.md, "The KV cache"):

* the buffers: :meth:`KVArena.alloc` (a chunk's storage in its tier: device, pinned host memory, or a
  file under ``offload_dir``), :meth:`KVArena.working` / :meth:`KVArena.give_back` (a CPU device's
  reused working buffers), and the files removed with the cache (:meth:`KVArena.close`);
* the traffic: the transfer engine, the accounting (:class:`~kinject.kv.spec.KVStats`), the stores in
  flight (:meth:`KVArena.submit_store`, :meth:`KVArena.wait_for_store_room`: backpressure);
* the row plan of the batch: the micro-batches' rows (:meth:`KVArena.chunk_rows`), the window a
  prefill by micro-batch computes now, the rows after a beam reorder, the decode chunks
  (:meth:`KVArena.decode_chunks`) and StreamingKV's per-step masks (:meth:`KVArena.meta`).

The transformers ``Cache`` facade (:class:`~kinject.kv.cache.KVCache`) builds the arena and the layers
and forwards the ``Cache`` API to them; no layer holds a reference to the facade.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kinject.kv.spec import STORES_IN_FLIGHT, KVStats

if TYPE_CHECKING:
    from kinject.engine.host_lane import HostLane
    from kinject.engine.transfer import TransferEngine
    from kinject.engine.transfer_handles import TransferHandle
    from kinject.kv.streaming import StreamingMeta
    from kinject.trace import Tracer

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


class KVArena:
    """The buffers, traffic and row plan the layers of one cache share (module docstring).

    ``layers``: the cache's layers, set by the cache once they are built (the row plan and the decode
    chunks ask every layer; :meth:`close` empties it, so the layers and the arena they hold are freed
    with the cache). ``rows``: the micro-batches' row slices; ``window``: the chunks a prefill by
    micro-batch / layer computes now (None: all); ``layer_rows``: a layer-wise prefill's chunks;
    ``rows_after_select``: the new row plan while a beam reorder re-chunks the layers;
    ``recent_stores``: the newest stores of any layer, newest last; ``generation``: tells prefetch
    stamps of different caches apart."""

    def __init__(self, *, device: torch.device, transfer: "TransferEngine | None", stats: KVStats,
                 tracer: "Tracer | None", host_lane: "HostLane", micro_batch_size: int | None,
                 capacity: int | None, offload_dir: str | os.PathLike | None, decode_chunk: int | str,
                 kv_budget: int | None, owner: str = "the model"):
        self.device = device
        self.owner = owner                 # the model class the cache serves (named in refusals)
        self.transfer = transfer
        self.stats = stats
        self.tracer = tracer
        self.host_lane = host_lane         # activations of host-computed attention to and from the host
        self.micro_batch_size = micro_batch_size
        self.capacity = capacity
        self.decode_chunk = decode_chunk   # micro-batches per decode attention call: an int, or "auto"
        self.kv_budget = kv_budget         # device bytes for KV working buffers (None: unbounded)
        self.generation = next(_ids)
        self.recent_stores: deque[TransferHandle] = deque(maxlen=STORES_IN_FLIGHT)
        self.layers: list = []
        self.rows: list[slice] | None = None
        self.window: range | None = None
        self.layer_rows: list[slice] | None = None
        self.rows_after_select: list[slice] | None = None
        self.mask2d: torch.Tensor | None = None     # generate's 2-D padding mask of this step (StreamingKV)
        self.disk_dir: Path | None = None           # where disk-tier chunks live (made on first use)
        self._offload_dir = offload_dir
        self._decode_k: int | None = None
        self._meta: tuple | None = None
        self._spare: dict[tuple, list[torch.Tensor]] = {}   # a CPU device's given-back working buffers

    # -- the row plan
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
        """Device KV of decode chunks of ``k`` micro-batches: the largest of the layers' needs
        (``KVLayer.decode_chunk_bytes``; layers of other kinds stream no decode chunks)."""
        bs = self.micro_batch_size or self.batch_size_rows
        return max((layer.decode_chunk_bytes(k, bs, self.capacity) for layer in self.layers
                    if hasattr(layer, "decode_chunk_bytes")), default=0)

    def _decide_decode_chunks(self) -> int:
        from kinject.errors import KinjectError

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

    def meta(self, seen: int, q: int) -> "StreamingMeta":
        """StreamingKV's per-step mask data for ``seen`` past and ``q`` new tokens (made once per step)."""
        key = (seen, q)
        if self._meta is None or self._meta[0] != key:
            policy = next(layer.streaming for layer in self.layers if getattr(layer, "streaming", None))
            device = self.mask2d.device if self.mask2d is not None else self.device
            self._meta = (key, policy.meta(self.mask2d, self.batch_size_rows, seen + q, device))
        return self._meta[1]

    def begin_step(self, attention_mask: torch.Tensor | None) -> None:
        """A model forward begins (``generate``'s 2-D padding mask, for StreamingKV)."""
        self.mask2d = attention_mask if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 \
            else None
        self._meta = None

    # -- the buffers
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
        if self.disk_dir is None:
            root = Path(self._offload_dir).expanduser() if self._offload_dir else Path(tempfile.gettempdir())
            root.mkdir(parents=True, exist_ok=True)
            self.disk_dir = Path(tempfile.mkdtemp(prefix=f"kv-{os.getpid()}-", dir=root))
        return self.disk_dir

    def close(self) -> None:
        """The cache is gone: its files are removed, and the layers let go (they hold this arena)."""
        self.layers = []
        self._spare.clear()
        if self.disk_dir is not None:
            shutil.rmtree(self.disk_dir, ignore_errors=True)

    # -- the stores in flight
    def wait_for_store_room(self) -> None:
        """Backpressure before a new KV store: wait (host; counted as ``store_waits``) until fewer than
        :data:`STORES_IN_FLIGHT` stores are in flight. The ``kv_store`` channel lands stores in order, so
        once the oldest of the last ones has landed every earlier one has too."""
        recent = self.recent_stores
        if len(recent) == STORES_IN_FLIGHT and not recent[0].done():
            self.stats.count("store_waits")
            recent[0].wait(host=True)

    def submit_store(self, idx: int, rows: slice, fn, nbytes: int, *, held: int, stores: int = 1) -> "TransferHandle":
        """Queue the KV store of layer ``idx``'s ``rows`` (``stores`` micro-batches: a decode chunk's in
        one job) on the ``kv_store`` channel (after the compute that produced it), count it, give back
        the ``held`` device bytes when it lands. Returns its handle, also kept among the recent stores
        (:meth:`wait_for_store_room`)."""
        stats = self.stats
        handle = self.transfer.submit("kv_store", fn, label=f"kv L{idx} rows {rows.start}:{rows.stop}", nbytes=nbytes,
                                      tier="device", layer=idx, wait_current=True)
        stats.count("stores", stores)
        stats.count("store_bytes", nbytes)
        handle.add_done_callback(lambda h, n=held: stats.free(n))
        self.recent_stores.append(handle)
        return handle
