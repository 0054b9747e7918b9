"""Encoder-decoder caches: the decoder's self-attention KV and its cross-attention KV, each a
:class:`~kinject.kv.cache.KVCache` inside transformers' ``EncoderDecoderCache``, and the views one
micro-batch's attention sees of them.

Cross-attention keys / values are the encoder output projected once per sequence: the first
decoder step computes them (the module calls ``cross_attention_cache.update`` while
``is_updated[layer]`` is false) and kinject stores them once in the layer's KV tier; every later
step the module reads ``cross_attention_cache.layers[layer].keys / .values``, which for a micro-batch
are its rows' entries, loaded from the tier on the ``kv_load`` channel (prefetched one micro-batch
ahead, like self-attention KV) -- a step of 0 new tokens for the cross layer: nothing is computed
again, nothing stored again. Beam search reorders both caches' rows (``reorder_cache``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers.cache_utils import EncoderDecoderCache

if TYPE_CHECKING:
    from kinject.kv.layer import MicroBatchView


class CrossCacheView:
    """One micro-batch's cross-attention cache: ``update`` stores the encoder KV (first step),
    ``layers[idx].keys / .values`` read the stored one (``[b, H, S_enc, D]``)."""

    def __init__(self, view: "MicroBatchView"):
        self.view = view

    def update(self, key_states, value_states, layer_idx=None, *args, **kwargs):
        return self.view.update(key_states, value_states, layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.view.layer.seen

    @property
    def layers(self) -> dict:
        return {self.view.layer.idx: self}

    def _part(self, p: int):
        w = self.view.work
        return self.view.layer.head_major(w)[p].narrow(2, 0, w.past + w.q)

    @property
    def keys(self):
        return self._part(0)

    @property
    def values(self):
        return self._part(1)


class EncoderDecoderView(EncoderDecoderCache):
    """What one micro-batch's attention gets as its ``EncoderDecoderCache``: the micro-batch view of
    the cache it uses (self or cross), the whole other cache, and its own ``is_updated`` (the module
    sets it for its rows; the operator marks the whole cache once every micro-batch has stored)."""

    def __init__(self, self_attention_cache, cross_attention_cache, is_updated: dict):
        # not EncoderDecoderCache.__init__: views are not Cache objects, and is_updated is given
        self.self_attention_cache = self_attention_cache
        self.cross_attention_cache = cross_attention_cache
        self.is_updated = is_updated
