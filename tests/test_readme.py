"""The README's two set-up commands are what CI runs: one place holds them (the README), and
``.ci/run`` reads them from there with ``.ci/readme_commands.py``, in a fresh virtual environment."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def command(which: str) -> str:
    return subprocess.run([sys.executable, str(ROOT / ".ci/readme_commands.py"), which], capture_output=True,
                          text=True, check=True).stdout.strip()


def readme_commands():
    spec = importlib.util.spec_from_file_location("readme_commands", ROOT / ".ci/readme_commands.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.readme_commands


def test_readme_holds_the_two_setup_commands():
    demo, tests = command("demo"), command("tests")
    assert demo.startswith("pip install torch==2.13.0 -e .") and demo.endswith("kinject demo")
    assert "[" not in demo                                       # the main job needs no extra
    assert tests.startswith("pip install -q torch==2.13.0 -e \".[test]\"") and tests.endswith("python -m pytest -q")
    block = re.search(r"## Set-up: two commands\s+```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    assert [ln for ln in block.splitlines() if ln.strip() and not ln.startswith("#")] == [demo, tests]


def test_a_third_or_a_missing_setup_command_is_refused():
    parse = readme_commands()
    good = "## Set-up: two commands\n\n```bash\n# 1. demo\npip install -e . && kinject demo\n\n# 2. tests\npytest\n```\n"
    assert parse(good) == {"demo": "pip install -e . && kinject demo", "tests": "pytest"}
    with pytest.raises(ValueError, match="exactly the two"):
        parse(good.replace("pytest\n", "pytest\npip install extra-step\n"))
    with pytest.raises(ValueError, match="no command"):
        parse(good.replace("pytest\n", ""))
    with pytest.raises(ValueError, match="no '## Set-up"):
        parse("# kinject\n")


def test_ci_runs_exactly_the_readme_commands_in_a_fresh_venv():
    ci = (ROOT / ".ci/run").read_text()
    code = [ln for ln in ci.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    assert any(ln.startswith("demo_cmd=$(python3 .ci/readme_commands.py demo)") for ln in code)
    assert any(ln.startswith("tests_cmd=$(python3 .ci/readme_commands.py tests)") for ln in code)
    assert "python3 -m venv" in ci and "--system-site-packages" not in ci
    # nothing installed or tested outside the README's own commands, demo first, stdin closed
    assert not [ln for ln in code if re.search(r"\bpip install\b|\bpytest\b", ln) and "echo" not in ln]
    runs = [ln for ln in code if ln.startswith("bash -c")]
    assert runs == ['bash -c "$demo_cmd" </dev/null || rc=$?', 'bash -c "$tests_cmd" </dev/null || rc=$?']
    assert '"$rc" -eq 5' in ci and 'exit "$rc"' in ci and "set -euo pipefail" in ci
    # then the linter, installed by the test extra, configured in pyproject.toml
    assert "python -m ruff check . </dev/null || rc=$?" in code
    assert code.index("python -m ruff check . </dev/null || rc=$?") > code.index(runs[1])


def test_readme_reads_at_a_glance():
    """Short table cells and lines: details live in docs/architecture.md and the docstrings. A line may
    run longer only where it holds a command (a table row whose first cell is one, a code block)."""
    text = (ROOT / "README.md").read_text()
    long_cells, long_lines, fence = [], [], False
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
        if fence:
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        long_cells += [f"line {n}: {len(c)} chars" for c in cells if len(c) > 300]
        command = bool(cells) and cells[0].startswith("`kinject ")
        if len(line) > 200 and not command:
            long_lines.append(f"line {n}: {len(line)} chars")
    assert long_cells == [] and long_lines == [], (long_cells, long_lines)
    assert "docs/architecture.md" in text.split("## How it fits together")[1].split("\n## ")[0]
