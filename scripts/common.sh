# shellcheck shell=bash
# Shared launch logic of scripts/run_<method>_qwen2.5_<size>.sh. Sourced by them, never run on its own.
#
# A launch script sets its algorithm knobs and infrastructure variables, sources this file and calls
# `gtpo_launch <overrides...> "$@"`. gtpo_launch prepends the infrastructure overrides (data, model, nodes,
# checkpoint folder, W&B names), so the script's knobs and then the caller's own overrides win, and picks one of:
#
#   DRY_RUN=1           resolve the full Hydra config, run verl's validation and the batch-arithmetic checks,
#                       print it; no Ray, no GPU (gtpo/launch/dry_run.py)
#   PREFLIGHT=1         on the cluster, before training: the dry run's checks plus data, model, checkpoint
#                       folder, driver, interfaces, trackers and Ray cluster size, one line each, in seconds
#                       (gtpo/launch/preflight.py); in job mode it is submitted as the job instead of training
#   SUBMIT_MODE=local   `python -m recipe.gtpo.main_gtpo ...` here: a fresh local Ray instance, or the cluster
#                       that `ray start` made on this node / that RAY_ADDRESS=<ip>:6379 names (Slurm, KubeRay)
#   SUBMIT_MODE=job     `ray job submit --address "$RAY_ADDRESS" --runtime-env <generated> -- python -m ...`
#   SUBMIT_MODE=auto    (default) `job` when RAY_ADDRESS is a dashboard URL (http:// or https://) and this shell
#                       is not already a Ray job's driver; `local` otherwise
#
# Paths on a cluster (SLURM_JOB_ID set, NNODES > 1, or job mode): TRAIN_FILE, TEST_FILE, MODEL_PATH and CKPTS_DIR
# must be absolute and outside $HOME (pyxis does not mount it, Apptainer's is quota-limited, and in job mode it is
# the submitting machine's): set RAY_DATA_HOME=<shared folder> or the paths themselves (ALLOW_HOME_PATHS=1 when
# $HOME really is shared storage mounted at the same path everywhere). Job mode prints the paths the cluster will
# read. MODEL_PATH is a local folder (download once: `hf download Qwen/Qwen2.5-7B --local-dir <folder>`; `hf` is in the
# image and in .venv/bin) and HF_HUB_OFFLINE=1 keeps every rank off the network.
#
# Metric logs go next to the checkpoints (unless set): VERL_FILE_LOGGER_ROOT=${CKPTS_DIR}/logs (verl's file logger),
# TENSORBOARD_DIR=${CKPTS_DIR}/tensorboard, WANDB_DIR=${CKPTS_DIR} (offline runs). verl's defaults are relative to
# the TaskRunner's working directory: a Ray session's scratch copy on whichever node it starts, lost with the
# session, and a resume would find no earlier log to keep.
#
# Processes on a running cluster take their environment from the Ray runtime env, not from the submitting shell,
# so job submission writes a private copy of RUNTIME_ENV that adds VERL_USE_EXTERNAL_MODULES (the recipe's plugin),
# the log folders (GTPO_LOG_VARS) and the variables ENV_PASSTHROUGH names, and nothing else: no prefix copying,
# since a login node's NCCL_*, GLOO_* or VLLM_* settings are wrong on GPU nodes with other NICs. A local driver
# attached to a running cluster (Slurm, a RayJob's entrypoint) puts the log folders into ray.init's runtime env
# itself (recipe/gtpo/main_gtpo.py). Tokens (WANDB_API_KEY, HF_TOKEN) stay on the cluster side, in the environment
# `ray start` ran with (sbatch exports, a Kubernetes Secret): a runtime env is stored with the job and returned by
# the dashboard's job API to anyone who can reach it.
#
# Variables read here (besides the ones each launch script defines):
#   PYTHON                  interpreter for local, dry and preflight runs: python3 when it finds the recipe's packages
#                           (the image installs them into the system python: docker/Dockerfile), else this checkout's
#                           .venv/bin/python (scripts/setup_env.sh), so a fresh shell needs nothing activated
#   GTPO_TRACE              1: print the launch's `set -x` trace on stderr (0: none after this file is sourced); it
#                           shows paths and names, never a secret (tokens and keys are never on a command line)
#   ENTRYPOINT              module started by every path (recipe.gtpo.main_gtpo)
#   SUBMIT_MODE             auto | local | job (auto)
#   JOB_NO_WAIT             1: `ray job submit --no-wait`, then follow with `ray job logs <id> --follow` (0);
#                           otherwise the launch exits with the driver's own status (85, 75, ...), not the CLI's
#   ENV_PASSTHROUGH         names copied into the job's runtime env when set in this shell (W&B project settings,
#                           HF_ENDPOINT, HF_HUB_OFFLINE; no secrets), besides GTPO_LOG_VARS, which always are
#   VERL_FILE_LOGGER_ROOT, TENSORBOARD_DIR, WANDB_DIR  log folders, exported (under CKPTS_DIR, see above)
#   ALLOW_HOME_PATHS        1: accept paths under $HOME on a cluster (0)
#   RAY_AUTH_MODE           token | disabled: job mode submits with the cluster's Ray token (token); a driver that
#                           joins a running cluster (RAY_ADDRESS) must carry it too, or it is refused before Ray starts
#   RAY_AUTH_TOKEN_PATH     the token's file (job mode and a joining driver; a Slurm job exports its own)
#   HF_HUB_OFFLINE          exported (1)

# The launchers start with `set -x` (house style), whose trace (~170 lines of plumbing per launch) buries the messages
# that matter: it stops here unless GTPO_TRACE=1 (the group's own trace goes to /dev/null).
{ [[ "${GTPO_TRACE:-0}" == 1 ]] || set +x; } 2>/dev/null
# Private by default: checkpoints (torch.load runs code in them), logs and runtime env are this user's alone.
umask 077
GTPO_REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
GTPO_PLUGIN_MODULE=gtpo.verl_plugin.register

# Fallbacks for launch scripts that leave a variable out (each run_*.sh sets its own defaults first).
RAY_DATA_HOME=${RAY_DATA_HOME:-"${HOME}/verl"}
TRAIN_FILE=${TRAIN_FILE:-"${RAY_DATA_HOME}/data/dapo_math_17k.parquet"}
TEST_FILE=${TEST_FILE:-"[${RAY_DATA_HOME}/data/aime2024.parquet,${RAY_DATA_HOME}/data/aime2025.parquet,${RAY_DATA_HOME}/data/math500.parquet]"}
RAY_ADDRESS=${RAY_ADDRESS:-}
WORKING_DIR=${WORKING_DIR:-"${GTPO_REPO_ROOT}"}
RUNTIME_ENV=${RUNTIME_ENV:-"${GTPO_REPO_ROOT}/recipe/gtpo/runtime_env.yaml"}
# shellcheck source=scripts/default_python.sh
source "${GTPO_REPO_ROOT}/scripts/default_python.sh"
ENTRYPOINT=${ENTRYPOINT:-recipe.gtpo.main_gtpo}
SUBMIT_MODE=${SUBMIT_MODE:-auto}
JOB_NO_WAIT=${JOB_NO_WAIT:-0}
DRY_RUN=${DRY_RUN:-0}
PREFLIGHT=${PREFLIGHT:-0}
ALLOW_HOME_PATHS=${ALLOW_HOME_PATHS:-0}
ENV_PASSTHROUGH=${ENV_PASSTHROUGH:-"WANDB_ENTITY WANDB_PROJECT WANDB_MODE WANDB_BASE_URL HF_ENDPOINT HF_HUB_OFFLINE"}
# Log folders (paths, never secrets): copied into a job's runtime env whatever ENV_PASSTHROUGH says.
GTPO_LOG_VARS="VERL_FILE_LOGGER_ROOT VERL_FILE_LOGGER_PATH TENSORBOARD_DIR WANDB_DIR"
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
# As verl/trainer/runtime_env.yaml: let NCCL free buffers without record_stream bookkeeping (every launch path).
export TORCH_NCCL_AVOID_RECORD_STREAMS=${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}

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

# Write the job's runtime env: RUNTIME_ENV plus the plugin module and the variables GTPO_LOG_VARS and
# ENV_PASSTHROUGH name.
gtpo_write_runtime_env() {
    local out=$1
    if [[ -n "${ENV_PASSTHROUGH_PREFIXES:-}" ]]; then
        echo "ENV_PASSTHROUGH_PREFIXES=${ENV_PASSTHROUGH_PREFIXES}: prefix copying is gone; name each variable in" \
            "ENV_PASSTHROUGH (cluster-specific NCCL_* / GLOO_* settings belong on the cluster nodes)" >&2
        return 1
    fi
    "${PYTHON}" - "${RUNTIME_ENV}" "${out}" "${GTPO_PLUGIN_MODULE}" "${GTPO_LOG_VARS} ${ENV_PASSTHROUGH}" <<'PY'
import os
import sys

import yaml

from gtpo.private_files import looks_secret  # PYTHONPATH holds this checkout (gtpo_launch)

src, dst, plugin, names = sys.argv[1:5]
with open(src) as f:
    env = yaml.safe_load(f) or {}
env_vars = {str(k): str(v) for k, v in (env.get("env_vars") or {}).items()}
modules = [m.strip() for v in (env_vars.get("VERL_USE_EXTERNAL_MODULES", ""), plugin) for m in v.split(",")]
env_vars["VERL_USE_EXTERNAL_MODULES"] = ",".join(dict.fromkeys(m for m in modules if m))
for key in names.split():
    if key in os.environ:
        env_vars[key] = os.environ[key]
        if looks_secret(key):
            print(f"[gtpo] warning: {key} is stored with the job and readable through the Ray dashboard; "
                  "prefer setting it where `ray start` runs", file=sys.stderr)
env["env_vars"] = env_vars
with open(dst, "w") as f:
    yaml.safe_dump(env, f, sort_keys=True)
print(f"[gtpo] runtime env {dst}: env_vars {sorted(env_vars)}", file=sys.stderr)
PY
}

# `ray job submit` authenticates to the cluster's dashboard with Ray's token (every cluster the recipe starts requires
# one): RAY_AUTH_MODE=token, exported here when unset, and the token's file in RAY_AUTH_TOKEN_PATH (a path, never the
# value: a `set -x` trace would print it). RAY_AUTH_MODE=disabled submits without it, to a cluster started so.
gtpo_check_ray_auth() {
    case "${RAY_AUTH_MODE:-token}" in
        disabled)
            echo "[gtpo] RAY_AUTH_MODE=disabled: submitting without Ray's token (a cluster started without" \
                "authentication accepts anyone who can reach it)" >&2
            return 0
            ;;
        token) ;;
        *)
            echo "RAY_AUTH_MODE=${RAY_AUTH_MODE}: expected token or disabled" >&2
            return 1
            ;;
    esac
    export RAY_AUTH_MODE=token
    if [[ -z "${RAY_AUTH_TOKEN_PATH:-}" ]]; then
        echo "RAY_ADDRESS=${RAY_ADDRESS}: the cluster's dashboard wants its Ray token and RAY_AUTH_TOKEN_PATH is" \
            "unset; set it to the token's file (docs/cluster.md, \"Security\": a Slurm job's is under RAY_AUTH_DIR," \
            "a RayJob's is in its Secret), or RAY_AUTH_MODE=disabled for a cluster started without authentication" >&2
        return 1
    fi
    if [[ ! -f "${RAY_AUTH_TOKEN_PATH}" || ! -r "${RAY_AUTH_TOKEN_PATH}" ]]; then
        echo "RAY_AUTH_TOKEN_PATH=${RAY_AUTH_TOKEN_PATH}: not a readable file" >&2
        return 1
    fi
}

# Why this launch counts as a cluster run (printed), or status 1 when it does not.
gtpo_cluster_reason() {
    local mode=$1
    if [[ -n "${SLURM_JOB_ID:-}" ]]; then
        echo "SLURM_JOB_ID=${SLURM_JOB_ID}"
    elif [[ "${mode}" == job ]]; then
        echo "SUBMIT_MODE=job, RAY_ADDRESS=${RAY_ADDRESS}"
    elif [[ "${NNODES}" =~ ^[0-9]+$ ]] && ((NNODES > 1)); then
        echo "NNODES=${NNODES}"
    else
        return 1
    fi
}

# On a cluster every node must read the same data, model and checkpoint paths: absolute, outside $HOME.
gtpo_check_paths() {
    local mode=$1 reason var item
    local -a items
    reason=$(gtpo_cluster_reason "${mode}") || return 0
    for var in TRAIN_FILE TEST_FILE MODEL_PATH CKPTS_DIR; do
        # A Hydra list ([a,b]) is checked item by item.
        local value=${!var}
        value=${value#[}
        IFS=',' read -r -a items <<<"${value%]}"
        for item in "${items[@]}"; do
            item=${item//[\"\' ]/}
            if [[ "${item}" != /* ]]; then
                echo "${var}=${item}: not an absolute path; on a cluster (${reason}) every node must read it at the" \
                    "same place (MODEL_PATH is a local folder, not a hub id: hf download <repo> --local-dir <dir>)" >&2
                return 1
            fi
            if [[ "${ALLOW_HOME_PATHS}" != 1 && -n "${HOME:-}" ]] \
                && [[ "${item}" == "${HOME}" || "${item}" == "${HOME}"/* ]]; then
                echo "${var}=${item} is under \$HOME=${HOME}: on a cluster (${reason}) set RAY_DATA_HOME=<shared" \
                    "folder mounted at the same path on every node> or ${var} itself (ALLOW_HOME_PATHS=1 if \$HOME is" \
                    "such a folder)" >&2
                return 1
            fi
        done
    done
    if [[ "${mode}" == job ]]; then
        echo "[gtpo] paths the cluster will read (nothing but WORKING_DIR is uploaded): TRAIN_FILE=${TRAIN_FILE}" \
            "TEST_FILE=${TEST_FILE} MODEL_PATH=${MODEL_PATH} CKPTS_DIR=${CKPTS_DIR}" >&2
    fi
}

# Launcher arguments that would run something else than the command line says, refused before Python starts:
# an environment variable passed as an argument (DRY_RUN=1 after the script name is a Hydra key, not the variable),
# a method= or model= without a preset (configs/<group>/<name>.yaml), and a method= or model= other than the
# launcher's own (its knobs, MODEL_PATH, NNODES and run names are that method's and model's), answered with the
# launcher that has them. The other groups' names are Hydra's to refuse (one line: recipe/gtpo/main_gtpo.py).
gtpo_check_args() {
    local script=${BASH_SOURCE[-1]} arg group value valid
    local -a presets
    local -A first=()
    for arg in "$@"; do
        if [[ "${arg}" =~ ^[A-Z][A-Z0-9_]*= ]]; then
            echo "${arg}: an environment variable of the launcher, not a Hydra override; set it before the command:" \
                "${arg} bash ${script} ..." >&2
            return 1
        fi
        for group in method model; do
            [[ "${arg}" == "${group}="* ]] || continue
            value=${arg#*=}
            if [[ ! -f "${GTPO_REPO_ROOT}/configs/${group}/${value}.yaml" ]]; then
                presets=("${GTPO_REPO_ROOT}/configs/${group}"/*.yaml)
                presets=("${presets[@]##*/}")
                printf -v valid '%s, ' "${presets[@]%.yaml}"
                echo "${arg}: no such preset (configs/${group}/${value}.yaml); valid: ${valid%, }" >&2
                return 1
            fi
            if [[ -z "${first[${group}]:-}" ]]; then
                first[${group}]=${value}
            elif [[ "${first[${group}]}" != "${value}" ]]; then
                echo "${arg} on the command line of ${script}, a launcher for ${group}=${first[${group}]}:" \
                    "its knobs, model path, node count and run names are those of ${group}=${first[${group}]};" \
                    "$(gtpo_launcher_of "${group}" "${value}" "${first[method]:-}" "${first[model]:-}")" >&2
                return 1
            fi
        done
    done
}

# "use <launcher>" for <group>=<value> (method or model) with the launcher's other preset, else the launchers that
# exist for <value>.
gtpo_launcher_of() {
    local group=$1 value=$2 method=$3 model=$4 name
    local -a found
    if [[ "${group}" == method ]]; then
        name=run_${value}_${model}.sh
        found=("${GTPO_REPO_ROOT}/scripts/run_${value}_qwen2.5_"*.sh)
    else
        name=run_${method}_${value}.sh
        found=("${GTPO_REPO_ROOT}/scripts/run_"*"_${value}.sh")
    fi
    if [[ -f "${GTPO_REPO_ROOT}/scripts/${name}" ]]; then
        echo "use scripts/${name}"
    elif [[ -f "${found[0]}" ]]; then
        found=("${found[@]##*/}")
        printf -v name 'scripts/%s, ' "${found[@]}"
        echo "use $( ((${#found[@]} > 1)) && echo "one of ")${name%, }"
    else
        echo "no launcher has ${group}=${value}"
    fi
}

# Run the recipe: dry run, preflight, local run or Ray job, with the infrastructure overrides first and "$@" after them.
gtpo_launch() {
    local mode
    gtpo_check_args "$@" || return 1
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
    export VERL_FILE_LOGGER_ROOT=${VERL_FILE_LOGGER_ROOT:-${CKPTS_DIR}/logs}
    export TENSORBOARD_DIR=${TENSORBOARD_DIR:-${CKPTS_DIR}/tensorboard}
    export WANDB_DIR=${WANDB_DIR:-${CKPTS_DIR}}
    export PYTHONPATH="${GTPO_REPO_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
    export HYDRA_FULL_ERROR=${HYDRA_FULL_ERROR:-1}

    if [[ "${DRY_RUN}" == 1 || "${DRY_RUN}" == true ]]; then
        echo "[gtpo] DRY_RUN: resolve and validate only; the real run would use SUBMIT_MODE=${mode}" >&2
        DRY_RUN=1 exec "${PYTHON}" -m "${ENTRYPOINT}" "${overrides[@]}"
    fi
    gtpo_check_paths "${mode}" || return 1
    local module=${ENTRYPOINT}
    if [[ "${PREFLIGHT}" == 1 || "${PREFLIGHT}" == true ]]; then
        module=gtpo.launch.preflight
    fi
    if [[ "${mode}" == local ]]; then
        exec "${PYTHON}" -m "${module}" "${overrides[@]}"
    fi

    gtpo_check_ray_auth || return 1
    local env_file
    env_file=$(mktemp "${TMPDIR:-/tmp}/gtpo_runtime_env.XXXXXX")
    # shellcheck disable=SC2064  # expand now: the trap must remove this very file
    trap "rm -f '${env_file}'" EXIT
    gtpo_write_runtime_env "${env_file}"
    # `ray job submit` exits 1 on FAILED and 0 otherwise: the driver's own code (85 saved for a preemption, 75 a
    # stalled stage) is read back from the job under a submission id of ours (gtpo/launch/job_exit.py).
    local job_id rc=0
    job_id=gtpo_$(date -u +%Y%m%dT%H%M%SZ)_$$_${RANDOM}
    local -a submit=(ray job submit --address "${RAY_ADDRESS}" --submission-id "${job_id}" --runtime-env "${env_file}"
        --working-dir "${WORKING_DIR}")
    if [[ "${JOB_NO_WAIT}" == 1 ]]; then
        submit+=(--no-wait)
    fi
    "${submit[@]}" -- python3 -m "${module}" "${overrides[@]}" || rc=$?
    if [[ "${JOB_NO_WAIT}" == 1 ]]; then
        echo "[gtpo] job ${job_id} submitted: ray job logs --address ${RAY_ADDRESS} ${job_id} --follow; once it" \
            "has ended, ${PYTHON} -m gtpo.launch.job_exit ${job_id} --address ${RAY_ADDRESS} exits with its driver's" \
            "status" >&2
        return "${rc}"
    fi
    "${PYTHON}" -m gtpo.launch.job_exit "${job_id}" --address "${RAY_ADDRESS}" --cli-status "${rc}"
}
