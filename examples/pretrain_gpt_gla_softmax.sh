#!/usr/bin/env bash
# Train a hybrid model, GLA layers with a softmax-attention layer every fourth (pattern GGG*), all
# under the same context parallelism, using stock Megatron-LM pretrain_gpt.py.
#
#   MEGATRON_LM=/path/to/Megatron-LM CP=2 GPUS=2 bash examples/pretrain_gpt_gla_softmax.sh [extra pretrain_gpt.py flags]
#
# The environment of examples/pretrain_gpt_gla.sh, with other defaults: SPEC=hybrid_local_spec (softmax
# layers all-gather K/V over CP; no TransformerEngine needed) or hybrid_te_spec (TE's attention
# and its own CP, --cp-comm-type); POS=rope (rotary embeddings for the softmax layers, unfused;
# GLA layers ignore them; POS=none for no positions). MODEL=small has 4 layers: layer 4 is softmax.
set -euo pipefail
SPEC=${SPEC:-hybrid_local_spec} POS=${POS:-rope} exec bash "$(dirname "$0")/pretrain_gpt_gla.sh" "$@"
