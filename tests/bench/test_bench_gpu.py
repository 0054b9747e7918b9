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
       "--new-tokens", "2", "--prompt-len", "16", "--repeats", "1"]


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
            "--new-tokens", "4", "--repeats", "1", "--out", str(out)]
    assert main(argv) == 0
    rows = {r.key: r for r in rows_of["rows"]}
    assert list(rows) == [k for k, _, _ in LADDER]
    for r in rows.values():
        assert r.error is None and r.times and r.peak > 0 and r.bytes_moved > 0 and r.match is not None
        if r.key != "acc":
            assert r.bubble is not None
    # every contender's host tier holds the index's pinned tensors, shared, not copies
    klotski = rows["klotski"].model.kinject.store["model.layers.0.mlp.experts[0]"]
    simple = rows["simple"].model.kinject.store["model.layers.0"]
    assert klotski.tier == simple.tier == "host"
    assert all(t.is_pinned() for t in list(klotski.tensors.values()) + list(simple.tensors.values()))
    assert klotski.tensors["gate_up_proj"].data_ptr() == simple.tensors["mlp.experts.gate_up_proj"].data_ptr()
    text = out.read_text()
    assert "DRY RUN" not in text and torch.cuda.get_device_name() in text and "driver" in text


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
