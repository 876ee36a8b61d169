#!/usr/bin/env bash
# Asynchronous D3D on CUDA with random weights: verify time, packed-draft time and achieved overlap for a
# Qwen3-8B-shaped target and a 5-layer drafter (one GPU with two streams; two GPUs if present).
# Needs only this repository installed (pip install -e .); finishes in a few minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-results}
mkdir -p "$out"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
timeout 240 python scripts/gpu_check.py --shape qwen3-8b --device cuda:0 --draft-layers 5 --json "$out/gpu_check_1gpu.json"
if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  timeout 120 python scripts/gpu_check.py --shape qwen3-8b --device cuda:0 --draft-device cuda:1 --draft-layers 5 \
    --json "$out/gpu_check_2gpu.json"
fi
