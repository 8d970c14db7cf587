#!/usr/bin/env bash
# Evaluate a saved checkpoint the way paper A's Table 1 reports it (arXiv 2508.04349, Sec. 3.1): the launch script
# that trained it runs verl's validation only (trainer.val_only=true) on the checkpoint, with the validation sets
# and sampling of the launch script (AIME 2024, AIME 2025, MATH 500; T 1.0, top-p 1.0) at Table 1's n = 32
# (EVAL_N; the launchers validate in the loop at n = 4), dumping every response (trainer.validation_data_dir); then
# `python -m gtpo.eval` regrades the dump and prints avg@n, unbiased pass@k, maj@k per benchmark and the Table 1
# columns (Mean@32, Pass@4, Pass@32). Cost: (30 + 30 + 500) x 32 = 17,920 responses per checkpoint.
#
#   bash scripts/eval_checkpoint.sh scripts/run_gtpo_qwen2.5_7b.sh <ckpts>/global_step_200 [hydra overrides]
#   bash scripts/eval_checkpoint.sh scripts/run.sh grpo qwen3_8b_base <ckpts>/global_step_200   # the generic launcher
#   EVAL_DIR=/shared/eval/gtpo-200 bash scripts/eval_checkpoint.sh ...      # where the dump and tables go
#   DRY_RUN=1 bash scripts/eval_checkpoint.sh ...                            # resolve + validate only (1, true, yes)
#
# The checkpoint folder is verl's <trainer.default_local_dir>/global_step_<N>; it must exist (a missing step is named
# with the steps that do). The evaluation is a run of its own beside the run it evaluates, which may still be
# training: its name is <run>-eval-step<N> (EXP_NAME), and its folder (EVAL_DIR, default <run folder>-eval-step<N>
# beside the run's folder; the evaluation's CKPTS_DIR, metric log, TensorBoard and W&B folders) lies outside the
# run's folder, so it never writes into, moves or prunes anything of the run (the driver refuses an EVAL_DIR inside
# it). It needs a Ray cluster of its own: the driver refuses one another verl run is on (verl's TransferQueue is one
# per cluster). On another cluster shape than the one that trained it, the checkpoint is resharded into a copy in
# EVAL_DIR (<EVAL_DIR>/resharded/global_step_<N>), never in place.
# A LoRA checkpoint: the launcher that trained it (scripts/run_gtpo_qwen2.5_<size>_lora.sh, or scripts/run.sh METHOD
# MODEL adapter=lora) loads base and adapters as its resume does and sends the adapters to vLLM before validating.
# EVAL_DIR must be readable here after the run: with job submission (RAY_ADDRESS=http://...) put it on storage this
# shell shares with the cluster.
set -xeuo pipefail
# The trace only when asked for (GTPO_TRACE=1).
{ [[ "${GTPO_TRACE:-0}" == 1 ]] || set +x; } 2>/dev/null
# The private umask and the interpreter of the launchers (the dump and the tables written here are the user's too).
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
dry_run=0
dry_run_value=${DRY_RUN:-0}
if [[ "${dry_run_value,,}" =~ ^(1|true|yes)$ ]]; then
    dry_run=1
fi

# The launcher, with the method and the model when it is scripts/run.sh (they come before its overrides).
launcher=("${1:-}")
taken=1
if [[ "${launcher[0]}" == run.sh || "${launcher[0]}" == */run.sh ]]; then
    launcher+=("${2:-}" "${3:-}")
    taken=3
fi
if [[ $# -le ${taken} ]]; then
    echo "usage: $0 <launch script> [METHOD MODEL, for scripts/run.sh] <checkpoint folder .../global_step_N>" \
        "[hydra overrides]" >&2
    exit 2
fi
shift "${taken}"
checkpoint=${1%/}
shift
if [[ "${checkpoint}" != *global_step_* ]]; then
    echo "checkpoint=${checkpoint}: expected verl's checkpoint folder <default_local_dir>/global_step_<N>" >&2
    exit 2
fi
step=${checkpoint##*global_step_}
if [[ "${JOB_NO_WAIT:-0}" == 1 ]]; then
    echo "JOB_NO_WAIT=1: the evaluation reads the dump when the validation job has finished; unset it" >&2
    exit 2
fi
# Absolute paths: the launch scripts run from the repository root.
[[ "${checkpoint}" == /* ]] || checkpoint="${PWD}/${checkpoint}"

# The checkpoint is here, in a dry run and a real one alike (its completeness: the launcher's checks, as the resume
# defines it, gtpo/trainer/resume/checkpoints.py); a missing step names the steps the run's folder holds.
check_checkpoint_exists() {
    local folder=$1 run_dir steps
    [[ -d "${folder}" ]] && return 0
    run_dir=$(dirname "${folder}")
    if [[ "${run_dir}" == / ]]; then
        echo "checkpoint=${folder}: no such folder (a path that starts with /global_step_: is the variable before" \
            "it, e.g. \$CKPTS_DIR, set in this shell?)" >&2
        exit 2
    fi
    if [[ ! -d "${run_dir}" ]]; then
        echo "checkpoint=${folder}: no such folder (nor its run's folder ${run_dir}; is the path's variable set?)" >&2
        exit 2
    fi
    steps=$(find "${run_dir}" -mindepth 1 -maxdepth 1 -type d -name 'global_step_*' -printf '%f\n' |
        sed 's/^global_step_//' | sort -n | paste -sd ' ')
    echo "checkpoint=${folder}: no such folder; ${run_dir} holds the steps: ${steps:-none}" >&2
    exit 2
}

# The evaluation's own run: its name and folders, outside the run it evaluates (which may be training beside it: a
# shared experiment name would move its live metric log aside, a folder inside it would be pruned with the step).
evaluation_folders() {
    local run_dir run_name
    run_dir=$(dirname "${checkpoint}")
    run_name=$(basename "${run_dir}")
    EXP_NAME="${run_name}-eval-step${step}"
    EVAL_DIR=${EVAL_DIR:-"${run_dir}-eval-step${step}"}
    [[ "${EVAL_DIR}" == /* ]] || EVAL_DIR="${PWD}/${EVAL_DIR}"
    # The launcher derives the checkpoint folder and every tracker's folder from these, not from the caller's.
    CKPTS_DIR="${EVAL_DIR}"
    VERL_FILE_LOGGER_ROOT="${EVAL_DIR}/logs"
    TENSORBOARD_DIR="${EVAL_DIR}/tensorboard"
    WANDB_DIR="${EVAL_DIR}"
    export EXP_NAME EVAL_DIR CKPTS_DIR VERL_FILE_LOGGER_ROOT TENSORBOARD_DIR WANDB_DIR
    unset VERL_FILE_LOGGER_PATH
}

check_checkpoint_exists "${checkpoint}"
evaluation_folders

# Infrastructure
EVAL_ARGS=${EVAL_ARGS:-"--sampling paper"}
# Samples per problem: Table 1's Mean@32 / Pass@4 / Pass@32 (in-loop validation uses the launchers' val_n = 4).
EVAL_N=${EVAL_N:-32}

dump_dir="${EVAL_DIR}/generations"
bash "${launcher[@]}" \
    trainer.val_only=true \
    trainer.val_before_train=true \
    trainer.resume_mode=resume_path \
    trainer.resume_from_path="${checkpoint}" \
    trainer.validation_data_dir="${dump_dir}" \
    actor_rollout_ref.rollout.val_kwargs.n="${EVAL_N}" \
    "$@"

if ((dry_run)); then
    exit 0
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC2086  # EVAL_ARGS is a list of gtpo.eval options
"${PYTHON}" -m gtpo.eval "${dump_dir}/${step}.jsonl" --out-dir "${EVAL_DIR}" ${EVAL_ARGS}
