"""Smoke test of `kinject bench overhead` on a tiny setting: exact tokens, store calls that do not
grow with the experts; no timing asserts (CPU timings are benchmarks, not tests)."""

import pytest
import torch

from kinject.bench import overhead


def test_overhead_rows_identical_tokens_and_flat_store_calls():
    rows = [overhead.measure(e, k, hidden=64, layers=2, moe_intermediate=32, batch=4, prompt=8, new_tokens=3,
                             repeats=1, device="cpu", counts=True) for e, k in ((8, 2), (32, 4))]
    # kinject's Python adds calls; its torch operations beyond transformers' stay few (on transformers 5.17
    # its fused decode steps make fewer than transformers' own: the difference may be negative)
    assert all(r["calls_per_layer_step"] > 0 and abs(r["ops_per_layer_step"]) < 20 for r in rows), rows
    assert all(r["same"] for r in rows)
    assert all(r["paired_iqr"][0] <= r["paired_ratio"] <= r["paired_iqr"][1] for r in rows)
    assert all(r["best_ratio"] == min(r["kinject_s"], r["kinject_s"]) / r["hf_s"] for r in rows)  # one repeat: its own
    # one acquire_many per group of ready experts (all of them here: nothing moves), not one per expert
    assert rows[0]["acquires_per_step"] == rows[1]["acquires_per_step"]
    text = overhead.table(rows)
    assert text.count("\n") == len(rows) + 1 and "✗" not in text


def test_overhead_cli_rows_per_setup(tmp_path):
    """Both setups (KV on the device / KV on the host tier, which on a CPU with no link is used in
    place with attention on the whole batch) are rows."""
    from kinject.app.cli import main

    out = tmp_path / "overhead.md"
    assert main(["bench", "overhead", "--shapes", "8x2", "--hidden", "64", "--layers", "2", "--moe-intermediate", "32",
                 "--batch", "4", "--prompt-len", "8", "--new-tokens", "3", "--repeats", "1", "--device", "cpu",
                 "--out", str(out)]) == 0
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| 8 | 2 |")]
    assert [r.split("|")[3].strip() for r in rows] == ["weights", "weights+kv"]
    assert all("✓" in r for r in rows) and "KV used in place, attention on the whole batch" in text


def test_overhead_wide_preset_is_bfloat16_and_shares_the_weights(tmp_path):
    """``--wide``: the workload at the Qwen3-30B-A3B width (here cut down by the options, which
    override the preset), bfloat16, the kinject twin over HF's own weight tensors; tokens identical."""
    from kinject.app.cli import main

    out = tmp_path / "wide.md"
    assert main(["bench", "overhead", "--wide", "--hidden", "64", "--moe-intermediate", "32", "--heads", "4",
                 "--kv-heads", "2", "--shapes", "8x2", "--layers", "1", "--repeats", "1", "--setups", "weights+kv",
                 "--out", str(out)]) == 0
    text = out.read_text()
    assert "bfloat16" in text and "batch 8, prompt 32 -> 8 new tokens" in text
    assert [line.split("|")[-2].strip() for line in text.splitlines() if line.startswith("| 8 | 2 |")] == ["✓"]
    ref, model = overhead.build_pair(4, 2, hidden=32, layers=1, moe_intermediate=16, device="cpu")
    shared = {p.untyped_storage().data_ptr() for p in ref.parameters()}      # (an expert's unit: a view of them)
    assert model.kinject.store.units and all(t.untyped_storage().data_ptr() in shared
                                             for u in model.kinject.store.units.values()
                                             if u.tier == "host" for t in u.tensors.values())
    model.kinject.transfer.close()


@pytest.mark.gpu
def test_cuda_overhead_pair_keeps_kinjects_host_tier_on_the_host():
    """On CUDA the HF model moves to the GPU while the kinject twin's host tier keeps host tensors
    (pinned): a twin taken after the move would hold CUDA tensors in its "host" tier and move nothing."""
    ref, model = overhead.build_pair(4, 2, hidden=32, layers=1, moe_intermediate=16, device="cuda")
    try:
        assert all(p.is_cuda for p in ref.parameters())
        host = [t for u in model.kinject.store.units.values() if u.tier == "host" for t in u.tensors.values()]
        assert host and all(t.device.type == "cpu" and t.is_pinned() for t in host)
    finally:
        model.kinject.transfer.close()


@pytest.mark.parametrize("args, says", [
    (["--shapes", "8by2"], "--shapes takes EXPERTSxTOPK pairs such as 128x8, got '8by2'"),
    (["--shapes", "4x8"], "--shapes 4x8: top-k must be in [1, experts]"),
    (["--device", "mps"], "--device must be cpu or cuda[:N], got 'mps'"),
] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "--device cuda, but torch sees no CUDA device here")]))
def test_overhead_bad_arguments_are_one_line_errors(args, says):
    from kinject.app.cli import main

    with pytest.raises(SystemExit) as e:
        main(["bench", "overhead", "--repeats", "1", *args])
    assert str(e.value) == f"kinject bench overhead: {says}"


def test_overhead_ablation_example_runs_variants_side_by_side():
    """examples/overhead_ablation.py: every variant checked against HF's tokens, one line each."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "examples" / "overhead_ablation.py"), "--experts", "4",
                          "--top-k", "2", "--layers", "1", "--new-tokens", "2", "--repeats", "1", "--", "--",
                          "pipeline.update_table=false"], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if "kinject / HF" in line]
    assert len(lines) == 2 and lines[1].endswith("pipeline.update_table=false")


def test_decode_step_counts_per_model_and_batch():
    """``--counts``'s per-decode-step table: Python calls (exact, cProfile) and ms for HF and kinject;
    kinject's bookkeeping adds calls on top of HF's."""
    from kinject.bench.step_counts import decode_step_counts, decode_table

    ref, model = overhead.build_pair(8, 2, hidden=64, layers=2, moe_intermediate=32, device="cpu",
                                     overrides=("vars.kv=device",))
    counts = {b: decode_step_counts({"hf": ref, "kinject": model},
                                    overhead.random_batch(ref.config.vocab_size, b, 8, "cpu"), new=3, repeats=1)
              for b in (1, 3)}
    for c in counts.values():
        assert 0 < c["hf"]["calls"] < c["kinject"]["calls"] and c["hf"]["ms"] >= 0 and c["kinject"]["ms"] >= 0
        assert "untraced_ms" not in c["hf"] and 0 < c["kinject"]["untraced_ms"] < 1e3   # outside every span
    assert not model.kinject.tracer.enabled                  # the traced run leaves tracing as it was
    text = decode_table(counts)
    assert text.count("\n") == 3 and "| 1 |" in text and "| 3 |" in text
    model.kinject.transfer.close()


def test_real_counts_rows_small_counts_same_tokens(monkeypatch, tmp_path):
    """``--real-counts``' two rows (in memory, from disk with auto budgets) on DeepSeek-V3 at small
    counts: tokens equal HF's, setup times and every expert a unit."""
    from kinject.bench import step_counts

    monkeypatch.setitem(step_counts.REAL_COUNTS, "deepseek_v3",
                        dict(num_hidden_layers=3, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
                             first_k_dense_replace=1, n_group=4, topk_group=2, moe_intermediate_size=16,
                             intermediate_size=64))
    rows = step_counts.real_counts_rows("deepseek_v3", batch=2, prompt=8, new_tokens=3, repeats=1,
                                        workdir=str(tmp_path), dtype=torch.float32)
    assert [r["setting"].split(" (")[0] for r in rows] == ["in memory", "from disk"]
    assert all(r["same"] and r["units"] >= 2 * 16 and r["setup_kj"] > 0 and r["kj_cpu"] > 0 for r in rows)
    assert any("host_budget: auto" in a for a in rows[1]["autos"])
    text = step_counts.real_counts_table(rows)
    assert "✗" not in text and "deepseek_v3" in text
