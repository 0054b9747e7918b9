"""Smoke tests of `kinject bench cpu / kv / plan` on small settings: rows, exact tokens, no timing asserts."""

import argparse

import pytest

from kinject.bench import cpu as bench_cpu
from kinject.fixtures import tiny_moe_path


def test_ladder_rows_and_tokens(tmp_path):
    rows, meta = bench_cpu.run(tiny_moe_path(), bandwidth=50.0, new_tokens=2, prompt_len=16, repeats=1,
                               workdir=tmp_path, quick=True)
    assert [r.name for r in rows] == ["HF in RAM", "simple pipeline", "+ multi-batch", "Klotski (+ hot-first order)"]
    assert all(r.same_tokens for r in rows)                     # the ladder never changes the tokens
    table = bench_cpu.table(rows, meta)
    body, notes = table.split("\n\n")
    assert body.count("\n") == len(rows) + 1 and "% of bound" in body
    assert notes.startswith("Ladder") and "+ multi-batch: " in notes and "Klotski (+ hot-first order) / + multi-batch" in notes
    klotski = rows[-1]
    assert klotski.steps == 2 and klotski.bytes_moved > 0 and klotski.peak > 0


def test_kv_and_plan_benches_write_tables(tmp_path, capsys, monkeypatch):
    ns = argparse.Namespace(model=None, sequences=4, bs=2, prompt_len=32, new_tokens=2, bandwidth=50.0, repeats=1,
                            threads=1, workdir=str(tmp_path), out=str(tmp_path / "kv.md"))
    assert bench_cpu.bench_kv(ns) == 0
    kv = (tmp_path / "kv.md").read_text()
    assert "KV on host, micro-batched" in kv and "✗" not in kv
    assert "| mixed attention | 1 / 3 |" in kv and "| full attention | 4 / 0 |" in kv and "less KV per decode step" in kv
    from kinject.plan import groups, profiler

    monkeypatch.setattr(groups, "AUTO_N_MAX", 3)                       # small groups: the columns, not the values
    monkeypatch.setattr(profiler, "CALIBRATION_GROUPS", (1, 2))
    monkeypatch.setattr(profiler, "CALIBRATION_REPEATS", 1)
    ns = argparse.Namespace(model=None, n=[1, 2], prompt_len=16, new_tokens=2, bandwidth=50.0, repeats=1, threads=1,
                            set=[], workdir=str(tmp_path / "p"), out=str(tmp_path / "plan.md"))
    assert bench_cpu.bench_plan(ns) == 0
    plan = (tmp_path / "plan.md").read_text()
    per_n, *auto = plan.split("| auto n | auto step | auto tokens/s | best measured n | best tokens/s | auto / best |")
    rows = [line.split(" | ")[0] for line in per_n.splitlines() if line[:3] in ("| 1", "| 2", "| 3")]
    assert rows[:2] in (["| 1", "| 2"], ["| 1 (auto)", "| 2"], ["| 1", "| 2 (auto)"]) and "predicted" in per_n
    assert sum("(auto)" in line for line in per_n.splitlines()) == 1                # auto's n measured too
    for column in ("| predicted step |", "| link wait |", "| measured / predicted |", "| measured tokens/s |"):
        assert column in per_n
    assert len(auto) == 1 and auto[0].strip().splitlines()[1].count("|") == 7      # the auto-n check, one row


def test_min_time_skips_repeats_of_long_rows(tmp_path):
    ladder = [bench_cpu.Rung("HF", kind="hf"), bench_cpu.Rung("simple", "simple_pipeline", split=True)]
    rows, meta = bench_cpu.run(tiny_moe_path(), bandwidth=50.0, new_tokens=2, prompt_len=16, repeats=3,
                               workdir=tmp_path, ladder=ladder, min_time=0.0)
    assert [len(r.times) for r in rows] == [1, 1]                   # every row already ran >= 0 s
    assert rows[1].same_tokens and rows[1].per_call == meta["bs"] and rows[1].steps == 2 * meta["sequences"] // meta["bs"]
    rows, _ = bench_cpu.run(tiny_moe_path(), bandwidth=50.0, new_tokens=2, prompt_len=16, repeats=2,
                            workdir=tmp_path, ladder=ladder[:1])
    assert len(rows[0].times) == 2 and rows[0].steps == 2           # no min_time: every repeat; prefill + 1 step


def test_many_experts_ladder_model_uses_fewer_bytes(tmp_path):
    """`--experts 32 --top-k 2`: the fixture's shape with many small experts; the Klotski rung
    moves only the experts the batch group uses, multi-batch every expert; tokens stay HF's."""
    model_dir = bench_cpu.many_experts_model(tmp_path, 32, 2, 16)
    assert bench_cpu.many_experts_model(tmp_path, 32, 2, 16) == model_dir        # built once
    rows, _ = bench_cpu.run(model_dir, bandwidth=50.0, new_tokens=2, prompt_len=16, repeats=1,
                            workdir=tmp_path / "w", quick=True)
    assert all(r.same_tokens for r in rows)
    by = {r.name: r for r in rows}
    assert by["Klotski (+ hot-first order)"].bytes_moved < by["+ multi-batch"].bytes_moved


def test_step_bound_sums_each_steps_own_limit():
    """Prefill compute-bound, decode link-bound: the bound adds each step's max, so one step's idle
    link cannot hide another step's transfers (the run average would)."""
    from kinject.trace import Tracer

    tr = Tracer(enabled=True)
    tr.mark_step(0.0, 1.0)                                         # prefill: 0.8 s compute, 100 B
    tr.record("compute", "prefill", 0.0, 0.8)
    tr.record("prefetch", "w0", 0.1, 0.2, kind="transfer", nbytes=100)
    tr.mark_step(1.0, 2.0)                                         # decode: 0.1 s compute, 500 B
    tr.record("compute", "decode", 1.5, 1.6)
    tr.record("ondemand", "w1", 1.0, 1.4, kind="transfer", nbytes=300)
    tr.record("prefetch", "w2", 1.95, 2.5, kind="transfer", nbytes=200)   # started in the step, ends after
    tr.record("prefetch", "w3", 2.05, 2.1, kind="transfer", nbytes=50)    # after the last step: counted in it
    bw = 1000.0                                                    # bytes per second
    assert bench_cpu.step_bound_seconds(tr, bw) == pytest.approx(0.8 + 0.55)
    assert bench_cpu.step_bound_seconds(Tracer(enabled=True), bw) == 0.0


def test_ladder_notes_say_why_a_rung_does_not_climb():
    """A rung that moves as many bytes and is not faster gets the reason from its measurements: the
    time the rung above waited for weights bounds what it can gain, and how near that rung is
    to its bound. A rung that climbs gets its ratio and both bounds."""
    Row = bench_cpu.Row
    meta = {"sequences": 10, "new_tokens": 10}                                # 100 tokens
    rows = [Row("simple", "r", rung=True, times=[2.0], steps=20, bytes_moved=2000, phase_s=1.0, runtime=object()),
            Row("multi", "r", rung=True, times=[1.0], steps=10, bytes_moved=1000, phase_s=0.5, runtime=object()),
            Row("variant", "r", times=[0.1], runtime=object()),                # not a rung: not in the notes
            Row("ordered", "r", rung=True, times=[1.0], steps=10, bytes_moved=1000, phase_s=0.5, runtime=object(),
                bubble=0.4)]
    rows[1].wait_s, rows[1].bubble = 0.02, 0.3
    notes = bench_cpu.ladder_notes(rows, meta)
    assert notes[2] == "- multi: 2.00x simple (50.0 -> 100.0 tok/s; bound 100.0 -> 200.0)"
    assert notes[3].startswith("- ordered: 1.00x multi (100.0 -> 100.0 tok/s; bound 200.0 -> 200.0). It does not climb")
    assert "It could gain at most 1.02x: multi already runs at 50% of that bound (compute bubble 30%) and waited " \
           "2.00 ms per step for weights (2% of its 100.00 ms step); what limits it is the wait" in notes[3]
    rows[1].wait_s = 0.8                                                      # most of the step: the bound limits
    assert "at most 2.00x" in bench_cpu.ladder_notes(rows, meta)[3] and "the link, not the wait" in \
        bench_cpu.ladder_notes(rows, meta)[3]
    assert notes[4] == "- ordered / multi: 1.00x" and "variant" not in "".join(notes)


def test_ladder_ablation_example_runs_variants_side_by_side(tmp_path):
    """examples/ladder_ablation.py: every variant gives the baseline's tokens, one table row each."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "examples" / "ladder_ablation.py"), "--experts", "4", "--top-k", "2",
                          "--repeats", "1", "--bandwidth", "1000", "--workdir", str(tmp_path), "--", "--",
                          "vars.weights=device"], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and "ms / generate" not in line and "---" not in line]
    assert len(rows) == 2 and rows[0].startswith("| (klotski.yaml") and rows[1].startswith("| vars.weights=device |")
    assert rows[0].endswith("| 1.000 |") and "tokens identical" in out.stdout


def test_step_costs_example_times_the_bookkeeping(tmp_path):
    """examples/step_costs.py: one table row per watched function that ran, each with its calls."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "examples" / "step_costs.py"), "--experts", "4", "--top-k", "2",
                          "--repeats", "1", "--workdir", str(tmp_path)], cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {line.split(" | ")[0][2:]: line for line in out.stdout.splitlines()
            if line.startswith("| ") and "---" not in line and "function" not in line}
    assert {"ExpertOrder.schedule", "Scheduler.enter", "ExpertRouting.route"} <= set(rows)
    assert all(float(line.split(" | ")[2]) > 0 for line in rows.values())
