"""Klotski's expert-aware pipeline (PrefetchGate + GroupedExperts) on tiny models (CPU).

Correctness: every family under its ``rules/<family>_klotski.yaml`` gives the untouched model's
greedy tokens (float32, logits within 1e-5). Schedule: with a deliberately slow (emulated)
host->device link, the trace shows hot experts first, cold experts in the order their transfers
landed, each expert once per layer per step and released by the end of its layer.
"""

import io
import math
import time
from collections import defaultdict

import pytest
import torch

import kinject
from kinject.engine.prefetch import CorrelationTable
from kinject.testing import FAMILIES, build_tiny_model, save_tiny_model, tiny_batch
from operators.experts import GroupedExperts
from operators.gate import PrefetchGate
from helpers.fault_ops import assert_failing_read_raises_then_recovers

NEW = 8
SLOW = "pipeline.emulate_bandwidth=0.01"     # GB/s: one 24 KiB expert holds the link ~2.5 ms


def greedy(model, batch, tok, new=NEW):
    return model.generate(**batch, max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id)


@pytest.fixture(scope="module")
def batch(tok):
    return tiny_batch(tok, 8, min_tokens=16)


def experts_ops(model):
    return [op for op in model.kinject.operators if isinstance(op, GroupedExperts)]


@pytest.mark.parametrize("family", FAMILIES)
def test_klotski_rules_give_identical_tokens_and_logits(family, tok, batch):
    model = build_tiny_model(family)
    with torch.no_grad():
        ref_logits = model(**batch).logits
    ref = greedy(model, batch, tok)
    before = {n: (p.data_ptr(), p.shape) for n, p in model.named_parameters()}

    kinject.optimize(model, f"rules/{family}_klotski.yaml")
    rt = model.kinject
    ops = experts_ops(model)
    assert ops and len(ops) == sum(isinstance(op, PrefetchGate) for op in rt.operators)
    for op in ops:                                     # one host unit per expert, params are stand-ins
        assert [u.name for u in op.units] == [f"{op.key}[{e}]" for e in range(op.num_experts)]
        assert all(u.tier == "host" for u in op.units)
        assert all(p.untyped_storage().nbytes() <= p.element_size() for p in op.base.parameters(recurse=False))
    assert torch.equal(greedy(model, batch, tok), ref)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits, ref_logits, atol=1e-5, rtol=0)
    assert all(u.refs == 0 for u in rt.store.units.values())

    kinject.restore(model)                             # exact inverse
    assert {n: (p.data_ptr(), p.shape) for n, p in model.named_parameters()} == before
    assert torch.equal(greedy(model, batch, tok), ref)


def test_disk_tier_and_from_pretrained_read_single_experts(tmp_path, tok, batch):
    model = build_tiny_model("mixtral")
    ref = greedy(model, batch, tok)
    kinject.optimize(model, "rules/mixtral_klotski.yaml", ["vars.weights=disk", f"pipeline.offload_dir={tmp_path}/off"])
    assert all(u.tier == "disk" for op in experts_ops(model) for u in op.units)
    assert torch.equal(greedy(model, batch, tok), ref)
    kinject.restore(model)

    # per-expert hub layout on disk: each expert unit reads only its own keys, in place
    ckpt = save_tiny_model("mixtral", tmp_path / "ckpt", legacy_expert_keys=True)
    loaded = kinject.from_pretrained(ckpt, "rules/mixtral_klotski.yaml",
                                     ["vars.weights=disk", f"pipeline.offload_dir={tmp_path}/o2"])
    unit = loaded.kinject.store["model.layers.1.mlp.experts[3]"]
    assert {s.expert for s in unit.tensors.values()} == {3}
    assert torch.equal(greedy(loaded, batch, tok), ref)
    assert not (tmp_path / "o2").exists()
    loaded.kinject.transfer.close()

    # a bfloat16 checkpoint computed in float32: experts are converted as they are read
    ckpt = save_tiny_model("mixtral", tmp_path / "bf16", dtype=torch.bfloat16)
    loaded = kinject.from_pretrained(ckpt, "rules/mixtral_klotski.yaml", ["vars.weights=disk"], dtype=torch.float32)
    assert loaded.kinject.store["model.layers.0.mlp.experts[0]"].dtype == torch.float32
    rounded = build_tiny_model("mixtral", dtype=torch.bfloat16).float()
    assert torch.equal(greedy(loaded, batch, tok), greedy(rounded, batch, tok))
    loaded.kinject.transfer.close()

    # GPT-OSS: fused, transposed, interleaved, biased experts straight from the checkpoint
    gpt = build_tiny_model("gpt_oss")
    ref_gpt = greedy(gpt, batch, tok)
    ckpt = save_tiny_model("gpt_oss", tmp_path / "gpt")
    loaded = kinject.from_pretrained(ckpt, "rules/gpt_oss_klotski.yaml", ["vars.experts=disk"])
    unit = loaded.kinject.store["model.layers.0.mlp.experts[5]"]
    assert set(unit.tensors) == {"gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"}
    assert torch.equal(greedy(loaded, batch, tok), ref_gpt)
    loaded.kinject.transfer.close()


def compute_groups(events):
    """(step, layer) -> that layer's grouped expert compute events (one per group), in start order."""
    groups = defaultdict(list)
    for e in events:
        if e.stream == "compute" and "experts" in e.args:
            groups[(e.args["step"], e.layer)].append(e)
    return groups


def unit_names(ev):
    """The store units a grouped compute event computed (``key[e]`` per expert of the group)."""
    key = ev.name.rsplit("[", 1)[0]
    return [f"{key}[{e}]" for e in ev.args["experts"]]


def landed_before(transfers, ev, name=None):
    """End of the last transfer of unit ``name`` (default: ``ev``'s) that finished before ``ev`` started."""
    name = name or ev.name
    ends = [t.end for t in transfers[name] if t.end <= ev.start]
    assert ends, f"{name} computed without a transfer before it"
    return max(ends)


def test_hot_first_then_cold_in_completion_order_released_per_layer(tok, batch):
    model = build_tiny_model("mixtral")
    ref = greedy(model, batch, tok, new=4)
    kinject.optimize(model, "rules/mixtral_klotski.yaml", ["pipeline.trace=true", SLOW])
    rt = model.kinject
    problems = []

    def after_layer(op, args, out):                    # every expert of the layer is released by its end
        held = [u.name for u in rt.store.units.values() if u.refs]
        kept = [u.name for u in op.units if u.device is not None]
        if held or kept:
            problems.append((op.key, held, kept))

    hooks = [op.register_forward_hook(after_layer) for op in experts_ops(model)]
    # Klotski's premise (eq. 2): n micro-batches of attention take longer than loading the gate
    # and K hot experts. A tiny model computes in microseconds, so its attention is stretched.
    hooks += [op.register_forward_hook(lambda *_: time.sleep(0.015))
              for op in rt.operators if op.key.endswith("self_attn")]
    assert torch.equal(greedy(model, batch, tok, new=4), ref)
    for h in hooks:
        h.remove()
    assert not problems
    rt.transfer.synchronize(timeout=10)
    left = [u.name for op in experts_ops(model) for u in op.units if u.device is not None or u.handle is not None]
    assert not left, f"experts left on the device after generate: {left}"

    events = rt.tracer.events()
    transfers = defaultdict(list)
    for e in events:
        if e.kind == "transfer":
            transfers[e.name].append(e)
    groups = compute_groups(events)
    steps = {s for s, _ in groups}
    assert len(groups) == len(steps) * 2 and len(steps) == 4     # 4 forward steps x 2 MoE layers
    n_hot = n_cold = n_ordered = 0
    for (step, layer), comps in groups.items():
        names = [n for c in comps for n in unit_names(c)]
        assert len(names) == len(set(names)), f"an expert computed twice in step {step} layer {layer}"
        hot = [c.args["hot"] for c in comps]
        assert hot == sorted(hot, reverse=True), f"a cold expert before a hot one: step {step} layer {layer}"
        assert sum(hot) <= 1, "the experts ready when the layer starts compute in one grouped call"
        for c in comps:                            # every expert of a group is there when the group starts
            for name in unit_names(c):             # (hot = on the device before the layer started)
                assert landed_before(transfers, c, name) <= (comps[0].start if c.args["hot"] else c.start)
        cold = [c for c in comps if not c.args["hot"]]
        # cold experts compute in the order their transfers ended, grouped: a group holds what had
        # landed when it formed, so every expert of the next group landed after every expert of this
        # one. Causal, not a clock tolerance: one worker serves the channel, so the order its
        # transfer spans end in is the order their done-callbacks queue the experts in.
        for a, b in zip(cold, cold[1:]):
            last_a = max(landed_before(transfers, a, n) for n in unit_names(a))
            first_b = min(landed_before(transfers, b, n) for n in unit_names(b))
            assert first_b > last_a, f"{b.name} landed {1e3 * (last_a - first_b):.2f} ms before {a.name}'s last expert"
            n_ordered += 1
        n_hot += sum(len(c.args["experts"]) for c in comps if c.args["hot"])
        n_cold += sum(len(c.args["experts"]) for c in cold)
    assert n_hot > 0 and n_cold > 0 and n_ordered > 0
    # the compute thread's wait for a cold expert to land is a stall span, as every weight wait is
    assert any(e.stream == "stall" and e.kind == "wait" and e.name.endswith("(cold experts)") for e in events)

    table = rt.shared("correlation", lambda: None)
    assert isinstance(table, CorrelationTable)
    assert set(table.freq) == {0, 1} and int(table.counts[1].sum()) > 0     # fed online
    stats = rt.shared("prefetch_stats", lambda: None)
    assert stats.precision() is not None and stats.precision(1) is not None
    text = rt.report(file=io.StringIO())
    assert "prefetch precision" in text and "layer 1: prefetch precision" in text and "loaded/step" in text


def test_index_order_rung_waits_for_each_expert(tok, batch):
    model = build_tiny_model("mixtral")
    ref = greedy(model, batch, tok, new=3)
    kinject.optimize(model, "rules/mixtral_hot_prefetch.yaml", ["pipeline.trace=true", SLOW])
    assert torch.equal(greedy(model, batch, tok, new=3), ref)
    events = model.kinject.tracer.events()
    for comps in compute_groups(events).values():
        experts = [e for c in comps for e in c.args["experts"]]
        assert experts == sorted(experts)
    assert any(e.stream == "stall" and ".experts[" in e.name for e in events)


def test_ablation_ladder_differs_only_in_yaml(tok, batch):
    from dataclasses import asdict

    from kinject.rules import load_rules

    def rules_of(rs):
        return [(r.match, r.replace_path, r.kwargs, r.recursive) for r in rs.rules]

    simple, multi = load_rules("simple_pipeline"), load_rules("multibatch")
    differ = {k for k, v in asdict(multi.pipeline).items() if asdict(simple.pipeline)[k] != v}
    assert differ == {"n_batches", "micro_batch_size"} and multi.pipeline.n_batches > 1
    assert rules_of(multi) == rules_of(simple)
    hot, klotski = load_rules("hot_prefetch"), load_rules("klotski")
    assert hot.rules[2].kwargs.pop("order") == "index"
    assert klotski.rules[2].kwargs.pop("order") == "hot_first"
    for h, k in zip(hot.rules[3:], klotski.rules[3:]):        # the block rule's experts follow vars.order too
        assert h.kwargs.pop("order", "index") == "index" and k.kwargs.pop("order", "hot_first") == "hot_first"
    assert rules_of(hot) == rules_of(klotski) and hot.pipeline == klotski.pipeline
    model = build_tiny_model("mixtral")
    ref = greedy(model, batch, tok)
    for name in ("mixtral_multibatch", "mixtral_hot_prefetch"):
        kinject.optimize(model, f"rules/{name}.yaml")
        assert torch.equal(greedy(model, batch, tok), ref), name
        kinject.restore(model)


def test_tight_budget_defers_cold_experts_and_keeps_tokens(tok, batch):
    model = build_tiny_model("mixtral")
    ref = greedy(model, batch, tok)
    kinject.optimize(model, "rules/mixtral_klotski.yaml")
    store = model.kinject.store
    budget = store.resident_external + store.largest_offloaded + 24 * 1024    # ~3 experts in flight at most
    kinject.restore(model)
    kinject.optimize(model, "rules/mixtral_klotski.yaml", [f"pipeline.device_budget={budget}", SLOW])
    assert torch.equal(greedy(model, batch, tok), ref)
    assert model.kinject.store.peak <= budget
    kinject.restore(model)


def test_correlation_table_from_file_frozen_and_saved(tmp_path, tok, batch):
    model = build_tiny_model("mixtral")
    ref = greedy(model, batch, tok)
    path = tmp_path / "corr.json"
    kinject.optimize(model, "rules/mixtral_klotski.yaml",
                     [f"pipeline.correlation_table={path}", "pipeline.save_table=true"])
    greedy(model, batch, tok, new=2)                                # warm-up: learnt online
    kinject.restore(model)                                          # save_table: written at the end
    saved = CorrelationTable.load(path)
    assert saved.layer_ids == [0, 1] and int(saved.counts[1].sum()) > 0

    kinject.optimize(model, "rules/mixtral_klotski.yaml",       # (emulated link: experts are moved, so predicted)
                     [f"pipeline.correlation_table={path}", "pipeline.update_table=false",
                      "pipeline.emulate_bandwidth=1000"])
    assert torch.equal(greedy(model, batch, tok), ref)
    table = model.kinject.shared("correlation", lambda: None)
    assert torch.equal(table.counts[1], saved.counts[1])            # frozen: not updated
    assert model.kinject.shared("prefetch_stats", lambda: None).precision() is not None
    kinject.restore(model)


LINK = "pipeline.emulate_bandwidth=1000"     # experts then move (no CPU in-place use): what predicts is asked


@pytest.mark.parametrize("overrides", [
    ["rules.2.replace.kwargs.prefetch=all", LINK], ["rules.2.replace.kwargs.prefetch=none"],
    ["rules.2.replace.kwargs.hot_experts=4", "vars.hot_probability=null", LINK], ["vars.experts=device"],
    ["pipeline.release_policy=cache"],
    ["vars.hot_probability=0.5", LINK],
], ids=["prefetch-all", "prefetch-none", "K=4", "experts-resident", "policy-cache", "hot-probability"])
def test_kwargs_variants_keep_tokens(overrides, tok, batch):
    model = build_tiny_model("qwen3_moe")
    ref = greedy(model, batch, tok)
    kinject.optimize(model, "rules/qwen3_moe_klotski.yaml", overrides)
    assert torch.equal(greedy(model, batch, tok), ref)
    op = experts_ops(model)[0]       # the first MoE layer: predicted from expert frequencies at any time
    if "prefetch=all" in overrides[0]:
        assert len(op.prefetch_units()) == op.num_experts
    if "prefetch=none" in overrides[0]:
        assert op.prefetch_units() == []
    if "hot_experts=4" in overrides[0]:
        assert len(op.prefetch_units()) == 4
    if "device" in overrides[0]:
        assert all(not u.offloaded for u in op.units) and op.prefetch_units() == []
    if "hot_probability" in overrides[0]:        # K, plus every expert used with chance >= 0.5
        from operators.experts import routing

        r = routing(model.kinject)
        lam = r.table().expected_tokens(op.layer, None, tokens=r.last_tokens)
        likely = sum(1 for v in lam.tolist() if 1 - math.exp(-v) >= 0.5)
        assert len(op.prefetch_units()) == max(op.hot_experts, likely) > op.hot_experts
    kinject.restore(model)


def test_hot_probability_must_be_a_probability():
    model = build_tiny_model("qwen3_moe")
    with pytest.raises(Exception, match="hot_probability must be a probability"):
        kinject.optimize(model, "rules/qwen3_moe_klotski.yaml", ["rules.2.replace.kwargs.hot_probability=1.5"])
    assert not hasattr(model, "kinject") or model.kinject is None


def test_no_blind_prediction_before_the_previous_layer_routed(tok, batch):
    """A later MoE layer is predicted from the previous layer's choices only once they exist
    this step (earlier, e.g. from a long lookahead, nothing is prefetched for it)."""
    from operators.experts import routing

    model = build_tiny_model("mixtral")
    kinject.optimize(model, "rules/mixtral_klotski.yaml", ["vars.hot_probability=null", LINK])   # K experts exactly
    greedy(model, batch, tok, new=2)
    first, second = experts_ops(model)[:2]
    assert len(first.prefetch_units()) == first.hot_experts      # first MoE layer: expert frequencies
    assert second.prefetch_units() == []                          # layer 0 has not routed in this step
    routing(model.kinject).route(first.layer, torch.tensor([[0, 1], [2, 1]]))
    assert len(second.prefetch_units()) == second.hot_experts
    kinject.restore(model)


def test_unused_prefetches_give_their_read_buffers_back(tmp_path, tok, batch):
    """Experts on disk: a hot prefetch the router did not choose is discarded, and the pooled
    buffers it was read into go back to the pool (steady state allocates no more)."""
    model = build_tiny_model("mixtral")
    one = tiny_batch(tok, 1, min_tokens=16)        # one sequence: 2 of 8 experts used, 6 predicted
    kinject.optimize(model, "rules/mixtral_klotski.yaml", ["vars.experts=disk", f"pipeline.offload_dir={tmp_path}",
                                                           "rules.2.replace.kwargs.hot_experts=6",
                                                           "pipeline.host_budget=null"])   # (no host cache: pooled reads)
    rt = model.kinject
    pool = rt.store.buffers
    for new in (4, 8):
        greedy(model, one, tok, new=new)
        rt.transfer.synchronize(timeout=10)         # discarded reads in flight land and are dropped
        free = pool.idle
        assert free == pool.allocated > 0, (free, pool.allocated)   # every buffer is back in the pool
    stats = rt.peek("prefetch_stats")
    assert stats.precision() < 1.0                  # some prefetches were discarded unused
    kinject.restore(model)


@pytest.mark.parametrize("family", ["mixtral", "deepseek_v3", "gpt_oss"])
def test_next_gate_predictor(family, tok, batch):
    """predictor=next_gate: each gate runs the next MoE layer's router on its own input and
    prefetches what it picks; tokens unchanged, every MoE layer but the first predicted that
    way, and it covers more of the routed tokens than the correlation table's K hot experts."""
    model = build_tiny_model(family)
    ref = greedy(model, batch, tok)
    coverage = {}
    for predictor in ("correlation", "next_gate"):
        kinject.optimize(model, f"rules/{family}_klotski.yaml", ["pipeline.trace=true", LINK,
                                                                 f"rules.2.replace.kwargs.predictor={predictor}"])
        rt = model.kinject
        assert torch.equal(greedy(model, batch, tok), ref)
        coverage[predictor] = rt.peek("prefetch_stats").coverage()
        pre = {e.layer for e in rt.tracer.events() if e.name.endswith("(pre-gate)")}
        layers = sorted(op.layer for op in experts_ops(model))
        assert pre == (set(layers[1:]) if predictor == "next_gate" else set())
        kinject.restore(model)
    assert coverage["next_gate"] > coverage["correlation"]


def cuda_reference(family, batch, tok, new=NEW):
    """Greedy tokens of the untouched model on the GPU (eager experts where no float32 grouped_mm kernel)."""
    ref_model = build_tiny_model(family).cuda()
    try:
        return greedy(ref_model, batch, tok, new)
    except (RuntimeError, NotImplementedError):
        ref_model.set_experts_implementation("eager")
        return greedy(ref_model, batch, tok, new)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family,path", [("mixtral", "from_pretrained"), ("gpt_oss", "from_pretrained"),
                                         ("deepseek_v3", "from_pretrained"), ("mixtral", "optimize")])
def test_cuda_klotski_matches_reference(family, path, tmp_path, tok, batch):
    cuda_batch = {k: v.cuda() for k, v in batch.items()}
    ref = cuda_reference(family, cuda_batch, tok)
    if path == "from_pretrained":                      # meta model, experts streamed into pinned host memory
        ckpt = save_tiny_model(family, tmp_path / "ckpt")
        model = kinject.from_pretrained(ckpt, f"rules/{family}_klotski.yaml", ["pipeline.device=cuda:0",
                                                                                "pipeline.trace=true"])
    else:                                              # CPU model: operators take their weights, the rest moves
        model = build_tiny_model(family)
        kinject.optimize(model, f"rules/{family}_klotski.yaml", ["pipeline.device=cuda:0", "pipeline.trace=true", SLOW])
        model.cuda()
    rt = model.kinject
    unit = experts_ops(model)[0].units[0]
    assert unit.tier == "host" and all(t.is_pinned() for t in unit.tensors.values())
    assert torch.equal(greedy(model, cuda_batch, tok), ref)
    assert all(u.refs == 0 for u in rt.store.units.values())
    rt.transfer.synchronize(timeout=10)
    assert not [u.name for op in experts_ops(model) for u in op.units if u.device is not None]
    groups = compute_groups(rt.tracer.events())
    assert groups                                      # traced: one compute group per layer and step at least
    for comps in groups.values():
        names = [n for c in comps for n in unit_names(c)]
        assert len(names) == len(set(names))
        hot = [c.args["hot"] for c in comps]
        assert hot == sorted(hot, reverse=True)
    assert rt.shared("prefetch_stats", lambda: None).precision() is not None
    rt.transfer.close()


@pytest.mark.gpu
@pytest.mark.parametrize("decode_chunk", [1, 2])
def test_cuda_paced_prefetch_behind_each_micro_batchs_kv_load(decode_chunk, tok, batch, monkeypatch):
    """On CUDA, KV in pinned host memory per micro-batch: each attention books the weights ahead a
    share behind each micro-batch's (or decode chunk's) KV load (``enter(paced=True)``; the prefetch
    and kv_load streams ordered by events, no synchronize): transformers' tokens on the same GPU, and
    the prefetch was booked in shares."""
    from kinject.engine.scheduler import Scheduler

    cuda_batch = {k: v.cuda() for k, v in batch.items()}
    ref = cuda_reference("mixtral", cuda_batch, tok)
    shares, pace = [], Scheduler.pace

    def counted(self):
        if self.pacing is not None and self.pacing.units:
            shares.append((self.pacing.share, len(self.pacing.units)))
        pace(self)

    monkeypatch.setattr(Scheduler, "pace", counted)
    model = build_tiny_model("mixtral")
    kinject.optimize(model, "rules/mixtral_klotski.yaml", ["pipeline.device=cuda:0", "vars.kv=host",
                                                            "pipeline.micro_batch_size=2",
                                                            f"pipeline.decode_chunk={decode_chunk}"])
    model.cuda()
    assert torch.equal(greedy(model, cuda_batch, tok), ref)
    assert any(share < left for share, left in shares)          # booked a share at a time, not in one block
    rt = model.kinject
    assert all(u.refs == 0 for u in rt.store.units.values())
    rt.transfer.close()


def test_failing_expert_transfer_raises_out_of_generate_then_recovers(tmp_path, tok, batch):
    model = build_tiny_model("mixtral")
    ref = greedy(model, batch, tok)
    kinject.optimize(model, "rules/mixtral_klotski.yaml", ["vars.experts=disk", f"pipeline.offload_dir={tmp_path}"])
    assert_failing_read_raises_then_recovers(model, "model.layers.1.mlp.experts[2]", "down_proj",
                                             lambda: greedy(model, batch, tok), ref, "expert on fire")
    kinject.restore(model)


@pytest.mark.parametrize("at", ["previous_layer", "lookahead"])
def test_hot_prefetch_at_previous_layer_starts_before_the_next_attention(at, tok, batch):
    """``hot_prefetch_at=previous_layer``: layer 1's predicted experts are on their way when layer 0's
    experts are done, before layer 1's attention starts; ``lookahead`` (2 operators: the paper's
    "while attention runs") starts them only with layer 1's attention."""
    model = build_tiny_model("mixtral")
    ref = greedy(model, batch, tok, new=3)
    kinject.optimize(model, "rules/mixtral_klotski.yaml",       # (emulated link: every step loads again)
                     [f"vars.hot_prefetch_at={at}", "pipeline.prefetch_lookahead=2", "vars.hot_probability=null",
                      "pipeline.emulate_bandwidth=1000"])
    first, second = experts_ops(model)[:2]
    seen = []

    def after_first(_op, _args, _out):
        if not model.kinject.scheduler.learning:
            units = [u for u in second.units if u.device is not None or u.handle is not None]
            seen.append(len(units))

    hook = first.register_forward_hook(after_first)
    assert torch.equal(greedy(model, batch, tok, new=3), ref)
    hook.remove()
    assert seen
    if at == "previous_layer":
        assert all(n >= second.hot_experts for n in seen)
    else:
        assert not any(seen)
    kinject.restore(model)


def test_prediction_only_when_it_could_start_a_transfer(tok, batch):
    """The table's prediction is made only while some expert of the layer is neither on the device
    nor on its way: with every expert resident, or used in place on a CPU, none is made (no prefetch
    statistics), and a layer whose experts are all materialised predicts again once the store
    drops one of them."""
    model = build_tiny_model("mixtral")
    ref = greedy(model, batch, tok)
    kinject.optimize(model, "rules/mixtral_klotski.yaml", ["vars.experts=device"])
    assert torch.equal(greedy(model, batch, tok), ref)
    assert all(op.prefetch_units() == [] for op in experts_ops(model))
    assert model.kinject.peek("prefetch_stats").precision() is None       # nothing was predicted
    kinject.restore(model)

    kinject.optimize(model, "rules/mixtral_klotski.yaml", ["vars.hot_probability=null"])   # host tier, in place
    assert torch.equal(greedy(model, batch, tok), ref)
    store, first = model.kinject.store, experts_ops(model)[0]
    assert all(u.device is None for u in first.units)                    # the end of generate dropped them
    assert first.prefetch_units() == []                                  # in place: nothing to move
    assert model.kinject.peek("prefetch_stats").precision() is None
    kinject.restore(model)

    kinject.optimize(model, "rules/mixtral_klotski.yaml", ["vars.hot_probability=null", LINK])   # host tier, moved
    assert torch.equal(greedy(model, batch, tok), ref)
    store, first = model.kinject.store, experts_ops(model)[0]
    for u in first.units:
        store.acquire(u)                                                 # every expert materialised (held)
    assert first.prefetch_units() == []
    store.release_many(first.units)                                      # free policy: dropped
    assert first.units[3].device is None
    assert len(first.prefetch_units()) == first.hot_experts              # predicts again
    kinject.restore(model)


@pytest.mark.parametrize("setting", ["resident", "in place", "emulated link", "saved"])
def test_the_table_counts_routing_only_where_a_count_can_be_used(setting, tmp_path, tok, batch):
    """The online table counts a step's routing when some expert can need a transfer, or when it is
    written out for later runs; experts that all stay on the device (resident, or host tensors a
    CPU uses in place) count nothing. The tokens are the same either way."""
    from operators.experts import routing

    overrides = {"resident": ["vars.experts=device"], "in place": [],
                 "emulated link": ["pipeline.emulate_bandwidth=1000"],
                 "saved": [f"pipeline.correlation_table={tmp_path / 'table.json'}", "pipeline.save_table=true"]}[setting]
    model = build_tiny_model("mixtral")
    ref = greedy(model, batch, tok)
    kinject.optimize(model, "rules/mixtral_klotski.yaml", overrides)
    assert torch.equal(greedy(model, batch, tok), ref)
    r = routing(model.kinject)
    counted = sum(int(f.sum()) for f in r.table().freq.values())
    learns = setting in ("emulated link", "saved")
    assert r.learns() is learns
    rows, prompt = batch["input_ids"].shape                 # every token the model ran: prompt + NEW - 1 each
    k = model.config.num_experts_per_tok
    assert counted == (rows * (prompt + NEW - 1) * k * len(experts_ops(model)) if learns else 0)
    kinject.restore(model)
    if setting == "saved":
        assert (tmp_path / "table.json").is_file()



def test_paced_prefetch_books_a_share_per_sub_step():
    """An operator that enters paced (attention, one KV load per micro-batch) has the weights ahead
    of it booked a share at each ``pace()`` (after that micro-batch's own load), not in one block
    ahead of every KV load; ``pace_end`` (or the next ``enter``) books what is left; a share that does
    not fit the budget stops the rest, as one call would."""
    from kinject.engine.scheduler import Scheduler
    from kinject.trace import Tracer

    class Store:
        drops, fits = 0, True

        def __init__(self):
            self.calls = []

        def prefetch_many(self, units):
            self.calls.append(list(units))
            return self.fits

    class Op:
        def __init__(self, units):
            self.units = units

        def offloads(self):
            return bool(self.units)

        def prefetch_units(self):
            return self.units

        def prefetch_settled(self):
            return False

    store, here, ahead = Store(), Op([]), Op(list("abcde"))
    sched = Scheduler(store, Tracer(enabled=False), lookahead=1)
    sched.follow([here, ahead])
    sched.enter(here, paced=True)
    sched.pace_parts(2)
    assert store.calls == []                   # nothing before the first micro-batch's own load
    sched.pace(), sched.pace(), sched.pace()
    assert store.calls == [list("abc"), list("de")]
    store.calls.clear()
    sched.enter(here, paced=True)
    sched.pace_parts(5)
    sched.pace()
    sched.enter(here)                          # the next operator: the paced one's rest first, then its own
    assert store.calls == [["a"], list("bcde"), list("abcde")]
    store.calls.clear()
    sched.enter(here, paced=True)
    sched.pace()                               # no pace_parts: everything at the first call
    sched.pace_end()
    assert store.calls == [list("abcde")]
    store.calls.clear()
    store.fits = False
    sched.enter(here, paced=True)
    sched.pace_parts(5)
    sched.pace(), sched.pace(), sched.pace_end()
    assert store.calls == [["a"]]              # did not fit: the rest is not asked for
