#!/usr/bin/env bash
# Create (or refresh) .venv in the repository root with everything the recipe and its tests need.
#
#   bash scripts/setup_env.sh            # idempotent: a second run with unchanged pins does nothing
#
# Without a GPU, torch==2.13.0 (CPU build) is installed first and then held by a constraint, so no dependency can
# pull a multi-GB CUDA torch. With a GPU, the torch already in the environment (e.g. the verl image's) is kept.
# Exact versions of the CPU environment are pinned in requirements/cpu-constraints.txt.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo_root}"

PYTHON="${PYTHON:-python3}"
VENV="${VENV:-${repo_root}/.venv}"
CPU_TORCH="torch==2.13.0"
constraints="${repo_root}/requirements/cpu-constraints.txt"

has_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1
}

stamp_of() {
  # What the environment was built from: pins, package metadata and the torch choice.
  cat "${repo_root}/pyproject.toml" "${constraints}" | sha256sum | cut -d' ' -f1
  if has_gpu; then echo gpu; else echo "cpu ${CPU_TORCH}"; fi
}

stamp_file="${VENV}/.gtpo-setup-stamp"
wanted="$(stamp_of)"
if [[ -f "${stamp_file}" && "$(cat "${stamp_file}")" == "${wanted}" ]]; then
  echo "setup_env: ${VENV} is up to date"
  exit 0
fi

if [[ ! -x "${VENV}/bin/python" ]]; then
  "${PYTHON}" -m venv "${VENV}"
fi
pip=("${VENV}/bin/python" -m pip)
"${pip[@]}" install --quiet --upgrade "pip>=24"

if has_gpu; then
  "${pip[@]}" install --quiet -e ".[test,gpu]"
else
  # torch first, from the local CPU wheel; the constraint keeps it.
  "${pip[@]}" install --quiet "${CPU_TORCH}"
  tmp_constraints="$(mktemp)"
  trap 'rm -f "${tmp_constraints}"' EXIT
  { echo "${CPU_TORCH}"; cat "${constraints}"; } >"${tmp_constraints}"
  "${pip[@]}" install --quiet -c "${tmp_constraints}" -e ".[test]"
fi

"${VENV}/bin/python" - <<'PY'
import torch, verl
print(f"setup_env: torch {torch.__version__}, verl {verl.__version__}")
PY
echo "${wanted}" >"${stamp_file}"
