#!/usr/bin/env bash
# The CPU demo: verl's real trainer teaches a random tiny model `say <d>` -> `<d>` by RL on a machine without GPU.
#
#   bash scripts/run_cpu_demo.sh                      # GTPO, 100 steps, outputs/cpu_demo/gtpo/
#   bash scripts/run_cpu_demo.sh --method grpo        # the GRPO baseline, same task and settings
#   bash scripts/run_cpu_demo.sh --steps 60 -- actor_rollout_ref.actor.optim.lr=2e-3   # Hydra overrides after --
#
# Sets up .venv (scripts/setup_env.sh, a no-op when it is up to date), then runs `python -m gtpo.cpu.demo`, which
# builds the offline assets, trains, and writes curves.png, a token heatmap and summary.json into the output folder.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo_root}"

bash scripts/setup_env.sh
exec .venv/bin/python -m gtpo.cpu.demo "$@"
