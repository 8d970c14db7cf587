#!/usr/bin/env bash
# DAPO on Qwen2.5-32B base: clip-higher, token-level loss, soft overlong punishment.
# DAPO, arXiv 2503.14476; paper A's scale (configs/scale/paper.yaml).
# 4 nodes x 8 GPUs | no KL | dynamic sampling | clip 0.2/0.28 | loss vanilla/token-mean
# Every setting comes from configs/method/dapo.yaml and configs/model/qwen2.5_32b.yaml; this is
# bash scripts/run.sh dapo qwen2.5_32b (--help: overrides, environment, DRY_RUN=1, PREFLIGHT=1).
exec "$(dirname "${BASH_SOURCE[0]}")/run.sh" dapo qwen2.5_32b "$@"
