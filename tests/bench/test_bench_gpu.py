"""`kinject bench gpu`: the CPU dry run (every row, the same tokens), the random checkpoint index;
one tiny CUDA run (skipped without a GPU). No timing asserts except the dry run's wall clock."""

import time

import pytest
import torch

from kinject.bench import gpu as bench_gpu
from kinject.bench.gpu import LADDER
from kinject.bench import random_checkpoint
from kinject.bench.random_checkpoint import RandomIndex
from kinject.app.cli import main

DRY = ["bench", "gpu", "--device", "cpu", "--layers", "1", "--hidden", "256", "--intermediate", "512", "--vocab", "512",
       "--new-tokens", "2", "--prompt-len", "16", "--repeats", "1", "--device-budget", "256MiB"]


@pytest.fixture
def rows_of(monkeypatch):
    """The Row objects of the next `bench gpu` run (the report only has their text)."""
    captured = {}
    real = bench_gpu.run

    def spy(*args, **kwargs):
        captured["rows"] = real(*args, **kwargs)
        return captured["rows"]

    monkeypatch.setattr(bench_gpu, "run", spy)
    return captured


def test_cpu_dry_run_every_row_same_tokens(tmp_path, rows_of):
    out = tmp_path / "bench_gpu.md"
    t0 = time.perf_counter()
    assert main(DRY + ["--out", str(out)]) == 0
    assert time.perf_counter() - t0 < 60
    rows = rows_of["rows"]
    assert [r.name for r in rows] == [name for _, name, _ in LADDER]
    assert all(r.error is None and len(r.times) == 1 and r.tokens is not None for r in rows)
    assert all(r.tokens.shape == rows[0].tokens.shape for r in rows)
    kinject_rows = [r for r in rows if r.rules is not None and r.key != "hqq"]
    assert len(kinject_rows) == 4
    for r in kinject_rows:                          # the ladder never changes the tokens (HQQ does)
        assert torch.equal(r.tokens, kinject_rows[0].tokens), r.name
        assert r.steps == 2 * r.calls and r.bytes_moved > 0 and r.peak > 0 and r.bubble is not None
    text = out.read_text()
    assert text.startswith("kinject bench gpu — DRY RUN on cpu") and "NOT a measurement" in text
    for _, name, _ in LADDER:
        assert f"| {name} | " in text
    assert "% of bound" in text and "- command: `" in text and "- commit: " in text


def test_cpu_dry_run_simple_pipeline_runs_n_calls(rows_of):
    assert main(DRY + ["--n", "2", "--contenders", "simple,multibatch,klotski", "-q"]) == 0
    simple, multi, klotski = rows_of["rows"]
    assert (simple.calls, simple.rows, multi.calls, multi.rows) == (2, 32, 1, 64)
    assert simple.steps == 2 * multi.steps
    assert torch.equal(simple.tokens, multi.tokens) and torch.equal(klotski.tokens, multi.tokens)


def test_bad_arguments_are_one_line_errors(capsys):
    assert main(DRY + ["--contenders", "simple,vllm"]) == 2
    assert "unknown contender 'vllm'" in capsys.readouterr().err
    assert main(DRY + ["--device-budget", "lots"]) == 2
    assert "--device-budget" in capsys.readouterr().err


def _small_meta():
    shape = bench_gpu.Shape(layers=2, hidden=64, intermediate=96, heads=4, kv_heads=2, vocab=128)
    return shape, bench_gpu.meta_model(shape, "eager")


def test_random_index_is_deterministic(monkeypatch):
    shape, meta = _small_meta()
    monkeypatch.setattr(random_checkpoint, "CHUNK", 1000)          # many chunks: threads must not matter
    a = RandomIndex(meta, seed=3, threads=4)
    b = RandomIndex(meta, seed=3, threads=1, cache=False)
    c = RandomIndex(meta, seed=4)
    assert a.materialize() >= 0 and a.nbytes == shape.model_bytes()
    assert set(a.names) == set(meta.state_dict())
    for name in a.names:
        t = a.source(name).read()
        assert t.dtype == torch.bfloat16 and tuple(t.shape) == a.source(name).shape and torch.isfinite(t).all()
        assert torch.equal(t, b.source(name).read()), name
        if t.dim() >= 2:
            assert not torch.equal(t, c.source(name).read()), name
        else:
            assert torch.equal(t, torch.ones_like(t))       # norm weights: ones, as HF's init
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    assert a.is_fused_expert(fused) and a.num_experts(fused) == shape.experts
    assert not a.is_fused_expert("model.layers.1.self_attn.q_proj.weight")
    whole = b.source(fused).read()
    for e in range(shape.experts):                          # a fused tensor is the stack of its experts
        src = b.expert_source(fused, e)
        assert src.shape == tuple(whole.shape[1:]) and src.nbytes == whole[e].numel() * 2 and src.pieces == ()
        assert torch.equal(src.read(), whole[e]) and torch.equal(a.expert_source(fused, e).read(), whole[e])
        out = torch.empty(src.shape, dtype=torch.float32)
        assert src.read(out=out) is out and torch.equal(out, whole[e].float())
    # cached: every reader gets the same tensor (one host copy whatever the number of contenders)
    assert a.source(fused).read().data_ptr() == a.expert_source(fused, 0).read().data_ptr()
    q = a.source("model.layers.0.self_attn.q_proj.weight").read().float()
    assert abs(q.std().item() - random_checkpoint.INIT_GAIN / 8) < 0.02
    with pytest.raises(KeyError):
        a.source("model.layers.9.mlp.gate.weight")
    with pytest.raises(IndexError):
        a.expert_source(fused, shape.experts)


def test_budget_is_the_real_share_of_the_model():
    for layers, gib in ((6, 4.61), (8, 6.10)):               # ~0.75 GiB per layer of a 24 GiB card
        budget, how = bench_gpu.device_budget(bench_gpu.Shape(layers=layers), 24)
        assert abs(budget / 2**30 - gib) < 0.01 and "raised" not in how
    shape = bench_gpu.Shape(layers=4)                        # below resident + one layer: raised to it
    budget, how = bench_gpu.device_budget(shape, 24)
    assert "raised" in how and budget >= shape.resident_bytes() + shape.layer_bytes()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tiny_cuda_run(tmp_path, rows_of):
    out = tmp_path / "bench_gpu.md"
    argv = ["bench", "gpu", "--device", "cuda:0", "--layers", "2", "--hidden", "512", "--intermediate", "1024",
            "--heads", "8", "--kv-heads", "2", "--vocab", "1024", "--bs", "8", "--n", "2", "--prompt-len", "32",
            "--new-tokens", "4", "--repeats", "1", "--device-budget", "48MiB", "--out", str(out)]
    assert main(argv) == 0
    rows = {r.key: r for r in rows_of["rows"]}
    assert list(rows) == [k for k, _, _ in LADDER]
    for r in rows.values():
        assert r.error is None and r.times and r.peak > 0 and r.bytes_moved > 0 and r.match is not None
        if r.key != "acc":
            assert r.bubble is not None
    # the rows running transformers' layers were refit on measured peaks and stayed inside the budget
    # (48 MiB < the model's 55 MB: accelerate offloads); every row says where it stands
    for key in ("acc", "simple", "multibatch"):
        r = rows[key]
        assert r.fit.how.startswith("measured") and r.peak <= 48 << 20, (key, r.fit.how, r.peak)
        assert r.calls == -(-16 // r.rows)
    # every contender's host tier holds the index's pinned tensors, shared, not copies
    klotski = rows["klotski"].model.kinject.store["model.layers.0.mlp.experts[0]"]
    simple = rows["simple"].model.kinject.store["model.layers.0"]
    assert klotski.tier == simple.tier == "host"
    assert all(t.is_pinned() for t in list(klotski.tensors.values()) + list(simple.tensors.values()))
    assert klotski.tensors["gate_up_proj"].data_ptr() == simple.tensors["mlp.experts.gate_up_proj"].data_ptr()
    text = out.read_text()
    assert "DRY RUN" not in text and torch.cuda.get_device_name() in text and "driver" in text
    assert "| inside budget |" in text and "max_memory {0: " in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_gpu_checks_script_says_there_is_no_cuda_and_runs_nothing(tmp_path):
    """scripts/gpu_checks.sh parses, and on a machine without CUDA stops at once with one line, exit 2."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_checks.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    proc = subprocess.run(["bash", str(script), str(tmp_path / "out")], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "gpu_checks: torch sees no CUDA device here (torch.cuda.is_available() is False); nothing to check"]
    assert list((tmp_path / "out").iterdir()) == []


# ---------------------------------------------------------------------------- sizing under one budget

from kinject.bench import gpu_sizing as sizing  # noqa: E402

GIB = 2**30


def test_hf_activation_estimate_covers_the_h100_allocation():
    """The first H100 run: transformers' generate decoding 128 sequences with batched_mm gathered
    down_proj[expert_ids] = [256 pairs, 4096, 14336] bf16 = the 28 GiB it asked for, after the 56 GiB
    gate_up gather; the estimate counts both, and the batched decode step only where it happens."""
    shape = bench_gpu.Shape(layers=6)
    pairs = 128 * shape.top_k
    down, gate_up = pairs * shape.hidden * shape.intermediate * 2, pairs * 2 * shape.intermediate * shape.hidden * 2
    assert down == 28 * GIB and gate_up == 56 * GIB
    assert sizing.batched_decode_bytes(shape, 128) > down + gate_up
    assert sizing.hf_activation_bytes(shape, 128, 512, batched_decode=True) == sizing.batched_decode_bytes(shape, 128)
    prefill = sizing.hf_activation_bytes(shape, 128, 512)      # grouped_mm: [pairs, 2 x intermediate] twice
    assert 2 * 128 * 512 * 2 * (2 * shape.intermediate) * 2 < prefill < down + gate_up
    # one decoding sequence costs top-k experts' bytes: more than its 512-token prefill
    assert sizing.batched_decode_bytes(shape, 1) > shape.top_k * shape.layer_params()["expert"] * 2
    assert sizing.hf_activation_bytes(shape, 1, 512, batched_decode=True) > sizing.hf_activation_bytes(shape, 1, 512)
    # kinject's experts: a row per routed pair, one gate_up output
    assert sizing.layer_activation_bytes(shape, 4, 512, expert_rows=shape.top_k) < sizing.hf_activation_bytes(shape, 4, 512)


def test_a_root_device_map_is_spelled_out_so_dispatch_finds_every_weight():
    """infer_auto_device_map answers {"": "cpu"} when nothing fits the GPU; dispatch_model gathers a
    CPU-offloaded module's weights by name prefix, and "" matched none (a KeyError at the first forward)."""
    from accelerate.utils import extract_submodules_state_dict

    model = bench_gpu.meta_model(bench_gpu.Shape(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=128), "sdpa")
    keys = set(model.state_dict())
    assert extract_submodules_state_dict(model.state_dict(), [""]) == {}          # the defect
    spelled = bench_gpu.spell_out_root(model, {"": "cpu"})
    assert set(spelled.values()) == {"cpu"} and "" not in spelled
    assert set(extract_submodules_state_dict(model.state_dict(), list(spelled))) == keys
    placed = {"model.layers.0": 0, "model.layers.1": "cpu", "lm_head": "cpu"}
    assert bench_gpu.spell_out_root(model, placed) is placed


@pytest.mark.parametrize("layers,budget_gib,sequences,prompt,new", [(6, None, 128, 512, 32), (8, 20.0, 96, 32, 128)])
def test_accelerate_batch_per_call_fits_the_budget(layers, budget_gib, sequences, prompt, new):
    from kinject.bench.contenders import acc_budget_peak

    shape = bench_gpu.Shape(layers=layers)
    budget = bench_gpu.device_budget(shape, 24)[0] if budget_gib is None else int(budget_gib * GIB)
    skeleton = bench_gpu.meta_model(shape, "sdpa")
    fit = sizing.size_accelerate(shape, skeleton, budget, sequences, prompt, new, device_key=0, batched_decode=True)
    assert 1 <= fit.rows <= sequences and fit.calls == -(-sequences // fit.rows)
    room = budget - fit.kv - fit.activations
    assert fit.max_memory == {0: room, "cpu": shape.model_bytes() + sizing.largest_no_split_bytes(skeleton)}
    assert fit.store_budget == room
    # the host share holds every weight even with nothing on the device: accelerate sends nothing to
    # disk (it keeps its largest no-split module's room free on every device but the last)
    from accelerate import infer_auto_device_map
    placed = infer_auto_device_map(skeleton, max_memory={"cpu": fit.max_memory["cpu"]},
                                   no_split_module_classes=list(skeleton._no_split_modules or []))
    assert "disk" not in placed.values()
    assert "disk" in infer_auto_device_map(skeleton, max_memory={"cpu": shape.model_bytes()},
                                           no_split_module_classes=list(skeleton._no_split_modules or [])).values()
    assert fit.weights == acc_budget_peak(skeleton, room) <= room and fit.total <= budget
    if fit.rows < sequences:                    # one more sequence would not fit
        more = fit.rows + 1
        room2 = (budget - sizing.kv_bytes(shape, more, prompt + new)
                 - sizing.hf_activation_bytes(shape, more, prompt, batched_decode=True))
        assert room2 <= 0 or acc_budget_peak(skeleton, room2) > room2
    if budget_gib is None:                      # a 24 GiB card's share: a few sequences per call, many calls
        assert fit.rows < 16 and fit.calls > 8
    else:
        assert fit.rows > 16
    tiny = sizing.size_accelerate(shape, skeleton, shape.layer_bytes() // 2, sequences, prompt, new, device_key=0,
                                  batched_decode=True)
    assert not tiny.fits and tiny.calls == 0 and "leave no room" in tiny.why


def test_whole_layer_rungs_fit_kv_and_activations_beside_one_layer():
    shape = bench_gpu.Shape(layers=6)
    budget = bench_gpu.device_budget(shape, 24)[0]
    floor = shape.resident_bytes() + shape.layer_bytes() * 65 // 64
    simple = sizing.size_whole_layer("simple", shape, budget, 128, 32, 512, 32)
    multi = sizing.size_whole_layer("multibatch", shape, budget, 128, 128, 512, 32)
    for fit in (simple, multi):
        assert fit.fits and fit.weights == floor and fit.total <= budget
        assert fit.store_budget == budget - fit.kv - fit.activations >= floor
        more = fit.rows + 1
        assert floor + sizing.kv_bytes(shape, more, 544) + sizing.hf_activation_bytes(shape, more, 512) > budget
    big = int(40 * GIB)                          # room for more than bs: simple stops at bs, multi-batch does not
    assert sizing.size_whole_layer("simple", shape, big, 128, 32, 512, 32).rows == 32
    assert sizing.size_whole_layer("multibatch", shape, big, 128, 128, 512, 32).rows > 32
    none = sizing.size_whole_layer("simple", shape, floor, 128, 32, 512, 32)
    assert not none.fits and "exceed the budget" in none.why


@pytest.mark.parametrize("bs,prompt", [(32, 512), (12, 32)])
def test_klotski_micro_batch_is_the_largest_the_planner_memory_model_fits(bs, prompt):
    shape = bench_gpu.Shape(layers=6)
    budget = bench_gpu.device_budget(shape, 24)[0]
    sequences = 4 * bs
    fit = sizing.size_klotski("klotski", shape, budget, sequences, bs, prompt, 32)
    assert fit.fits and fit.rows == sequences and bs % fit.micro_batch == 0
    peak = sizing.klotski_memory(shape, budget, sequences, fit.micro_batch, fit.prefill_chunk, prompt, 32)["device_peak"]
    assert peak == fit.total <= budget and fit.store_budget == budget - fit.kv - fit.activations
    bigger = [d for d in range(fit.micro_batch + 1, bs + 1) if bs % d == 0]
    for mb in bigger:                            # every larger divisor of bs exceeds the budget
        assert sizing.klotski_memory(shape, budget, sequences, mb, 1, prompt, 32)["device_peak"] > budget
    if fit.prefill_chunk < sequences // fit.micro_batch:
        assert sizing.klotski_memory(shape, budget, sequences, fit.micro_batch, fit.prefill_chunk + 1, prompt,
                                     32)["device_peak"] > budget
    if prompt == 512:                            # a 24 GiB card's share cannot prefill 32 x 512 tokens at once
        assert fit.micro_batch < bs
    # decode: the KV chunks get what the prefill's activations leave free, never more than the budget
    assert fit.kv <= fit.kv_room <= fit.kv + fit.activations and fit.store_budget + fit.kv_room <= budget
    setup = bench_gpu.Setup(shape, torch.device("cuda", 0), bs, 4, prompt, 32, 1, budget, "test", 1e9, 1e12, "sdpa")
    overrides = bench_gpu.row_overrides(fit, setup)
    for want in (f"pipeline.device_budget={fit.store_budget}", f"pipeline.micro_batch_size={fit.micro_batch}",
                 "pipeline.prefill=layer", f"pipeline.prefill_chunk={fit.prefill_chunk}", "pipeline.decode_chunk=auto",
                 f"pipeline.kv_budget={fit.kv_room}"):
        assert want in overrides, want
    whole = sizing.size_whole_layer("simple", shape, budget, sequences, bs, prompt, 32)
    assert not any("prefill" in o or "kv_budget" in o for o in bench_gpu.row_overrides(whole, setup))
    small = sizing.size_klotski("klotski", shape, shape.layer_bytes(), sequences, bs, prompt, 32)
    assert not small.fits and "micro-batch 1" in small.why


def test_rows_from_probes_fits_a_line_through_two_peaks():
    assert sizing.rows_from_probes(100, 40, 46, 3, cap=64) == 21            # 3 per row: 40 + 20 x 3 = 100
    assert sizing.rows_from_probes(100, 40, 46, 3, cap=8) == 8
    assert sizing.rows_from_probes(100, 101, 120, 3, cap=8) == 0            # one sequence alone is over
    assert sizing.rows_from_probes(100, 40, 40, 3, cap=8) == 3              # flat: only what was measured
    assert sizing.rows_from_probes(10**6, 40, 46, 3, cap=64) == 24          # never more than GROWTH x the probe
    assert sizing.rows_from_probes(100, 99, 160, 2, cap=8) == 1


def test_accelerate_gets_the_sized_max_memory(monkeypatch):
    """On CUDA, accelerate's device map is inferred with max_memory = {gpu: its sized room, cpu: every weight}."""
    import accelerate

    shape, meta = _small_meta()
    index = RandomIndex(meta, seed=0)
    fit = sizing.Fit("acc", 3, 8, 5 << 20, 1 << 20, 0, 0, host=shape.model_bytes(), store_budget=3 << 20,
                     max_memory={0: 3 << 20, "cpu": shape.model_bytes()})
    seen = {}

    def infer(model, max_memory=None, **kw):
        seen["max_memory"] = max_memory
        return {"": "cpu"}

    monkeypatch.setattr(accelerate, "infer_auto_device_map", infer)
    monkeypatch.setattr(accelerate, "dispatch_model", lambda model, **kw: model)
    row = bench_gpu._accelerate_row(shape, index, fit, "eager", torch.device("cuda", 1))
    assert seen["max_memory"] == {1: 3 << 20, "cpu": shape.model_bytes()} and row.fit is fit
    assert "max_memory {1: 3.0 MiB" in row.what


def test_cpu_dry_run_sizes_every_row_under_a_small_budget(rows_of, capsys):
    """A budget that fits a few sequences per call: accelerate and the whole-layer rungs run several
    generate calls (the tokens those give are the same as one call's), the Klotski rungs micro-batches;
    a budget below a rung's least is reported for that row before anything runs."""
    argv = DRY[:-2] + ["--bs", "8", "--n", "2", "--contenders", "acc,simple,multibatch,klotski", "-q"]
    assert main(argv + ["--device-budget", "8MiB", "--hf-experts", "eager"]) == 0
    acc, simple, multi, klotski = rows_of["rows"]
    assert [r.model.config._experts_implementation for r in rows_of["rows"]] == ["eager"] * 3 + ["grouped_mm"]
    assert 1 <= acc.rows < 16 and acc.calls == -(-16 // acc.rows) and acc.calls > 1
    assert simple.rows <= 8 and multi.rows < 16 and multi.calls > 1
    assert klotski.rows == 16 and klotski.fit.micro_batch is not None and 8 % klotski.fit.micro_batch == 0
    assert all(r.fit.total <= 8 << 20 for r in (acc, simple, multi, klotski))
    assert torch.equal(simple.tokens, multi.tokens) and torch.equal(klotski.tokens, multi.tokens)
    assert acc.tokens.shape == multi.tokens.shape
    text = capsys.readouterr().out
    assert f"| {acc.name} | {acc.rows} x {acc.calls} calls |" in text and "inside budget" in text
    # below every rung's least: each row says so, none is loaded or run
    assert main(argv + ["--device-budget", "6MiB"]) == 1
    for r in rows_of["rows"]:
        assert r.model is None and not r.times and r.error.startswith("does not fit the device budget: "), r.name
    assert "0 (does not fit)" in capsys.readouterr().out


def _calibration(peak_of, rows: int, cap: int, budget: int, new_tokens: int = 2):
    shape = bench_gpu.Shape(layers=1, hidden=64, intermediate=96, heads=4, kv_heads=2, vocab=128)
    setup = bench_gpu.Setup(shape, torch.device("cpu"), 8, 4, 16, new_tokens, 1, budget, "test", 1e9, 1e12, "sdpa")
    fit = sizing.Fit("acc", rows, setup.sequences, budget, 50, 0, 0)
    row = bench_gpu.Row("acc", "accelerate", None, fit=fit, rows=rows)
    asked = []

    def probe(r, batch, n, s, tokens):
        asked.append(n)
        out = peak_of(n)
        if out is None:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return out

    bench_gpu.calibrate(row, {}, setup, 2, cap, probe=probe)
    return row, asked


def test_calibration_refits_the_batch_on_measured_peaks():
    # linear: 100 + 10 per sequence under 300 -> 20, whatever the estimate said (4, or 30)
    for estimate in (4, 30):
        row, asked = _calibration(lambda n: 100 + 10 * n, estimate, cap=32, budget=300)
        assert row.rows == 20 and row.calls == 2 and asked[:2] == [1, estimate] and asked[-1] == 20
        assert row.fit.rows == 20 and "measured" in row.fit.how
    # capped by the contender's cap (the simple pipeline's bs)
    assert _calibration(lambda n: 100 + n, 4, cap=8, budget=300)[0].rows == 8
    # convex (the line is optimistic): steps down until the measured peak fits
    row, asked = _calibration(lambda n: 100 + 10 * n + n * n, 2, cap=32, budget=300)
    assert 100 + 10 * row.rows + row.rows ** 2 <= 300 and row.rows >= 8 and asked[-1] == row.rows   # 10 fits
    # out of memory at the estimate: halved, never raised
    row, asked = _calibration(lambda n: None if n > 4 else 100 + 10 * n, 16, cap=32, budget=300)
    assert asked[:4] == [1, 16, 8, 4] and 1 <= row.rows
    # the KV the rest of the run adds counts: 6 more tokens per sequence
    shape = bench_gpu.Shape(layers=1, hidden=64, intermediate=96, heads=4, kv_heads=2, vocab=128)
    per_seq = sizing.kv_bytes(shape, 1, 4)
    row, _ = _calibration(lambda n: 100 + 10 * n, 4, cap=64, budget=300 + 20 * per_seq, new_tokens=6)
    assert row.rows == 20


def test_calibration_reports_one_sequence_over_the_budget():
    from kinject.errors import KinjectError

    with pytest.raises(KinjectError, match="one sequence peaks at"):
        _calibration(lambda n: 400, 4, cap=8, budget=300)


def test_time_limit_counts_the_whole_command_and_leaves_out_rows_before_running(rows_of):
    """--time-limit counts from the command's start (weights, loading, warm-ups included): when
    nothing is left for a first repeat, every row says so and none is timed."""
    assert main(DRY + ["--n", "1", "--contenders", "simple,klotski", "--time-limit", "0.01", "-q"]) == 1
    for r in rows_of["rows"]:
        assert not r.times and r.error.startswith("not run: one repeat needs"), r.error
        assert "--time-limit left 0 s" in r.error


def test_rows_say_whether_they_stayed_inside_the_budget_and_errors_say_where():
    from kinject.bench.gpu_report import inside_budget

    shape = bench_gpu.Shape(layers=1, hidden=64, intermediate=96, heads=4, kv_heads=2, vocab=128)
    gpu = bench_gpu.Setup(shape, torch.device("cuda", 0), 8, 4, 16, 2, 1, 100 << 20, "test", 1e9, 1e12, "sdpa")
    fit = sizing.Fit("klotski", 32, 32, 100 << 20, 60 << 20, 10 << 20, 20 << 20, how="estimated")
    row = bench_gpu.Row("klotski", "Klotski", "klotski", fit=fit, peak=90 << 20)
    assert inside_budget(row, gpu) == "yes"
    row.peak = 130 << 20
    over = inside_budget(row, gpu)
    assert over.startswith("no, 30.0 MiB over") and "weights 60.0 MiB + KV 10.0 MiB + activations 20.0 MiB" in over
    dry = bench_gpu.Setup(shape, torch.device("cpu"), 8, 4, 16, 2, 1, 100 << 20, "test", 1e9, 1e12, "sdpa")
    assert inside_budget(row, dry) == "n/a (no device counter)"

    def deep():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 28.00 GiB")

    try:
        deep()
    except torch.cuda.OutOfMemoryError as exc:
        where = bench_gpu._where(exc)
    assert where.startswith(" (at test_bench_gpu.py:") and " deep <- " in where
