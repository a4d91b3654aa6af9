#!/bin/bash
# The GPU pass, in one call on a bare GPU machine (from the repository root):
#
#   bash scripts/gpu_check.sh           # every check, within 8 minutes on one H200
#   bash scripts/gpu_check.sh --quick   # a shorter subset, for a second try
#   bash scripts/gpu_check.sh --dry     # CPU dry run (--device cpu --tiny): checks the pass's
#                                       # logic on a machine without a GPU; no GPU figures
#
# 1. Fails fast, in one line, when torch sees no CUDA device (not with --dry).
# 2. Installs the wheels of .whl/ (made by scripts/gpu_wheels.sh on a machine with the
#    package index) offline into .gpu-deps/ (pip --no-index --no-deps --target; unzipped
#    when the image has no pip), and puts it and the checkout on PYTHONPATH.
# 3. Runs each check of scripts/gpu_checks/ in its own process under `timeout`, with a time
#    budget each, clamped so that the whole pass ends within PASS_S (480 s). A check prints
#    one JSON line per part ("passed", "failed", or "skipped" with a reason: a part that
#    cannot run here, e.g. SGLang absent, skips and does not fail the pass); a check that
#    overruns its budget or dies gets a "failed" line naming why.
# 4. Prints a summary JSON line and exits non-zero if any part failed.
#
# Every line also goes to $GPU_CHECK_OUT (default $OUT/gpu_check, else /tmp/gpu_check), with
# each check's stderr. Record the lines in a dated record under benchmarks/records/ and in
# docs/gpus.md.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PASS_S=${PASS_S:-480}
MODE=full
case "${1:-}" in
    "") ;;
    --quick) MODE=quick ;;
    --dry) MODE=dry ;;
    *) echo "gpu_check: unknown argument ${1}; use --quick or --dry" >&2; exit 2 ;;
esac
LOG=${GPU_CHECK_OUT:-${OUT:-/tmp}/gpu_check}
mkdir -p "$LOG"
START=$(date +%s)

if [[ $MODE != dry ]]; then
    if ! probe=$($PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" 2>&1); then
        if [[ -z $probe ]]; then
            echo '{"check": "cuda", "status": "failed", "reason": "torch sees no CUDA device"}' | tee "$LOG/lines.jsonl"
        else
            echo "{\"check\": \"cuda\", \"status\": \"failed\", \"reason\": \"torch does not import with $PY\"}" | tee "$LOG/lines.jsonl"
        fi
        exit 1
    fi
fi

DEPS=$PWD/.gpu-deps
NEEDED="import trio, zmq, zstandard, pydantic, opentelemetry.sdk.trace, hypercorn, starlette"
shopt -s nullglob
wheels=(.whl/*.whl)
# Where the packages already import (a full environment), .whl/ is not needed.
DEPS_PATH=
if (( ${#wheels[@]} )) && ! $PY -c "$NEEDED" 2>/dev/null; then
    DEPS_PATH=":$DEPS"
    stamp=$(ls .whl | sort | cksum | cut -d' ' -f1)
    if [[ ! -f $DEPS/.stamp || $(cat "$DEPS/.stamp") != "$stamp" ]]; then
        rm -rf "$DEPS" && mkdir -p "$DEPS"
        if $PY -m pip --version >/dev/null 2>&1; then
            $PY -m pip install --quiet --no-index --no-deps --disable-pip-version-check --target "$DEPS" "${wheels[@]}" \
                >"$LOG/install.log" 2>&1 || { echo "gpu_check: installing .whl/ failed; see $LOG/install.log"; exit 1; }
        else  # no pip on the image: these wheels are plain archives (no .data/ scripts needed)
            $PY -c "import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]" \
                "$DEPS" "${wheels[@]}" || { echo "gpu_check: unpacking .whl/ failed"; exit 1; }
        fi
        echo "$stamp" >"$DEPS/.stamp"
    fi
fi
export PYTHONPATH="$PWD$DEPS_PATH${PYTHONPATH:+:$PYTHONPATH}"
if ! missing=$($PY -c "
import importlib, sys
mods = ['trio', 'zmq', 'zstandard', 'pydantic', 'opentelemetry.sdk.trace', 'hypercorn', 'starlette', 'orchestrator', 'actors']
bad = []
for m in mods:
    try:
        importlib.import_module(m)
    except Exception as e:
        bad.append(f'{m} ({type(e).__name__}: {e})')
print('; '.join(bad))
sys.exit(1 if bad else 0)" 2>&1); then
    echo "gpu_check: cannot import ${missing}; run scripts/gpu_wheels.sh where the index is reachable and carry .whl/"
    exit 1
fi
$PY -c "
import json, torch
cuda = torch.cuda.is_available()
print(json.dumps({'check': 'cuda', 'status': 'passed' if cuda else 'skipped', 'torch': torch.__version__,
                  'devices': [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
                  **({} if cuda else {'reason': 'CPU dry run'})}))" | tee "$LOG/lines.jsonl"

# check:budget_s, in running order (budgets sum to <= PASS_S less install time)
case $MODE in
    full) CHECKS=(weight_delta:45 sampler_cuda:90 fp8_pool:50 trainer:100 demo_cuda:120 sglang_pool:40); ARGS=() ;;
    quick) CHECKS=(weight_delta:30 sampler_cuda:60 fp8_pool:40 trainer:60 demo_cuda:70); ARGS=(--quick) ;;
    dry) CHECKS=(weight_delta:120 sampler_cuda:120 fp8_pool:120 trainer:180 demo_cuda:180 sglang_pool:20)
         ARGS=(--device cpu --tiny) ;;
esac
[[ $MODE == dry ]] && PASS_S=${DRY_PASS_S:-900}

for entry in "${CHECKS[@]}"; do
    name=${entry%%:*} budget=${entry##*:}
    left=$(( PASS_S - ($(date +%s) - START) - 5 ))
    (( budget > left )) && budget=$left
    if (( budget < 10 )); then
        echo "{\"check\": \"$name\", \"status\": \"failed\", \"reason\": \"no time left in the ${PASS_S} s pass\"}" | tee -a "$LOG/lines.jsonl"
        continue
    fi
    t0=$(date +%s)
    timeout -k 5 "$budget" $PY "scripts/gpu_checks/$name.py" "${ARGS[@]}" \
        > >(tee "$LOG/$name.jsonl" | tee -a "$LOG/lines.jsonl") 2>"$LOG/$name.stderr"
    rc=$?
    wait  # the tee above
    if (( rc == 124 || rc == 137 )); then
        echo "{\"check\": \"$name\", \"status\": \"failed\", \"reason\": \"over its budget of ${budget} s\"}" | tee -a "$LOG/lines.jsonl"
    elif (( rc != 0 )) && ! grep -q '"status": "failed"' "$LOG/$name.jsonl"; then
        $PY -c "import json, sys; print(json.dumps({'check': sys.argv[1], 'status': 'failed', 'reason': f'exit {sys.argv[2]}', 'stderr_tail': open(sys.argv[3]).read()[-600:]}))" \
            "$name" "$rc" "$LOG/$name.stderr" | tee -a "$LOG/lines.jsonl"
    fi
    echo "gpu_check: $name done in $(( $(date +%s) - t0 )) s (budget $budget s, exit $rc)" >&2
done

$PY - "$LOG/lines.jsonl" "$MODE" "$(( $(date +%s) - START ))" <<'PY'
import json, sys

lines = [json.loads(x) for x in open(sys.argv[1]) if x.startswith("{")]
by = {s: [x["check"] for x in lines if x.get("status") == s] for s in ("passed", "failed", "skipped")}
print(json.dumps({"summary": "gpu_check", "mode": sys.argv[2], "wall_s": int(sys.argv[3]),
                  "passed": len(by["passed"]), "skipped": len(by["skipped"]), "failed": by["failed"]}))
sys.exit(1 if by["failed"] else 0)
PY
