# shellcheck shell=bash
# PYTHON, when unset, for scripts/common.sh and scripts/eval_checkpoint.sh (sourced by both, never run on its own):
# python3 first where it has the recipe's packages: the sbatch mounts this checkout into the image, where a .venv made
# on the login node (CPU torch) must not replace the image's python; else this checkout's .venv (a fresh shell after
# scripts/setup_env.sh).
if [[ -z "${PYTHON:-}" ]]; then
    PYTHON=python3
    gtpo_venv_python="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv/bin/python"
    if [[ -x "${gtpo_venv_python}" ]] && ! python3 -c 'import importlib.util as u, sys
sys.exit(not (u.find_spec("hydra") and u.find_spec("verl")))' 2>/dev/null; then
        PYTHON=${gtpo_venv_python}
    fi
    unset gtpo_venv_python
fi
