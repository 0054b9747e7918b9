"""The README's two set-up commands are what CI runs: one place holds them (the README), and
``.ci/run`` reads them from there with ``.ci/readme_commands.py``."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def command(which: str) -> str:
    return subprocess.run([sys.executable, str(ROOT / ".ci/readme_commands.py"), which], capture_output=True,
                          text=True, check=True).stdout.strip()


def test_readme_holds_the_two_setup_commands():
    demo, tests = command("demo"), command("tests")
    assert demo.startswith("pip install torch==2.13.0 -e .") and demo.endswith("kinject demo")
    assert tests.startswith("pip install -q torch==2.13.0 -e \".[test]\"") and "python -m pytest" in tests


def test_ci_runs_exactly_the_readme_commands_in_a_fresh_venv():
    ci = (ROOT / ".ci/run").read_text()
    assert ".ci/readme_commands.py demo" in ci and ".ci/readme_commands.py tests" in ci
    assert "python3 -m venv" in ci and "--system-site-packages" not in ci
    assert 'bash -c "$demo_cmd"' in ci and 'bash -c "$tests_cmd"' in ci
