"""Print one of the README's two set-up commands: the one place both the README and CI read them.

    python3 .ci/readme_commands.py demo    # README command 1: install + the main job
    python3 .ci/readme_commands.py tests   # README command 2: install the test extra + the suite

The commands are the lines that follow ``# 1.`` and ``# 2.`` in the README's "Set-up: two
commands" block, so CI runs exactly what a newcomer reads. The block must hold exactly those two
commands (anything else in it would be a step a newcomer runs and CI does not): exit 2 otherwise.
tests/test_readme.py checks the shape.
"""

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
KEYS = {"demo": "# 1.", "tests": "# 2."}


def readme_commands(text: str) -> dict[str, str]:
    block = re.search(r"^## Set-up: two commands\s+```bash\n(.*?)^```", text, re.S | re.M)
    if block is None:
        raise ValueError("README.md: no '## Set-up: two commands' bash block")
    lines = [ln.strip() for ln in block.group(1).splitlines()]
    out = {}
    for key, marker in KEYS.items():
        idx = next((i for i, ln in enumerate(lines) if ln.startswith(marker)), None)
        if idx is None or idx + 1 >= len(lines) or not lines[idx + 1] or lines[idx + 1].startswith("#"):
            raise ValueError(f"README.md: the set-up block has no command on the line after '{marker}'")
        out[key] = lines[idx + 1]
    others = [ln for ln in lines if ln and not ln.startswith("#") and ln not in out.values()]
    if others or len(set(out.values())) != len(KEYS):
        raise ValueError(f"README.md: the set-up block must hold exactly the two commands; also found {others}")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in KEYS:
        sys.exit(f"usage: {sys.argv[0]} {{{','.join(KEYS)}}}")
    try:
        print(readme_commands(README.read_text())[sys.argv[1]])
    except ValueError as exc:
        print(exc, file=sys.stderr)
        sys.exit(2)
