#!/bin/bash
# Download, on a machine that reaches the package index, the wheels the GPU pass
# (scripts/gpu_check.sh) needs and the GPU machine's image lacks, into .whl/ (ignored by git).
# The GPU machine reaches no index; gpu_check.sh installs these offline.
#
#   bash scripts/gpu_wheels.sh          # then carry .whl/ to the GPU machine with the checkout
#
# Target: CPython 3.12, manylinux x86-64, binary wheels only, no dependency resolution:
# every package the pass imports that the image lacks is named below with its version,
# dependencies included. The total must stay within 48 MiB (what a device call carries
# alongside the checkout); the script prints it and fails with one line past it.
#
# The device image is assumed to provide: CUDA torch 2.11, transformers (with its own
# dependencies: huggingface-hub, packaging, pyyaml, regex, tqdm, ...), safetensors,
# tokenizers, numpy, xxhash, psutil, rich, httpx (with httpcore, certifi), pytest.
# Not needed by the pass and so not downloaded: datasets (only `[task] kind = "hf"`), plotly
# (only report.html, which a run skips with one line without it), sglang (its check skips).
#
# Refresh: when the image changes, edit IMAGE_HAS in docs/gpus.md and the list below; the
# versions are those the CPU venv is tested with (`pip freeze | grep -i <name>`). To find what
# is missing on the image, run there:
#   python -c "import trio, zmq, zstandard, pydantic, opentelemetry.sdk.trace, hypercorn, starlette"
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEST=${WHEEL_DIR:-.whl}
LIMIT_MIB=${GPU_WHEELS_LIMIT_MIB:-48}  # what a device call carries beside the checkout

WHEELS=(
    # trio and its dependencies
    trio==0.35.0 attrs==26.1.0 sortedcontainers==2.4.0 outcome==1.3.0.post0 sniffio==1.3.1 idna==3.20
    # ZeroMQ, zstd
    pyzmq==27.3.0 zstandard==0.25.0
    # pydantic
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    typing-extensions==4.16.0
    # OpenTelemetry (importlib-metadata/zipp are not needed on 3.12 by these versions)
    opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
    # the gateway: hypercorn, starlette
    hypercorn==0.18.0 h11==0.16.0 h2==4.4.1 priority==2.0.0 hpack==4.2.0 hyperframe==6.1.0
    wsproto==1.3.2 starlette==1.10.0 anyio==4.16.0
)

mkdir -p "$DEST"
$PY -m pip download --quiet --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --implementation cp --no-deps -d "$DEST" "${WHEELS[@]}"

# Stale wheels from an earlier list would be installed too: keep only the named ones.
keep=$($PY - "$DEST" "${WHEELS[@]}" <<'PY'
import re, sys
from pathlib import Path

dest, specs = Path(sys.argv[1]), sys.argv[2:]
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
want = {norm(n) + "-" + v for n, v in (s.split("==") for s in specs)}
for f in sorted(dest.glob("*.whl")):
    name, version = f.name.split("-")[:2]
    if norm(name) + "-" + version not in want:
        f.unlink()
        print(f"gpu_wheels: removed stale {f.name}", file=sys.stderr)
print(sum(1 for _ in dest.glob("*.whl")))
PY
)
bytes=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
mib=$(( (bytes + 1048575) / 1048576 ))
echo "gpu_wheels: $keep wheels, $bytes bytes (${mib} MiB) in $DEST"
if (( keep != ${#WHEELS[@]} )); then
    echo "gpu_wheels: expected ${#WHEELS[@]} wheels in $DEST, found $keep" >&2
    exit 1
fi
if (( bytes > LIMIT_MIB * 1048576 )); then
    echo "gpu_wheels: $DEST is ${mib} MiB, over the ${LIMIT_MIB} MiB limit" >&2
    exit 1
fi
