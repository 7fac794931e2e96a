#!/usr/bin/env bash
# The device check (docs/backends.md): the torch backend on one CUDA GPU, in at most 8 minutes.
# Carries only the working tree (src/ and bench/, well under 64 MiB); needs torch with CUDA and
# transformers on the machine. Results in $OUT (the device tool's folder) or runs/device.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-runs/device}"
mkdir -p "$out"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
python -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'transformers', transformers.__version__)" | tee "$out/versions.txt"
PYTHONPATH=src timeout 470 python bench/device_check.py --device cuda --dtype bfloat16 --out "$out" 2>&1 | tee "$out/log.txt"
