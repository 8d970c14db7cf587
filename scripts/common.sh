# shellcheck shell=bash
# What a launch settles in bash before Python starts, sourced by scripts/run.sh and scripts/eval_checkpoint.sh: a
# private umask (checkpoints hold code torch.load runs; logs and dumps are the user's), this checkout on PYTHONPATH,
# and PYTHON when unset: python3 where it has the recipe's packages (the image: the sbatch mounts this checkout into
# it, where a .venv made on a login node must not replace the image's python), else this checkout's .venv
# (scripts/setup_env.sh). Everything else is Python: gtpo/launch/launcher.py.
umask 077
gtpo_repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="${gtpo_repo_root}${PYTHONPATH:+:${PYTHONPATH}}"
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON=python3
    gtpo_venv_python="${gtpo_repo_root}/.venv/bin/python"
    if [[ -x "${gtpo_venv_python}" ]] && ! python3 -c 'import importlib.util as u, sys
sys.exit(not (u.find_spec("hydra") and u.find_spec("verl")))' 2>/dev/null; then
        PYTHON=${gtpo_venv_python}
    fi
    unset gtpo_venv_python
fi
unset gtpo_repo_root
export PYTHON
