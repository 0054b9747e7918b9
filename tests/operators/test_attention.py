"""OffloadedAttention + KVCache + StreamingKV on tiny models (CPU).

Correctness: every family under ``rules/<family>_kv_offload.yaml`` (attention weights and the KV
cache of all sequences on the host, attention run per micro-batch) gives the untouched model's
greedy tokens -- 13 ragged left-padded prompts, micro-batch 4 (13 is not a multiple of 4), prefill
and 16 decode steps. StreamingKV is checked against a plainly written reference: the untouched
model re-run on the whole sequence every step with a hand-made sink + window mask.
"""

import gc

import pytest
import torch

import kinject
from kinject.errors import RuleError
from kinject.kv import KVCache, StreamingKV
from kinject.kv.spec import STORES_IN_FLIGHT
from kinject.testing import FAMILIES, build_tiny_model, tiny_batch, tiny_tokenizer
from operators.attention import OffloadedAttention

NEW = 16
MB = 4


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def batch(tok):
    return tiny_batch(tok, 13, min_tokens=16)          # 13 rows of 16..32 tokens, left-padded


def generate(model, batch, tok, new=NEW, **kw):
    kw.setdefault("do_sample", False)
    return model.generate(**batch, max_new_tokens=new, pad_token_id=tok.pad_token_id, **kw)


def group(model):
    return model.kinject.shared("attention", None)


def kv_bound(cache: KVCache, prompt: int, outgoing_tokens: int = 1) -> int:
    """Two micro-batches' working KV (past + new, at its largest over the run) plus the outgoing
    entries of the micro-batches whose stores may be in flight -- at prefill, stored from their
    working buffers: those buffers beside the one computing -- from the shapes of what the cache stored."""
    work = token = prefill = 0
    for layer in cache.layers:
        chunk = max(layer.chunks, key=lambda c: c.size)
        per_token = sum(t[0, 0].numel() * t.element_size() for t in chunk.ring) * chunk.size
        if layer.is_sliding:
            tokens = max(prompt, min(layer.seen, layer.sliding_window))
        elif layer.streaming:
            tokens = layer.streaming.sink + max(prompt, layer.streaming.window)
        else:
            tokens = layer.seen
        work, token = max(work, tokens * per_token), max(token, per_token)
        prefill = max(prefill, (layer.sink_len + prompt) * per_token)
    return max(2 * work + STORES_IN_FLIGHT * outgoing_tokens * token, (STORES_IN_FLIGHT + 1) * prefill)


LINK = "pipeline.emulate_bandwidth=1000"     # GB/s: a link that copies without slowing the tests


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])      # full layers; sliding + full layers
def test_host_kv_on_a_cpu_without_a_link_is_used_in_place(family, tok, batch):
    """With the host memory the compute memory and no link (a CPU, no emulation), the host tier's
    KV is appended in place like the device tier's: nothing loaded, stored or held twice; and with
    nothing to overlap, attention runs once per layer and step on the whole batch (the rule file's
    micro_batch_size 4 would run it 4 times on 13 rows)."""
    model = build_tiny_model(family)
    ref = generate(model, batch, tok)
    kinject.optimize(model, f"rules/{family}_kv_offload.yaml")
    out = model.generate(**batch, max_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    cache = out.past_key_values
    assert all(layer.in_place for layer in cache.layers) and cache.stored_bytes()["host"] > 0
    assert model.kinject.pipeline.micro_batch_size == 4 and group(model).micro_batch_size() is None
    assert [c.rows for c in cache.layers[0].chunks] == [slice(0, batch["input_ids"].shape[0])]
    stats = group(model).stats.summary()
    assert stats["micro_batches"] == model.config.num_hidden_layers * NEW
    assert stats["loads"] == stats["stores"] == stats["load_bytes"] == stats["store_bytes"] == 0
    transfer = model.kinject.transfer.stats
    assert transfer["bytes"]["kv_load"] == transfer["bytes"]["kv_store"] == 0
    kinject.restore(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_offload_gives_identical_greedy_tokens(family, tok, batch):
    model = build_tiny_model(family)
    gen = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id, return_dict_in_generate=True,
               output_logits=True)
    expected = model.generate(**batch, **gen)
    ref = expected.sequences
    before = {n: (p.data_ptr(), p.shape) for n, p in model.named_parameters()}

    # a (fast) emulated link: the host tier is then across a link, so every chunk's KV is copied in and out
    kinject.optimize(model, f"rules/{family}_kv_offload.yaml", [LINK])
    ops = [op for op in model.kinject.operators if isinstance(op, OffloadedAttention)]
    assert len(ops) == model.config.num_hidden_layers
    assert all(op.binding.unit.tier == "host" and op.kv.tier == "host" for op in ops)
    out = model.generate(**batch, **gen)
    assert torch.equal(out.sequences, ref)
    torch.testing.assert_close(torch.stack(out.logits), torch.stack(expected.logits), atol=1e-5, rtol=0)

    cache = out.past_key_values
    assert isinstance(cache, KVCache)
    assert [c.rows for c in cache.layers[0].chunks] == [slice(0, 4), slice(4, 8), slice(8, 12), slice(12, 13)]
    assert cache.stored_bytes()["host"] > 0 and cache.stored_bytes()["device"] == 0
    model.kinject.transfer.synchronize(timeout=30)      # the last store has landed
    stats = group(model).stats.summary()
    steps = NEW                                          # prefill + 15 decode forwards
    assert stats["micro_batches"] == len(ops) * steps * 4
    assert stats["loads"] == len(ops) * (steps - 1) * 4  # every step after prefill loads every chunk
    assert stats["prefetch_hits"] > 0                    # next layer's chunk 0 loaded during this layer
    assert stats["resident"] == 0                        # everything released / landed
    assert 0 < stats["peak"] <= kv_bound(cache, batch["input_ids"].shape[1])
    assert any(line.startswith("kv cache: host") for line in group(model).report_lines())

    kinject.restore(model)                               # exact inverse
    assert "_prepare_cache_for_generation" not in model.__dict__ and not model._forward_pre_hooks
    assert {n: (p.data_ptr(), p.shape) for n, p in model.named_parameters()} == before
    assert torch.equal(generate(model, batch, tok), ref)


def test_generate_features_repeated_calls_sampling_beams_eos(tok, batch):
    model = build_tiny_model("mixtral")
    small = {k: v[:7] for k, v in batch.items()}

    def run():
        out = {"greedy": generate(model, batch, tok), "again": generate(model, small, tok, new=6)}
        torch.manual_seed(7)
        out["sample"] = generate(model, batch, tok, new=8, do_sample=True, top_k=20, num_return_sequences=2)
        torch.manual_seed(7)
        out["sample2"] = generate(model, batch, tok, new=8, do_sample=True, top_k=20, num_return_sequences=2)
        out["beams"] = generate(model, small, tok, new=6, num_beams=2)
        out["no_cache"] = generate(model, small, tok, new=4, use_cache=False)
        eos = int(out["greedy"][0, batch["input_ids"].shape[1] + 3])     # row 0 stops after 4 tokens
        out["eos"] = generate(model, batch, tok, eos_token_id=eos)
        with torch.no_grad():
            out["logits"] = model(**batch).logits                        # a plain forward: DynamicCache
        return out

    ref = run()
    kinject.optimize(model, "rules/mixtral_kv_offload.yaml")
    got = run()
    assert got["sample"].shape[0] == 2 * batch["input_ids"].shape[0]
    assert torch.equal(got["sample"], got["sample2"])                     # seeded sampling reproducible
    for k in ref:
        if k == "logits":
            torch.testing.assert_close(got[k], ref[k], atol=1e-5, rtol=0)
        else:
            assert torch.equal(got[k], ref[k]), k
    assert (got["eos"][0] == tok.pad_token_id).any()                      # EOS stopped row 0
    assert torch.equal(generate(model, batch, tok), ref["greedy"])        # same model, once more
    kinject.restore(model)


@pytest.mark.parametrize("tier", ["disk", "device"])
def test_disk_and_device_kv_tiers(tier, tok, batch, tmp_path):
    model = build_tiny_model("qwen3_moe")
    ref = generate(model, batch, tok)
    kinject.optimize(model, "rules/qwen3_moe_kv_offload.yaml",
                     [f"vars.kv={tier}", "vars.weights=device", f"pipeline.offload_dir={tmp_path}"])
    out = model.generate(**batch, max_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.past_key_values.stored_bytes()[tier] > 0
    stats = group(model).stats.summary()
    if tier == "disk":
        files = list(tmp_path.rglob("*.bin"))
        assert files and stats["loads"] > 0
        del out
        gc.collect()
        assert not list(tmp_path.rglob("*.bin"))                          # files go with the cache
    else:
        assert stats["loads"] == stats["stores"] == 0                     # nothing to move
    kinject.restore(model)


@torch.no_grad()
def streaming_reference(model, batch, tok, sink, window, new):
    """Greedy decoding where every query at slot t sees the keys s that are real tokens, s <= t,
    and among the first `sink` real tokens of the row or s > t - window; the whole sequence is
    recomputed every step (no cache). Sliding layers (GPT-OSS) keep their own window."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    dev = ids.device
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=dev)
    sliding = getattr(model.config, "sliding_window", None)

    def as_float(allowed):                                   # eager attention adds the mask
        return torch.zeros(allowed.shape, device=dev).masked_fill(~allowed, torch.finfo(torch.float32).min)[:, None]

    for _ in range(new):
        length = ids.shape[1]
        real = mask.bool()
        sinks = real & (real.long().cumsum(-1) <= sink)
        t = torch.arange(length, device=dev)[:, None]
        s = torch.arange(length, device=dev)[None, :]
        causal = real[:, None, :] & (s <= t)
        keep = causal & (sinks[:, None, :] | (s > t - window))
        attn = as_float(keep)
        if "sliding_attention" in getattr(model.config, "layer_types", []):
            attn = {"full_attention": attn, "sliding_attention": as_float(causal & (s > t - sliding))}
        pos = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits[:, -1]
        nxt = logits.argmax(-1).masked_fill(done, tok.pad_token_id)
        done |= nxt == tok.eos_token_id
        ids = torch.cat([ids, nxt[:, None]], 1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return ids


@pytest.mark.parametrize("family,tier", [("mixtral", "host"), ("gpt_oss", "host"), ("deepseek_v3", "device")])
def test_streaming_kv_matches_plain_reference_and_stays_bounded(family, tier, tok):
    sink, window = 4, 8
    batch = tiny_batch(tok, 6, min_tokens=8)                 # prompts 8..16 tokens: past the window
    model = build_tiny_model(family)
    full = generate(model, batch, tok, new=24)
    ref = streaming_reference(model, batch, tok, sink, window, 24)
    spec = f"vars.kv={{tier: {tier}, policy: streaming, sink: {sink}, window: {window}}}"
    kinject.optimize(model, f"rules/{family}_kv_offload.yaml", [spec])
    stats = group(model).stats
    out = model.generate(**batch, max_new_tokens=24, do_sample=False, pad_token_id=tok.pad_token_id,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert not torch.equal(out.sequences, full)              # the policy is really on

    # bounded: each full layer keeps sink + window - 1 slots whatever the length; device KV too
    prompt = batch["input_ids"].shape[1]
    cache = out.past_key_values
    stored = cache.stored_bytes()[tier]
    for layer in cache.layers:
        if not layer.is_sliding:
            assert layer.streaming == StreamingKV(sink, window) and layer.count == window - 1
            assert layer.seen == prompt + 23
    assert stats.peak <= kv_bound(cache, prompt, outgoing_tokens=1 + sink)
    stats.reset()
    longer = model.generate(**batch, max_new_tokens=48, do_sample=False, pad_token_id=tok.pad_token_id,
                            return_dict_in_generate=True)
    assert longer.past_key_values.stored_bytes()[tier] == stored
    assert torch.equal(longer.sequences[:, :out.sequences.shape[1]], out.sequences)
    assert stats.peak <= kv_bound(cache, prompt, outgoing_tokens=1 + sink)
    kinject.restore(model)


def test_multi_batch_group_micro_batches_attention_only(tok):
    """n * bs sequences in one generate, the KV across a (fast emulated) link: attention runs n
    micro-batches, the experts see all tokens."""
    n, bs = 3, 4
    batch = tiny_batch(tok, n * bs, min_tokens=8)
    model = build_tiny_model("olmoe")
    ref = generate(model, batch, tok, new=6)
    kinject.optimize(model, "rules/olmoe_kv_offload.yaml", ["pipeline.trace=true", f"pipeline.micro_batch_size={bs}",
                                                             f"pipeline.n_batches={n}", LINK])
    rt = model.kinject
    tokens = []
    experts = model.model.layers[0].mlp.experts.base
    hook = experts.register_forward_pre_hook(lambda m, args: tokens.append(args[0].shape[0]))
    rt.tracer.clear()
    assert torch.equal(generate(model, batch, tok, new=6), ref)
    hook.remove()
    width = batch["input_ids"].shape[1]
    assert tokens == [n * bs * width] + [n * bs] * 5           # prefill, then 5 decode steps
    spans = [e for e in rt.tracer.events() if e.stream == "compute" and e.name.startswith("model.layers.0.self_attn")]
    assert len(spans) == 6 * n
    assert {e.name.split(" rows ")[1] for e in spans} == {"0:4", "4:8", "8:12"}
    kinject.restore(model)


def test_kv_transfers_overlap_compute(tok):
    """With an emulated slow link, micro-batch j+1's KV load and j-1's store overlap j's compute."""
    batch = tiny_batch(tok, 12, min_tokens=16)
    model = build_tiny_model("mixtral")
    kinject.optimize(model, "rules/mixtral_kv_offload.yaml", ["pipeline.trace=true", "pipeline.emulate_bandwidth=0.05"])
    rt = model.kinject
    generate(model, batch, tok, new=6)
    events = rt.tracer.events()
    compute = [e for e in events if e.stream == "compute" and "self_attn rows" in e.name]
    loads = [e for e in events if e.stream == "kv_load"]              # "kv L<layer> mb<j>"
    stores = [e for e in events if e.stream == "kv_store"]            # "kv L<layer> rows <a>:<b>"
    assert loads and stores and all(e.args.get("emulated") for e in loads)

    def attn(layer, j):                                                # compute spans of micro-batch j
        return [c for c in compute if c.name == f"model.layers.{layer}.self_attn rows {4 * j}:{4 * j + 4}"]

    def overlaps(a, b):
        return a.start < b.end and b.start < a.end

    load_overlap = store_overlap = 0
    for ld in loads:
        layer, j = int(ld.name.split()[1][1:]), int(ld.name.split()[2][2:])
        load_overlap += j > 0 and any(overlaps(ld, c) for c in attn(layer, j - 1))
    for st in stores:
        layer, j = int(st.name.split()[1][1:]), int(st.name.split()[3].split(":")[0]) // 4
        store_overlap += any(overlaps(st, c) for c in attn(layer, j + 1))
    assert load_overlap > 0 and store_overlap > 0
    kinject.restore(model)


def test_layers_without_the_operator_use_the_cache_whole_batch(tok, batch):
    model = build_tiny_model("phimoe")
    ref = generate(model, batch, tok, new=8)
    rules = {"pipeline": {"micro_batch_size": MB},
             "rules": [{"match": {"name": r"^model\.layers\.0\.self_attn$"},
                        "replace": {"class": "operators.attention.OffloadedAttention",
                                    "kwargs": {"kv_cache": "host"}}}]}
    kinject.optimize(model, rules)
    out = model.generate(**batch, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert [layer.spec.tier for layer in out.past_key_values.layers] == ["host", "device"]
    kinject.restore(model)


@pytest.mark.parametrize("tier", ["host", "device"])
def test_kvcache_behaves_like_dynamic_cache_full_and_sliding_layers(tier):
    """Whole-batch updates through KVCache (chunks of 2 rows out of 3) return what DynamicCache
    returns, with the same mask sizes, for a full and a sliding (window 16) layer. On the device tier
    a full layer's store is its working buffer, written and read through views kept per store: they
    must follow the store when it grows, is cropped and has rows selected."""
    from transformers.cache_utils import DynamicCache

    from kinject.kv import KVSpec
    from kinject.testing import tiny_config
    from kinject.engine.transfer import TransferEngine

    config = tiny_config("gpt_oss")                      # layer 0 sliding (16), layer 1 full
    with TransferEngine("cpu") as engine:
        cache = KVCache(config, specs=lambda i: KVSpec(tier), transfer=engine, micro_batch_size=2, capacity=8)
        ref = DynamicCache(config=config)
        assert cache.is_sliding == ref.is_sliding == [True, False]
        gen = torch.Generator().manual_seed(0)
        for q in (20, 1, 1, 3, 1):                           # prefill past the window, decode, a chunk
            assert [cache.get_mask_sizes(q, i) for i in (0, 1)] == [ref.get_mask_sizes(q, i) for i in (0, 1)]
            for i in (0, 1):
                k, v = torch.randn(3, 2, q, 16, generator=gen), torch.randn(3, 2, q, 16, generator=gen)
                for got, want in zip(cache.update(k, v, i), ref.update(k, v, i)):
                    assert torch.equal(got, want)
            assert cache.get_seq_length() == ref.get_seq_length()
        assert cache.layers[1].cap >= 26 and cache.layers[0].count == 15   # grown past capacity=8; ring full
        cache.layers[1].crop(-2)
        ref.layers[1].crop(-2)
        k, v = torch.randn(3, 2, 1, 16), torch.randn(3, 2, 1, 16)
        for got, want in zip(cache.update(k, v, 1), ref.update(k, v, 1)):
            assert torch.equal(got, want)
        index = torch.tensor([2, 0])
        cache.batch_select_indices(index)
        ref.batch_select_indices(index)
        for i in (0, 1):
            k, v = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16)
            for got, want in zip(cache.update(k, v, i), ref.update(k, v, i)):
                assert torch.equal(got, want)


def test_a_commit_waits_for_a_store_only_once_the_bound_of_stores_is_in_flight():
    """Backpressure lets ``STORES_IN_FLIGHT`` (2) stores be in flight, so the compute thread may run a
    micro-batch further ahead of the device than the store it just made. Stores held back on their
    channel: the first host wait comes at the third micro-batch's commit, with two stores pending;
    the loads of the next step still see every stored entry."""
    import threading

    from transformers.cache_utils import DynamicCache

    from kinject.engine.transfer import TransferEngine
    from kinject.kv import KVSpec
    from kinject.testing import tiny_config

    assert STORES_IN_FLIGHT == 2
    config = tiny_config("mixtral")
    release, stores = threading.Event(), []
    gen = torch.Generator().manual_seed(0)
    with TransferEngine("cpu") as engine:
        submit = engine.submit

        def held_back(channel, fn, **kw):
            if channel == "kv_store":
                stores.append(fn)
                fn = lambda fn=fn: (release.wait(30), fn())[1]         # noqa: E731
            return submit(channel, fn, **kw)

        engine.submit = held_back
        cache = KVCache(config, specs=lambda i: KVSpec("host"), transfer=engine, micro_batch_size=1)
        ref = DynamicCache(config=config)
        k, v = torch.randn(3, 2, 5, 16, generator=gen), torch.randn(3, 2, 5, 16, generator=gen)
        got = []
        step = threading.Thread(target=lambda: got.append(cache.update(k, v, 0)))
        step.start()                                                   # three chunks: three commits
        for _ in range(3000):
            if cache.stats.counts["store_waits"] or not step.is_alive():
                break
            step.join(0.01)
        assert cache.stats.counts["store_waits"] == 1 and len(stores) == STORES_IN_FLIGHT
        release.set()
        step.join(30)
        assert not step.is_alive() and len(stores) == 3
        for x, y in zip(got[0], ref.update(k, v, 0)):
            assert torch.equal(x, y)
        k, v = torch.randn(3, 2, 1, 16, generator=gen), torch.randn(3, 2, 1, 16, generator=gen)
        for x, y in zip(cache.update(k, v, 0), ref.update(k, v, 0)):
            assert torch.equal(x, y)


def test_bad_kv_cache_kwargs_are_rule_errors_before_any_change():
    model = build_tiny_model("mixtral")
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    for bad, msg in [("{tier: tape}", "tier"), ("{tier: host, policy: streaming, sink: -1}", "sink"),
                     ("{tier: host, windw: 8}", "windw"), ("{tier: host, window: 8}", "policy: streaming")]:
        with pytest.raises(RuleError, match=msg):
            kinject.optimize(model, "rules/mixtral_kv_offload.yaml", [f"vars.kv={bad}"])
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before
    assert getattr(model, "kinject", None) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family,kv", [("mixtral", "host"), ("gpt_oss", "host"), ("deepseek_v3", "disk"),
                                       ("mixtral", "{tier: host, policy: streaming, sink: 4, window: 8}")])
def test_cuda_kv_offload_matches_reference(family, kv, tok, batch, tmp_path):
    cuda_batch = {k: v.cuda() for k, v in batch.items()}
    ref_model = build_tiny_model(family).cuda()
    try:
        ref = generate(ref_model, cuda_batch, tok)
        eager = False
    except (RuntimeError, NotImplementedError):        # no float32 grouped_mm kernel: eager experts
        ref_model.set_experts_implementation("eager")
        ref = generate(ref_model, cuda_batch, tok)
        eager = True
    if "streaming" in kv:
        ref = streaming_reference(ref_model, cuda_batch, tok, 4, 8, NEW)
    model = build_tiny_model(family)
    if eager:
        model.set_experts_implementation("eager")
    kinject.optimize(model, f"rules/{family}_kv_offload.yaml",
                     ["pipeline.device=cuda:0", f"vars.kv={kv}", f"pipeline.offload_dir={tmp_path}"])
    model.cuda()
    out = model.generate(**cuda_batch, max_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    cache = out.past_key_values
    chunk = cache.layers[0].chunks[0]
    if "disk" not in kv:
        assert all(t.device.type == "cpu" and t.is_pinned() for t in chunk.ring)
    model.kinject.transfer.synchronize(timeout=30)
    stats = group(model).stats.summary()
    assert stats["resident"] == 0 and stats["loads"] > 0
    sink = 4 if "streaming" in kv else 0
    assert stats["peak"] <= kv_bound(cache, batch["input_ids"].shape[1], outgoing_tokens=1 + sink)
    model.kinject.transfer.close()


def test_generate_keeps_the_cache_under_transformers_own_name(tok, batch):
    """``generate`` gets the KVCache under the name this transformers keeps its cache under (``cache``
    from 5.23, ``past_key_values`` before): no deprecated alias beside it (which made every step
    format the cache into a FutureWarning), and a cache the caller passes under either name is kept."""
    import warnings

    from transformers import DynamicCache

    from kinject.kv.generate import CACHE_KWARG

    model = build_tiny_model("qwen3_moe")
    ref = generate(model, batch, tok, new=4)
    kinject.optimize(model, "rules/qwen3_moe_kv_offload.yaml")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = model.generate(**batch, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id,
                             return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert isinstance(out.past_key_values, KVCache)
    assert not [w for w in seen if "past_key_values" in str(w.message)], [str(w.message)[:120] for w in seen]
    for name in dict.fromkeys((CACHE_KWARG, "past_key_values")):
        mine = DynamicCache(config=model.config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = model.generate(**batch, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id,
                                 return_dict_in_generate=True, **{name: mine})
        assert torch.equal(out.sequences, ref)
        assert out.past_key_values is mine                  # the caller's cache, not a KVCache
    kinject.restore(model)
