#!/usr/bin/env bash
# GTPO on Qwen2.5-3B base with LoRA adapters on one 24 or 48 GB GPU.
# Tan et al., arXiv 2508.04349; paper A's scale (configs/scale/paper.yaml).
# 1 node x 1 GPU | LoRA r=128 | no KL | dynamic sampling | clip 0.2/0.28 | loss vanilla/token-mean
# Settings: configs/method/gtpo.yaml, configs/model/qwen2.5_3b.yaml, configs/adapter/lora.yaml and
# configs/adapter/model/lora_qwen2.5_3b.yaml. Another method: bash scripts/run.sh <method> qwen2.5_3b adapter=lora
exec "$(dirname "${BASH_SOURCE[0]}")/run.sh" gtpo qwen2.5_3b adapter=lora "$@"
