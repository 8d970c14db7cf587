#!/usr/bin/env bash
# GTPO: token-level entropy-shaped rewards on top of DAPO
# (arXiv 2508.04349) | Qwen3-8B-Base | 1 node x 8 GPUs | FSDP2 + vLLM | verl 0.9.1
#
# Presets: configs/method/gtpo.yaml (estimator, loss, clip, KL off, dynamic sampling), configs/model/qwen3_8b_base.yaml
# (parallelism, offload, token budgets, the chat template's thinking switch: docs/knobs.md, Qwen3) and
# configs/scale/paper.yaml (paper A's batch, lengths, lr, sampling). Another method: copy this file to
# run_<method>_qwen3_8b_base.sh and change `method=`. Launch logic: scripts/common.sh.
#
#   bash scripts/run_gtpo_qwen3_8b_base.sh [overrides]                     # on this node / Slurm driver
#   RAY_ADDRESS=http://<head>:8265 bash scripts/run_gtpo_qwen3_8b_base.sh   # ray job submit to a cluster
#   DRY_RUN=1 bash scripts/run_gtpo_qwen3_8b_base.sh                       # resolve + validate, no Ray
#   PREFLIGHT=1 bash scripts/run_gtpo_qwen3_8b_base.sh                     # on the cluster, before training (seconds)
set -xeuo pipefail

# Algorithm
# Scale: paper A's setup (arXiv 2508.04349, Sec. 3.1) from configs/scale/paper.yaml: 128 prompts x 16 responses,
# prompt 2048 + response 4096 tokens, lr 1e-6, rollout temperature 1.0 / top-p 1.0, mini-batch 32 prompts.
# scale=dapo (here or as an argument) selects DAPO's 512 x 16 at 2048 + 20480 instead (configs/scale/dapo.yaml).
# Validation: AIME 2024, AIME 2025, MATH 500 (TEST_FILE) with paper A's sampling (configs/sampling/paper.yaml),
# in the loop at n = 4 every 20 steps: (30 + 30 + 500) x 4 = 2,240 responses, 1.1 training rounds each; Table 1's
# n = 32 (17,920 responses, 8.75 rounds) runs offline on saved checkpoints: scripts/eval_checkpoint.sh.
method=gtpo
model_preset=qwen3_8b_base
scale=paper
clip_ratio_low=0.2
clip_ratio_high=0.28
loss_agg_mode=token-mean
val_sampling=paper
val_n=4

# Infrastructure (on a cluster RAY_DATA_HOME, or each path, must be shared storage: scripts/common.sh)
NNODES=${NNODES:-1}
NGPUS_PER_NODE=${NGPUS_PER_NODE:-8}
RAY_DATA_HOME=${RAY_DATA_HOME:-"${HOME}/verl"}
MODEL_PATH=${MODEL_PATH:-"${RAY_DATA_HOME}/models/Qwen3-8B-Base"}
TRAIN_FILE=${TRAIN_FILE:-"${RAY_DATA_HOME}/data/dapo_math_17k.parquet"}
TEST_FILE=${TEST_FILE:-"[${RAY_DATA_HOME}/data/aime2024.parquet,${RAY_DATA_HOME}/data/aime2025.parquet,${RAY_DATA_HOME}/data/math500.parquet]"}
PROJECT_NAME=${PROJECT_NAME:-gtpo-reproduction}
EXP_NAME=${EXP_NAME:-gtpo-qwen3-8b-base}
CKPTS_DIR=${CKPTS_DIR:-"${RAY_DATA_HOME}/ckpts/${PROJECT_NAME}/${EXP_NAME}"}
RAY_ADDRESS=${RAY_ADDRESS:-}
WORKING_DIR=${WORKING_DIR:-"$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"}
RUNTIME_ENV=${RUNTIME_ENV:-"${WORKING_DIR}/recipe/gtpo/runtime_env.yaml"}

# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

gtpo_launch \
    method="${method}" \
    model="${model_preset}" \
    scale="${scale}" \
    sampling="${val_sampling}" \
    actor_rollout_ref.rollout.val_kwargs.n="${val_n}" \
    actor_rollout_ref.actor.clip_ratio_low="${clip_ratio_low}" \
    actor_rollout_ref.actor.clip_ratio_high="${clip_ratio_high}" \
    actor_rollout_ref.actor.loss_agg_mode="${loss_agg_mode}" \
    "$@"
