#!/usr/bin/env bash
# DAPO w/ Forking Tokens: DAPO with the policy gradient restricted to the top-20% entropy tokens
# (arXiv 2506.01939) | Qwen2.5-7B base | 1 node x 8 GPUs | FSDP2 + vLLM | verl 0.9.1
#
# Presets: configs/method/dapo_forking.yaml (estimator, loss, clip, KL off, dynamic sampling) and
# configs/model/qwen2.5_7b.yaml (lengths, batch, parallelism, offload, token budgets).
# Launch logic: scripts/common.sh.
#
#   bash scripts/run_dapo_forking_qwen2.5_7b.sh [overrides]                     # on this node / Slurm driver
#   RAY_ADDRESS=http://<head>:8265 bash scripts/run_dapo_forking_qwen2.5_7b.sh   # ray job submit to a cluster
#   DRY_RUN=1 bash scripts/run_dapo_forking_qwen2.5_7b.sh                       # resolve + validate, no Ray
#   PREFLIGHT=1 bash scripts/run_dapo_forking_qwen2.5_7b.sh                     # on the cluster, before training (seconds)
set -xeuo pipefail

# Algorithm
method=dapo_forking
model_preset=qwen2.5_7b
clip_ratio_low=0.2
clip_ratio_high=0.28
loss_agg_mode=token-mean
n_resp_per_prompt=16
train_prompt_bsz=512
train_prompt_mini_bsz=32
max_prompt_length=$((1024 * 2))
max_response_length=$((1024 * 20))

# Infrastructure (on a cluster RAY_DATA_HOME, or each path, must be shared storage: scripts/common.sh)
NNODES=${NNODES:-1}
NGPUS_PER_NODE=${NGPUS_PER_NODE:-8}
RAY_DATA_HOME=${RAY_DATA_HOME:-"${HOME}/verl"}
MODEL_PATH=${MODEL_PATH:-"${RAY_DATA_HOME}/models/Qwen2.5-7B"}
TRAIN_FILE=${TRAIN_FILE:-"${RAY_DATA_HOME}/data/dapo-math-17k.parquet"}
TEST_FILE=${TEST_FILE:-"${RAY_DATA_HOME}/data/aime-2024.parquet"}
PROJECT_NAME=${PROJECT_NAME:-gtpo-reproduction}
EXP_NAME=${EXP_NAME:-dapo_forking-qwen2.5-7b}
CKPTS_DIR=${CKPTS_DIR:-"${RAY_DATA_HOME}/ckpts/${PROJECT_NAME}/${EXP_NAME}"}
RAY_ADDRESS=${RAY_ADDRESS:-}
WORKING_DIR=${WORKING_DIR:-"$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"}
RUNTIME_ENV=${RUNTIME_ENV:-"${WORKING_DIR}/recipe/gtpo/runtime_env.yaml"}

# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

gtpo_launch \
    method="${method}" \
    model="${model_preset}" \
    data.max_prompt_length="${max_prompt_length}" \
    data.max_response_length="${max_response_length}" \
    data.train_batch_size="${train_prompt_bsz}" \
    actor_rollout_ref.rollout.n="${n_resp_per_prompt}" \
    actor_rollout_ref.actor.ppo_mini_batch_size="${train_prompt_mini_bsz}" \
    actor_rollout_ref.actor.clip_ratio_low="${clip_ratio_low}" \
    actor_rollout_ref.actor.clip_ratio_high="${clip_ratio_high}" \
    actor_rollout_ref.actor.loss_agg_mode="${loss_agg_mode}" \
    "$@"
