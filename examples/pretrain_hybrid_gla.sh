#!/usr/bin/env bash
# Train a GLA hybrid model as Megatron-Core's HybridModel with Megatron-LM's pretrain_hybrid.py
# (core_v0.19.0 or later): one layer per symbol of --hybrid-layer-pattern, G = GLA (ZeCO context
# parallelism), * = softmax attention, - = MLP, E = MoE, | = pipeline-stage boundary.
#
#   MEGATRON_LM=/path/to/Megatron-LM CP=2 GPUS=2 bash examples/pretrain_hybrid_gla.sh [extra pretrain_hybrid.py flags]
#
# Environment (all optional): MEGATRON_LM (checkout with pretrain_hybrid.py), GPUS (processes on this
# node), CP, TP, PP, SPEC (a stack from megatron_zeco/specs.py: hybrid_stack_local_spec, or
# hybrid_stack_local_{lasp1,lasp2,a2a}_spec, or hybrid_stack_te_spec with TransformerEngine; G = KDA with
# kda_hybrid_stack_local_spec, G = Gated DeltaNet with gdn_hybrid_stack_local_spec and the flags
# docs/gated-deltanet.md gives, --swiglu and --linear-*), MODEL
# (small | gla-1b | gdn-1b: a Gated DeltaNet hybrid shaped like Qwen3-Next, three Gated DeltaNet layers
# to one softmax layer, about 1B parameters; its SPEC defaults to gdn_hybrid_stack_local_spec and it
# brings the --linear-* flags and --swiglu), PATTERN (overrides the model's; with PP > 1 put PP - 1 or
# more '|' in it, e.g. PP=2 PATTERN='G-G-|G-*-'), SEQ, ITERS, PRECISION (default --bf16; empty for fp32), POS
# (--position-embedding-type: rope, for the softmax layers; GLA layers ignore it; none without them).
# docs/hybrid-model.md maps the GPTModel specs' patterns to these.
set -euo pipefail
HERE=$(cd "$(dirname "$0")/.." && pwd)
: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout (core_v0.19.0 or later: pretrain_hybrid.py)}"
GPUS=${GPUS:-2} CP=${CP:-2} TP=${TP:-1} PP=${PP:-1}
MODEL=${MODEL:-small} SEQ=${SEQ:-4096} ITERS=${ITERS:-60} POS=${POS:-rope}

case "$MODEL" in
  # examples/pretrain_gpt_gla_softmax.sh's model (GPTModel GGG*, 4 layers with an MLP each) as HybridModel layers.
  small)  ARCH=(--hidden-size 1024 --num-attention-heads 8) DEFAULT_PATTERN='G-G-G-*-' ;;
  # The ZeCO paper's GLA-1B (20 GLA layers, each with its MLP), every 4th mixer softmax attention.
  gla-1b) ARCH=(--hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 5632)
          DEFAULT_PATTERN='G-G-G-*-G-G-G-*-G-G-G-*-G-G-G-*-G-G-G-*-' ;;
  # 16 mixers (12 Gated DeltaNet, 4 softmax), each with its SwiGLU MLP; Gated DeltaNet heads of 128 as
  # Qwen3-Next's (16 q/k heads, 16 value heads here), a convolution of 4 taps.
  gdn-1b) ARCH=(--hidden-size 2048 --num-attention-heads 16 --ffn-hidden-size 5632 --swiglu
                --linear-num-key-heads 16 --linear-num-value-heads 16 --linear-key-head-dim 128
                --linear-value-head-dim 128 --linear-conv-kernel-dim 4)
          DEFAULT_PATTERN='G-G-G-*-G-G-G-*-G-G-G-*-G-G-G-*-' DEFAULT_SPEC=gdn_hybrid_stack_local_spec ;;
  *) echo "MODEL must be small, gla-1b or gdn-1b" >&2; exit 2 ;;
esac
SPEC=${SPEC:-${DEFAULT_SPEC:-hybrid_stack_local_spec}}
# A bare spec name is one of megatron_zeco.specs; 'module name' picks another module's (e.g.
# 'benchmarks.reference_specs megatron_gdn_hybrid_stack_local_spec', Megatron's own Gated DeltaNet).
read -r -a SPEC_ARGS <<< "$SPEC"
[ "${#SPEC_ARGS[@]}" -eq 1 ] && SPEC_ARGS=(megatron_zeco.specs "$SPEC")
PATTERN=${PATTERN:-$DEFAULT_PATTERN}
LAYERS=${PATTERN//|/}  # --num-layers is the pattern's layer count (Megatron-LM derives it so)
case "$SPEC" in
  *_te_*) IMPL=(--transformer-impl transformer_engine) ;;
  *) IMPL=(--transformer-impl local --no-gradient-accumulation-fusion --no-persist-layer-norm) ;;
esac

export PYTHONPATH="$HERE:$MEGATRON_LM:${PYTHONPATH:-}"
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1  # never NVLink multicast

cd "$MEGATRON_LM"
exec torchrun --nproc-per-node "$GPUS" pretrain_hybrid.py \
  "${ARCH[@]}" \
  --spec "${SPEC_ARGS[@]}" \
  --hybrid-layer-pattern "$PATTERN" --num-layers "${#LAYERS}" \
  --position-embedding-type "$POS" --no-rope-fusion \
  --context-parallel-size "$CP" --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" \
  --seq-length "$SEQ" --max-position-embeddings "$SEQ" \
  --micro-batch-size 1 --global-batch-size 8 --train-iters "$ITERS" \
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 5 --clip-grad 1.0 \
  ${PRECISION---bf16} --attention-dropout 0 --hidden-dropout 0 --disable-bias-linear \
  "${IMPL[@]}" \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 \
  --no-create-attention-mask-in-dataloader \
  --split 100,0,0 --eval-iters 0 --eval-interval 1000 --log-interval 5 --seed 1234 \
  "$@"
