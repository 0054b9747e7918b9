"""OffloadedAttention(compute="host"): decode attention on the host over the host-tier KV (CGOPipe).

Identical greedy tokens to transformers on the built-in model (GQA: 4 query heads, 2 KV heads,
rules/klotski.yaml), on GPT-OSS (sliding + full layers, sinks), DeepSeek-V3 (MLA: keys and values of
different widths) and with beams; StreamingKV gives the same tokens as the same policy computed on
the device. After the prefill no KV byte crosses the link: the transfer engine's kv_load / kv_store
counters do not move during decode steps, while the host lane carries the activations.
"""

import io
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import kinject
from kinject.errors import KinjectError, RuleError
from kinject.families import build_tiny_family_model
from kinject.fixtures import tiny_moe_path
from kinject.kv import KVCache, KVSpec
from kinject.testing import build_tiny_model, tiny_batch, tiny_tokenizer
from operators import host_attention
from operators.attention import OffloadedAttention

NEW = 10
# a link to save the KV's bytes on: with none (a CPU device, no emulation) a host-tier KV is used in
# place by every attention, so compute: host would have nothing to show
LINK = "pipeline.emulate_bandwidth=1000"
ON_DEVICE = ["rules.2.replace.kwargs.compute=host", "pipeline.micro_batch_size=2"]     # rules/kv_offload.yaml
HOST = ON_DEVICE + [LINK]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def batch(tok):
    return tiny_batch(tok, 5, min_tokens=10)          # 5 rows (not a multiple of 2), left-padded


def generate(model, batch, pad, new=NEW, **kw):
    return model.generate(**batch, max_new_tokens=new, do_sample=False, pad_token_id=pad, **kw)


def kv_bytes(model) -> int:
    b = model.kinject.transfer.stats["bytes"]
    return b["kv_load"] + b["kv_store"]


def test_builtin_model_host_attention_identical_tokens_and_no_kv_moved_in_decode():
    tokenizer = AutoTokenizer.from_pretrained(tiny_moe_path())
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_path(), dtype=torch.float32)
    prompts = ["def main(args):\n    return", "import os\nimport sys\n", "class Reader:\n    def"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    ref = generate(model, batch, tokenizer.pad_token_id)
    kinject.optimize(model, "rules/klotski.yaml", ["rules.0.replace.kwargs.compute=host", "pipeline.trace=true", LINK])
    ops = [op for op in model.kinject.operators if isinstance(op, OffloadedAttention)]
    assert ops and all(op.kv.compute == "host" and op.kv.tier == "host" for op in ops)

    generate(model, batch, tokenizer.pad_token_id, new=1)          # the prefill alone (on the device): KV stored once
    prefill_kv = kv_bytes(model)
    assert prefill_kv > 0 and sum(op.host.stats["calls"] for op in ops) == 0
    out = generate(model, batch, tokenizer.pad_token_id)
    assert torch.equal(out, ref)
    # the second generate's prefill stores its KV once more; its NEW - 1 decode steps move none
    assert kv_bytes(model) == 2 * prefill_kv
    group = model.kinject.peek("attention")
    assert group.stats.summary()["load_bytes"] == 0
    calls = (NEW - 1) * len(ops) * 2                                  # decode steps x layers x micro-batches (3 rows, 2)
    assert sum(op.host.stats["calls"] for op in ops) == calls
    assert group.lane.stats["to_device"] == calls                    # one output back per call
    text = model.kinject.report(file=io.StringIO())
    assert f"host attention (compute: host, {len(ops)} layers): {calls} micro-batch calls" in text
    assert "KV moved for them 0 B" in text
    assert sum(e.stream == "host_compute" for e in model.kinject.tracer.events()) == calls


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_families_host_attention_identical_tokens(family, tok, batch):
    """GPT-OSS: sliding window 16 (the prompts + NEW pass it: the ring wraps) beside full layers,
    attention sinks passed to its own eager function; DeepSeek-V3: MLA's keys and values differ in width."""
    model = build_tiny_model(family)
    ref = generate(model, batch, tok.pad_token_id, new=2 * NEW)
    kinject.optimize(model, "rules/kv_offload.yaml", HOST)
    out = generate(model, batch, tok.pad_token_id, new=2 * NEW, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert model.kinject.transfer.stats["bytes"]["kv_load"] == 0
    cache = out.past_key_values
    if family == "gpt_oss":
        assert cache.is_sliding[0] and cache.layers[0].seen > cache.layers[0].sliding_window


def test_beams_and_sdpa(tok, batch):
    model = build_tiny_model("mixtral")
    model.set_attn_implementation("sdpa")
    ref = generate(model, batch, tok.pad_token_id, num_beams=3)
    kinject.optimize(model, "rules/kv_offload.yaml", HOST)
    assert torch.equal(generate(model, batch, tok.pad_token_id, num_beams=3), ref)
    assert model.kinject.transfer.stats["bytes"]["kv_load"] == 0


def test_streaming_kv_on_the_host_matches_the_device(tok, batch):
    streaming = "vars.kv={tier: host, policy: streaming, sink: 2, window: 6}"
    outs, moved = [], []
    for compute in ("device", "host"):
        model = build_tiny_model("mixtral")
        kinject.optimize(model, "rules/kv_offload.yaml",
                         [f"rules.2.replace.kwargs.compute={compute}", "pipeline.micro_batch_size=2", streaming, LINK])
        outs.append(generate(model, batch, tok.pad_token_id, new=12))
        moved.append(model.kinject.transfer.stats["bytes"]["kv_load"])
    assert torch.equal(outs[0], outs[1])
    assert moved[0] > 0 and moved[1] == 0


def test_mixed_attention_model_attention_layers_on_the_host(tok):
    """Qwen3-Next: gated-delta-net layers (LinearAttentionLayer, served on the device per micro-batch)
    beside attention layers computed on the host."""
    model = build_tiny_family_model("qwen3_next")
    batch = tiny_batch(tok, 3, min_tokens=8)
    ref = generate(model, batch, 0, new=6)
    kinject.optimize(model, "rules/klotski.yaml", ["rules.0.replace.kwargs.compute=host", LINK])
    assert torch.equal(generate(model, batch, 0, new=6), ref)
    assert any(op.host.stats["calls"] for op in model.kinject.operators if isinstance(op, OffloadedAttention))


@pytest.mark.parametrize("family,what", [
    ("glm_moe_dsa", "cache layer 0 is a DynamicIndexedLayer"),
    ("minimax", "MiniMaxLightningAttention has no config"),
])
def test_cache_kinds_host_compute_cannot_serve_are_refused_at_optimize(family, what):
    model = build_tiny_family_model(family)
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    with pytest.raises(KinjectError, match=what) as info:
        kinject.optimize(model, "rules/klotski.yaml", ["rules.0.replace.kwargs.compute=host", LINK])
    assert "self_attn" in str(info.value)                             # names the module
    assert getattr(model, "kinject", None) is None
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before


def test_bad_compute_kwargs_are_rule_errors():
    model = build_tiny_model("mixtral")
    with pytest.raises(RuleError, match="compute"):
        kinject.optimize(model, "rules/kv_offload.yaml", ["rules.2.replace.kwargs.compute=gpu"])
    with pytest.raises(RuleError, match="needs kv_cache tier host"):
        kinject.optimize(model, "rules/kv_offload.yaml", ["rules.2.replace.kwargs.compute=host", "vars.kv=device"])
    config = build_tiny_family_model("qwen3_next").config
    with pytest.raises(KinjectError, match="cache layer 0 is a LinearAttentionLayer"):
        KVCache(config, specs=lambda i: KVSpec("host", compute="host"), transfer=object())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_cuda_host_attention_matches_reference(family, tok, batch):
    """On CUDA: projections on the GPU, the attention core on the host over pinned host KV, the
    query / output through the host lane's pinned buffers on its own stream; identical greedy tokens
    to the untouched model on the GPU, and no KV byte moved after the prefill."""
    cuda_batch = {k: v.cuda() for k, v in batch.items()}
    ref_model = build_tiny_model(family).cuda()
    try:
        ref = generate(ref_model, cuda_batch, tok.pad_token_id, new=2 * NEW)
        eager = False
    except (RuntimeError, NotImplementedError):        # no float32 grouped_mm kernel: eager experts
        ref_model.set_experts_implementation("eager")
        ref = generate(ref_model, cuda_batch, tok.pad_token_id, new=2 * NEW)
        eager = True
    model = build_tiny_model(family)
    if eager:
        model.set_experts_implementation("eager")
    kinject.optimize(model, "rules/kv_offload.yaml", ON_DEVICE + ["pipeline.device=cuda:0"])
    model.cuda()
    generate(model, cuda_batch, tok.pad_token_id, new=1)
    model.kinject.transfer.synchronize(timeout=30)
    prefill_kv = kv_bytes(model)
    out = generate(model, cuda_batch, tok.pad_token_id, new=2 * NEW, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    model.kinject.transfer.synchronize(timeout=30)
    assert kv_bytes(model) == 2 * prefill_kv
    assert all(t.device.type == "cpu" and t.is_pinned() for t in out.past_key_values.layers[0].chunks[0].ring)
    lane = model.kinject.peek("attention").lane
    assert lane.cuda and lane.stats["to_device"] == (2 * NEW - 1) * model.config.num_hidden_layers * 3
    model.kinject.transfer.close()


def test_micro_batches_pipelined_host_attention_overlaps_the_next_projections(tok, batch):
    """The CUDA schedule, run on CPU (``overlap`` forced): micro-batch j's host attention waits until
    micro-batch j+1's query projection has run -- possible only if j+1 started while j's attention was
    on the host (the sequential schedule would time out) -- and the tokens stay identical."""
    model = build_tiny_model("mixtral")
    ref = generate(model, batch, tok.pad_token_id, new=4)
    kinject.optimize(model, "rules/kv_offload.yaml", HOST)
    ops = [op for op in model.kinject.operators if isinstance(op, OffloadedAttention)]
    log, cond, overlapped = [], threading.Condition(), []

    def label(module):                                  # "<key> rows a:b" of the micro-batch this thread runs
        call = host_attention._active().get(id(module))
        return call.label if call is not None else None

    for op in ops:
        op.host.overlap = True
        base = op.base

        def projected(_module, _args, base=base):
            with cond:
                log.append(label(base))
                cond.notify_all()

        base.q_proj.register_forward_pre_hook(projected)

        def gated(module, query, *args, eager=op.host.eager, **kwargs):
            mine = label(module)
            a, b = map(int, mine.rsplit(" ", 1)[1].split(":"))
            if b < 5:                                   # rows 0:2, 2:4 (then 4:5): a next micro-batch exists
                nxt = f"{mine.rsplit(' ', 1)[0]} {b}:{min(b + 2, 5)}"
                with cond:
                    at = len(log) - log[::-1].index(mine)
                    overlapped.append(cond.wait_for(lambda: nxt in log[at:], timeout=10))
            return eager(module, query, *args, **kwargs)

        op.host.eager = gated
    assert torch.equal(generate(model, batch, tok.pad_token_id, new=4), ref)
    assert len(overlapped) == 3 * len(ops) * 2 and all(overlapped)     # 3 decode steps x layers x 2 micro-batches


def test_a_failing_pipelined_micro_batch_raises_and_leaves_the_model_usable(tok, batch):
    model = build_tiny_model("mixtral")
    ref = generate(model, batch, tok.pad_token_id, new=3)
    kinject.optimize(model, "rules/kv_offload.yaml", HOST)
    op = next(op for op in model.kinject.operators if isinstance(op, OffloadedAttention))
    op.host.overlap = True
    eager = op.host.eager

    def failing(module, query, *args, **kwargs):
        if query.shape[0] == 1:                         # the last micro-batch (rows 4:5)
            raise RuntimeError("host attention failed")
        return eager(module, query, *args, **kwargs)

    op.host.eager = failing
    with pytest.raises(RuntimeError, match="host attention failed"):
        generate(model, batch, tok.pad_token_id, new=3)
    assert op.base.config is model.config                # the module's own config is back
    op.host.eager = eager
    assert torch.equal(generate(model, batch, tok.pad_token_id, new=3), ref)
