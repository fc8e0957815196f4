#!/bin/bash
# Measured vs predicted peak memory and throughput on one CUDA GPU (see benchmarks/gpu_check.py).
# Writes benchmarks/results/gpu_check.md and .json. Designed to finish in under 8 minutes on an
# A100/H100-class GPU: DeepSpeed kernels are JIT-built first, then >= 10 short `memkit verify`
# runs of llama-3.2-1b (built from its config, fresh weights) until the time budget is spent.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
# Variable-length LoRA steps with and without expandable segments (measured vs memkit's replay).
python benchmarks/gpu_check_varlen.py || true
exec python benchmarks/gpu_check.py "$@"
