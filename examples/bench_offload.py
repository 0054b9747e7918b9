"""Benchmark kinject's disk offload against accelerate's on this machine's CPU.

    python examples/bench_offload.py --workdir kinject-bench --out offload.md
    python examples/bench_offload.py --help

Same as ``kinject bench offload ...`` (kinject/bench/offload.py); results go in BENCHMARKS.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run from a checkout, not installed

from kinject.app.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", "offload", *sys.argv[1:]]))
