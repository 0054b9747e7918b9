"""Mixed-attention and sparse-attention MoE families (token mixers of several kinds in one model):
every cache-layer kind keeps the Klotski schedule (CPU).

The families are not hand-kept: every MoE family of transformers' causal-LM mapping
(:func:`kinject.families.moe_families`) is grouped by the set of cache-layer kinds
``DynamicCache(config=...)`` builds for its tiny config, and the first family of each group is run
with attention / mixers -> OffloadedAttention (KV on host, then on disk), router -> PrefetchGate,
experts -> GroupedExperts, 6 ragged prompts in micro-batches of 2 (n_batches 3): greedy tokens must
equal the untouched model's. Then: what stays where (fixed-size states with the compute, context
tensors in the tier), each chunk seeing only its rows, generate's bookkeeping (beam search), and
StreamingKV on a mixed-attention model.
"""

import functools

import pytest
import torch
from transformers import DynamicCache
from transformers import cache_utils

import kinject
from kinject.families import build_tiny_family_model, cache_layer_kinds, families_by_cache_kinds, moe_families
from kinject.kv import DelegatedLayer, KVCache, KVLayer, StreamingKV
from kinject.testing import tiny_batch, tiny_tokenizer
from operators.attention import OffloadedAttention

NEW = 6
MB, N = 2, 3
# Every attention and token-mixer class of the scanned families (softmax, MLA, sparse / indexed, linear
# and delta attention, Mamba layers and mixers, gated delta nets, short convolutions) -- and no module
# nested inside one of them.
MIXERS = r"(Attention|MLA|GatedDeltaNet|MambaLayer|Mamba2?Mixer|ShortConv)$"


def rules(tier, *, experts=True, kv=None, offload_dir=None):
    out = [{"match": {"class_name": MIXERS},
            "replace": {"class": "operators.attention.OffloadedAttention",
                        "kwargs": {"weights": "host", "kv_cache": kv or tier}}}]
    if experts:
        out += [{"match": {"name": r"^model\.layers\.\d+\.\w+\.(gate|router)$"},
                 "replace": {"class": "operators.gate.PrefetchGate"}, "optional": True},
                {"match": {"name": r"^model\.layers\.\d+\.\w+\.experts$"},
                 "replace": {"class": "operators.experts.GroupedExperts"}, "optional": True}]
    # a (fast) emulated link: host KV then crosses a link, so it is chunked by micro-batch
    pipeline = {"micro_batch_size": MB, "n_batches": N, "emulate_bandwidth": 1000}
    if offload_dir is not None:
        pipeline["offload_dir"] = str(offload_dir)
    return {"pipeline": pipeline, "rules": out}


@functools.lru_cache(maxsize=1)
def kind_groups() -> dict:
    """Cache-kind group -> its first family (families that keep a cache class of their own aside)."""
    return {kinds: fams[0] for kinds, fams in families_by_cache_kinds().items() if "own cache" not in kinds}


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def batch(tok):
    return tiny_batch(tok, MB * N, min_tokens=8)          # 6 rows of 8..16 tokens, left-padded


def generate(model, batch, tok, new=NEW, **kw):
    kw.setdefault("do_sample", False)
    return model.generate(**batch, max_new_tokens=new, pad_token_id=tok.pad_token_id, **kw)


def test_the_scan_finds_every_non_attention_kind():
    kinds = set().union(*kind_groups())
    generic = {"DynamicLayer", "DynamicSlidingWindowLayer", "LinearAttentionLayer", "DynamicIndexedLayer",
               "LinearAttentionAndFullAttentionLayer", "LinearAttentionAndSlidingWindowAttentionLayer"}
    if hasattr(cache_utils, "DummyLayer"):      # a layer that holds nothing: transformers 5.17 has no such class
        generic.add("DummyLayer")
    assert generic <= kinds
    assert kinds - generic, "a family's own cache-layer class (DeepSeek-V4's compressed layers)"


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_first_family_of_every_cache_kind_group_gives_identical_greedy_tokens(tier, tok, batch, tmp_path):
    failures = []
    for kinds, family in kind_groups().items():
        model = build_tiny_family_model(family)
        ref = generate(model, batch, tok)
        kinject.optimize(model, rules(tier, offload_dir=tmp_path / family))
        try:
            ops = [op for op in model.kinject.operators if isinstance(op, OffloadedAttention)]
            assert ops and all(op.binding.unit.tier == "host" and op.kv.tier == tier for op in ops)
            out = generate(model, batch, tok, return_dict_in_generate=True)
            cache = out.past_key_values
            assert isinstance(cache, KVCache) and tuple(cache.kinds()) == cache_layer_kinds(family)
            for layer in cache.layers:
                if isinstance(layer, (KVLayer, DelegatedLayer)) and layer.spec.tier == tier:
                    assert [c.rows for c in layer.chunks] == [slice(0, 2), slice(2, 4), slice(4, 6)]
            if not torch.equal(out.sequences, ref):
                failures.append(f"{family} {sorted(kinds)}: tokens differ")
        finally:
            kinject.restore(model)
    assert not failures, failures


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_fixed_states_stay_with_compute_context_tensors_go_to_the_tier(tier, tok, batch, tmp_path):
    """Qwen4-Exp has both: gated-delta-net layers (conv + recurrent states) and an indexed (DSA) layer."""
    model = build_tiny_family_model("qwen4_exp_text")
    ref = generate(model, batch, tok)
    kinject.optimize(model, rules(tier, offload_dir=tmp_path))
    out = generate(model, batch, tok, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    cache = out.past_key_values
    linear, indexed = cache.layers
    assert isinstance(linear, DelegatedLayer) and linear.kind == "LinearAttentionLayer"
    assert isinstance(indexed, DelegatedLayer) and indexed.kind == "DynamicIndexedLayer"
    for part in linear.chunks:                              # each chunk: only its rows, no tier traffic
        assert not part.stored
        assert all(t.shape[0] == part.size for t in part.obj.conv_states.values() if t is not None)
        assert all(t.shape[0] == part.size for t in part.obj.recurrent_states.values() if t is not None)
    assert cache.state_bytes() > 0
    seen = cache.get_seq_length()
    for part in indexed.chunks:                             # keys, values, indexer keys: in the tier
        assert {("keys", None), ("values", None), ("indexer_keys", None)} <= set(part.stored)
        assert part.obj.keys is part.stored[("keys", None)] and part.obj.keys.shape[0] == part.size
        assert part.obj.indexer_keys.shape[:2] == (part.size, seen)
    assert indexed.stored_bytes() > 0 and cache.stored_bytes()[tier] >= indexed.stored_bytes()
    for part in indexed.chunks:                             # grown by concatenation: stored growth-dim first
        assert {path: d for path, (d, _) in part.seq.items()} == \
            {("keys", None): 2, ("values", None): 2, ("indexer_keys", None): 1}
    if tier == "disk":
        assert any(cache.arena.disk_dir.iterdir())              # file-backed tensors under offload_dir
    s = model.kinject.shared("attention", None).stats.summary()
    assert s["load_bytes"] > 0 and s["store_bytes"] > 0 and s["prefetch_hits"] > 0
    assert "stay with the compute" in model.kinject.report()
    stats = model.kinject.shared("attention", None).stats
    stored = {}
    for new in (2, NEW):                                    # decode steps store only their new entries
        stats.reset()
        generate(model, batch, tok, new=new, eos_token_id=None)
        stored[new] = stats.counts["store_bytes"]
    per_token = indexed.stored_bytes() / seen            # one token of keys, values, indexer keys
    assert (stored[NEW] - stored[2]) / (NEW - 2) == pytest.approx(per_token)
    kinject.restore(model)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_layers_reading_another_layers_kv_see_every_micro_batchs_rows(tier, tok, batch, tmp_path):
    """Gemma 4 with its last two layers reading the K/V the first two store for them (a
    ``KVSharingDict`` the model fills during its forward; their caches ``DummyLayer``s): each
    micro-batch of a storing layer writes its own rows, the reading layers see all of them joined
    (before, the last micro-batch's rows were the only ones there, and the reader failed on their
    count). Kolibri 1.1 (transformers 5.25) shares K/V the same way: the first family of its cache-kind
    group in the identical-tokens test above."""
    if "gemma4_text" not in moe_families():
        pytest.skip("the installed transformers has no gemma4_text family")
    model = build_tiny_family_model("gemma4_text", num_hidden_layers=4, num_kv_shared_layers=2,
                                    layer_types=["sliding_attention", "full_attention"] * 2)
    ref = generate(model, batch, tok)
    kinject.optimize(model, rules(tier, offload_dir=tmp_path))
    out = generate(model, batch, tok, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    # the reading layers' caches: DummyLayers (transformers 5.24 on), or no cache layer at all (5.17)
    assert out.past_key_values.kinds()[2:] in ([], ["DummyLayer", "DummyLayer"])
    kinject.restore(model)


@pytest.mark.parametrize("family", ["qwen3_next", "deepseek_v32"])
def test_beam_search_reorders_every_kind(family, tok, batch):
    model = build_tiny_family_model(family)
    kw = dict(num_beams=2, num_return_sequences=2, early_stopping=True)
    ref = generate(model, batch, tok, new=4, **kw)
    kinject.optimize(model, rules("host", experts=False))
    assert torch.equal(generate(model, batch, tok, new=4, **kw), ref)
    kinject.restore(model)


def test_kvcache_whole_batch_calls_match_dynamic_cache():
    """Whole-batch calls (a mixer no rule wrapped, a sibling module) on delegated layers, split over
    chunks of 2 rows out of 3: the same results and states as transformers' DynamicCache."""
    from kinject.engine.transfer import TransferEngine
    from kinject.families import tiny_family_config
    from kinject.kv import KVSpec

    config = tiny_family_config("qwen4_exp_text")         # layer 0 linear attention, layer 1 indexed
    cache_layer_kinds("qwen4_exp_text")
    gen = torch.Generator().manual_seed(0)

    # the states as the installed transformers' mixers read them: Cache.get_conv_state /
    # get_recurrent_state (newer than 5.17), else the layer's own conv_states / recurrent_states
    getters = hasattr(cache_utils.Cache, "get_conv_state")

    def conv_state(c, i):
        return c.get_conv_state(i) if getters else c.layers[i].conv_states[0]

    def recurrent_state(c, i):
        return c.get_recurrent_state(i) if getters else c.layers[i].recurrent_states[0]

    with TransferEngine("cpu") as engine:
        cache = KVCache(config, specs=lambda i: KVSpec("host"), transfer=engine, micro_batch_size=2)
        ref = DynamicCache(config=config)
        assert cache.is_linear == ref.is_linear == [True, False]
        assert not cache.has_previous_state(0)
        for q in (5, 1, 1):
            conv, rec = torch.randn(3, 8, q, generator=gen), torch.randn(3, 2, 4, 4, generator=gen)
            assert torch.equal(cache.update_conv_state(conv, 0), ref.update_conv_state(conv, 0))
            assert torch.equal(cache.update_recurrent_state(rec, 0), ref.update_recurrent_state(rec, 0))
            k, v, ik = (torch.randn(3, 2, q, 16, generator=gen), torch.randn(3, 2, q, 16, generator=gen),
                        torch.randn(3, q, 16, generator=gen))
            assert torch.equal(cache.update_indexer(ik, 1), ref.update_indexer(ik, 1))
            for got, want in zip(cache.update(k, v, 1), ref.update(k, v, 1)):
                assert torch.equal(got, want)
            assert cache.get_seq_length() == ref.get_seq_length()
            assert cache.get_mask_sizes(q, 1) == ref.get_mask_sizes(q, 1)
            assert cache.has_previous_state(0) and torch.equal(conv_state(cache, 0), conv_state(ref, 0))
        cache.layers[1].crop(-2)                            # the indexed layer (linear ones need record_past)
        ref.layers[1].crop(-2)
        assert cache.layers[1].get_seq_length() == ref.layers[1].get_seq_length() == 5
        # the cache's own length, as transformers reads it: its first attention layer's (<= 5.24: 5), or
        # layer 0's, which from 5.25 counts its tokens even where it is a linear one (not cropped here: 7)
        assert cache.get_seq_length() == ref.get_seq_length()
        assert torch.equal(cache.layers[1].indexer_keys, ref.layers[1].indexer_keys)
        state = conv_state(cache, 0)                        # in-place decode updates reach every chunk
        state.add_(1.0)
        conv_state(ref, 0).add_(1.0)
        assert torch.equal(cache.layers[0].chunks[1].obj.conv_states[0], conv_state(ref, 0)[2:])
        index = torch.tensor([2, 0, 0])
        cache.batch_select_indices(index)
        ref.layers[0].reorder_cache(index)
        ref.layers[1].batch_select_indices(index)
        assert torch.equal(recurrent_state(cache, 0), recurrent_state(ref, 0))
        held = [id(t) for p in cache.layers[0].chunks for t in vars(p.obj).values() if isinstance(t, torch.Tensor)]
        assert len(held) == len(set(held))                  # each chunk its own tensors, its token count too
        conv = torch.randn(3, 8, 4, generator=gen)          # a whole-batch update after the reorder
        assert torch.equal(cache.update_conv_state(conv, 0), ref.update_conv_state(conv, 0))
        if hasattr(ref.layers[0], "cumulative_length_linear"):      # linear layers count their tokens (5.25)
            assert cache.layers[0].get_seq_length() == ref.layers[0].get_seq_length()
        k, v = torch.randn(3, 2, 1, 16, generator=gen), torch.randn(3, 2, 1, 16, generator=gen)
        for got, want in zip(cache.update(k, v, 1), ref.update(k, v, 1)):
            assert torch.equal(got, want)


def test_streaming_kv_on_mixed_attention_applies_to_attention_layers_and_keeps_recurrent_states_exact(tok, batch):
    """Qwen3-Next, layer 0 gated delta net, layer 1 full attention. A window covering every token
    changes nothing; a short one changes the tokens, keeps the attention layer bounded, and leaves
    layer 0's conv / recurrent states exactly those of the untouched model fed the same tokens."""
    model = build_tiny_family_model("qwen3_next")
    full = generate(model, batch, tok, new=12)
    kinject.optimize(model, rules("host", experts=False, kv={"tier": "host", "policy": "streaming", "sink": 2,
                                                              "window": 64}))
    assert torch.equal(generate(model, batch, tok, new=12), full)
    kinject.restore(model)

    sink, window = 2, 6
    kinject.optimize(model, rules("host", experts=False, kv={"tier": "host", "policy": "streaming", "sink": sink,
                                                              "window": window}))
    out = generate(model, batch, tok, new=12, return_dict_in_generate=True)
    kinject.restore(model)
    assert not torch.equal(out.sequences, full)             # the policy is on
    cache = out.past_key_values
    linear, attention = cache.layers
    assert isinstance(linear, DelegatedLayer) and linear.streaming is None
    assert isinstance(attention, KVLayer) and attention.streaming == StreamingKV(sink, window)
    assert attention.count == window - 1

    ref = DynamicCache(config=model.config)                 # the untouched model, teacher-forced
    ids, mask = batch["input_ids"], batch["attention_mask"]
    from kinject.kv.generate import CACHE_KWARG        # ``cache`` from transformers 5.23, else past_key_values

    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{CACHE_KWARG: ref})
        for t in range(ids.shape[1], out.sequences.shape[1] - 1):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            model(input_ids=out.sequences[:, t:t + 1], attention_mask=mask, use_cache=True, **{CACHE_KWARG: ref})
    torch.testing.assert_close(linear.conv_states[0], ref.layers[0].conv_states[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(linear.recurrent_states[0], ref.layers[0].recurrent_states[0], atol=1e-5, rtol=0)


def _indexed_attention_cache(engine):
    """(cache, its indexed-attention layer, the generator): a host-tier KVCache of a tiny
    ``qwen4_exp_text`` (layer 1: indexed attention) after a prefill of 5 tokens and one step."""
    from kinject.families import tiny_family_config
    from kinject.kv import KVSpec

    config = tiny_family_config("qwen4_exp_text")
    gen = torch.Generator().manual_seed(0)
    cache = KVCache(config, specs=lambda i: KVSpec("host"), transfer=engine, micro_batch_size=2)
    for q in (5, 1):
        cache.update_indexer(torch.randn(3, q, 16, generator=gen), 1)
        cache.update(torch.randn(3, 2, q, 16, generator=gen), torch.randn(3, 2, q, 16, generator=gen), 1)
    return cache, cache.layers[1], gen


def test_loads_copy_each_tier_tensor_as_one_dense_block(monkeypatch):
    """Keys, values and indexer keys are kept growth dimension first, so their tier copies are permuted
    views of their buffers. A load to a device must copy them in memory order: a strided host source
    would make CUDA gather it into a pageable temporary first (a synchronous copy, not from pinned
    memory). The device (here ``meta``: no values, but the copies CUDA would get) copies are
    contiguous; on the CPU they hold exactly the stored values."""
    from kinject.engine.transfer import TransferEngine

    with TransferEngine("cpu") as engine:
        cache, layer, _ = _indexed_attention_cache(engine)
        part = layer.parts[0]
        assert not all(t.is_contiguous() for t in part.stored.values())   # what makes the test bite
        engine.synchronize(timeout=30)                      # no store copies beside the load's
        sources = []
        copy = torch.Tensor.copy_

        def spy(dst, src, *args, **kwargs):
            sources.append(src)
            return copy(dst, src, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "copy_", spy)
        monkeypatch.setattr(cache.arena, "device", torch.device("meta"))
        work = layer.acquire(layer.load(0, 1))
        monkeypatch.undo()
        assert sources and all(src.is_contiguous() for src in sources)
        for path, t in work.loaded.items():
            assert t.is_meta and t.is_contiguous() and t.shape == part.stored[path].shape
        layer.abort([work])
        work = layer.acquire(layer.load(0, 1))
        assert set(work.loaded) == set(part.stored)
        for path, t in work.loaded.items():
            assert t.is_contiguous() and torch.equal(t, part.stored[path])
        layer.abort([work])


@pytest.mark.parametrize("gpu", [False, True])
def test_a_grown_tensor_is_checked_by_its_store_and_stored_whole_if_its_start_changed(gpu, monkeypatch):
    """Indexed-attention keys grow by concatenation, so a step stores only their new entries -- if
    they still start with what was loaded. ``gpu``: as if the keys were on a GPU, where ``torch.equal``
    on the compute thread would wait for the device every micro-batch: the comparison is read by the
    store job instead. Keys that grew but whose start changed are stored whole; the next load sees
    exactly the family's keys either way."""
    import threading

    from kinject.engine.transfer import TransferEngine
    from kinject.kv import delegate

    equal = torch.equal
    with TransferEngine("cpu") as engine:
        cache, layer, gen = _indexed_attention_cache(engine)
        if gpu:
            monkeypatch.setattr(delegate, "reading_syncs", lambda t: True, raising=False)
        compute, compared_on_compute = threading.current_thread(), []
        monkeypatch.setattr(torch, "equal", lambda x, y: (
            compared_on_compute.append(threading.current_thread() is compute), equal(x, y))[1])
        for changed in (False, True):
            work = layer.acquire(layer.load(0, 1))
            keys = work.part.obj.keys                       # [b, H, S, D]
            grown = torch.cat([keys + 1 if changed else keys, torch.randn(2, 2, 1, 16, generator=gen)], 2)
            work.part.obj.keys = grown
            layer.commit(work)
            engine.synchronize(timeout=30)
            assert equal(work.part.stored[("keys", None)], grown)
            again = layer.acquire(layer.load(0, 1))
            assert equal(again.part.obj.keys, grown)
            layer.abort([again])
        assert not (gpu and any(compared_on_compute))
