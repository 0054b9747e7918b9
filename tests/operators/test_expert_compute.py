"""Grouped expert compute (operators/expert_compute.py) and the per-step bookkeeping around it:
same bits as one expert at a time, one store call per group, no worker-thread hand-offs on a CPU."""

from __future__ import annotations

import pytest
import torch

import kinject
from helpers.expert_counts import count_backends
from kinject.testing import build_tiny_model, tiny_batch, tiny_tokenizer
from operators.expert_compute import ExpertMath, compute_group, has_stacked_view, stacked_view, stacked_views
from operators.experts import GroupedExperts


def _math(transposed=False, gated=True):
    act = torch.nn.functional.silu

    def gate(h):
        g, u = h.chunk(2, dim=-1)
        return act(g) * u

    return ExpertMath(up="gate_up_proj" if gated else "up_proj", down="down_proj", transposed=transposed,
                      activation=gate if gated else act, post=None)


def _reference(math, w, ids, counts, x):
    """One expert at a time, as GroupedExperts used to: x @ W.T (+ b), activation, x @ W.T (+ b)."""
    out, start = [], 0
    for e, n in zip(ids, counts):
        rows = x[start:start + n]
        up, down = w[math.up][e], w[math.down][e]
        h = rows @ up if math.transposed else rows @ up.T
        if math.up + "_bias" in w:
            h = h + w[math.up + "_bias"][e]
        h = math.activation(h)
        y = h @ down if math.transposed else h @ down.T
        if math.down + "_bias" in w:
            y = y + w[math.down + "_bias"][e]
        out.append(y)
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("transposed,bias", [(False, False), (True, True)])
def test_grouped_call_is_bitwise_one_expert_at_a_time(transposed, bias):
    g = torch.Generator().manual_seed(0)
    E, H, I = 8, 32, 16
    shape_up, shape_down = ((E, H, 2 * I), (E, I, H)) if transposed else ((E, 2 * I, H), (E, H, I))
    w = {"gate_up_proj": torch.randn(shape_up, generator=g), "down_proj": torch.randn(shape_down, generator=g)}
    if bias:
        w["gate_up_proj_bias"] = torch.randn(E, 2 * I, generator=g)
        w["down_proj_bias"] = torch.randn(E, H, generator=g)
    math = _math(transposed)
    ids, counts = [1, 2, 5, 7], [3, 1, 4, 2]                       # a gap (3, 4, 6): not ready / not used
    x = torch.randn(sum(counts), H, generator=g)
    per_expert = [{k: v[e] for k, v in w.items()} for e in ids]   # views of the fused [E, ...] tensors
    assert all(has_stacked_view([t[k] for t in per_expert], ids) for k in w)
    assert torch.equal(stacked_view([t["down_proj"] for t in per_expert], ids), w["down_proj"][1:8])
    ref = _reference(math, w, ids, counts, x)
    assert torch.equal(compute_group(math, per_expert, ids, counts, x, backend="loop"), ref)
    assert torch.equal(compute_group(math, per_expert, ids, counts, x, backend="grouped_mm"), ref)
    assert torch.equal(compute_group(math, per_expert, ids, counts, x), ref)
    every = [{k: v[e] for k, v in w.items()} for e in range(E)]
    whole = stacked_views(math, every)                                # [E, ...] over all experts
    assert all(v.data_ptr() == w[k].data_ptr() and v.shape == w[k].shape for k, v in whole.items())
    assert torch.equal(compute_group(math, per_expert, ids, counts, x, stacked=whole), ref)
    copies = [{k: v.clone() for k, v in t.items()} for t in per_expert]   # separate tensors: no stacked view
    assert stacked_views(math, copies) is None
    assert not has_stacked_view([t["gate_up_proj"] for t in copies], ids)
    assert torch.equal(compute_group(math, copies, ids, counts, x), ref)


def test_refused_inputs_take_the_loop_for_that_call_a_missing_kernel_for_the_process(monkeypatch, caplog):
    """torch's grouped GEMM refuses a stride-0 input: that call loops, the kernel stays on; only a
    kernel that fails on fresh contiguous tensors too is switched off for the device and dtype."""
    from operators import expert_compute

    g = torch.Generator().manual_seed(1)
    E, H, I = 4, 32, 16
    w = {"gate_up_proj": torch.randn(E, 2 * I, H, generator=g), "down_proj": torch.randn(E, H, I, generator=g)}
    math, ids, counts = _math(), [0, 1, 3], [1, 1, 1]
    per_expert = [{k: v[e] for k, v in w.items()} for e in ids]
    x = torch.randn(1, H, generator=g).expand(3, H)                  # one token's row, three times (stride 0)
    ref = _reference(math, w, ids, counts, x.contiguous())
    monkeypatch.setattr(expert_compute, "_KERNEL_OK", {})
    calls = []
    real = expert_compute._GROUPED_MM
    monkeypatch.setattr(expert_compute, "_GROUPED_MM", lambda *a, **k: calls.append(1) or real(*a, **k))
    with caplog.at_level("INFO", logger="operators.expert_compute"):
        assert torch.equal(compute_group(math, per_expert, ids, counts, x), ref)       # refused, then the loop
        assert calls and False not in expert_compute._KERNEL_OK.values()
        calls.clear()
        assert torch.equal(compute_group(math, per_expert, ids, counts, x.contiguous()), ref)
        assert calls                                                                 # still the grouped GEMM

        def missing(*a, **k):
            raise NotImplementedError("no grouped_mm kernel for this dtype")
        monkeypatch.setattr(expert_compute, "_GROUPED_MM", missing)
        assert torch.equal(compute_group(math, per_expert, ids, counts, x.contiguous()), ref)
    assert list(expert_compute._KERNEL_OK.values()) == [False]
    assert "grouped_mm unavailable for cpu torch.float32" in caplog.text


def test_cpu_group_runs_over_its_span_and_loops_when_spread_thin(monkeypatch):
    """On a CPU the grouped GEMM pays for every expert of its span: a group gets the slice of the
    stacked views from its first to its last expert, and one spread over more than
    ``_CPU_SPREAD`` times its size runs one mm per expert instead; the same bits either way."""
    import operators.expert_compute as ec

    g = torch.Generator().manual_seed(1)
    E, H, I = 64, 16, 8
    w = {"gate_up_proj": torch.randn(E, 2 * I, H, generator=g), "down_proj": torch.randn(E, H, I, generator=g)}
    math = _math()
    every = [{k: v[e] for k, v in w.items()} for e in range(E)]
    whole = stacked_views(math, every)
    spans = []
    grouped = ec._grouped
    monkeypatch.setattr(ec, "_grouped", lambda m, views, ids, *a: spans.append(views[m.up].shape[0]) or
                        grouped(m, views, ids, *a))
    for ids, span in (([10, 11, 13, 14], 5), ([3, 9, 30, 61], None), ([0, 63], None)):
        counts = [2, 1, 3, 1][: len(ids)]
        x = torch.randn(sum(counts), H, generator=g)
        ref = _reference(math, w, ids, counts, x)
        spans.clear()
        assert torch.equal(compute_group(math, [every[e] for e in ids], ids, counts, x, stacked=whole), ref)
        assert spans == ([span] if span else [])       # spread thin (span 59 > 4 x 4, 64 > 4 x 2): loops
        spans.clear()                                  # forced: the grouped GEMM over the span all the same
        assert torch.equal(compute_group(math, [every[e] for e in ids], ids, counts, x, stacked=whole,
                                         backend="grouped_mm"), ref)
        assert spans == [ids[-1] - ids[0] + 1]
    assert not ec._spread_thin([3, 9, 30, 61], torch.device("cuda"))   # never on an accelerator


def test_host_experts_on_cpu_one_store_call_per_layer_and_no_threads():
    """Every weight in the host tier of a CPU, no emulated link: the tokens of the untouched model,
    each MoE layer's experts acquired in one store call per step (64 experts, top-6), no unit
    acquired alone, and no transfer worker thread started (jobs run in the caller's thread)."""
    tok = tiny_tokenizer()
    batch = tiny_batch(tok, 4, min_tokens=12)
    cfg = dict(num_experts=64, num_experts_per_tok=6, num_hidden_layers=2)
    ref_model = build_tiny_model("qwen3_moe", **cfg)
    gen = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    ref = ref_model.generate(**batch, **gen)
    model = build_tiny_model("qwen3_moe", **cfg)
    kinject.optimize(model, "rules/qwen3_moe_klotski.yaml", ["vars.weights=host"])
    rt = model.kinject
    calls = {"acquire": [], "acquire_many": []}
    one, many = rt.store.acquire, rt.store.acquire_many
    rt.store.acquire = lambda unit, *a, **k: calls["acquire"].append(unit.name) or one(unit, *a, **k)
    rt.store.acquire_many = lambda units, *a, **k: calls["acquire_many"].append(len(units)) or many(units, *a, **k)
    steps0 = rt.scheduler.step
    assert torch.equal(model.generate(**batch, **gen), ref)
    steps = rt.scheduler.step - steps0
    experts = [op for op in rt.operators if isinstance(op, GroupedExperts)]
    assert len(calls["acquire_many"]) == steps * len(experts)      # one grouped call per MoE layer per step
    assert not [n for n in calls["acquire"] if ".experts[" in n]  # no expert acquired on its own
    assert all(u.refs == 0 and u.device is None for op in experts for u in op.units)
    assert rt.transfer.inline and not rt.transfer._threads
    kinject.restore(model)


def test_experts_own_tensors_are_sliced_from_one_stacked_view_moved_ones_are_not():
    """GroupedExperts._stacked: a [E, ...] view when the group's tensors are the experts' own
    (host units used in place on a CPU, "moved" over an emulated link on a CPU, or resident ones),
    None for tensors the store really moved (here: copies made by the load)."""
    tok = tiny_tokenizer()
    batch = tiny_batch(tok, 2, min_tokens=8)
    gen = dict(max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
    ref = build_tiny_model("qwen3_moe").generate(**batch, **gen)
    emulated = ["vars.weights=host", "pipeline.emulate_bandwidth=1000.0"]
    for overrides, copied, sliced in ((["vars.weights=host"], False, True), (["vars.weights=device"], False, True),
                                      (emulated, False, True), (emulated, True, False)):
        model = build_tiny_model("qwen3_moe")
        kinject.optimize(model, "rules/qwen3_moe_klotski.yaml", overrides)
        op = next(op for op in model.kinject.operators if isinstance(op, GroupedExperts))
        if copied:                                              # loads land in new tensors, as on a GPU
            store = model.kinject.store
            real = store._copy_fn
            store._copy_fn = lambda unit, src: (lambda fn: lambda: {k: v.clone() for k, v in fn().items()})(real(unit, src))
        seen = []
        compute = op.layout.compute_sorted
        op.layout.compute_sorted = lambda *a, stacked=None, **k: seen.append(stacked) or compute(*a, stacked=stacked, **k)
        assert torch.equal(model.generate(**batch, **gen), ref), overrides
        assert seen and all((s is not None) == sliced for s in seen), overrides
        if sliced:
            fused = op.base.gate_up_proj                       # a stand-in now; the views are of the original
            assert next(iter(seen[0].values())).shape[0] == op.stored and fused.shape[0] == op.stored
        kinject.restore(model)


def test_trace_records_one_event_per_group_with_its_experts():
    tok = tiny_tokenizer()
    batch = tiny_batch(tok, 4, min_tokens=12)
    model = build_tiny_model("mixtral")
    kinject.optimize(model, "rules/mixtral_klotski.yaml", ["pipeline.trace=true"])
    model.generate(**batch, max_new_tokens=2, do_sample=False, pad_token_id=tok.pad_token_id)
    groups = [e for e in model.kinject.tracer.events() if e.stream == "compute" and "experts" in e.args]
    assert groups and all(e.args["tokens"] > 0 and e.args["experts"] == sorted(e.args["experts"]) for e in groups)
    kinject.restore(model)


def test_fill_link_prefetches_ranked_experts_until_the_gate_routes():
    """``fill_link``: after the K hot experts, more experts of the table's ranking are prefetched
    (one at a time) while the attention runs; never once the layer has routed; same tokens; every
    unused one is dropped (nothing left on the device after generate)."""
    import time

    tok = tiny_tokenizer()
    batch = tiny_batch(tok, 8, min_tokens=16)
    model = build_tiny_model("mixtral")
    gen = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    ref = model.generate(**batch, **gen)
    kinject.optimize(model, "rules/mixtral_klotski.yaml",
                     ["pipeline.emulate_bandwidth=0.01", "rules.2.replace.kwargs.fill_link=true"])
    rt = model.kinject
    late = []
    for op in rt.operators:
        if isinstance(op, GroupedExperts):
            fill = op._fill_next

            def spy(step, ranking, op=op, fill=fill):
                before = set(op.step.prefetched)
                fill(step, ranking)
                if op.step.routed >= step and set(op.step.prefetched) - before:
                    late.append(op.key)             # a speculative load started after routing
            op._fill_next = spy
    hooks = [op.register_forward_hook(lambda *_: time.sleep(0.015))      # attention long enough to fill
             for op in rt.operators if op.key.endswith("self_attn")]
    loads0 = rt.store.stats["loads"]
    assert torch.equal(model.generate(**batch, **gen), ref)
    for h in hooks:
        h.remove()
    rt.transfer.synchronize(timeout=10)
    assert not late
    experts = [op for op in rt.operators if isinstance(op, GroupedExperts)]
    assert all(op.fill_link for op in experts) and rt.store.stats["loads"] > loads0
    assert not [u.name for op in experts for u in op.units if u.device is not None or u.handle is not None]
    kinject.restore(model)


def test_tokens_per_expert_skips_ids_outside_the_experts():
    """Expert-parallel sentinels (an id >= E, or -1) are not counted, and say so."""
    from operators.experts import _tokens_per_expert

    counts, ok = _tokens_per_expert(torch.tensor([[0, 2], [2, 3]]), 4)
    assert counts.tolist() == [1, 0, 2, 1] and ok
    counts, ok = _tokens_per_expert(torch.tensor([[0, 4], [2, 6]]), 4)
    assert counts.tolist() == [1, 0, 1, 0] and not ok
    counts, ok = _tokens_per_expert(torch.tensor([[-1, 1], [1, 3]]), 4)
    assert counts.tolist() == [0, 2, 0, 1] and not ok
    counts, ok = _tokens_per_expert(torch.zeros((0, 2), dtype=torch.long), 4)
    assert counts.tolist() == [0, 0, 0, 0] and ok


def test_a_decode_steps_few_choices_are_counted_as_bincount_counts_them():
    """A decode step's choices (up to FEW_CHOICES) are counted in Python, more with bincount: the same
    counts and the same in-range answer either way, sentinels included."""
    from operators.expert_routing import FEW_CHOICES, _counts_per_expert, _tokens_per_expert

    g = torch.Generator().manual_seed(0)
    cases = [(torch.randint(0, 64, (t, k), generator=g), 64) for t, k in ((1, 8), (2, 8), (8, 8), (9, 8), (1, 1), (40, 4))]
    cases += [(torch.tensor([[0, 4], [2, 6]]), 4), (torch.tensor([[-1, 1], [1, 3]]), 4), (torch.zeros((0, 2), dtype=torch.long), 4)]
    for choices, n in cases:
        counts, counts_t, ok = _counts_per_expert(choices, n)
        ref, ref_ok = _tokens_per_expert(choices, n)
        assert counts == ref.tolist() and ok == ref_ok, choices
        assert (counts_t is None) == (choices.numel() <= FEW_CHOICES)


def test_expert_group_costs_example_times_every_backend():
    """examples/expert_group_costs.py: one row per group size (the three backends agree on the bits,
    or it fails), the chosen backend per ``_spread_thin``."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "examples" / "expert_group_costs.py"), "--experts", "16",
                          "--hidden", "32", "--intermediate", "8", "--groups", "2", "12", "--repeats", "20"],
                         cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert [r.split(" | ")[0] for r in rows] == ["| 2", "| 12"]
    assert all(r.endswith(("| loop |", "| grouped GEMM |")) for r in rows)


def _no_slabs(monkeypatch) -> None:
    """The store as it was: every moved or dequantized unit in tensors of its own."""
    import kinject.engine.store as store

    monkeypatch.setattr(store, "stacks", lambda units, specs: [])


@pytest.mark.parametrize("case", ["disk", "hqq"])
def test_moved_experts_compute_in_grouped_calls(case, monkeypatch, tmp_path):
    """Experts read from disk into the store's landing slab, or HQQ-dequantized into a stacked
    workspace, are equally spaced views of one allocation: every group of two or more computes
    in one grouped GEMM (none falls back to one mm per expert), with the tokens of the untouched
    model (disk) or of the same HQQ run with one tensor per unit (HQQ is lossy). Without slabs the
    same run loops, so the count can tell."""
    tok = tiny_tokenizer()
    batch = tiny_batch(tok, 4, min_tokens=12)
    cfg = dict(num_experts=16, num_experts_per_tok=4, num_hidden_layers=2)
    gen = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    # disk: no host cache (its subject is the landing slab of the read path; a cached unit is used in place)
    overrides = {"disk": ["vars.weights=disk", "pipeline.host_budget=null"],
                 "hqq": ["vars.weights=host", "vars.quant={nbits: 4, group_size: 64}"]}[case]
    overrides = overrides + [f"pipeline.offload_dir={tmp_path}"]

    def run(slabs: bool):
        with monkeypatch.context() as m:
            if not slabs:
                _no_slabs(m)
            seen = count_backends(m)
            model = build_tiny_model("qwen3_moe", **cfg)
            kinject.optimize(model, "rules/qwen3_moe_klotski.yaml", overrides)
            out = model.generate(**batch, **gen)
            kinject.restore(model)
        return out, seen

    ref = build_tiny_model("qwen3_moe", **cfg).generate(**batch, **gen) if case == "disk" else None
    tokens, seen = run(slabs=True)
    base_tokens, base = run(slabs=False)
    assert torch.equal(tokens, base_tokens)
    if ref is not None:
        assert torch.equal(tokens, ref)
    assert base["looped"] and not base["grouped"], base       # one tensor per unit: one mm per expert
    # with slabs the grouped GEMM carries the experts; a group may still loop when its experts landed in
    # different allocations (a cold expert loaded alone on demand, beside a prefetched slab): which
    # ones do depends on when the disk reads finish, so the count, not the absence, is asserted
    assert seen["grouped"] and max(seen["grouped"]) > 1, seen
    assert sum(seen["looped"]) < sum(seen["grouped"]) / 4, seen


def test_slot_ids_find_units_in_one_slab_whatever_their_expert_ids(monkeypatch):
    """Experts 1, 5, 6 landed in slots 0, 2, 3 of one [4, ...] slab: the grouped GEMM runs over the
    slab by slot (same bits as one expert at a time); tensors of their own, or out of order, do not."""
    from operators.expert_compute import _slot_ids

    g = torch.Generator().manual_seed(2)
    H, I = 16, 8
    math = _math()
    slab = {"gate_up_proj": torch.randn(4, 2 * I, H, generator=g), "down_proj": torch.randn(4, H, I, generator=g)}
    ids, slots, counts = [1, 5, 6], [0, 2, 3], [2, 3, 1]
    weights = [{k: v[s] for k, v in slab.items()} for s in slots]
    assert _slot_ids([w["gate_up_proj"] for w in weights]) == slots
    assert _slot_ids([w["gate_up_proj"] for w in weights[::-1]]) is None
    assert _slot_ids([w["gate_up_proj"].clone() for w in weights]) is None
    x = torch.randn(sum(counts), H, generator=g)
    ref = _reference(math, slab, slots, counts, x)
    seen = count_backends(monkeypatch)
    assert torch.equal(compute_group(math, weights, ids, counts, x), ref)
    assert seen == {"grouped": [3], "looped": []}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_cuda_moved_experts_land_in_one_slab_and_compute_grouped(tier, monkeypatch, tmp_path):
    """CUDA, bf16: experts copied from pinned host memory or read from disk land in the store's
    landing slab (allocated on the transfer stream, ordered by events) and every group of two or
    more computes in one grouped GEMM; the tokens are those of the same model with every expert
    resident (its [E, ...] parameters: grouped GEMMs over the same weights)."""
    tok = tiny_tokenizer()
    batch = {k: v.cuda() for k, v in tiny_batch(tok, 4, min_tokens=12).items()}
    cfg = dict(num_experts=16, num_experts_per_tok=4, num_hidden_layers=2)
    gen = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)

    def run(weights: str):
        model = build_tiny_model("qwen3_moe", **cfg).to(torch.bfloat16)
        kinject.optimize(model, "rules/qwen3_moe_klotski.yaml", [f"vars.weights={weights}", "pipeline.device=cuda:0",
                                                                 f"pipeline.offload_dir={tmp_path}"])
        model.cuda()
        out = model.generate(**batch, **gen)
        kinject.restore(model)
        return out

    ref = run("device")
    seen = count_backends(monkeypatch)
    assert torch.equal(run(tier), ref)
    # with slabs the grouped GEMM carries the experts; a group may still loop when its experts landed in
    # different allocations (a cold expert loaded alone on demand, beside a prefetched slab): which
    # ones do depends on when the copies / disk reads finish, so the count, not the absence, is
    # asserted. From disk more experts arrive on demand, one read each (H100, 2026-11-27: 58 experts
    # grouped, 30 looped); gathering them into one allocation would read their bytes three times
    # where a GEMM per expert reads them once, so they stay looped.
    assert seen["grouped"] and max(seen["grouped"]) > 1, seen
    assert sum(seen["looped"]) < sum(seen["grouped"]) / (4 if tier == "host" else 1), seen


def test_groups_by_storage_slab_by_slab_in_order_of_first_appearance():
    """A group's experts split by the storage they landed in (a prefetched batch's slab and the router's
    cold batch's): slab-sharing experts together, in order of first appearance; experts each in their
    own storage (host cache entries) or without tensors stay one per part."""
    from operators.expert_sites import _by_storage

    slab_a, slab_b = torch.zeros(4, 3, 2), torch.zeros(2, 3, 2)
    own = [{"up": torch.zeros(3, 2), "down": torch.zeros(2, 3)} for _ in range(3)]
    tensors = [{"up": slab_a[0]}, {"up": slab_b[1]}, {"up": slab_a[2]}, {"up": slab_b[0]}, {"up": slab_a[3]}]
    assert _by_storage(tensors) == [[0, 2, 4], [1, 3]]
    assert _by_storage(own) == [[0], [1], [2]]
    assert _by_storage([{"up": slab_a[0]}, {"up": slab_a[1]}]) == [[0, 1]]
    assert _by_storage([{"up": slab_a[0]}, {}, {"up": slab_a[1]}]) == [[0], [1], [2]]   # a role missing: each alone
    assert _by_storage([]) == []


def _experts_of(model_type: str, **extra):
    """A family's fused experts module, built from a tiny config on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                  **extra)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return next(m for n, m in model.named_modules() if n.endswith("mlp.experts"))


def test_default_silu_gate_is_marked_for_a_host_kernel_to_fuse_and_others_are_not():
    """transformers' default gate with a SiLU act_fn (Qwen3-MoE, Mixtral) is marked ``fused =
    "silu"`` and computes as it did; GPT-OSS's own clamped gate, another activation, and a gate or
    act_fn overridden on the instance are left unmarked (a host kernel then calls them between its
    projections)."""
    from operators.expert_compute import SiluGate, is_default_silu_gate

    for family in ("qwen3_moe", "mixtral"):
        base = _experts_of(family)
        math = ExpertMath.of(base)
        assert isinstance(math.activation, SiluGate) and math.activation.fused == "silu", family
        h = torch.randn(3, 64)
        assert torch.equal(math.activation(h), base._apply_gate(h)), family
    assert not is_default_silu_gate(_experts_of("gpt_oss"))
    assert getattr(ExpertMath.of(_experts_of("gpt_oss")).activation, "fused", None) is None
    gelu = _experts_of("qwen3_moe")
    gelu.act_fn = torch.nn.GELU()
    assert not is_default_silu_gate(gelu)
    own = _experts_of("qwen3_moe")
    own._apply_gate = lambda h: h[..., : h.shape[-1] // 2]
    assert not is_default_silu_gate(own)
    hooked = _experts_of("mixtral")
    hooked.act_fn.register_forward_hook(lambda *a: None)
    assert not is_default_silu_gate(hooked)
