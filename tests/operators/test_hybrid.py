"""Experts computed where they live: ``rules/hybrid.yaml``, ``compute: host | auto``.

Identical greedy tokens to transformers' own model on the trained fixture (host and disk tiers),
on HQQ units and on a checkpoint released in FP8 (dequantized on the host by the same codecs), and
the bytes that did not move; the decision rule and its measured costs; the errors.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM

import kinject
from kinject import testing
from kinject.engine.costs import LineFit, PlacementCosts
from kinject.errors import RuleError
from kinject.families import build_tiny_family_model
from kinject.fixtures import tiny_moe_path
from operators.experts import GroupedExperts
from operators.host_experts import BACKENDS, HostComputeError, choose_backend

GEN = dict(max_new_tokens=6, do_sample=False)
# the chat setting: batch 1, a quarter of the weights fit, link emulated (slower than the
# issue's 1 GB/s here, so that a loaded CI box's host compute is still clearly the cheaper side)
CHAT = ["pipeline.micro_batch_size=1", "pipeline.n_batches=1", "pipeline.device_budget=6MiB",
        "pipeline.emulate_bandwidth=0.1"]


@pytest.fixture(scope="module")
def prompt(tok):
    return tok(["def parse(path):\n    with open(path) as f:"], return_tensors="pt")


@pytest.fixture(scope="module")
def reference(prompt):
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_path(), dtype=torch.float32)
    return model.generate(**prompt, **GEN)


def _experts(model) -> list[GroupedExperts]:
    return [op for op in model.kinject.operators if isinstance(op, GroupedExperts)]


def _expert_loads(model) -> int:
    return sum(model.kinject.store.owner_loads.get(op.key, (0, 0))[0] for op in _experts(model))


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_hybrid_rules_chat_identical_tokens_no_expert_moved(prompt, reference, tier, tmp_path):
    """Batch 1 over a slow link: every chosen expert is cheaper on the host (Fiddler's rule from the
    measured costs), so none is moved, and the tokens are transformers' own."""
    model = kinject.from_pretrained(tiny_moe_path(), "rules/hybrid.yaml",
                                    [*CHAT, f"vars.weights={tier}", f"pipeline.offload_dir={tmp_path}"],
                                    dtype=torch.float32)
    assert torch.equal(model.generate(**prompt, **GEN), reference)
    hosts = [op.host for op in _experts(model)]
    assert all(h is not None and h.mode == "auto" for h in hosts)
    assert _expert_loads(model) == 0
    assert sum(h.stats["experts"] for h in hosts) >= 6 * GEN["max_new_tokens"]       # every layer, every step
    saved = sum(h.stats["saved_bytes"] for h in hosts)
    assert saved == sum(op.units[0].wire_nbytes for op in _experts(model)) / len(_experts(model)) * \
        sum(h.stats["experts"] for h in hosts)
    costs = hosts[0].costs
    assert costs.emulated and costs.link_bytes_per_s == 0.1e9 and costs.host.known
    report = model.kinject.report()
    assert "host compute (experts computed where they live)" in report and "torch-grouped" in report


@pytest.mark.parametrize("compute", ["host", "auto"])
def test_scheduler_stops_asking_experts_that_compute_where_they_live(prompt, reference, compute, tmp_path):
    """Every expert off the device computed on the host (``host``, or ``auto`` once no expert is
    worth moving at a decode step's rows): after the first step of each input shape the scheduler
    asks their operators for no prefetch units; the tokens stay transformers' own."""
    model = kinject.from_pretrained(tiny_moe_path(), "rules/hybrid.yaml",
                                    [*CHAT, f"vars.experts_compute={compute}", f"pipeline.offload_dir={tmp_path}"],
                                    dtype=torch.float32)
    assert torch.equal(model.generate(**prompt, **GEN), reference)          # learns the order, calibrates
    sched, asked = model.kinject.scheduler, []
    for op in _experts(model):
        op.prefetch_units = (lambda f: lambda: asked.append(sched.step) or f())(op.prefetch_units)
    start = sched.step
    assert torch.equal(model.generate(**prompt, **GEN), reference)
    steps = sched.step - start
    assert steps == GEN["max_new_tokens"] and asked and set(asked) <= {start, start + 1}, (steps, sorted(set(asked)))
    assert _expert_loads(model) == 0


def test_klotski_moves_what_hybrid_computes_in_place(prompt, reference, tmp_path):
    """The same setting with klotski.yaml: the chosen experts are moved (the bytes hybrid saves)."""
    model = kinject.from_pretrained(tiny_moe_path(), "rules/klotski.yaml", [*CHAT, f"pipeline.offload_dir={tmp_path}"],
                                    dtype=torch.float32)
    assert torch.equal(model.generate(**prompt, **GEN), reference)
    assert _expert_loads(model) >= 6 * GEN["max_new_tokens"]
    assert all(op.host is None for op in _experts(model))


def test_compute_host_traces_a_host_lane_with_activation_bytes(prompt, reference, tmp_path):
    model = kinject.from_pretrained(tiny_moe_path(), "rules/hybrid.yaml",
                                    [*CHAT, "vars.experts_compute=host", "pipeline.trace=true",
                                     f"pipeline.offload_dir={tmp_path}"], dtype=torch.float32)
    assert torch.equal(model.generate(**prompt, **GEN), reference)
    events = model.kinject.tracer.events()
    host = [e for e in events if e.stream == "host_compute" and "experts" in e.args]   # (not embeddings / lm_head)
    assert host and all(e.args["backend"] == "torch-grouped" and e.args["tokens"] > 0 for e in host)
    unit = _experts(model)[0].units[0].wire_nbytes
    assert all(e.args["saved_bytes"] == unit * len(e.args["experts"]) for e in host)
    act = [e for e in events if e.kind == "transfer" and e.tier == "activations" and "experts host rows" in e.name]
    hidden = model.config.hidden_size * 4
    assert sum(e.nbytes for e in act) == 2 * sum(e.args["tokens"] for e in host) * hidden
    assert _expert_loads(model) == 0


def test_hqq_units_dequantized_on_the_host_same_tokens_as_on_the_device(prompt, tmp_path):
    """HQQ units computed where they live are dequantized by the same codec: the device path's tokens."""
    common = [*CHAT, f"pipeline.offload_dir={tmp_path}"]
    device = kinject.from_pretrained(tiny_moe_path(), "rules/klotski_hqq.yaml", common, dtype=torch.float32)
    want = device.generate(**prompt, **GEN)
    host = kinject.from_pretrained(tiny_moe_path(), "rules/klotski_hqq.yaml", [*common, "vars.experts_compute=host"],
                                   dtype=torch.float32)
    assert torch.equal(host.generate(**prompt, **GEN), want)
    assert _expert_loads(host) == 0 and all(op.host.stats["experts"] for op in _experts(host))


@pytest.fixture(scope="module")
def fp8_release(tmp_path_factory):
    """A tiny Qwen3-MoE written as FP8 releases are, and transformers' tokens of it."""
    path = testing.save_tiny_fp8_model("qwen3_moe", tmp_path_factory.mktemp("fp8"), build=build_tiny_family_model,
                                       block=(32, 32))
    batch = testing.tiny_batch(testing.tiny_tokenizer(), 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return path, batch, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).generate(**batch, **GEN)


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_fp8_release_computed_on_the_host_gives_transformers_tokens(fp8_release, tier, tmp_path):
    path, batch, want = fp8_release
    model = kinject.from_pretrained(path, "rules/hybrid.yaml", [f"vars.weights={tier}", "vars.experts_compute=host",
                                                                "pipeline.emulate_bandwidth=1",
                                                                f"pipeline.offload_dir={tmp_path}/off"])
    assert torch.equal(model.generate(**batch, **GEN), want)
    ops = _experts(model)
    assert all(u.quant for op in ops for u in op.units) and all(op.host.stats["experts"] for op in ops)
    assert _expert_loads(model) == 0


# ---- the decision ------------------------------------------------------------------------------


def test_line_fit_measures_and_clips_outliers():
    fit = LineFit()
    for rows in (1, 2, 4, 8):
        fit.add(rows, 1e-4 + 1e-5 * rows)
    a, b = fit.coefficients()
    assert a == pytest.approx(1e-4) and b == pytest.approx(1e-5)
    fit.add(8, 1.0)                                    # a descheduled thread: counts as 4x the line
    assert fit(8) < 4 * (1e-4 + 8e-5)                 # not 1 s: the point was clipped
    assert fit(0) == 0.0


def test_fiddler_rule_moves_experts_with_many_rows():
    """Host compute wins for few rows, moving wins once the rows' host compute outweighs the bytes
    (a fast device): large batch groups fall back to Klotski's moves by themselves."""
    costs = PlacementCosts(link_bytes_per_s=1e9)
    costs.add("host", 1, 1, 50e-6)
    costs.add("host", 1, 64, 3.2e-3)                  # 50 us per row on the host
    costs.add("device", 1, 1, 5e-6)
    costs.add("device", 1, 64, 20e-6)                 # the device barely notices the rows
    unit = 786_432                                     # 0.79 ms on the link
    row = 1024
    assert costs.host_wins(1, unit, row)
    assert not costs.host_wins(64, unit, row)
    assert PlacementCosts().move_s(1) == float("inf")  # no rate measured yet: never moved on a guess


def test_same_cores_decision_is_the_links_alone_whatever_the_timings():
    """A CPU device computes a moved expert with the same kernel on the same cores as the host: the
    compute terms cancel, however far apart the two fits drifted under load, and the rows'
    activations vs. the expert's bytes decide (a tie moves: Klotski's path)."""
    costs = PlacementCosts(link_bytes_per_s=1e9, same_cores=True)
    costs.add("host", 1, 1, 5e-3)
    costs.add("host", 1, 64, 9e-2)                    # the host timed while another process ran
    costs.add("device", 1, 1, 5e-6)
    costs.add("device", 1, 64, 2e-5)                  # the device timed on a quiet moment
    unit, row = 786_432, 1024                          # rows outweigh the expert from 384 on
    assert costs.host_wins(1, unit, row) and costs.host_wins(383, unit, row)
    assert not costs.host_wins(384, unit, row)
    assert not costs.host_wins(64, unit, row, same_kernel=False)    # a backend's own kernel: the fits decide
    assert not PlacementCosts(link_bytes_per_s=float("inf"), same_cores=True).host_wins(1, unit, row)


def _expert_steps(model) -> list[tuple]:
    """Per traced expert compute, in order: (step, layer, experts, rows, lane)."""
    return [(e.args["step"], e.layer, tuple(e.args["experts"]), e.args["tokens"], e.stream)
            for e in model.kinject.tracer.events() if e.stream in ("compute", "host_compute")
            and e.args and "experts" in e.args and "step" in e.args]


def test_where_moving_wins_hybrid_moves_and_computes_exactly_as_klotski(tok, tmp_path):
    """Costs where moving wins (a device far faster per row than the host, as a GPU is): compute:
    auto keeps no expert on the host and prefetches every predicted one, so each step is Klotski's
    (compute: device) -- the same expert loads and bytes moved per step, the same grouped calls
    on the same rows -- and the tokens are transformers' own."""
    batch = tok(["def parse(path):", "import os\nimport sys", "class Node:\n    def", "for i in range("],
                return_tensors="pt", padding=True)
    want = AutoModelForCausalLM.from_pretrained(tiny_moe_path(), dtype=torch.float32).generate(**batch, **GEN)
    common = ["pipeline.micro_batch_size=2", "pipeline.n_batches=2", "pipeline.device_budget=6MiB",
              "pipeline.emulate_bandwidth=1", "pipeline.trace=true", f"pipeline.offload_dir={tmp_path}"]
    runs = {}
    for compute in ("auto", "device"):
        model = kinject.from_pretrained(tiny_moe_path(), "rules/hybrid.yaml", [*common, f"vars.experts_compute={compute}"],
                                        dtype=torch.float32)
        if compute == "auto":
            costs = model.kinject.peek("placement_costs")
            costs.same_cores = False                       # a fast device: 1 us a row there, 10 ms on the host
            for rows in (1, 8):
                costs.add("host", 1, rows, 1e-2 * rows)
                costs.add("device", 1, rows, 1e-6 * rows)
        assert torch.equal(model.generate(**batch, **GEN), want)
        store = model.kinject.store
        runs[compute] = (_expert_loads(model), dict(store.stats["bytes"]), _expert_steps(model),
                         model.kinject.scheduler.step)
        if compute == "auto":
            assert all(op.host.stats["experts"] == 0 for op in _experts(model))
    assert runs["auto"] == runs["device"]
    assert runs["device"][0] > 0 and not any(lane == "host_compute" for *_, lane in runs["device"][2])


def test_compute_kwarg_is_checked_before_anything_changes(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_path(), dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuleError, match=r"klotski.yaml:\d+, rule 2, key 'replace.kwargs.compute'.*'gpu'"):
        kinject.optimize(model, "rules/klotski.yaml", ["vars.experts_compute=gpu", f"pipeline.offload_dir={tmp_path}"])
    assert not hasattr(model, "kinject")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_no_host_kernel_lists_every_backend_and_why():
    class Looped:                                       # a layout computed through its block's own loop
        name, call, math = "loop_block", "loop_block", None

    with pytest.raises(HostComputeError) as err:
        choose_backend(Looped(), where="model.layers.0.mlp (compute: host)")
    msg = str(err.value)
    assert "model.layers.0.mlp (compute: host)" in msg
    assert all(f"{b.name}:" in msg for b in BACKENDS)


def test_host_kernel_setting_names_the_chain_and_rejects_a_typo(tmp_path):
    from kinject.rules import HOST_KERNELS
    from operators.host_experts import chain

    assert set(HOST_KERNELS) == {"auto", *(b.name for b in BACKENDS)}
    assert [b.name for b in chain("torch-grouped")][0] == "torch-grouped"
    assert sorted(b.name for b in chain("torch-grouped")) == sorted(b.name for b in BACKENDS)
    assert chain() == BACKENDS and BACKENDS[0].name == "torch-host"
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_path(), dtype=torch.float32)
    with pytest.raises(RuleError, match=r"host_kernel must be one of auto, torch-host, .*got 'kt'"):
        kinject.optimize(model, "rules/hybrid.yaml", ["pipeline.host_kernel=kt", f"pipeline.offload_dir={tmp_path}"])
    assert not hasattr(model, "kinject")


# ---- the planner: host compute as a third resource -----------------------------------------------


def _chat_profile(**over):
    """A decode layer of the fixture's shape: one expert 786 KB over a 1 GB/s link (0.79 ms), its
    device compute 20 us + 1 us/row, its host compute 40 us + 20 us/row, rows of 1 KiB."""
    from kinject.plan.profile import Profile

    kw = dict(bs=1, t_attn=50e-6, t_gate=10e-6, t_expert=(20e-6, 1e-6), num_experts=8, top_k=2, num_layers=6,
              attn_bytes=1 << 20, gate_bytes=8 << 10, expert_bytes=786_432, bandwidth=1e9,
              t_host_expert=(40e-6, 20e-6), activation_bytes_per_row=1024)
    kw.update(over)
    return Profile(**kw)


def test_planner_bound_counts_host_compute_as_the_third_resource():
    from kinject.plan import planner

    hybrid, klotski = _chat_profile(), _chat_profile(t_host_expert=None)
    sp = planner.split_experts(hybrid, 1, 2, 0.25, 2.0)
    assert sp.k_dev == 0 and sp.q_dev == 0 and sp.host_experts == 4           # batch 1: nothing moves
    b_h, b_k = planner.plan_bound(hybrid, 1), planner.plan_bound(klotski, 1)
    assert b_h.terms["cpu"] > 0 and b_k.terms["cpu"] == 0
    assert b_h.terms["transfer"] < b_k.terms["transfer"] and b_h.tokens_per_s > b_k.tokens_per_s
    # many rows per expert: moving is cheaper than the host's per-row cost, Klotski's moves come back
    big = planner.split_experts(hybrid, 256, 2, 0.25, 6.0)
    assert big.host_experts == 0 and big.k_dev == 2 and big.q_dev == 6.0
    # a CPU "device" is the host's cores: compute cancels, the rows (64 KiB each way) stay under the bytes
    cpu = planner.split_experts(_chat_profile(same_cores=True), 256, 2, 0.25, 6.0)
    assert cpu.host_experts == 8 and cpu.k_dev == 0 and cpu.q_dev == 0
    plan = planner.solve(hybrid, bs=1)
    assert plan.split.host_experts > 0 and "host compute:" in planner.format_table(plan)
    assert hybrid.to_dict()["t_host_expert"] == {"fixed_s": 40e-6, "per_token_s": 20e-6}


def test_bench_hybrid_quick_table(tmp_path, capsys):
    """``kinject bench hybrid --quick`` (one batch here): every contender's row, same tokens as HF,
    hybrid's choice per layer, the bound share and the crossover line."""
    from kinject.app.cli import main

    assert main(["bench", "hybrid", "--quick", "--batches", "1", "--new-tokens", "2", "--repeats", "1",
                 "--prompt-len", "8", "--workdir", str(tmp_path), "--out", str(tmp_path / "t.md")]) == 0
    text = (tmp_path / "t.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| tiny_moe | 1 |")]
    assert [r.split(" | ")[2] for r in rows] == ["resident (HF in RAM)", "accelerate offload", "Klotski", "hybrid",
                                                 "hybrid, host attention"]
    assert all(r.rstrip().endswith("✓ |") for r in rows)
    for hybrid in (r.split(" | ") for r in rows[-2:]):
        assert hybrid[7].startswith("L0 ") and hybrid[6].endswith("%")
    cells = [[c.strip() for c in r.split("|")[1:-1]] for r in rows]
    calls = {c[2]: float(c[8].replace(",", "")) for c in cells}                # per decode step
    assert all(n > 100 for n in calls.values())
    assert "EMULATED" in text and "crossover: measured" in text


def test_hybrid_with_host_attention_switch(prompt, reference, tmp_path):
    """vars.attention_compute=host (CGOPipe): decode attention where the host KV lives, experts by
    Fiddler's rule; transformers' tokens, no KV loaded in the decode steps."""
    from operators.attention import OffloadedAttention

    model = kinject.from_pretrained(tiny_moe_path(), "rules/hybrid.yaml",
                                    [*CHAT, "vars.kv=host", "vars.attention_compute=host", f"pipeline.offload_dir={tmp_path}"],
                                    dtype=torch.float32)
    ops = [op for op in model.kinject.operators if isinstance(op, OffloadedAttention)]
    assert ops and all(op.kv.compute == "host" for op in ops)
    assert torch.equal(model.generate(**prompt, **GEN), reference)
    assert model.kinject.transfer.stats["bytes"]["kv_load"] == 0
    assert _expert_loads(model) == 0


@pytest.mark.gpu
def test_cuda_host_experts_beside_device_experts_identical_tokens(prompt, tmp_path):
    """CUDA: cold experts computed on the host worker (rows over the experts' host lane, pinned, own
    stream, events) while the GPU computes the resident / prefetched ones: transformers' tokens on the
    same GPU, rows both ways on the lane, the experts' bytes not moved."""
    ref_model = AutoModelForCausalLM.from_pretrained(tiny_moe_path(), dtype=torch.float32).to("cuda")
    batch = {k: v.to("cuda") for k, v in prompt.items()}
    want = ref_model.generate(**batch, **GEN)
    model = kinject.from_pretrained(tiny_moe_path(), "rules/hybrid.yaml",
                                    ["pipeline.device=cuda", "vars.experts_compute=host", "pipeline.device_budget=6MiB",
                                     "pipeline.micro_batch_size=1", "pipeline.n_batches=1", "pipeline.host_threads=2",
                                     f"pipeline.offload_dir={tmp_path}"], dtype=torch.float32)
    assert torch.equal(model.generate(**batch, **GEN), want)
    hosts = [op.host for op in _experts(model)]
    assert all(h.stats["experts"] > 0 for h in hosts) and _expert_loads(model) == 0
    lane = model.kinject.peek("experts_host_lane")
    assert lane.stats["to_host"] == lane.stats["to_device"] > 0


@pytest.mark.gpu
def test_cuda_keeps_attention_and_routers_resident_and_computes_the_head_where_it_lives(prompt, tmp_path):
    """CUDA: ``pipeline.keep_resident`` materialises the every-step units it keeps (attention, routers)
    on the GPU once; ``OffloadedModule(compute: host)`` runs embeddings and lm_head on their pinned
    host-tier weights, token ids / a hidden state to the host and the result back over the modules'
    host lane (own stream, events): transformers' tokens on the same GPU, the head never moved."""
    from operators.offload import OffloadedModule

    ref_model = AutoModelForCausalLM.from_pretrained(tiny_moe_path(), dtype=torch.float32).to("cuda")
    batch = {k: v.to("cuda") for k, v in prompt.items()}
    want = ref_model.generate(**batch, **GEN)
    model = kinject.from_pretrained(tiny_moe_path(), "rules/hybrid.yaml",
                                    ["pipeline.device=cuda", "vars.experts_compute=host", "vars.head_compute=host",
                                     "pipeline.device_budget=6MiB", "pipeline.micro_batch_size=1",
                                     "pipeline.n_batches=1", "pipeline.host_threads=2",
                                     f"pipeline.offload_dir={tmp_path}"], dtype=torch.float32)
    rt, layers = model.kinject, model.config.num_hidden_layers
    kept = {u.name for u in rt.residency.kept}
    assert {f"model.layers.{i}.self_attn" for i in range(layers)} <= kept
    assert all(t.device.type == rt.device.type for u in rt.residency.kept for t in u.device.values())
    head = [op for op in rt.operators if isinstance(op, OffloadedModule) and op.host is not None]
    assert head and all(op.binding.unit in rt.residency.moving for op in head)
    assert torch.equal(model.generate(**batch, **GEN), want)
    assert all(op.host.stats["calls"] == GEN["max_new_tokens"] and op.binding.unit.loads == 0 for op in head)
    lane = rt.peek("modules_host_lane")
    assert lane.cuda == (rt.device.type == "cuda") and lane.stats["to_host"] == lane.stats["to_device"] == len(head) * GEN["max_new_tokens"]
    rt.transfer.close()


def test_profile_measures_host_compute_from_the_host_lane(tmp_path):
    """``kinject plan``'s profile of hybrid rules fits the host cost from the host_compute lane of its
    calibration run; the plan then counts host compute as the cpu term of its bound."""
    from kinject.plan import planner, profiler

    model = kinject.from_pretrained(tiny_moe_path(), "rules/hybrid.yaml",
                                    [*CHAT, "vars.experts_compute=host", f"pipeline.offload_dir={tmp_path}"],
                                    dtype=torch.float32)
    profile = profiler.measure_profile(model, bs=1, refresh=True)
    assert profile.t_host_expert is not None and profile.t_host_expert(1) > 0
    assert profile.activation_bytes_per_row == model.config.hidden_size * 4
    assert planner.plan_bound(profile, 1).terms["cpu"] >= 0


def test_three_resource_bound_per_step():
    """Per step max(link, device, host); on shared cores the two compute lanes' union."""
    from kinject.bench.hybrid import three_resource_seconds
    from kinject.trace import Tracer

    tr = Tracer()
    tr.mark_step(0.0, 1.0)
    tr.mark_step(1.0, 2.0)
    tr.record("compute", "attn", 0.0, 0.2)
    tr.record("host_compute", "experts host", 0.2, 0.5)
    tr.record("ondemand", "w", 0.1, 0.2, kind="transfer", nbytes=100)
    tr.record("compute", "attn", 1.0, 1.1)
    tr.record("host_compute", "experts host", 1.05, 1.15)
    tr.record("prefetch", "w", 1.0, 1.9, kind="transfer", nbytes=900)
    # step 1: link 0.1 s, device 0.2, host 0.3 -> 0.3 apart, 0.5 shared; step 2: link 0.9 s
    assert three_resource_seconds(tr, 1000.0, shared_cores=False) == pytest.approx(0.3 + 0.9)
    assert three_resource_seconds(tr, 1000.0, shared_cores=True) == pytest.approx(0.5 + 0.9)


def test_sampling_with_hybrid_draws_the_same_tokens(prompt, tmp_path):
    """Seeded sampling gives transformers' tokens: the cost calibration draws from its own generator."""
    ref = AutoModelForCausalLM.from_pretrained(tiny_moe_path(), dtype=torch.float32)
    torch.manual_seed(7)
    want = ref.generate(**prompt, max_new_tokens=6, do_sample=True, top_k=20)
    model = kinject.from_pretrained(tiny_moe_path(), "rules/hybrid.yaml", [*CHAT, f"pipeline.offload_dir={tmp_path}"],
                                    dtype=torch.float32)
    torch.manual_seed(7)
    assert torch.equal(model.generate(**prompt, max_new_tokens=6, do_sample=True, top_k=20), want)
    assert all(op.host.stats["experts"] for op in _experts(model))


@pytest.mark.parametrize("fmt", ["mxfp4", "int4"])
def test_low_bit_release_computed_on_the_host_gives_transformers_tokens(fmt, tmp_path):
    """GPT-OSS experts stored MXFP4 (transposed, biased) and Qwen3-MoE experts stored INT4 (compressed
    tensors, group 32), dequantized on the host by their codecs: transformers' tokens, none moved."""
    from kinject.io.quantized_writers import save_compressed_tensors_checkpoint, save_mxfp4_checkpoint

    tok = testing.tiny_tokenizer()
    if fmt == "mxfp4":
        path = save_mxfp4_checkpoint(testing.build_tiny_model("gpt_oss", dtype=torch.bfloat16), tmp_path / "ckpt",
                                     tokenizer=tok)
    else:
        model = testing.build_tiny_model("qwen3_moe", dtype=torch.bfloat16, hidden_size=128, moe_intermediate_size=128)
        path = save_compressed_tensors_checkpoint(model, tmp_path / "ckpt", tokenizer=tok, num_bits=4,
                                                  strategy="group", group_size=32)
    batch = testing.tiny_batch(tok, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = AutoModelForCausalLM.from_pretrained(path).generate(**batch, **GEN)
    model = kinject.from_pretrained(path, "rules/hybrid.yaml", ["vars.experts_compute=host", "pipeline.emulate_bandwidth=1",
                                                                f"pipeline.offload_dir={tmp_path}/off"])
    assert torch.equal(model.generate(**batch, **GEN), want)
    ops = _experts(model)
    assert all(u.quant for op in ops for u in op.units) and all(op.host.stats["experts"] for op in ops)
    assert _expert_loads(model) == 0


# ------------------------------------------------------------------ what the device budget keeps


def test_batch_1_under_the_budget_moves_no_weight_and_no_kv(prompt, reference, tmp_path):
    """The issue's chat setting with host attention: the residency plan keeps every attention and
    router unit (they must compute on the device every step), embeddings / lm_head (tied: one
    unit) are computed where they live, experts too: a decode step moves no weight and no KV, only
    activations (each counted: per step at most a few rows of hidden states and one row of logits)."""
    from operators.offload import OffloadedModule

    model = kinject.from_pretrained(tiny_moe_path(), "rules/hybrid.yaml",
                                    [*CHAT, "vars.kv=host", "vars.attention_compute=host", "pipeline.trace=true",
                                     f"pipeline.offload_dir={tmp_path}"], dtype=torch.float32)
    rt = model.kinject
    plan = rt.residency
    kept = {u.name for u in plan.kept}
    layers = model.config.num_hidden_layers
    assert {f"model.layers.{i}.self_attn" for i in range(layers)} <= kept
    assert {f"model.layers.{i}.mlp.gate" for i in range(layers)} <= kept
    head = [op for op in rt.operators if isinstance(op, OffloadedModule) and op.host is not None]
    assert sorted(op.key for op in head) == ["lm_head", "model.embed_tokens"]
    assert head[0].binding.unit is head[1].binding.unit and head[0].binding.unit in plan.moving   # tied: one unit
    assert plan.kept_bytes + plan.reserve + rt.store.resident_external <= rt.store.budget
    assert "residency plan: kept 12 every-step units" in rt.report()
    rt.store.reset_stats()
    assert torch.equal(model.generate(**prompt, **GEN), reference)
    assert sum(rt.store.stats["bytes"].values()) == 0                     # no weight moved, prefill included
    assert rt.transfer.stats["bytes"]["kv_load"] == 0
    steps = rt.tracer.steps()
    assert len(steps) == GEN["max_new_tokens"]
    decode = [e for e in rt.tracer.events() if e.kind == "transfer" and e.start >= steps[1][0]]
    assert decode and all(e.tier == "activations" for e in decode)
    hidden, vocab = model.config.hidden_size * 4, model.config.vocab_size * 4
    per_step = sum(e.nbytes for e in decode) / (len(steps) - 1)
    top_k = model.config.num_experts_per_tok
    assert per_step <= 8 + 2 * hidden + vocab + layers * 2 * top_k * hidden   # ids, embedding row, logits, experts' rows
    assert all(op.host.stats["calls"] == len(steps) for op in head)


def test_residency_plan_keeps_what_must_compute_on_the_device_first():
    """Every-step units that must compute on the device are kept first; a unit its operator can
    compute where it lives only with what is left; room stays for two of the largest unit still
    moving every step and one of the largest expert; experts are never kept."""
    from kinject.engine.residency import plan_residency
    from kinject.engine.store import TensorStore
    from kinject.engine.transfer import TransferEngine

    kib = 1024
    store = TensorStore("cpu", TransferEngine("cpu", inline=True), device_budget=3 * 256 * kib)
    def add(name, n, **kw):
        return store.add(name, {"w": torch.zeros(n * kib // 4)}, "host", **kw)
    head = add("lm_head", 384, every_step=True)
    head.host_compute = True
    attn = [add(f"attn{i}", 256, layer=i, every_step=True) for i in range(2)]
    expert = add("expert", 300, layer=0)
    plan = plan_residency(store)
    assert plan.kept == [attn[0]] and plan.moving == [attn[1], head]
    assert plan.reserve == 2 * 256 * kib and plan.saved_per_step == 256 * kib
    assert not attn[0].offloaded and attn[0].device is not None and store.used == 256 * kib
    assert expert.offloaded and attn[1].offloaded
    assert store.acquire(attn[0])["w"] is attn[0].device["w"]           # used like a resident unit
    store.remove(attn[0])
    assert store.used == 0


def test_head_computes_where_it_lives_until_its_outputs_outweigh_its_weights(tmp_path):
    """OffloadedModule(compute: auto) on lm_head: decode-sized calls run on the host (a row of logits
    is far less than the weights); a forward over 300 rows, once its output size per row is known,
    moves the weights instead (300 rows of logits outweigh them). Logits equal transformers' own."""
    from operators.offload import OffloadedModule

    ids = torch.randint(3, 4000, (1, 300), generator=torch.Generator().manual_seed(0))
    ref = AutoModelForCausalLM.from_pretrained(tiny_moe_path(), dtype=torch.float32)(ids).logits
    model = kinject.from_pretrained(tiny_moe_path(), "rules/hybrid.yaml",
                                    ["pipeline.keep_resident=false", "pipeline.emulate_bandwidth=1",
                                     f"pipeline.offload_dir={tmp_path}"], dtype=torch.float32)
    head = next(op for op in model.kinject.operators if isinstance(op, OffloadedModule) and op.key == "lm_head")
    unit = head.binding.unit
    assert head.host.mode == "auto" and unit.host_compute
    for calls, loads in ((1, 0), (1, 1)):          # first: size unknown, its input decides (host); then moved
        torch.testing.assert_close(model(ids).logits, ref, rtol=0, atol=0)
        assert head.host.stats["calls"] == calls and unit.loads == loads
    assert head.host.out_per_row == model.config.vocab_size * 4
