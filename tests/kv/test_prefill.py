"""``pipeline.prefill: micro_batch``: a batch group's prefill run one micro-batch at a time through
the whole model (:class:`kinject.kv.MicroBatchPrefill`), then decoded as one group with its KV
streamed per micro-batch; ``pipeline.prefill: layer``: each layer runs every micro-batch before the
next layer, its weights loaded once for the group. Same greedy tokens as transformers; every layer sees one micro-batch's
rows at the prefill (so its activations are one micro-batch's), the whole group's when decoding."""

import contextlib
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


@contextlib.contextmanager
def rows_seen(modules, label=lambda i, shape: shape):
    """Yield the list of ``label(i, rows)`` for each call of ``modules[i]`` (its hidden states' leading
    shape); the forward pre-hooks are removed on exit, whatever happens inside."""
    seen = []
    hooks = [m.register_forward_pre_hook(
        lambda mod, args, kwargs, i=i: seen.append(label(i, (args[0] if args else kwargs["hidden_states"]).shape)),
        with_kwargs=True) for i, m in enumerate(modules)]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def rows_per_layer_call(model):
    """Rows x width each decoder layer's call saw, per call."""
    return rows_seen(model.model.layers, lambda i, shape: shape[:2])


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])      # full layers; sliding + full layers
def test_micro_batch_prefill_gives_identical_tokens_with_one_micro_batch_per_layer_call(family, tok, batch):
    model = build_tiny_model(family)
    ref = greedy(model, batch, tok)
    kinject.optimize(model, f"rules/{family}_klotski.yaml",     # a fast emulated link: KV copied in and out
                     ["vars.kv=host", "pipeline.micro_batch_size=2", "pipeline.prefill=micro_batch",
                      "pipeline.emulate_bandwidth=1000"])
    rt = model.kinject
    steps = rt.scheduler.step
    with rows_per_layer_call(model) as seen:
        out = greedy(model, batch, tok)
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


def prefill_bytes(model, batch, tok, rules, overrides):
    """Bytes the link moved for a prefill (generate of 1 token) and its greedy tokens, under ``overrides``."""
    kinject.optimize(model, rules, ["vars.kv=host", "pipeline.micro_batch_size=2", "pipeline.emulate_bandwidth=1000",
                                    *overrides])
    stats = model.kinject.transfer.stats["bytes"]
    before = sum(stats.values())
    model.generate(**batch, max_new_tokens=1, do_sample=False, pad_token_id=tok.pad_token_id)
    moved = sum(stats.values()) - before
    kinject.restore(model)
    return moved


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_layer_prefill_runs_each_layer_per_micro_batch_and_moves_each_weight_once(family, tok, batch):
    """Klotski's order: layer i runs every micro-batch of the group, then layer i + 1; the weights a
    layer's micro-batches used stay until its last one, so the prefill moves exactly what the group
    prefill moves (every offloaded weight once), not once per micro-batch as prefill: micro_batch does."""
    model = build_tiny_model(family)
    ref = greedy(model, batch, tok)
    rules = f"rules/{family}_klotski.yaml"
    group = prefill_bytes(model, batch, tok, rules, [])
    by_chunk = prefill_bytes(model, batch, tok, rules, ["pipeline.prefill=micro_batch"])
    # plus the group's hidden states staged through the host tier between layers: every layer's output
    # but the last's out, every layer's input but the first's in
    layers, (rows, width) = len(model.model.layers), batch["input_ids"].shape
    hidden = 2 * (layers - 1) * rows * width * model.config.hidden_size * 4
    assert prefill_bytes(model, batch, tok, rules, ["pipeline.prefill=layer"]) == group + hidden < by_chunk

    kinject.optimize(model, rules, ["vars.kv=host", "pipeline.micro_batch_size=2", "pipeline.prefill=layer",
                                    "pipeline.emulate_bandwidth=1000"])
    rt = model.kinject
    steps = rt.scheduler.step
    with rows_seen([layer.mlp for layer in model.model.layers], lambda i, shape: (i, shape[0])) as seen:
        out = greedy(model, batch, tok)                             # (layer, rows) each MoE block's call saw
    assert torch.equal(out, ref)
    chunks = -(-ROWS // 2)
    sizes = [2 if c < chunks - 1 else 1 for c in range(chunks)]
    assert seen[:layers * chunks] == [(i, n) for i in range(layers) for n in sizes]        # layer-major
    assert seen[layers * chunks:] == [(i, ROWS) for i in range(layers)] * (NEW - 1)
    assert rt.scheduler.step - steps == NEW                        # the prefill is one pipeline step
    assert rt.peek("attention").stats.summary()["stores"] == chunks * layers * NEW
    assert rt.store._holding is None                                  # no hold left open
    kinject.restore(model)
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)
    assert torch.equal(greedy(model, batch, tok), ref)


def test_layer_prefill_under_a_device_budget_keeps_each_layers_weights_until_its_last_micro_batch(tok, batch):
    """With a budget a little over one layer's weights, prefetches of the next layers must not evict
    the units this layer's micro-batches hold (TensorStore.hold): the weights still move once."""
    model = build_tiny_model("mixtral")
    rules, budget = "rules/mixtral_klotski.yaml", ["pipeline.device_budget=550000"]
    layers, (rows, width) = len(model.model.layers), batch["input_ids"].shape
    hidden = 2 * (layers - 1) * rows * width * model.config.hidden_size * 4
    group = prefill_bytes(model, batch, tok, rules, budget)
    assert prefill_bytes(model, batch, tok, rules, [*budget, "pipeline.prefill=layer"]) == group + hidden


def test_group_prefill_is_the_default_and_streaming_kv_prefills_the_group(tok, batch):
    model = build_tiny_model("mixtral")
    ref = greedy(model, batch, tok)
    kinject.optimize(model, "rules/mixtral_klotski.yaml", ["vars.kv=host", "pipeline.micro_batch_size=2"])
    with rows_per_layer_call(model) as seen:
        assert torch.equal(greedy(model, batch, tok), ref)
    assert seen[0][0] == ROWS                                         # group prefill: every row at once
    kinject.restore(model)

    # StreamingKV builds its masks from the whole batch's rows: it keeps the group prefill
    kinject.optimize(model, "rules/mixtral_klotski.yaml",
                     ["vars.kv={tier: host, policy: streaming, sink: 2, window: 64}", "pipeline.micro_batch_size=2",
                      "pipeline.prefill=micro_batch"])
    with rows_per_layer_call(model) as seen:
        greedy(model, batch, tok)
    assert seen[0][0] == ROWS
    kinject.restore(model)


def test_a_plain_forward_and_a_foreign_cache_run_unchanged(tok, batch):
    model = build_tiny_model("mixtral")
    with torch.no_grad():
        ref = model(**batch).logits
    kinject.optimize(model, "rules/mixtral_klotski.yaml",
                     ["vars.kv=host", "pipeline.micro_batch_size=2", "pipeline.prefill=micro_batch"])
    with rows_per_layer_call(model) as seen, torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, ref, atol=1e-5, rtol=0)   # a DynamicCache: whole batch
    assert seen[0][0] == ROWS
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
            if cache.window == range(2, 3):
                raise RuntimeError("boom")

    hook = layer.register_forward_pre_hook(fail_on_third_chunk, with_kwargs=True)
    with pytest.raises(RuntimeError, match="boom"):
        greedy(model, batch, tok)
    hook.remove()
    assert calls == [range(j, j + 1) for j in range(3)] and caches[-1].window is None
    kinject.restore(model)


def test_unknown_prefill_mode_is_refused_naming_the_key():
    model = build_tiny_model("mixtral")
    with pytest.raises(RuleError, match="prefill"):
        kinject.optimize(model, "rules/mixtral_klotski.yaml", ["pipeline.prefill=chunks"])
    assert not hasattr(model, "kinject")


def test_layer_prefill_copies_the_next_micro_batchs_hidden_rows_while_this_one_computes(tok, batch):
    """Staged between layers in the host tier, micro-batch j + 1's hidden rows are on their way to
    the device before micro-batch j's layer call computes (not copied and waited for just before
    their own call)."""
    model = build_tiny_model("mixtral")
    ref = greedy(model, batch, tok)
    kinject.optimize(model, "rules/mixtral_klotski.yaml", ["vars.kv=host", "pipeline.micro_batch_size=2",
                                                            "pipeline.prefill=layer", "pipeline.emulate_bandwidth=100",
                                                            "pipeline.trace=true"])
    assert torch.equal(greedy(model, batch, tok), ref)
    rt = model.kinject
    start, end = rt.tracer.steps()[0]                 # the prefill
    events = [e for e in rt.tracer.events() if start <= e.start <= end]
    rows = [f"{r}:{min(r + 2, ROWS)}" for r in range(0, ROWS, 2)]
    last_in, checked = None, 0
    for e in events:
        if e.name.startswith("hidden rows") and e.name.endswith(" in"):
            last_in = e.name.split()[2]
        elif e.stream == "compute" and ".self_attn rows " in e.name and not e.name.startswith("model.layers.0."):
            j = rows.index(e.name.rsplit(" ", 1)[1])
            if j + 1 < len(rows):
                assert last_in == rows[j + 1], (e.name, last_in)
                checked += 1
    assert checked == (len(model.model.layers) - 1) * (len(rows) - 1)
    kinject.restore(model)


def _loop_block_mixtral():
    from test_any_family import _legacy_mixtral          # Mixtral as transformers 4 wrote it: a loop over a ModuleList
    return _legacy_mixtral()


MODELS = {"mixtral": (lambda: build_tiny_model("mixtral"), "rules/mixtral_klotski.yaml"),
          "gpt_oss": (lambda: build_tiny_model("gpt_oss"), "rules/gpt_oss_klotski.yaml"),   # sliding + full layers
          "loop_block": (_loop_block_mixtral, "rules/klotski.yaml")}


@pytest.mark.parametrize("family", sorted(MODELS))
def test_layer_prefill_in_windows_runs_each_layers_experts_once_over_the_group(family, tok, batch):
    """``pipeline.prefill_chunk``: each layer call of a layer-wise prefill takes that many
    micro-batches; the attention still runs per micro-batch inside it, the experts once over all the
    window's tokens. With every micro-batch in one window each layer's experts run once per prefill
    (as transformers runs them), the tokens are transformers' and the link moves the same bytes."""
    from operators.attention import OffloadedAttention
    from operators.experts import GroupedExperts

    build, rules = MODELS[family]
    model = build()
    ref = greedy(model, batch, tok)
    chunks = -(-ROWS // 2)
    one = prefill_bytes(model, batch, tok, rules, ["pipeline.prefill=layer"])
    for k, windows in ((chunks, [ROWS]), (2, [4, ROWS - 4])):
        overrides = ["pipeline.prefill=layer", f"pipeline.prefill_chunk={k}"]
        assert prefill_bytes(model, batch, tok, rules, overrides) == one     # weights once, hidden states staged alike
        kinject.optimize(model, rules, ["vars.kv=host", "pipeline.micro_batch_size=2", "pipeline.emulate_bandwidth=1000",
                                        *overrides])
        rt = model.kinject
        experts = [op for op in rt.operators if isinstance(op, GroupedExperts)]
        attention = [op.base for op in rt.operators if isinstance(op, OffloadedAttention)]
        assert len(experts) == len(attention) == len(model.model.layers)
        width = batch["input_ids"].shape[1]
        with rows_seen(experts, lambda i, shape: (i, shape[0] // width if len(shape) == 2 else shape[0])) as ex, \
                rows_seen(attention, lambda i, shape: (i, shape[0])) as at:
            model.generate(**batch, max_new_tokens=1, do_sample=False, pad_token_id=tok.pad_token_id)   # the prefill
        layers = range(len(experts))
        assert ex == [(i, n) for i in layers for n in windows]              # each window's tokens in one call
        assert at == [(i, 2 if c < chunks - 1 else 1) for i in layers for c in range(chunks)]   # per micro-batch
        assert torch.equal(greedy(model, batch, tok), ref)
        assert rt.store._holding is None
        kinject.restore(model)
    assert torch.equal(greedy(model, batch, tok), ref)


def test_prefill_chunk_must_be_a_positive_integer():
    model = build_tiny_model("mixtral")
    with pytest.raises(RuleError, match="prefill_chunk"):
        kinject.optimize(model, "rules/mixtral_klotski.yaml", ["pipeline.prefill_chunk=0"])
    assert not hasattr(model, "kinject")


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [1, 2])
def test_cuda_layer_prefill_stages_hidden_rows_in_pinned_memory(chunk, tok, batch, monkeypatch):
    """On CUDA: a layer-wise prefill (``prefill_chunk`` 1 and 2 micro-batches per layer call) with the
    group's hidden states in pinned host memory between layers -- the next window's rows copied on
    the kv_load stream while this window computes, its output back on kv_store, each waited on by
    event -- and the KV in the host tier: transformers' tokens on the same GPU."""
    from kinject.kv.generate import HiddenStaging
    from test_klotski import cuda_reference

    cuda_batch = {k: v.cuda() for k, v in batch.items()}
    ref = cuda_reference("mixtral", cuda_batch, tok, new=NEW)
    staged, to_device = [], HiddenStaging.to_device

    def counted(self, x, label):
        staged.append(x.is_pinned())
        return to_device(self, x, label)

    monkeypatch.setattr(HiddenStaging, "to_device", counted)
    model = build_tiny_model("mixtral")
    kinject.optimize(model, "rules/mixtral_klotski.yaml", ["pipeline.device=cuda:0", "vars.kv=host",
                                                            "pipeline.micro_batch_size=2", "pipeline.prefill=layer",
                                                            f"pipeline.prefill_chunk={chunk}"])
    model.cuda()
    assert torch.equal(greedy(model, cuda_batch, tok), ref)
    windows = -(-ROWS // (2 * chunk))
    assert len(staged) == (len(model.model.layers) - 1) * windows and all(staged)   # from pinned host rows
    rt = model.kinject
    assert rt.store._holding is None and all(u.refs == 0 for u in rt.store.units.values())
    rt.transfer.close()
