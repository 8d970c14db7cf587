#!/usr/bin/env bash
# GTPO-trajectory on Qwen2.5-32B base: conflict-token masking, entropy filtering.
# Simoni et al., arXiv 2508.03772; paper A's scale (configs/scale/paper.yaml).
# 4 nodes x 8 GPUs | no KL | no dynamic sampling | clip 0.2/0.2 | loss vanilla/seq-mean-token-mean
# Every setting comes from configs/method/gtpo_traj.yaml and configs/model/qwen2.5_32b.yaml; this is
# bash scripts/run.sh gtpo_traj qwen2.5_32b (--help: overrides, environment, DRY_RUN=1, PREFLIGHT=1).
exec "$(dirname "${BASH_SOURCE[0]}")/run.sh" gtpo_traj qwen2.5_32b "$@"
