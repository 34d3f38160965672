#!/usr/bin/env bash
# The GPU check on a bare GPU machine (torch installed, no network), from the repository's root:
#     bash benchmarks/gpu_check.sh [gpu_check.py's options]
# installs what .whl/ holds (benchmarks/gpu_wheels.sh makes it) into $ZECO_SITE (default /tmp/zeco-site),
# puts the trimmed Triton's compiler on the toolkit's ptxas, and runs benchmarks/gpu_check.py. Where the
# packages are installed already (fla-core 0.6.0, Triton >= 3.7.1), run benchmarks/gpu_check.py alone.
set -uo pipefail
cd "$(dirname "$0")/.."
SITE=${ZECO_SITE:-/tmp/zeco-site}
PY=${PYTHON:-python3}
if [ -d .whl ]; then
    mkdir -p "$SITE"
    if ls .whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
            || exit 1
    fi
    if [ -f .whl/triton-3.7.1-slim.tar.xz ]; then
        tar xJf .whl/triton-3.7.1-slim.tar.xz -C "$SITE" || exit 1
        export TRITON_BACKENDS_IN_TREE=1
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# the trimmed Triton has no ptxas of its own: the CUDA toolkit's
if [ -z "${TRITON_PTXAS_PATH:-}" ]; then
    for p in "$(command -v ptxas 2>/dev/null)" /usr/local/cuda/bin/ptxas; do
        if [ -n "$p" ] && [ -x "$p" ]; then export TRITON_PTXAS_PATH="$p"; break; fi
    done
fi
exec "$PY" benchmarks/gpu_check.py "$@"
