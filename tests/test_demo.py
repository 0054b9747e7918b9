"""``kinject demo`` tells the story: the built-in model under a quarter of its weights, kinject vs
the alternatives side by side, the same greedy tokens (no timing asserts)."""

from kinject.app.cli import main
from kinject.app.demo import run_demo


def test_demo_compares_hf_accelerate_and_kinject_under_one_budget_with_identical_tokens(tmp_path, capsys):
    result = run_demo(batch=4, new_tokens=4, plot=str(tmp_path / "demo.png"), trace=str(tmp_path / "t.json"))
    out = capsys.readouterr().out
    head = out.splitlines()[:8]
    assert "device budget" in head[1] and "25% of the weights" in head[1] and "EMULATED" in head[1]
    names = [r.name for r in result["rows"]]
    assert names == ["untouched HF, all in memory", "accelerate offload (cpu_offload hooks)",
                     "kinject simple pipeline", "kinject Klotski"]
    assert all(r.identical for r in result["rows"]) and result["identical"]
    budget = result["budget"]
    assert budget == int(result["weights"] * 0.25)
    hf, acc, simple, klotski = result["rows"]
    assert hf.peak == result["weights"] > budget                       # the reference does not fit
    for row in (simple, klotski):
        assert 0 < row.peak <= budget and row.moved_per_step > 0
    assert acc.moved_per_step > 0
    assert klotski.moved_per_step < simple.moved_per_step             # only the experts the router picks
    assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "t.json").is_file()
    assert "greedy tokens identical" in out and out.count(" yes") >= 3


def test_demo_command_exits_zero(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--batch", "2", "--max-new-tokens", "2", "--plot", "p.png"]) == 0
    assert (tmp_path / "p.png").is_file()
