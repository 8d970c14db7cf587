# shellcheck shell=bash
# Shared launch logic of scripts/run_<method>_qwen2.5_<size>.sh. Sourced by them, never run on its own.
#
# A launch script sets its algorithm knobs and infrastructure variables, sources this file and calls
# `gtpo_launch <overrides...> "$@"`. gtpo_launch prepends the infrastructure overrides (data, model, nodes,
# checkpoint folder, W&B names), so the script's knobs and then the caller's own overrides win, and picks one of:
#
#   DRY_RUN=1           resolve the full Hydra config, run verl's validation and the batch-arithmetic checks,
#                       print it; no Ray, no GPU (gtpo/verl_plugin/dry_run.py)
#   SUBMIT_MODE=local   `python -m recipe.gtpo.main_gtpo ...` here: a fresh local Ray instance, or the cluster
#                       that `ray start` made on this node / that RAY_ADDRESS=<ip>:6379 names (Slurm, KubeRay)
#   SUBMIT_MODE=job     `ray job submit --address "$RAY_ADDRESS" --runtime-env <generated> -- python -m ...`
#   SUBMIT_MODE=auto    (default) `job` when RAY_ADDRESS is a dashboard URL (http:// or https://) and this shell
#                       is not already a Ray job's driver; `local` otherwise
#
# Processes on a running cluster take their environment from the Ray runtime env, not from the submitting shell,
# so job submission writes a private copy of RUNTIME_ENV that adds VERL_USE_EXTERNAL_MODULES (the recipe's plugin)
# and copies the variables named in ENV_PASSTHROUGH and those starting with ENV_PASSTHROUGH_PREFIXES (W&B and
# Hugging Face credentials, NCCL_*, VLLM_*, GLOO_*) from this shell. Their values never appear on a command line.
#
# Variables read here (besides the ones each launch script defines):
#   PYTHON                  interpreter for local and dry runs (python3)
#   ENTRYPOINT              module started by every path (recipe.gtpo.main_gtpo)
#   SUBMIT_MODE             auto | local | job (auto)
#   JOB_NO_WAIT             1: `ray job submit --no-wait`, then follow with `ray job logs <id> --follow` (0)
#   ENV_PASSTHROUGH         names copied into the job's runtime env when set in this shell
#   ENV_PASSTHROUGH_PREFIXES  name prefixes copied likewise

GTPO_REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
GTPO_PLUGIN_MODULE=gtpo.verl_plugin.register

# Fallbacks for launch scripts that leave a variable out (each run_*.sh sets its own defaults first).
RAY_DATA_HOME=${RAY_DATA_HOME:-"${HOME}/verl"}
TRAIN_FILE=${TRAIN_FILE:-"${RAY_DATA_HOME}/data/dapo-math-17k.parquet"}
TEST_FILE=${TEST_FILE:-"${RAY_DATA_HOME}/data/aime-2024.parquet"}
RAY_ADDRESS=${RAY_ADDRESS:-}
WORKING_DIR=${WORKING_DIR:-"${GTPO_REPO_ROOT}"}
RUNTIME_ENV=${RUNTIME_ENV:-"${GTPO_REPO_ROOT}/recipe/gtpo/runtime_env.yaml"}
PYTHON=${PYTHON:-python3}
ENTRYPOINT=${ENTRYPOINT:-recipe.gtpo.main_gtpo}
SUBMIT_MODE=${SUBMIT_MODE:-auto}
JOB_NO_WAIT=${JOB_NO_WAIT:-0}
DRY_RUN=${DRY_RUN:-0}
ENV_PASSTHROUGH=${ENV_PASSTHROUGH:-"WANDB_API_KEY WANDB_ENTITY WANDB_MODE WANDB_BASE_URL HF_TOKEN HF_ENDPOINT HF_HUB_OFFLINE"}
ENV_PASSTHROUGH_PREFIXES=${ENV_PASSTHROUGH_PREFIXES:-"NCCL_ VLLM_ GLOO_"}

# Comma-joined union of module lists, order kept, blanks and duplicates dropped.
gtpo_merge_modules() {
    local out="" item
    local -a items
    IFS=',' read -r -a items <<<"$(IFS=','; echo "$*")"
    for item in "${items[@]}"; do
        item=${item// /}
        [[ -z "${item}" || ",${out}," == *",${item},"* ]] && continue
        out=${out:+${out},}${item}
    done
    echo "${out}"
}

# Resolve SUBMIT_MODE=auto to local or job.
gtpo_submit_mode() {
    case "${SUBMIT_MODE}" in
        local | job)
            echo "${SUBMIT_MODE}"
            ;;
        auto)
            # A Ray job's driver (KubeRay, `ray job submit`) has RAY_ADDRESS=<gcs ip:port> and this variable set.
            if [[ "${RAY_ADDRESS}" == http://* || "${RAY_ADDRESS}" == https://* ]] && [[ -z "${RAY_JOB_CONFIG_JSON_ENV_VAR:-}" ]]; then
                echo job
            else
                echo local
            fi
            ;;
        *)
            echo "SUBMIT_MODE=${SUBMIT_MODE}: expected auto, local or job" >&2
            return 1
            ;;
    esac
}

# Write the job's runtime env: RUNTIME_ENV plus the plugin module and the pass-through variables of this shell.
gtpo_write_runtime_env() {
    local out=$1
    "${PYTHON}" - "${RUNTIME_ENV}" "${out}" "${GTPO_PLUGIN_MODULE}" "${ENV_PASSTHROUGH}" "${ENV_PASSTHROUGH_PREFIXES}" <<'PY'
import os
import sys

import yaml

src, dst, plugin, names, prefixes = sys.argv[1:6]
with open(src) as f:
    env = yaml.safe_load(f) or {}
env_vars = {str(k): str(v) for k, v in (env.get("env_vars") or {}).items()}
modules = [m.strip() for v in (env_vars.get("VERL_USE_EXTERNAL_MODULES", ""), plugin) for m in v.split(",")]
env_vars["VERL_USE_EXTERNAL_MODULES"] = ",".join(dict.fromkeys(m for m in modules if m))
wanted = set(names.split())
for key, value in os.environ.items():
    if key in wanted or any(key.startswith(p) for p in prefixes.split()):
        env_vars[key] = value
env["env_vars"] = env_vars
with open(dst, "w") as f:
    yaml.safe_dump(env, f, sort_keys=True)
print(f"[gtpo] runtime env {dst}: env_vars {sorted(env_vars)}", file=sys.stderr)
PY
}

# Run the recipe: dry run, local run or Ray job, with the infrastructure overrides first and "$@" after them.
gtpo_launch() {
    local mode
    mode=$(gtpo_submit_mode)
    cd "${GTPO_REPO_ROOT}" || return 1
    local -a overrides=(
        data.train_files="${TRAIN_FILE}"
        data.val_files="${TEST_FILE}"
        actor_rollout_ref.model.path="${MODEL_PATH}"
        trainer.nnodes="${NNODES}"
        trainer.n_gpus_per_node="${NGPUS_PER_NODE}"
        trainer.project_name="${PROJECT_NAME}"
        trainer.experiment_name="${EXP_NAME}"
        trainer.default_local_dir="${CKPTS_DIR}"
        "$@"
    )
    VERL_USE_EXTERNAL_MODULES=$(gtpo_merge_modules "${VERL_USE_EXTERNAL_MODULES:-}" "${GTPO_PLUGIN_MODULE}")
    export VERL_USE_EXTERNAL_MODULES
    export PYTHONPATH="${GTPO_REPO_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
    export HYDRA_FULL_ERROR=${HYDRA_FULL_ERROR:-1}

    if [[ "${DRY_RUN}" == 1 || "${DRY_RUN}" == true ]]; then
        echo "[gtpo] DRY_RUN: resolve and validate only; the real run would use SUBMIT_MODE=${mode}" >&2
        DRY_RUN=1 exec "${PYTHON}" -m "${ENTRYPOINT}" "${overrides[@]}"
    fi
    if [[ "${mode}" == local ]]; then
        exec "${PYTHON}" -m "${ENTRYPOINT}" "${overrides[@]}"
    fi

    local env_file
    env_file=$(mktemp "${TMPDIR:-/tmp}/gtpo_runtime_env.XXXXXX")
    # shellcheck disable=SC2064  # expand now: the trap must remove this very file
    trap "rm -f '${env_file}'" EXIT
    gtpo_write_runtime_env "${env_file}"
    local -a submit=(ray job submit --address "${RAY_ADDRESS}" --runtime-env "${env_file}" --working-dir "${WORKING_DIR}")
    if [[ "${JOB_NO_WAIT}" == 1 ]]; then
        submit+=(--no-wait)
    fi
    "${submit[@]}" -- python3 -m "${ENTRYPOINT}" "${overrides[@]}"
}
