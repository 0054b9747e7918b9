"""``pipeline.decode_chunk``: a decode step's attention over several micro-batches at once, their KV
loaded as one chunk (:meth:`kinject.kv.layer.KVLayer.span`). Tokens stay the untouched model's; the
KV bytes moved stay those of one load and one store per micro-batch; the device KV stays within two
chunks (one computing, one loading) and the stores in flight; a set value that does not fit
``pipeline.kv_budget`` is an error."""

import pytest
import torch

import kinject
from kinject.errors import RuleError
from kinject.errors import KinjectError
from kinject.kv.spec import STORES_IN_FLIGHT
from kinject.testing import build_tiny_model, tiny_batch, tiny_tokenizer
from operators.attention import OffloadedAttention

NEW = 6
LINK = "pipeline.emulate_bandwidth=1000"     # GB/s: the host tier across a link that copies without slowing the tests


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def batch(tok):
    return tiny_batch(tok, 13, min_tokens=16)          # 13 rows, left-padded: micro-batches 4, 4, 4, 1


def run(model, batch, tok, overrides):
    """Greedy tokens, KV statistics and layer 0's attention calls per forward of one generate."""
    kinject.optimize(model, "rules/mixtral_kv_offload.yaml", [LINK, "pipeline.micro_batch_size=4", *overrides])
    try:
        op = next(op for op in model.kinject.operators if isinstance(op, OffloadedAttention) and op.layer_idx == 0)
        calls = []
        hook = op.base.register_forward_pre_hook(lambda m, a, kw: calls.append(kw["hidden_states"].shape[0]),
                                                 with_kwargs=True)
        out = model.generate(**batch, max_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id,
                             return_dict_in_generate=True)
        hook.remove()
        model.kinject.transfer.synchronize(timeout=30)
        stats = model.kinject.shared("attention", None).stats.summary()
        return out.sequences, stats, calls, out.past_key_values
    finally:
        kinject.restore(model)


def test_decode_chunks_give_the_same_tokens_and_kv_bytes_in_fewer_attention_calls(tok, batch):
    model = build_tiny_model("mixtral")
    ref = model.generate(**batch, max_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id)
    one, s1, calls1, _ = run(model, batch, tok, [])
    two, s2, calls2, cache2 = run(model, batch, tok, ["pipeline.decode_chunk=2"])
    auto, sa, callsa, _ = run(model, batch, tok, ["pipeline.decode_chunk=auto"])     # no kv_budget: every row at once
    assert torch.equal(one, ref) and torch.equal(two, ref) and torch.equal(auto, ref)
    for key in ("loads", "load_bytes", "stores", "store_bytes", "micro_batches"):
        assert s1[key] == s2[key] == sa[key], key
    assert calls1 == [4, 4, 4, 1] * NEW
    assert calls2 == [4, 4, 4, 1] + [8, 5] * (NEW - 1)
    assert callsa == [4, 4, 4, 1] + [13] * (NEW - 1)
    assert s2["resident"] == sa["resident"] == 0
    # each decode step's first load is issued as its forward begins and found by its attention
    assert s1["prefetch_stale"] == s2["prefetch_stale"] == sa["prefetch_stale"] == 0
    # two decode chunks of 8 rows at the longest length, plus the stores in flight (or the prefill's buffers)
    layer = cache2.layers[0]
    per_row = layer.row_bytes(layer.chunks[0]) // 4
    prompt = batch["input_ids"].shape[1]
    bound = max(2 * 8 * layer.seen * per_row + STORES_IN_FLIGHT * 4 * per_row, (STORES_IN_FLIGHT + 1) * 4 * prompt * per_row)
    assert s1["peak"] < s2["peak"] <= bound


def test_auto_takes_the_most_micro_batches_kv_budget_fits_and_a_set_value_must_fit(tok, batch):
    model = build_tiny_model("mixtral")
    ref = model.generate(**batch, max_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id)
    _, _, _, cache = run(model, batch, tok, ["pipeline.decode_chunk=2"])
    room = cache.decode_chunk_bytes(2)
    assert cache.decode_chunk_bytes(1) < room < cache.decode_chunk_bytes(3)
    out, stats, calls, _ = run(model, batch, tok, ["pipeline.decode_chunk=auto", f"pipeline.kv_budget={room}"])
    assert torch.equal(out, ref) and calls[4:] == [8, 5] * (NEW - 1)
    with pytest.raises(KinjectError, match=r"pipeline.decode_chunk: 3 micro-batches .* pipeline.kv_budget"):
        run(model, batch, tok, ["pipeline.decode_chunk=3", f"pipeline.kv_budget={room}"])
    with pytest.raises(Exception, match="decode_chunk must be a positive integer or 'auto'"):
        kinject.optimize(model, "rules/mixtral_kv_offload.yaml", ["pipeline.decode_chunk=0"])
    with pytest.raises(RuleError, match=r"key 'pipeline.decode_chunk': expected int or str, got True"):
        kinject.optimize(model, "rules/mixtral_kv_offload.yaml", ["pipeline.decode_chunk=true"])   # not read as 1


def test_a_decode_chunks_load_waits_for_each_micro_batchs_last_store_then_copies_non_blocking(tok, batch,
                                                                                              monkeypatch):
    """The hazard a GPU would show: a decode chunk's one load reads every one of its micro-batches'
    stored entries, so (on the kv_load stream, CUDA) it must wait for each one's previous store
    before its first copy -- the host ring is written by those device->host copies -- and its copies
    are ``non_blocking`` (from pinned memory on CUDA)."""
    model = build_tiny_model("mixtral")
    _, _, _, cache = run(model, batch, tok, ["pipeline.decode_chunk=2"])
    layer, events = cache.layers[0], []

    class Stored:                                  # a micro-batch's last store
        def __init__(self, j):
            self.j = j

        def wait(self, *args, **kwargs):
            events.append(("store waited", self.j))

    class Transfer:                                # runs the load now
        def submit(self, channel, fn, **kwargs):
            events.append(("issued", channel))
            fn()

    for j, chunk in enumerate(layer.chunks):
        chunk.last_store = Stored(j)
    layer.arena.transfer = Transfer()
    copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda t, src, non_blocking=False:
                        events.append(("copy", non_blocking)) or copy(t, src, non_blocking=non_blocking))
    work = layer._issue(0, 1)
    monkeypatch.undo()
    assert layer.span(0) == 2 and len(work.subs) == 2
    assert events[:3] == [("issued", "kv_load"), ("store waited", 0), ("store waited", 1)]
    assert events[3:] and set(events[3:]) == {("copy", True)}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("family,kv", [("gpt_oss", "host"), ("deepseek_v3", "disk"),
                                       ("mixtral", "{tier: host, policy: streaming, sink: 4, window: 8}")])
def test_decode_chunks_serve_sliding_mla_disk_and_streaming_layers(family, kv, device, tok, batch, tmp_path):
    """Sliding layers (rings), MLA entries on the disk tier, StreamingKV (sinks, its masks by rows):
    decode chunks of 2 micro-batches give the tokens and KV bytes of one micro-batch at a time. On
    CUDA each decode chunk lands in one device buffer (disk: staged through pinned memory), its
    micro-batches stored from their rows of it."""
    cuda = device != "cpu"
    batch = {k: v.to(device) for k, v in batch.items()}
    outs, stats = [], []
    for dc in (1, 2):
        model = build_tiny_model(family)           # (the same random weights each time)
        if cuda:                                   # (no float32 grouped_mm kernel on every GPU)
            model.set_experts_implementation("eager")
        kinject.optimize(model, f"rules/{family}_kv_offload.yaml", [f"pipeline.device={device}" if cuda else LINK,
                                                                    "pipeline.micro_batch_size=4",
                                                                    f"vars.kv={kv}", f"pipeline.offload_dir={tmp_path}",
                                                                    f"pipeline.decode_chunk={dc}"])
        if cuda:
            model.to(device)
        outs.append(model.generate(**batch, max_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id))
        model.kinject.transfer.synchronize(timeout=30)
        stats.append(model.kinject.shared("attention", None).stats.summary())
        model.kinject.transfer.close()
    assert torch.equal(outs[0], outs[1])
    for key in ("loads", "load_bytes", "stores", "store_bytes", "micro_batches"):
        assert stats[0][key] == stats[1][key], key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_decode_chunks_match_one_micro_batch_at_a_time(tok, batch, tmp_path):
    """On CUDA: the decode chunk's KV lands in one device buffer from pinned host storage (non_blocking,
    by stream), and each micro-batch's new entries are stored from its rows of it."""
    cuda_batch = {k: v.cuda() for k, v in batch.items()}
    outs = []
    for dc in (1, "auto"):
        model = build_tiny_model("mixtral")
        model.set_experts_implementation("eager")
        kinject.optimize(model, "rules/mixtral_kv_offload.yaml", ["pipeline.device=cuda:0", "pipeline.micro_batch_size=4",
                                                                  f"pipeline.offload_dir={tmp_path}",
                                                                  f"pipeline.decode_chunk={dc}"])
        model.cuda()
        outs.append(model.generate(**cuda_batch, max_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id))
        model.kinject.transfer.synchronize(timeout=30)
        assert model.kinject.shared("attention", None).stats.summary()["resident"] == 0
        model.kinject.transfer.close()
    assert torch.equal(outs[0], outs[1])


def test_cpu_working_buffers_are_reused_once_committed_and_no_view_of_them_is_alive():
    """On a CPU device a KV load's working buffer (room for the generate's capacity) is reused once
    given back, never while a view of it (keys or values its attention's caller kept) is alive."""
    from kinject.engine.transfer import TransferEngine
    from kinject.kv import KVCache, KVSpec
    from kinject.testing import tiny_config

    with TransferEngine("cpu") as engine:
        cache = KVCache(tiny_config("mixtral"), specs=lambda i: KVSpec("host"), transfer=engine, capacity=32)
        buf, owner = cache.arena.working(10, (4, 2, 16), torch.float32)
        assert buf.shape == (10, 4, 2, 16) and owner.shape == (32, 4, 2, 16) and buf.data_ptr() == owner.data_ptr()
        del buf                                 # committed: nothing reads the load's view any more
        cache.arena.give_back([owner])
        again, same = cache.arena.working(11, (4, 2, 16), torch.float32)
        assert same is owner and again.shape[0] == 11
        kept = again[:, :2]                     # a view someone still reads
        del again
        cache.arena.give_back([same])
        fresh, other = cache.arena.working(11, (4, 2, 16), torch.float32)
        assert other is not owner and fresh.data_ptr() != kept.data_ptr()
