#!/usr/bin/env bash
# The one launcher: bash scripts/run.sh METHOD MODEL [adapter=NAME] [Hydra overrides]; --help lists the methods, the
# model presets, the published runs and the environment it reads. The logic is gtpo/launch/launcher.py.
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
exec "${PYTHON}" -m gtpo.launch "$@"
