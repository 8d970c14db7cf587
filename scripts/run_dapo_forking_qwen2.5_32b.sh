#!/usr/bin/env bash
# DAPO w/ forking tokens on Qwen2.5-32B base: DAPO's gradient on the high-entropy tokens.
# Beyond the 80/20 Rule, arXiv 2506.01939; paper A's scale (configs/scale/paper.yaml).
# 4 nodes x 8 GPUs | no KL | dynamic sampling | forking tokens rho=0.2 | clip 0.2/0.28 | loss vanilla/token-mean
# Every setting comes from configs/method/dapo_forking.yaml and configs/model/qwen2.5_32b.yaml; this is
# bash scripts/run.sh dapo_forking qwen2.5_32b (--help: overrides, environment, DRY_RUN=1, PREFLIGHT=1).
exec "$(dirname "${BASH_SOURCE[0]}")/run.sh" dapo_forking qwen2.5_32b "$@"
