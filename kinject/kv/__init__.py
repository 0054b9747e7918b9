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
compute stream by ``TransferHandle.wait``. Memory backpressure: at most
:data:`~kinject.kv.spec.STORES_IN_FLIGHT` (2) stores are in flight per cache -- before making the
next one's outgoing copy, ``commit`` waits (host, on one store's event) for the oldest of them, which
normally landed while the next micro-batches computed. The channel lands stores in order, so a load
that waits for its chunk's newest store waits for every earlier one too.

Device KV accounting (:class:`KVStats`, offloaded tiers): a micro-batch's working buffer (its past
+ room for the new entries) is counted from its load until its commit; new entries waiting for
their store (a copy, so the working buffer can go) are counted until the store lands. With loads
one micro-batch ahead and N = ``STORES_IN_FLIGHT`` stores in flight, the peak is at most two working
buffers plus N micro-batches' outgoing entries (``KVStats.peak``). On the first step (prefill)
nothing is loaded and the working buffer holds only new entries, which are stored from it directly
(then the peak is N + 1 working buffers). A decode step with ``pipeline.decode_chunk`` k > 1 loads k
micro-batches into one working buffer (one attention call) and commits each from its rows: the same
bound with k micro-batches' buffers in place of one (:meth:`KVCache.decode_chunk_bytes`).

Other layer kinds (linear attention, state-space, conv, mixed linear + attention, indexed / DSA, a
family's own compressed layers): :class:`DelegatedLayer` serves each through transformers' own class,
one object per micro-batch chunk (:mod:`kinject.kv.delegate`); their context-sized tensors use the
tiers, their fixed-size recurrent / conv states stay with the compute.

Policies per layer: full layers keep everything; sliding layers (GPT-OSS) keep the last
``sliding_window - 1`` entries in a ring, exactly like ``DynamicSlidingWindowLayer`` (same mask
sizes); :class:`StreamingKV` keeps sinks + a recent window.
"""

from kinject.kv.cache import KVCache
from kinject.kv.delegate import ChunkView, DelegatedLayer
from kinject.kv.generate import GenerateCache, HiddenStaging, MicroBatchPrefill
from kinject.kv.layer import KVLayer, MicroBatchView
from kinject.kv.spec import TIERS, KVSpec, KVStats, Tier, parse_kv_cache
from kinject.kv.streaming import StreamingKV

__all__ = ["ChunkView", "DelegatedLayer", "GenerateCache", "HiddenStaging", "KVCache", "KVLayer", "KVSpec", "KVStats",
           "MicroBatchPrefill", "MicroBatchView", "StreamingKV", "TIERS", "Tier", "parse_kv_cache"]
