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
#   DRY_RUN=1 bash scripts/eval_checkpoint.sh ...                            # resolve + validate only, and check
#                                                                            # the checkpoint is here and complete
#
# The checkpoint folder is verl's <trainer.default_local_dir>/global_step_<N>; the evaluation runs best on the
# cluster shape that trained it (on another, the checkpoint is first resharded in place: docs/resume-and-preemption.md).
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
if [[ "${DRY_RUN:-0}" =~ ^(1|true|yes)$ ]]; then
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
# The dry run checks the checkpoint it would evaluate: here (below), complete (the launcher's dry run, as the resume
# defines it: gtpo/trainer/resume/checkpoints.py).
if ((dry_run)) && [[ ! -d "${checkpoint}" ]]; then
    echo "checkpoint=${checkpoint}: no such folder" >&2
    exit 2
fi

# Infrastructure
EVAL_DIR=${EVAL_DIR:-"${checkpoint}/eval"}
EVAL_ARGS=${EVAL_ARGS:-"--sampling paper"}
# Samples per problem: Table 1's Mean@32 / Pass@4 / Pass@32 (in-loop validation uses the launchers' val_n = 4).
EVAL_N=${EVAL_N:-32}

[[ "${EVAL_DIR}" == /* ]] || EVAL_DIR="${PWD}/${EVAL_DIR}"
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
