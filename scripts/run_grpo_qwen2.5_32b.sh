#!/usr/bin/env bash
# GRPO on Qwen2.5-32B base: group-normalised advantages, KL loss to the reference.
# DeepSeekMath, arXiv 2402.03300; paper A's scale (configs/scale/paper.yaml).
# 4 nodes x 8 GPUs | KL loss 0.001 | no dynamic sampling | clip 0.2/0.2 | loss vanilla/seq-mean-token-mean
# Every setting comes from configs/method/grpo.yaml and configs/model/qwen2.5_32b.yaml; this is
# bash scripts/run.sh grpo qwen2.5_32b (--help: overrides, environment, DRY_RUN=1, PREFLIGHT=1).
exec "$(dirname "${BASH_SOURCE[0]}")/run.sh" grpo qwen2.5_32b "$@"
