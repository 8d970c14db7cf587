#!/usr/bin/env bash
# Evaluate a saved checkpoint the way paper A's Table 1 reports it (arXiv 2508.04349, Sec. 3.1): the launch script
# that trained it runs verl's validation only (trainer.val_only=true) on the checkpoint, with the validation sets
# and sampling of the launch script (AIME 2024, AIME 2025, MATH 500; T 1.0, top-p 1.0) at Table 1's n = 32
# (EVAL_N; the launchers validate in the loop at n = 4), dumping every response (trainer.validation_data_dir); then
# `python -m gtpo.eval` regrades the dump and prints avg@n, unbiased pass@k, maj@k per benchmark and the Table 1
# columns (Mean@32, Pass@4, Pass@32). Cost: (30 + 30 + 500) x 32 = 17,920 responses per checkpoint.
#
#   bash scripts/eval_checkpoint.sh scripts/run_gtpo_qwen2.5_7b.sh <ckpts>/global_step_200 [hydra overrides]
#   EVAL_DIR=/shared/eval/gtpo-200 bash scripts/eval_checkpoint.sh ...      # where the dump and tables go
#   DRY_RUN=1 bash scripts/eval_checkpoint.sh ...                            # resolve + validate only, and check
#                                                                            # the checkpoint is here and complete
#
# The checkpoint folder is verl's <trainer.default_local_dir>/global_step_<N>; the evaluation runs best on the
# cluster shape that trained it (on another, the checkpoint is first resharded in place: docs/resume-and-preemption.md).
# A LoRA checkpoint: the LoRA launcher that trained it (scripts/run_<method>_qwen2.5_<size>_lora.sh) loads base and
# adapters as its resume does and sends the adapters to vLLM before validating. EVAL_DIR must be readable here after the run: with
# job submission (RAY_ADDRESS=http://...) put it on storage this shell shares with the cluster.
set -xeuo pipefail
# The trace only when asked for, as in scripts/common.sh (GTPO_TRACE=1).
{ [[ "${GTPO_TRACE:-0}" == 1 ]] || set +x; } 2>/dev/null
# Private by default, as scripts/common.sh makes the launcher it calls: the dump and the tables written here.
umask 077

if [[ $# -lt 2 ]]; then
    echo "usage: $0 <launch script> <checkpoint folder .../global_step_N> [hydra overrides]" >&2
    exit 2
fi
launch_script=$1
checkpoint=${2%/}
shift 2
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
# defines it: gtpo/trainer/checkpoints.py).
if [[ "${DRY_RUN:-0}" == 1 || "${DRY_RUN:-0}" == true ]] && [[ ! -d "${checkpoint}" ]]; then
    echo "checkpoint=${checkpoint}: no such folder" >&2
    exit 2
fi

# Infrastructure
EVAL_DIR=${EVAL_DIR:-"${checkpoint}/eval"}
# As scripts/common.sh: python3 where it has the recipe's packages (the image), else this checkout's .venv.
# shellcheck source=scripts/default_python.sh
source "$(dirname "${BASH_SOURCE[0]}")/default_python.sh"
EVAL_ARGS=${EVAL_ARGS:-"--sampling paper"}
# Samples per problem: Table 1's Mean@32 / Pass@4 / Pass@32 (in-loop validation uses the launchers' val_n = 4).
EVAL_N=${EVAL_N:-32}

[[ "${EVAL_DIR}" == /* ]] || EVAL_DIR="${PWD}/${EVAL_DIR}"
dump_dir="${EVAL_DIR}/generations"
bash "${launch_script}" \
    trainer.val_only=true \
    trainer.val_before_train=true \
    trainer.resume_mode=resume_path \
    trainer.resume_from_path="${checkpoint}" \
    trainer.validation_data_dir="${dump_dir}" \
    actor_rollout_ref.rollout.val_kwargs.n="${EVAL_N}" \
    "$@"

if [[ "${DRY_RUN:-0}" == 1 || "${DRY_RUN:-0}" == true ]]; then
    exit 0
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck disable=SC2086  # EVAL_ARGS is a list of gtpo.eval options
"${PYTHON}" -m gtpo.eval "${dump_dir}/${step}.jsonl" --out-dir "${EVAL_DIR}" ${EVAL_ARGS}
