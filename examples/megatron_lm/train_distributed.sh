#!/bin/bash
# Megatron-LM's own pretrain_gpt.py, unchanged but for one import line, with npuspeed.
#
#   MEGATRON_LM=/path/to/Megatron-LM bash examples/megatron_lm/train_distributed.sh [cpu|npu] [extra args]
#
# cpu: 2 ranks on gloo, a tiny Llama-style model on --mock-data (about a minute).
# npu: one node of Ascend NPUs on HCCL (Megatron's nccl is mapped to it), a small model in bf16;
#      DATA_PATH / TOKENIZER_MODEL select real data, otherwise --mock-data.
# Environment: LAYOUT=tp2 (default, TP2+SP) | pp2 | dp2 (DP2 with the distributed optimizer);
# NPROC (ranks; default 2 on cpu, 8 on npu); TRAIN_ITERS; CKPT_DIR (save there, resume from
# there); FEATURES (npuspeed's flags; default below); the checkout must be Megatron-LM
# core_v0.16.x (`npuspeed patch-source` refuses other versions).
set -euo pipefail
DEVICE=${1:-cpu}
shift $(( $# > 0 ? 1 : 0 ))
: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout (tag core_v0.16.1)}"
LAYOUT=${LAYOUT:-tp2}
TRAIN_ITERS=${TRAIN_ITERS:-10}

# 1. The one-line change: `import npuspeed.megatron_adaptor` after `import torch` (idempotent).
npuspeed patch-source "$MEGATRON_LM"

# 2. npuspeed's features; Megatron-LM's parser accepts these flags once the line is in.
FEATURES=${FEATURES:-"--use-flash-attn --use-fused-rmsnorm --use-fused-swiglu --use-fused-rotary-pos-emb --recompute-activation-function"}

case "$LAYOUT" in
  tp2) PARALLEL="--tensor-model-parallel-size 2 --sequence-parallel --use-coc --coc-parallel-num 2" ;;
  pp2) PARALLEL="--pipeline-model-parallel-size 2" ;;
  dp2) PARALLEL="--use-distributed-optimizer" ;;
  *) echo "LAYOUT must be tp2, pp2 or dp2" >&2; exit 2 ;;
esac

LLAMA="--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights"
SCHEDULE="--train-iters $TRAIN_ITERS --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --log-interval 1 --eval-iters 0 --eval-interval 1000"

case "$DEVICE" in
  cpu)
    NPROC=${NPROC:-2}
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    MODEL="--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4"
    DATA="--mock-data --tokenizer-type NullTokenizer --vocab-size 128"
    DEVICE_ARGS="--distributed-backend gloo"
    ;;
  npu)
    NPROC=${NPROC:-8}
    export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron's TP ordering; honoured by torch_npu
    MODEL="--num-layers 8 --hidden-size 1024 --ffn-hidden-size 2816 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 16 --bf16"
    if [[ -n "${DATA_PATH:-}" ]]; then
      DATA="--data-path $DATA_PATH --split 949,50,1 --tokenizer-type ${TOKENIZER_TYPE:-Llama2Tokenizer} --tokenizer-model ${TOKENIZER_MODEL:?set TOKENIZER_MODEL with DATA_PATH}"
    else
      DATA="--mock-data --tokenizer-type NullTokenizer --vocab-size 32000"
    fi
    DEVICE_ARGS=""  # nccl by default; npuspeed runs it on HCCL
    ;;
  *) echo "usage: $0 [cpu|npu] [extra pretrain_gpt.py args]" >&2; exit 2 ;;
esac

CKPT=""
if [[ -n "${CKPT_DIR:-}" ]]; then
  CKPT="--save $CKPT_DIR --load $CKPT_DIR --save-interval ${SAVE_INTERVAL:-5}"
fi

cd "$MEGATRON_LM"
# shellcheck disable=SC2086
exec torchrun --nproc-per-node "$NPROC" --master-port "${MASTER_PORT:-29500}" pretrain_gpt.py \
  $MODEL $LLAMA $PARALLEL $SCHEDULE $DATA $DEVICE_ARGS $CKPT $FEATURES "$@"
