#!/usr/bin/env bash
# Smoke run on Qwen2.5-0.5B-Instruct, before any 7B / 32B run: GTPO (or method=<name>) for steps 1-2, a checkpoint,
# a resume to step 4, then a check that step 4's checkpoint is there; about ten minutes (estimate).
# 1 node x 1 GPU | no KL | dynamic sampling | clip 0.2/0.28 | loss vanilla/token-mean
# Settings: configs/model/qwen2.5_0.5b.yaml, configs/scale/smoke.yaml; NGPUS_PER_NODE=2 trains at data-parallel
# size 2. This is bash scripts/run.sh --smoke gtpo qwen2.5_0.5b (--help: overrides, environment, DRY_RUN=1).
exec "$(dirname "${BASH_SOURCE[0]}")/run.sh" --smoke gtpo qwen2.5_0.5b "$@"
