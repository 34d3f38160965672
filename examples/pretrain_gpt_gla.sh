#!/usr/bin/env bash
# Train a GLA model with ZeCO context parallelism using stock Megatron-LM pretrain_gpt.py.
#
#   MEGATRON_LM=/path/to/Megatron-LM CP=2 GPUS=2 bash examples/pretrain_gpt_gla.sh [extra pretrain_gpt.py flags]
#
# Environment (all optional): MEGATRON_LM (checkout with pretrain_gpt.py), GPUS (processes on this
# node), CP, TP, PP, SPEC (a name from megatron_zeco/specs.py), MODEL (small | gla-1b), SEQ, ITERS,
# PRECISION (default --bf16; empty for fp32), POS (--position-embedding-type: none; rope for the
# softmax layers of hybrid specs, see examples/pretrain_gpt_gla_softmax.sh).
# The spec name picks the CP strategy: gla_local_spec (ZeCO), gla_local_{lasp1,lasp2,a2a}_spec;
# gla_te_* with TransformerEngine. No patch to Megatron-LM is needed.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout (core_v0.19.0 tested)}"
GPUS=${GPUS:-2} CP=${CP:-2} TP=${TP:-1} PP=${PP:-1}
SPEC=${SPEC:-gla_local_spec} MODEL=${MODEL:-small} SEQ=${SEQ:-4096} ITERS=${ITERS:-60} POS=${POS:-none}

case "$MODEL" in
  small)  ARCH=(--num-layers 4 --hidden-size 1024 --num-attention-heads 8) ;;
  # The ZeCO paper's GLA-1B: 20 layers, hidden 2048, 16 heads of 128.
  gla-1b) ARCH=(--num-layers 20 --hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 5632) ;;
  *) echo "MODEL must be small or gla-1b" >&2; exit 2 ;;
esac

export PYTHONPATH="$HERE:$MEGATRON_LM:${PYTHONPATH:-}"
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

cd "$MEGATRON_LM"
exec torchrun --nproc-per-node "$GPUS" pretrain_gpt.py \
  "${ARCH[@]}" \
  --spec megatron_zeco.specs "$SPEC" \
  --position-embedding-type "$POS" --no-rope-fusion \
  --context-parallel-size "$CP" --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
  --seq-length "$SEQ" --max-position-embeddings "$SEQ" \
  --micro-batch-size 1 --global-batch-size 8 --train-iters "$ITERS" \
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 5 --clip-grad 1.0 \
  ${PRECISION---bf16} --attention-dropout 0 --hidden-dropout 0 --disable-bias-linear \
  --transformer-impl local --no-gradient-accumulation-fusion --no-persist-layer-norm \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 \
  --no-create-attention-mask-in-dataloader \
  --split 100,0,0 --eval-iters 0 --eval-interval 1000 --log-interval 5 --seed 1234 \
  "$@"
