#!/usr/bin/env bash
# GRPO-S on Qwen2.5-7B base: sequence-level entropy shaping on the DAPO base.
# Tan et al., arXiv 2508.04349; paper A's scale (configs/scale/paper.yaml).
# 1 node x 8 GPUs | no KL | dynamic sampling | clip 0.2/0.28 | loss grpo_s/seq-mean-token-mean
# Every setting comes from configs/method/grpo_s.yaml and configs/model/qwen2.5_7b.yaml; this is
# bash scripts/run.sh grpo_s qwen2.5_7b (--help: overrides, environment, DRY_RUN=1, PREFLIGHT=1).
exec "$(dirname "${BASH_SOURCE[0]}")/run.sh" grpo_s qwen2.5_7b "$@"
