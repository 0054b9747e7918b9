"""`kinject inspect` on every tiny family: matches printed, weights never read."""

import subprocess
import sys

import pytest

from kinject.app.cli import main
from kinject.testing import FAMILIES, save_tiny_model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {f: save_tiny_model(f, root / f) for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_inspect_every_family(family, checkpoints, capsys):
    path = checkpoints[family]
    (path / "model.safetensors").unlink()           # proves no weight is read
    assert main(["inspect", str(path), f"rules/{family}_resident.yaml"]) == 0
    out = capsys.readouterr().out
    assert "weights not read" in out
    assert "rule 0" in out
    assert all("0 matched (optional)" in line for line in out.splitlines() if ": 0 matched" in line)
    assert "self_attn" in out and "experts" in out


def test_inspect_lists_moe_modules_no_rule_touched(checkpoints, capsys):
    rules = checkpoints["mixtral"].parent / "partial.yaml"
    rules.write_text("rules:\n  - match: {name: 'self_attn$'}\n    replace: {class: default}\n")
    assert main(["inspect", str(checkpoints["mixtral"]), str(rules)]) == 0
    out = capsys.readouterr().out
    assert "MoE-looking modules no rule touched" in out
    assert "MixtralExperts: 2" in out and "MixtralTopKRouter: 2" in out


def test_cli_errors_are_one_line_without_traceback(checkpoints, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - match: {name: experts}\n    replace: {class: operators.base.Defualt}\n")
    proc = subprocess.run([sys.executable, "-m", "kinject.app.cli", "inspect", str(checkpoints["mixtral"]), str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and "rule 0" in proc.stderr and "Defualt" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "kinject.app.cli", "inspect", str(tmp_path), "rules/mixtral_resident.yaml"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "no config.json" in proc.stderr
