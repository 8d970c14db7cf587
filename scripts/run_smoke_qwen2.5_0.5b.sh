#!/usr/bin/env bash
# Smoke run: GTPO (any method with method=<name>) on Qwen2.5-0.5B-Instruct, 4 steps with a checkpoint and a resume
# | 1 node x 1 GPU (or 2: NGPUS_PER_NODE=2) | FSDP2 + vLLM | verl 0.9.1
#
# The first thing to run on a new cluster, image or driver, before a 7B / 32B launcher: it exercises on real
# hardware what the CPU tests cannot (vLLM generation and validation, FSDP2 over NCCL, remove-padding with
# flash-attention, the entropy hand-off to the estimator, the reward workers, checkpoint save and resume, the
# image) in about ten minutes (estimate: two trainer starts of a few minutes each, 4 steps of 16 prompts x 8
# responses, 4 validations of 64 prompts x 2 responses, all at 1024 + 1024 tokens).
#
# Presets: configs/model/qwen2.5_0.5b.yaml (one GPU) and configs/scale/smoke.yaml (batch, lengths, 64 validation
# prompts). Phase 1 trains steps 1-2 from scratch and saves global_step_2; phase 2 resumes from the checkpoint the
# tracker names (trainer.resume_mode=auto, the clusters' requeue path) and trains steps 3-4; the script then checks
# that step 4's checkpoint exists. With NGPUS_PER_NODE=2 the same batch (16 x 8 rows, mini-batches of 64) trains at
# data-parallel size 2: two FSDP ranks, two vLLM replicas and two checkpoint shards, the first GPU run of what a
# multi-GPU launcher does. Launch logic: scripts/common.sh.
#
#   bash scripts/run_smoke_qwen2.5_0.5b.sh [overrides]                  # GTPO
#   bash scripts/run_smoke_qwen2.5_0.5b.sh method=dapo_forking          # any method preset
#   NGPUS_PER_NODE=2 bash scripts/run_smoke_qwen2.5_0.5b.sh             # data-parallel size 2
#   DRY_RUN=1 bash scripts/run_smoke_qwen2.5_0.5b.sh                    # resolve + validate both phases, no Ray
#   .venv/bin/hf download Qwen/Qwen2.5-0.5B-Instruct --local-dir "$RAY_DATA_HOME/models/Qwen2.5-0.5B-Instruct"
#                                                                       # the model, once (`hf` inside the image)
set -xeuo pipefail

# Algorithm: GTPO unless the command line names a method (method=<name>); the run and checkpoint names follow it.
method=gtpo
for arg in "$@"; do
    if [[ "${arg}" == method=* ]]; then
        method=${arg#method=}
    fi
done
model_preset=qwen2.5_0.5b
scale=smoke
val_sampling=paper
val_n=2
steps_before_resume=2
total_steps=4

# Infrastructure
NNODES=${NNODES:-1}
NGPUS_PER_NODE=${NGPUS_PER_NODE:-1}
RAY_DATA_HOME=${RAY_DATA_HOME:-"${HOME}/verl"}
MODEL_PATH=${MODEL_PATH:-"${RAY_DATA_HOME}/models/Qwen2.5-0.5B-Instruct"}
TRAIN_FILE=${TRAIN_FILE:-"${RAY_DATA_HOME}/data/dapo_math_17k.parquet"}
TEST_FILE=${TEST_FILE:-"[${RAY_DATA_HOME}/data/aime2024.parquet,${RAY_DATA_HOME}/data/aime2025.parquet,${RAY_DATA_HOME}/data/math500.parquet]"}
PROJECT_NAME=${PROJECT_NAME:-gtpo-smoke}
EXP_NAME=${EXP_NAME:-"smoke-${method}-qwen2.5-0.5b"}
CKPTS_DIR=${CKPTS_DIR:-"${RAY_DATA_HOME}/ckpts/${PROJECT_NAME}/${EXP_NAME}"}
RAY_ADDRESS=${RAY_ADDRESS:-}
WORKING_DIR=${WORKING_DIR:-"$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"}
RUNTIME_ENV=${RUNTIME_ENV:-"${WORKING_DIR}/recipe/gtpo/runtime_env.yaml"}

# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# One trainer run; the phase's overrides, then the caller's, follow the smoke settings.
smoke_phase() {
    gtpo_launch \
        method="${method}" \
        model="${model_preset}" \
        scale="${scale}" \
        sampling="${val_sampling}" \
        actor_rollout_ref.rollout.val_kwargs.n="${val_n}" \
        trainer.save_freq="${steps_before_resume}" \
        "$@"
}

# Phase 1: steps 1..2 from scratch (an earlier smoke run's checkpoints are not resumed), checkpoint at step 2.
(smoke_phase trainer.total_training_steps="${steps_before_resume}" trainer.resume_mode=disable "$@")
# Phase 2: resume from the checkpoint the tracker names (phase 1's global_step_2), steps 3..4.
(smoke_phase trainer.total_training_steps="${total_steps}" trainer.resume_mode=auto "$@")

if [[ "${DRY_RUN:-0}" == 1 || "${DRY_RUN:-0}" == true ]]; then
    exit 0
fi
tracker="${CKPTS_DIR}/latest_checkpointed_iteration.txt"
if [[ ! -d "${CKPTS_DIR}" ]]; then
    echo "[smoke] both phases finished; ${CKPTS_DIR} is not visible here: check ${tracker} on the cluster" >&2
    exit 0
fi
if [[ "$(cat "${tracker}" 2>/dev/null)" != "${total_steps}" || ! -d "${CKPTS_DIR}/global_step_${total_steps}" ]]; then
    echo "[smoke] FAILED: ${tracker} says '$(cat "${tracker}" 2>/dev/null)', expected ${total_steps} after the resume" >&2
    exit 1
fi
echo "[smoke] OK: ${method} trained ${steps_before_resume} steps, resumed from global_step_${steps_before_resume}" \
    "and trained to step ${total_steps} (${CKPTS_DIR})"
