"""Store / transfer / scheduler / loader end to end on tiny models (CPU)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import kinject
from kinject.errors import BudgetError, LoadError
from kinject.testing import FAMILIES, build_tiny_model, save_tiny_model, tiny_batch
from helpers.fault_ops import assert_failing_read_raises_then_recovers

NEW = 8


def greedy(model, batch, tok, new=NEW):
    return model.generate(**batch, max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id)


@pytest.fixture(scope="module")
def batch(tok):
    return tiny_batch(tok, 4, min_tokens=16)


@pytest.mark.parametrize("family", FAMILIES)
def test_offloaded_weights_give_identical_tokens_host_disk_and_from_pretrained(family, tmp_path, tok, batch):
    model = build_tiny_model(family)
    ref = greedy(model, batch, tok)
    rules = f"rules/{family}_offload.yaml"
    for tier in ("host", "disk"):
        kinject.optimize(model, rules, [f"vars.weights={tier}", f"pipeline.offload_dir={tmp_path}/off"])
        assert torch.equal(greedy(model, batch, tok), ref), tier
        assert model.kinject.store.summary()["tier_bytes"][tier] > 0
        kinject.restore(model)
    assert torch.equal(greedy(model, batch, tok), ref)          # restore is exact

    ckpt = save_tiny_model(family, tmp_path / "ckpt")
    for tier in ("host", "disk"):
        loaded = kinject.from_pretrained(ckpt, rules, [f"vars.weights={tier}", f"pipeline.offload_dir={tmp_path}/o2"],
                                         attn_implementation="eager")
        assert torch.equal(greedy(loaded, batch, tok), ref), f"from_pretrained {tier}"
        if tier == "disk":   # read in place from the checkpoint: nothing copied to offload_dir
            assert not (tmp_path / "o2").exists()
        loaded.kinject.transfer.close()


def test_from_pretrained_legacy_and_sharded_checkpoints(tmp_path, tok, batch):
    ref = greedy(build_tiny_model("mixtral"), batch, tok)
    for name, kw in {"legacy": dict(legacy_expert_keys=True), "sharded": dict(max_shard_size="100KB"),
                     "bf16": dict(dtype=torch.bfloat16)}.items():
        path = save_tiny_model("mixtral", tmp_path / name, **kw)
        extra = ["pipeline.disk_readahead=false"] if name == "sharded" else []   # FADV_RANDOM reads: same tokens
        model = kinject.from_pretrained(path, "rules/mixtral_offload.yaml", ["vars.weights=disk", *extra],
                                        dtype=torch.float32, attn_implementation="eager")
        out = greedy(model, batch, tok)
        shards = sorted(str(f) for f in path.glob("*.safetensors"))
        assert model.kinject.store.disk_files() == shards, name     # what a benchmark drops from the page cache
        if name == "bf16":
            assert out.shape == ref.shape            # different weights (rounded): runs, not equal
        else:
            assert torch.equal(out, ref), name


def test_from_pretrained_parameters_require_grad_as_transformers_makes_them(tmp_path):
    """Every parameter of a ``from_pretrained`` model (read by materialise_rest, or an operator's
    stand-in) requires grad exactly where transformers' own load of the checkpoint does. Besides
    sameness: torch's CPU ``F.linear`` of a strided 3-D bfloat16 input (the lm_head on
    ``hidden[:, -1:]``) is ~200x slower with a weight that needs no grad."""
    from transformers import AutoModelForCausalLM

    path = save_tiny_model("qwen3_moe", tmp_path / "ckpt")
    ref = {n: p.requires_grad for n, p in AutoModelForCausalLM.from_pretrained(path).named_parameters()}
    assert all(ref.values())
    for tier in ("device", "host"):
        model = kinject.from_pretrained(path, "rules/klotski.yaml", ["vars.weights=device", f"vars.experts={tier}"])
        got = {n.replace(".base.", "."): p.requires_grad for n, p in model.named_parameters()}   # (operator wraps)
        assert got == ref, tier
        model.kinject.transfer.close()


def test_disk_budget_is_respected_and_reported(tmp_path, tok, batch):
    model = build_tiny_model("mixtral")
    ref = greedy(model, batch, tok)
    kinject.optimize(model, "rules/mixtral_offload.yaml", ["vars.weights=disk", f"pipeline.offload_dir={tmp_path}"])
    store = model.kinject.store
    # the smallest budget that can run: everything resident + the largest unit, + a little
    budget = store.resident_external + store.largest_offloaded + 1024
    kinject.restore(model)
    # no host cache of its own: on a CPU the cache would hold the disk units in RAM beside the device
    # budget; here it may only borrow the budget's free room, so the budget bounds everything read
    kinject.optimize(model, "rules/mixtral_offload.yaml",
                     ["vars.weights=disk", f"pipeline.offload_dir={tmp_path}", f"pipeline.device_budget={budget}",
                      "pipeline.host_budget=null"])
    assert torch.equal(greedy(model, batch, tok), ref)
    store = model.kinject.store
    assert 0 < store.peak <= budget
    assert store.host_cache.own_capacity == 0 and 0 < store.summary()["host_cache"]["peak_bytes"]   # it borrowed
    assert store.memory_peak <= budget                                # device copies + cache entries together
    assert model.kinject.store.stats["prefetch_skipped"] > 0      # no room to prefetch: on demand instead
    kinject.restore(model)


def test_budget_that_cannot_fit_is_refused_up_front(tmp_path):
    model = build_tiny_model("mixtral")
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    with pytest.raises(BudgetError, match=r"does not fit device_budget 10.00 KiB: .*largest offloaded unit"):
        kinject.optimize(model, "rules/mixtral_offload.yaml", ["pipeline.device_budget=10KiB"])
    assert {k: v.data_ptr() for k, v in model.state_dict().items()} == before
    assert getattr(model, "kinject", None) is None


def test_missing_truncated_and_misshaped_tensors_fail_at_load(tmp_path):
    path = save_tiny_model("mixtral", tmp_path / "m")
    f = path / "model.safetensors"
    tensors = load_file(f)
    key = "model.layers.1.self_attn.q_proj.weight"
    missing = dict(tensors)
    del missing[key]
    save_file(missing, f, metadata={"format": "pt"})
    with pytest.raises(LoadError, match=r"model\.layers\.1\.self_attn\.q_proj\.weight"):
        kinject.from_pretrained(path, "rules/mixtral_offload.yaml")
    bad = dict(tensors)
    bad[key] = bad[key][:, :-1].contiguous()
    save_file(bad, f, metadata={"format": "pt"})
    with pytest.raises(LoadError, match=r"q_proj\.weight.*model\.safetensors"):
        kinject.from_pretrained(path, "rules/mixtral_offload.yaml")
    save_file(tensors, f, metadata={"format": "pt"})
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 4096])
    with pytest.raises(LoadError, match=r"model\.safetensors"):
        kinject.from_pretrained(path, "rules/mixtral_offload.yaml")


def test_failing_transfer_raises_out_of_generate_quickly_then_recovers(tmp_path, tok, batch):
    model = build_tiny_model("mixtral")
    ref = greedy(model, batch, tok)
    kinject.optimize(model, "rules/mixtral_offload.yaml", ["vars.weights=disk", f"pipeline.offload_dir={tmp_path}"])
    assert_failing_read_raises_then_recovers(model, "model.layers.1.mlp.experts", "gate_up_proj",
                                             lambda: greedy(model, batch, tok), ref, "disk on fire")


def test_scheduler_learns_order_loads_once_and_prefetches_before_use(tmp_path, tok, batch):
    model = build_tiny_model("mixtral")
    kinject.optimize(model, "rules/mixtral_offload.yaml", ["pipeline.emulate_bandwidth=2", "pipeline.trace=true"])
    rt = model.kinject
    greedy(model, batch, tok, new=1)                       # learning step(s)
    order = [op.key for op in rt.scheduler.order]
    assert order[0] == "model.embed_tokens" and order[-1] == "lm_head"
    assert order.index("model.layers.0.self_attn") < order.index("model.layers.0.mlp.gate") \
        < order.index("model.layers.0.mlp.experts") < order.index("model.layers.1.self_attn")
    greedy(model, batch, tok, new=2)
    rt.store.reset_stats()
    rt.tracer.clear()
    steps_before = rt.scheduler.step
    greedy(model, batch, tok, new=4)
    steps = rt.scheduler.step - steps_before
    # once per forward: the scheduler's order is cyclic (the last layers of a step prefetch the first
    # of the next), except in a generate's last forward (max_new_tokens): nothing for a step that never comes
    assert steps == 4 and rt.scheduler.forwards_left is None
    for unit in rt.store.units.values():
        assert unit.loads == steps, unit.name
    # where generate does not say how many forwards it makes (max_length only), the last step also
    # prefetched the first ops of a next step; those were dropped when generate returned
    first = {u.name for op in rt.scheduler.order[:rt.scheduler.lookahead] for u in op.prefetch_units()}
    rt.store.reset_stats()
    for unit in rt.store.units.values():
        unit.loads = 0
    model.generate(**batch, max_length=batch["input_ids"].shape[1] + 4, do_sample=False, pad_token_id=tok.pad_token_id)
    for unit in rt.store.units.values():
        assert unit.loads == 4 + (unit.name in first), unit.name
    rt.transfer.synchronize(timeout=10)
    assert not [u.name for u in rt.store.units.values() if u.offloaded and (u.device is not None or u.handle)]
    rt.store.reset_stats()
    rt.tracer.clear()
    greedy(model, batch, tok, new=4)
    events = rt.tracer.events()
    computes = [e for e in events if e.stream == "compute"]
    prefetched = {}
    for e in events:
        if e.stream == "prefetch":
            prefetched.setdefault(e.name, []).append(e)
    # every op but the first of the first step was prefetched, and the transfer began before it computed
    late = 0
    for c in computes:
        starts = [p.start for p in prefetched.get(c.name, []) if p.start <= c.start]
        late += not starts
    assert computes and late <= 1, f"{late} compute events had no prefetch issued before them"
    assert rt.transfer.emulated and "EMULATED" in rt.report(file=open("/dev/null", "w"))


def test_lookahead_counts_only_operators_with_offloaded_weights(tok, batch):
    """Only the experts offloaded, lookahead 1: layer L+1's experts are prefetched from layer L's
    experts (the resident attention and gate in between do not use up the lookahead)."""
    model = build_tiny_model("mixtral")
    ref = greedy(model, batch, tok)
    kinject.optimize(model, "rules/mixtral_offload.yaml", ["pipeline.trace=true", "vars.weights=device",
                                                           "rules.4.replace.kwargs.weights=host", "pipeline.prefetch_lookahead=1"])
    rt = model.kinject
    assert torch.equal(greedy(model, batch, tok), ref)
    sched = rt.scheduler
    experts = [op for op in sched.order if op.key.endswith("mlp.experts")]
    assert all(op.offloads() for op in experts) and not any(
        op.offloads() for op in sched.order if op not in experts)
    for a, b in zip(experts, experts[1:] + experts[:1]):
        assert sched._next_offloading(sched.position(a)) == [b]
    attn1 = next(op for op in sched.order if op.key == "model.layers.1.self_attn")
    assert sched._next_offloading(sched.position(attn1)) == [experts[1]]
    rt.tracer.clear()
    greedy(model, batch, tok, new=2)
    events = rt.tracer.events()
    fetched = min(e.start for e in events if e.stream == "prefetch" and e.name == "model.layers.1.mlp.experts")
    started = min(e.start for e in events if e.stream == "compute" and e.name == "model.layers.1.self_attn")
    assert fetched <= started          # issued while layer 0's experts computed, before layer 1 began


def test_scheduler_stops_asking_once_everything_ahead_is_settled(tok, batch):
    """Every weight used in place on a CPU: after the first step the scheduler asks no operator for
    its prefetch units again; once the store forgets a device copy it asks, and prefetches it."""
    model = build_tiny_model("mixtral")
    ref = greedy(model, batch, tok)
    kinject.optimize(model, "rules/mixtral_klotski.yaml")
    rt = model.kinject
    sched = rt.scheduler
    asked, steps = [], []
    for op in rt.operators:
        op.prefetch_units = (lambda f, key: lambda: asked.append(key) or steps.append(sched.step) or f())(
            op.prefetch_units, op.key)
    assert torch.equal(greedy(model, batch, tok), ref)
    start = sched.step
    asked.clear(), steps.clear()
    assert torch.equal(greedy(model, batch, tok), ref)
    # only the first step of each input shape asks: the prefill (the last generate dropped what was
    # idle) and the first decode step (a new shape: settled at one token count is not at another)
    assert asked and set(steps) == {start, start + 1}
    attn1 = next(op for op in sched.order if op.key == "model.layers.1.self_attn")
    before = sched.order[sched.position(attn1) - 1]
    sched.enter(before)                         # the end of generate dropped what was idle: asks once,
    asked.clear()
    sched.enter(before)
    assert asked == []                          # then not
    unit = attn1.binding.unit
    assert rt.store.discard(unit, in_place=True) and unit.device is None
    sched.enter(before)
    assert attn1.key in asked and unit.device is not None        # forgotten: asked again, prefetched
    kinject.restore(model)


def test_chrome_trace_export(tmp_path, tok, batch):
    model = build_tiny_model("mixtral")
    # (an emulated link: with none, host units are used in place and stay, so nothing is prefetched)
    kinject.optimize(model, "rules/mixtral_simple_pipeline.yaml", ["pipeline.trace=true", "pipeline.emulate_bandwidth=1000"])
    greedy(model, batch, tok, new=2)
    out = tmp_path / "trace.json"
    model.kinject.tracer.to_chrome(out)
    data = json.loads(out.read_text())
    streams = {e["args"]["name"] for e in data["traceEvents"] if e.get("ph") == "M" and e.get("name") == "thread_name"}
    assert {"compute", "prefetch"} <= streams


def test_disk_reads_reuse_buffers_and_read_ahead_window(tmp_path, tok, batch):
    model = build_tiny_model("mixtral")
    ref = greedy(model, batch, tok)
    kinject.optimize(model, "rules/mixtral_offload.yaml", ["vars.weights=disk", f"pipeline.offload_dir={tmp_path}",
                                                           "pipeline.disk_workers=1",
                                                           "pipeline.host_budget=null"])   # (no host cache: every step reads)
    rt = model.kinject
    pool = rt.store.buffers
    for _ in range(3):
        assert torch.equal(greedy(model, batch, tok), ref)
        rt.transfer.synchronize(timeout=10)
        # every read buffer is back in the pool once nothing holds the units read into it
        assert pool.idle == pool.allocated
    # and the pool holds no more than one window of the schedule needs: the op computing and
    # the `lookahead` ops read ahead of it (cyclic: the last op reads the next step's first).
    # Which of those reads overlap depends on timing, so the window is a bound, not a count.
    order, window = rt.scheduler.order, rt.scheduler.lookahead + 1
    need: dict = {}
    for i in range(len(order)):
        counts: dict = {}
        for op in (order[(i + j) % len(order)] for j in range(window)):
            for unit in op.prefetch_units():
                for src in unit.tensors.values():
                    key = (tuple(src.shape), unit.dtype or src.dtype)
                    counts[key] = counts.get(key, 0) + 1
        for key, n in counts.items():
            need[key] = max(need.get(key, 0), n)
    assert 0 < pool.allocated <= sum(need.values())
    kinject.restore(model)
    kinject.optimize(model, "rules/mixtral_offload.yaml", ["pipeline.trace=true", "vars.weights=disk",
                                                           f"pipeline.offload_dir={tmp_path}",
                                                           "pipeline.disk_read_ahead_layers=1"])
    assert torch.equal(greedy(model, batch, tok), ref)
    read_ahead = [e for e in model.kinject.tracer.events() if e.name.endswith("(read-ahead)")]
    assert read_ahead and all(e.layer == 1 for e in read_ahead)   # layer 0 triggers the window [1]


def test_device_memory_is_sampled_for_the_trace_and_plot(tmp_path, tok, batch):
    model = build_tiny_model("mixtral")
    kinject.optimize(model, "rules/mixtral_offload.yaml", ["pipeline.trace=true"])
    greedy(model, batch, tok, new=2)
    samples = model.kinject.tracer.counters()["device_bytes"]
    store = model.kinject.store
    assert max(v for _, v in samples) == store.peak and min(v for _, v in samples) >= store.resident_external
    model.kinject.tracer.to_chrome(tmp_path / "t.json")
    assert any(e.get("ph") == "C" for e in json.loads((tmp_path / "t.json").read_text())["traceEvents"])
    model.kinject.tracer.plot(tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_two_models_on_disk_in_one_offload_dir_keep_their_own_files(tmp_path, tok, batch):
    """Shipped rule files share one offload_dir across models: each store writes its own files."""
    import gc

    a, b = build_tiny_model("mixtral", seed=1), build_tiny_model("mixtral", seed=2)
    ref_a, ref_b = greedy(a, batch, tok), greedy(b, batch, tok)
    assert not torch.equal(ref_a, ref_b)
    for m in (a, b):
        kinject.optimize(m, "rules/offload.yaml", ["vars.weights=disk", f"pipeline.offload_dir={tmp_path}"])
    assert torch.equal(greedy(a, batch, tok), ref_a) and torch.equal(greedy(b, batch, tok), ref_b)
    assert len(list(tmp_path.glob("units-*"))) == 2
    for m in (a, b):
        kinject.restore(m)
    del a, b, m
    gc.collect()
    assert not list(tmp_path.glob("units-*"))                       # the files go with their store


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_parameters_stay_bound_only_to_tensors_used_in_place(tier, tmp_path, tok, batch):
    """A host unit on a CPU is used in place (its tensors are the device copy): after a call the
    module's parameters still point at them (no .data swaps per call). A disk unit is read into
    buffers that go back to the pool: after a call the parameters are storage-less stand-ins."""
    model = build_tiny_model("mixtral")
    ref = greedy(model, batch, tok)
    kinject.optimize(model, "rules/mixtral_offload.yaml", [f"vars.weights={tier}", f"pipeline.offload_dir={tmp_path}"])
    attn = model.model.layers[0].self_attn                   # OffloadedAttention
    assert torch.equal(greedy(model, batch, tok), ref)
    unit, params = attn.binding.unit, attn.binding.params
    if tier == "host":
        assert all(p.data_ptr() == unit.tensors[n].data_ptr() for n, p in params.items())
    else:
        assert all(p.untyped_storage().nbytes() <= p.element_size() for p in params.values())
    assert all(u.refs == 0 for u in model.kinject.store.units.values())
    kinject.restore(model)
    assert torch.equal(greedy(model, batch, tok), ref)


def test_scheduler_settled_mark_is_taken_before_its_checks():
    """A transfer thread can drop a device copy (a discarded prefetch landing) while ``enter`` asks
    the operators ahead whether they are settled: the mark must be the drop count from before the
    checks, so the next ``enter`` sees the drop and prefetches the unit again."""
    from kinject.engine.scheduler import Scheduler
    from kinject.engine.store import TensorStore
    from kinject.engine.transfer import TransferEngine
    from kinject.trace import Tracer

    engine = TransferEngine("cpu", inline=False)        # workers, as on CUDA: host units do move
    store = TensorStore("cpu", engine)
    try:
        unit = store.add("u", {"w": torch.ones(4)}, "host")

        class Ahead:                                     # an operator ahead with one unit
            landing = None                               # runs inside its settled check, once

            def offloads(self):
                return True

            def prefetch_units(self):
                return [unit]

            def prefetch_settled(self):
                settled = store.settled(unit)
                if self.landing is not None:
                    self.landing(), setattr(self, "landing", None)
                return settled

        here, ahead = Ahead(), Ahead()
        sched = Scheduler(store, Tracer())
        sched.follow([here, ahead])
        ahead.landing = lambda: store._drop(unit)        # its copy is dropped after it said "settled"
        sched.enter(here)                                # prefetches the unit; dropped mid-check
        assert not store.settled(unit)
        sched.enter(here)                                # not skipped: the drop is seen, the unit prefetched
        assert store.settled(unit)
    finally:
        engine.close()


def test_forwards_of_generate_only_where_one_token_is_one_forward():
    """The scheduler's last-forward hint: ``max_new_tokens`` from the call, else from the generation
    config the call or the model carries; unknown (None) for ``max_length`` alone and for decoding
    that makes several forwards per token."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from kinject.runtime import _forwards_of_generate

    model = SimpleNamespace(generation_config=GenerationConfig(max_length=20))
    assert _forwards_of_generate(model, {"max_new_tokens": 7}) == 7
    assert _forwards_of_generate(model, {}) is None
    assert _forwards_of_generate(model, {"generation_config": GenerationConfig(max_new_tokens=3)}) == 3
    assert _forwards_of_generate(SimpleNamespace(generation_config=GenerationConfig(max_new_tokens=5)), {}) == 5
    assert _forwards_of_generate(model, {"max_new_tokens": 7, "assistant_model": object()}) is None
    assert _forwards_of_generate(model, {"max_new_tokens": 7, "prompt_lookup_num_tokens": 3}) is None
    assert _forwards_of_generate(model, {"max_new_tokens": True}) is None
    assert _forwards_of_generate(SimpleNamespace(), {"max_new_tokens": 2}) == 2


def test_scheduler_remembers_what_is_settled_per_input_shape():
    """Settled positions are kept per input shape for the last few shapes (a chat alternates a prefill
    and decode steps): a shape seen before asks nothing again while the store has dropped nothing;
    a new shape asks; the least recently used shape is forgotten beyond ``SETTLED_SHAPES``; a drop
    unsettles every shape."""
    from kinject.engine.scheduler import SETTLED_SHAPES, Scheduler
    from kinject.engine.store import TensorStore
    from kinject.engine.transfer import TransferEngine
    from kinject.trace import Tracer

    engine = TransferEngine("cpu")
    store = TensorStore("cpu", engine)
    asked = []

    class Op:
        def __init__(self, name):
            self.name = name

        def offloads(self):
            return True

        def prefetch_units(self):
            return []

        def prefetch_settled(self):
            asked.append(self.name)
            return True

    here, ahead = Op("here"), Op("ahead")
    sched = Scheduler(store, Tracer(enabled=False))
    sched.follow([here, ahead])
    try:
        def step(shape) -> list:
            asked.clear()
            sched.begin_step(shape)
            sched.enter(here)
            sched.end_step()
            return list(asked)

        assert step((1, 32)) == ["ahead"] and step((1, 1)) == ["ahead"]       # each new shape asks once
        assert step((1, 1)) == [] and step((1, 32)) == [] and step((1, 1)) == []   # then neither does
        assert step((1, 32)) == []                                             # (1, 32): the most recently used
        for n in range(SETTLED_SHAPES - 1):                                    # new shapes push the oldest out:
            assert step((2, n + 2)) == ["ahead"]                               # (1, 1) goes, (1, 32) stays
        assert step((1, 32)) == [] and step((1, 1)) == ["ahead"]
        store.drops += 1                                                       # the store forgot a device copy
        assert step((1, 32)) == ["ahead"] and step((1, 32)) == []
    finally:
        engine.close()
