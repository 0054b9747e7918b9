#!/usr/bin/env bash
# The checks kinject owes a CUDA machine, in one command: the GPU tests, `kinject bench overhead`
# on CUDA (kernel launches per step beside kinject/HF time) and `kinject bench gpu` (the ladder),
# each writing its log and Markdown table into OUTDIR, with the machine and versions, so that
# the numbers can go into BENCHMARKS.md as they are. A step that fails does not stop the others;
# the exit status is the first failing step's.
#
#   bash scripts/gpu_checks.sh OUTDIR [STEPS]       STEPS: comma separated from env,tests,overhead,ladder
#                                                   (default: all four, in that order)
#
# Run from the repository root, with kinject importable (installed, or the checkout on PYTHONPATH)
# and hqq + omegaconf present. Budget (an H100, 2026-11-27): env + tests ~1 min, overhead ~1.5 min,
# ladder KINJECT_LADDER_SECONDS (default 360, the whole command: rows whose first repeat cannot fit
# are reported "not run", repeats stop there, partial medians reported): ~8.5 min in all, one call.
set -uo pipefail
out=${1:?usage: bash scripts/gpu_checks.sh OUTDIR [env,tests,overhead,ladder]}
steps=",${2:-env,tests,overhead,ladder},"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
status=0

step() {  # step NAME CMD...: run CMD, its output into OUTDIR/NAME.log; remember the first failure
    local name=$1; shift
    [[ $steps == *",$name,"* ]] || return 0
    echo "== $name: $*" | tee "$out/$name.log"
    "$@" 2>&1 | tee -a "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc" | tee -a "$out/$name.log"
    [[ $rc -eq 0 || $status -ne 0 ]] || status=$rc
}

if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_checks: torch sees no CUDA device here (torch.cuda.is_available() is False); nothing to check" >&2
    exit 2
fi
missing=$("$py" -c "import importlib.util as u; print(' '.join(m for m in ('kinject', 'hqq', 'omegaconf', 'transformers') if u.find_spec(m) is None))")
if [[ -n $missing ]]; then
    echo "gpu_checks: missing Python packages: $missing (install them first; see README 'Set up')" >&2
    exit 2
fi

step env bash -c "date -u +%Y-%m-%dT%H:%MZ; git rev-parse --short HEAD 2>/dev/null; \
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; \
    $py -c 'import torch, transformers, hqq, sys; print(\"python\", sys.version.split()[0], \"torch\", torch.__version__, \
\"cuda\", torch.version.cuda, \"transformers\", transformers.__version__, \"hqq\", getattr(hqq, \"__version__\", \"?\"))'; \
    nproc; free -g | head -2"
step tests "$py" -m pytest -q -p no:cacheprovider -m gpu -rs tests   # incl. tests/operators/test_host_attention.py, tests/operators/test_hybrid.py (compute: host, keep_resident), tests/kv/test_decode_chunk.py, tests/test_klotski.py (paced prefetch), tests/kv/test_prefill.py (prefill_chunk, staged hidden rows), tests/operators/test_kt_kernel.py (real kt-kernel where installed)
step overhead "$py" -m kinject bench overhead --device cuda --repeats 5 --setups weights --out "$out/overhead.md"
# KINJECT_LADDER_ARGS: the ladder's options (default "--hf-experts eager --bs 8": 32 sequences, so that
# accelerate's row, 8 sequences per call at a 24 GiB card's share, and the whole-layer rungs finish two
# repeats in 6 minutes; at --bs 32 they need ~160 s per repeat; transformers' default batched_mm decode
# fits 2 sequences per call there, and such rows need ~700 s per repeat)
step ladder "$py" -m kinject bench gpu --time-limit "${KINJECT_LADDER_SECONDS:-360}" ${KINJECT_LADDER_ARGS:---hf-experts eager --bs 8} \
    --out "$out/ladder.md"
exit $status
