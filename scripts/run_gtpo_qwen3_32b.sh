#!/usr/bin/env bash
# GTPO on Qwen3-32B: token-level entropy shaping on the DAPO base.
# Tan et al., arXiv 2508.04349; paper A's scale (configs/scale/paper.yaml).
# 4 nodes x 8 GPUs | no KL | dynamic sampling | clip 0.2/0.28 | loss vanilla/token-mean
# Settings: configs/method/gtpo.yaml, configs/model/qwen3_32b.yaml (chat template: docs/knobs.md, Qwen3).
# Another method: bash scripts/run.sh <method> qwen3_32b (--help: overrides, environment, DRY_RUN=1).
exec "$(dirname "${BASH_SOURCE[0]}")/run.sh" gtpo qwen3_32b "$@"
