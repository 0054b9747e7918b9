"""Encoder-decoder MoE families (Switch Transformers, NLLB-MoE) under rules/klotski.yaml: decoder
cross-attention's encoder KV is stored once in the KV tier and loaded per micro-batch afterwards.

Identical greedy and beam tokens to transformers with 5 rows (micro-batch 2: not a multiple) and
3 beams; the KV store counters show the cross KV written exactly once per generate: stores =
self-attention (steps x layers x micro-batches) + cross-attention (layers x micro-batches), and the
cross layers' stored bytes equal one encoder pass's keys and values.
"""

import warnings

import pytest
import torch

import kinject
from kinject.modal_families import build_tiny_seq2seq_model, seq2seq_families
from transformers.cache_utils import EncoderDecoderCache

NEW = 6


def _batch(vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, min(200, vocab), (5, 9), generator=g)                      # [5, 9]
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[3, :1] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _generate(model, batch, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(**batch, max_new_tokens=NEW, do_sample=False, **kw)


@pytest.mark.parametrize("model_type", seq2seq_families())
def test_cross_attention_kv_stored_once_identical_greedy_and_beams(model_type):
    model = build_tiny_seq2seq_model(model_type)
    batch = _batch(model.config.vocab_size)
    ref, ref_beams = _generate(model, batch), _generate(model, batch, num_beams=3)
    kinject.optimize(model, "rules/klotski.yaml", ["pipeline.micro_batch_size=2",
                                                   "pipeline.emulate_bandwidth=1000"])   # a link: KV really moves
    group = model.kinject.peek("attention")
    layers = len(group.cross)
    assert layers == len(group.by_index()) >= 2                    # every decoder layer's cross-attention

    out = _generate(model, batch, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    cache = out.past_key_values
    assert isinstance(cache, EncoderDecoderCache)
    cross = cache.cross_attention_cache
    model.kinject.transfer.synchronize(timeout=30)
    stats = group.stats.summary()
    chunks = 3                                                      # 5 rows, micro-batch 2
    steps = out.sequences.shape[1] - 1                              # decoder forwards (the start token is given)
    assert stats["stores"] == steps * layers * chunks + layers * chunks
    cross_bytes = sum(layer.stored_bytes() for layer in cross.layers)
    src = batch["input_ids"].shape[1]
    per_token = sum(t[0].numel() * t.element_size() for t in cross.layers[0].chunks[0].ring) // 2   # of 2 rows
    assert cross_bytes == layers * src * 5 * per_token             # the encoder KV of every row, once
    assert all(layer.seen == src for layer in cross.layers)        # never appended to after the first step
    # after the first step every cross layer loads its micro-batches' encoder KV
    assert stats["load_bytes"] >= (steps - 1) * cross_bytes

    assert torch.equal(_generate(model, batch, num_beams=3), ref_beams)
    kinject.restore(model)
    assert torch.equal(_generate(model, batch), ref)
