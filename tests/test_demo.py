"""``kinject demo`` tells the story: the built-in model under a quarter of its weights, kinject vs
the alternatives side by side, the same greedy tokens (no timing asserts)."""

from cli_helpers import cli_without_matplotlib
from kinject.app.cli import main
from kinject.app.demo import ACC, HF, KLOTSKI, SIMPLE, moved_per_step, run_demo


def test_demo_compares_hf_accelerate_and_kinject_under_one_budget_with_identical_tokens(tmp_path, capsys):
    result = run_demo(batch=4, new_tokens=3, repeats=1, plot=str(tmp_path / "demo.png"), trace=str(tmp_path / "t.json"))
    out = capsys.readouterr().out
    head = out.splitlines()
    assert "kinject demo" in head[0] and "4 prompts x 3 new tokens" in head[0]
    assert "device budget" in head[1] and "25% of the weights" in head[1] and "EMULATED" in head[1]
    assert [ln.split("  ")[1].strip() for ln in head[3:7]] == [HF, ACC, SIMPLE, KLOTSKI]   # the table comes first
    assert "peak device" in head[7] and "KV cache" in head[7]
    assert head[8].startswith("kinject Klotski makes") and "accelerate" in head[8] and "EMULATED" in head[8]
    assert head[9].startswith("Per step Klotski moves") and "reaches" in head[9]
    rows = result["rows"]
    assert [r.name for r in rows] == [HF, ACC, SIMPLE, KLOTSKI]
    assert all(r.same_tokens for r in rows) and result["identical"]          # every kinject row: HF's tokens
    assert all(" yes" in ln for ln in head[4:7]) and "reference" in head[3]
    budget, weights = result["budget"], result["weights"]
    assert budget == int(weights * 0.25)
    hf, acc, simple, klotski = rows
    assert hf.peak == weights > budget and moved_per_step(hf) == 0           # the reference does not fit
    for row in (acc, simple, klotski):
        assert 0 < row.peak <= budget and moved_per_step(row) > 0
    assert hf.per_call == acc.per_call == klotski.per_call == 4 and simple.per_call == 2   # simple: single batches
    assert acc.steps == klotski.steps == 3 and simple.steps == 6             # prefill + 2 decode steps per call
    assert moved_per_step(acc) == acc.per_forward                            # accelerate reloads every offloaded module
    assert klotski.runtime.transfer.emulated and simple.runtime.transfer.emulated
    assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "t.json").is_file()
    assert set(result["timings"]) >= {"startup", "import", "load", "warmup", "runs", "plot", "total"}
    assert "demo wall time" in out


def test_demo_command_exits_zero(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--batch", "2", "--max-new-tokens", "2", "--repeats", "1", "--plot", "p.png"]) == 0
    assert (tmp_path / "p.png").is_file()
    assert main(["demo", "--budget", "0"]) == 2                              # a user error: one line, exit 2
    assert "--budget" in capsys.readouterr().err


def test_demo_without_matplotlib_still_runs_and_says_so_in_one_line(tmp_path):
    """matplotlib is a dependency, but a broken or missing one costs the picture only."""
    proc = cli_without_matplotlib(["demo", "--batch", "2", "--max-new-tokens", "2", "--repeats", "1", "--plot", "p.png"],
                                  tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "p.png").exists()
    lines = [ln for ln in proc.stderr.splitlines() if "matplotlib" in ln]
    assert len(lines) == 1 and "no plot drawn" in lines[0]
    assert "kinject Klotski makes" in proc.stdout
