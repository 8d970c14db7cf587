#!/usr/bin/env bash
# GTPO on Qwen2.5-7B base: token-level entropy shaping on the DAPO base.
# Tan et al., arXiv 2508.04349; paper A's scale (configs/scale/paper.yaml).
# 1 node x 8 GPUs | no KL | dynamic sampling | clip 0.2/0.28 | loss vanilla/token-mean
# Every setting comes from configs/method/gtpo.yaml and configs/model/qwen2.5_7b.yaml; this is
# bash scripts/run.sh gtpo qwen2.5_7b (--help: overrides, environment, DRY_RUN=1, PREFLIGHT=1).
exec "$(dirname "${BASH_SOURCE[0]}")/run.sh" gtpo qwen2.5_7b "$@"
