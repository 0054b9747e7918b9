"""Helpers shared by tests: running kinject's command line in a subprocess as a user would."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def cli_without_matplotlib(args: list[str], cwd) -> subprocess.CompletedProcess:
    """``kinject ARGS`` in a fresh interpreter where ``import matplotlib`` fails, on this checkout's code."""
    code = f"import sys; sys.modules['matplotlib'] = None; from kinject.app.cli import main; sys.exit(main({args!r}))"
    # this checkout's kinject, whatever is installed; the caller's PYTHONPATH after it (e.g. another
    # transformers the suite runs against: the subprocess must see the same one)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env)
