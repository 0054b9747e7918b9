"""Print one of the README's two set-up commands: the one place both the README and CI read them.

    python3 .ci/readme_commands.py demo    # README command 1: install + the main job
    python3 .ci/readme_commands.py tests   # README command 2: install the test extra + the suite

The commands are the lines that follow ``# 1.`` and ``# 2.`` in the README's "Set-up: two
commands" block, so CI runs exactly what a newcomer reads (tests/test_readme.py checks the shape).
"""

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_commands(text: str) -> dict[str, str]:
    block = re.search(r"## Set-up: two commands\s+```bash\n(.*?)```", text, re.S)
    if block is None:
        raise SystemExit("README.md: no '## Set-up: two commands' bash block")
    lines = block.group(1).splitlines()
    out = {}
    for key, marker in (("demo", "# 1."), ("tests", "# 2.")):
        idx = next((i for i, ln in enumerate(lines) if ln.startswith(marker)), None)
        if idx is None or idx + 1 >= len(lines) or not lines[idx + 1].strip():
            raise SystemExit(f"README.md: the set-up block has no command after '{marker}'")
        out[key] = lines[idx + 1].strip()
    return out


if __name__ == "__main__":
    print(readme_commands(README.read_text())[sys.argv[1]])
