#!/usr/bin/env bash
# The CPU demo: verl's real trainer teaches a random tiny model `say <d>` -> `<d>` by RL on a machine without GPU.
#
#   bash scripts/run_cpu_demo.sh                      # GTPO, 100 steps, outputs/cpu_demo/gtpo/
#   bash scripts/run_cpu_demo.sh --method grpo        # any preset: grpo, dapo, dapo_forking, gtpo, grpo_s, gtpo_traj
#   bash scripts/run_cpu_demo.sh --steps 60 -- actor_rollout_ref.actor.optim.lr=2e-3   # Hydra overrides after --
#
# Sets up .venv (scripts/setup_env.sh, a no-op when it is up to date), then runs `python -m gtpo.cpu.demo`, which
# builds the offline assets, trains (one live line on the console: step/total, reward, entropy, elapsed, remaining;
# the trainer's own output in <out>/train.log), and writes curves.png, a token heatmap and summary.json.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${repo_root}"

bash scripts/setup_env.sh
exec .venv/bin/python -m gtpo.cpu.demo "$@"
