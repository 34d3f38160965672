#!/usr/bin/env bash
# On a 2-GPU machine: Megatron-LM pretrain_gpt.py with the GLA spec at CP=2 and at CP=1, the same
# global batch and mock data; compares the loss curves. Logs go to ${OUT:-runs/parity}.
#   MEGATRON_LM=third_party/megatron-lm bash benchmarks/gpu_pretrain_parity.sh
#   LAUNCHER=pretrain_gpt_gla_softmax.sh OUT=runs/parity-hybrid ... bash benchmarks/gpu_pretrain_parity.sh  # hybrid model
set -uo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$HERE/runs/parity}; mkdir -p "$OUT"
export MEGATRON_LM=$(cd "${MEGATRON_LM:-$HERE/third_party/megatron-lm}" && pwd)
ITERS=${ITERS:-60} LIMIT=${LIMIT:-270}  # seconds per run
LAUNCHER=$HERE/examples/${LAUNCHER:-pretrain_gpt_gla.sh}
GPUS=2 CP=2 ITERS=$ITERS timeout "$LIMIT" bash "$LAUNCHER" > "$OUT/cp2.log" 2>&1; echo "cp2 exit $?"
GPUS=1 CP=1 ITERS=$ITERS timeout "$LIMIT" bash "$LAUNCHER" > "$OUT/cp1.log" 2>&1; echo "cp1 exit $?"
tail -n 5 "$OUT/cp2.log"
python3 "$HERE/benchmarks/compare_losses.py" "$OUT/cp1.log" "$OUT/cp2.log"
