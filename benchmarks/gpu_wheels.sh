#!/usr/bin/env bash
# Packages the GPU check needs on a GPU machine that has torch but no network, into .whl/ (git-ignored):
# fla-core 0.6.0 and megatron-core 0.19.2 as wheels, and Triton 3.7.1 trimmed to its NVIDIA backend as
# .whl/triton-3.7.1-slim.tar.xz (fla-core 0.6.0 refuses the gated delta rule's backward on Hopper with
# Triton < 3.7.1, its issue #640; the trimmed copy leaves out the AMD backend, profilers and bundled
# ptxas, which the machine's CUDA toolkit provides). Python 3.12 on x86-64 Linux, as the GPU machines run.
# Run it where pip reaches PyPI; benchmarks/gpu_check.sh installs what it finds in .whl/.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=3.12
mkdir -p .whl
pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl fla-core==0.6.0 megatron-core==0.19.2
if [ ! -f .whl/triton-3.7.1-slim.tar.xz ]; then
    work=$(mktemp -d)
    pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d "$work" triton==3.7.1
    (cd "$work" && unzip -q triton-*.whl && rm triton-*.whl \
        && rm -rf triton/backends/amd triton/backends/nvidia/lib/cupti triton/_C/libproton.so triton/profiler \
                  triton/instrumentation triton/FileCheck triton/backends/nvidia/bin/* \
        && strip --strip-unneeded triton/_C/libtriton.so \
        && tar cf - triton triton-3.7.1.dist-info | xz -T0 -6 > "$OLDPWD/.whl/triton-3.7.1-slim.tar.xz")
    rm -rf "$work"
fi
ls -la .whl
