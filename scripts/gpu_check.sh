#!/bin/bash
# What only a GPU machine can check. Run it on one (from the repository root):
#
#   bash scripts/gpu_check.sh              # every check; one JSON line each, then a summary
#
# It runs every scripts/gpu_checks/*.py (torch CUDA sampler, FP8 matmuls, an SGLang pool
# when sglang is installed, and whatever other checks live there), each in its own process
# with a time limit. A check prints JSON lines and exits 0 (passed, or skipped with a
# reason), or non-zero (failed). This script exits non-zero if any check failed or no CUDA
# device is visible. Record what it prints as a dated record under benchmarks/records/ (see docs/gpus.md).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LIMIT=${GPU_CHECK_TIMEOUT:-900}

if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo '{"check": "cuda", "status": "failed", "reason": "torch sees no CUDA device"}'
    exit 1
fi
$PY -c "import torch, json; print(json.dumps({'check': 'cuda', 'status': 'passed', 'torch': torch.__version__, 'devices': [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}))"

failed=()
for check in scripts/gpu_checks/*.py; do
    echo "== $check" >&2
    if ! timeout "$LIMIT" $PY "$check"; then
        failed+=("$check")
    fi
done
if (( ${#failed[@]} )); then
    echo "gpu_check: FAILED: ${failed[*]}" >&2
    exit 1
fi
echo "gpu_check: all checks passed (or skipped with a reason)" >&2
