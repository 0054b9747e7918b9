"""``pipeline.prefill: micro_batch``: a batch group's prefill run one micro-batch at a time through
the whole model (:class:`kinject.kv.MicroBatchPrefill`), then decoded as one group with its KV
streamed per micro-batch. Same greedy tokens as transformers; every layer sees one micro-batch's
rows at the prefill (so its activations are one micro-batch's), the whole group's when decoding."""

import pytest
import torch

import kinject
from kinject.errors import RuleError
from kinject.kv import KVCache
from kinject.testing import build_tiny_model, tiny_batch

NEW = 5
ROWS = 7                 # micro-batches of 2: the last holds one row


def greedy(model, batch, tok):
    return model.generate(**batch, max_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id)


@pytest.fixture(scope="module")
def batch(tok):
    return tiny_batch(tok, ROWS, min_tokens=12)


def rows_per_layer_call(model):
    """Rows each decoder layer's call saw, per call: forward pre-hooks on every layer."""
    seen, hooks = [], []
    for layer in model.model.layers:
        hooks.append(layer.register_forward_pre_hook(
            lambda mod, args, kwargs: seen.append((args[0] if args else kwargs["hidden_states"]).shape[:2]),
            with_kwargs=True))
    return seen, hooks


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])      # full layers; sliding + full layers
def test_micro_batch_prefill_gives_identical_tokens_with_one_micro_batch_per_layer_call(family, tok, batch):
    model = build_tiny_model(family)
    ref = greedy(model, batch, tok)
    kinject.optimize(model, f"rules/{family}_klotski.yaml",     # a fast emulated link: KV copied in and out
                     ["vars.kv=host", "pipeline.micro_batch_size=2", "pipeline.prefill=micro_batch",
                      "pipeline.emulate_bandwidth=1000"])
    rt = model.kinject
    seen, hooks = rows_per_layer_call(model)
    steps = rt.scheduler.step
    out = greedy(model, batch, tok)
    for h in hooks:
        h.remove()
    assert torch.equal(out, ref)
    chunks = -(-ROWS // 2)
    layers = len(model.model.layers)
    prefill, decode = seen[:chunks * layers], seen[chunks * layers:]
    width = batch["input_ids"].shape[1]
    assert prefill == [torch.Size([2 if c < chunks - 1 else 1, width]) for c in range(chunks) for _ in range(layers)]
    assert decode == [torch.Size([ROWS, 1])] * (layers * (NEW - 1))
    assert rt.scheduler.step - steps == chunks + NEW - 1          # each chunk's forward is a pipeline step
    stats = rt.peek("attention").stats.summary()
    assert stats["stores"] == chunks * layers * NEW                 # every chunk's KV went to the host tier
    kinject.restore(model)
    assert "forward" not in model.__dict__
    assert torch.equal(greedy(model, batch, tok), ref)


def test_group_prefill_is_the_default_and_streaming_kv_prefills_the_group(tok, batch):
    model = build_tiny_model("mixtral")
    ref = greedy(model, batch, tok)
    kinject.optimize(model, "rules/mixtral_klotski.yaml", ["vars.kv=host", "pipeline.micro_batch_size=2"])
    seen, hooks = rows_per_layer_call(model)
    assert torch.equal(greedy(model, batch, tok), ref)
    assert seen[0][0] == ROWS                                         # group prefill: every row at once
    for h in hooks:
        h.remove()
    kinject.restore(model)

    # StreamingKV builds its masks from the whole batch's rows: it keeps the group prefill
    kinject.optimize(model, "rules/mixtral_klotski.yaml",
                     ["vars.kv={tier: host, policy: streaming, sink: 2, window: 64}", "pipeline.micro_batch_size=2",
                      "pipeline.prefill=micro_batch"])
    seen, hooks = rows_per_layer_call(model)
    greedy(model, batch, tok)
    assert seen[0][0] == ROWS
    for h in hooks:
        h.remove()
    kinject.restore(model)


def test_a_plain_forward_and_a_foreign_cache_run_unchanged(tok, batch):
    model = build_tiny_model("mixtral")
    with torch.no_grad():
        ref = model(**batch).logits
    kinject.optimize(model, "rules/mixtral_klotski.yaml",
                     ["vars.kv=host", "pipeline.micro_batch_size=2", "pipeline.prefill=micro_batch"])
    seen, hooks = rows_per_layer_call(model)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, ref, atol=1e-5, rtol=0)   # a DynamicCache: whole batch
    assert seen[0][0] == ROWS
    for h in hooks:
        h.remove()
    kinject.restore(model)


def test_cache_window_is_cleared_when_a_chunk_fails(tok, batch):
    model = build_tiny_model("mixtral")
    kinject.optimize(model, "rules/mixtral_klotski.yaml",
                     ["vars.kv=host", "pipeline.micro_batch_size=2", "pipeline.prefill=micro_batch"])
    caches, calls = [], []
    layer = model.model.layers[-1]

    def fail_on_third_chunk(mod, args, kwargs):
        cache = next((v for v in kwargs.values() if isinstance(v, KVCache)), None)
        if cache is not None and cache.window is not None:
            caches.append(cache)
            calls.append(cache.window)
            if cache.window == 2:
                raise RuntimeError("boom")

    hook = layer.register_forward_pre_hook(fail_on_third_chunk, with_kwargs=True)
    with pytest.raises(RuntimeError, match="boom"):
        greedy(model, batch, tok)
    hook.remove()
    assert calls == [0, 1, 2] and caches[-1].window is None
    kinject.restore(model)


def test_unknown_prefill_mode_is_refused_naming_the_key():
    model = build_tiny_model("mixtral")
    with pytest.raises(RuleError, match="prefill"):
        kinject.optimize(model, "rules/mixtral_klotski.yaml", ["pipeline.prefill=chunks"])
    assert not hasattr(model, "kinject")
