#!/usr/bin/env bash
# Packs what bench/gpu_smoke.sh needs on a GPU machine that has torch and transformers but no network,
# and that receives the repository as a small copy (tens of MiB): run it here, then send the
# repository with its .gpu/ folder (git-ignored) and run bench/gpu_smoke.sh there.
#
#   bash bench/gpu_pack.sh [PYTHON]        PYTHON: an interpreter of the GPU machine's version
#                                          (default python3.12), with its headers, to build toolgym
#
# TOOLGYM_SMOKE_PACK: the folder to write (default .gpu, where gpu_smoke.sh looks);
# TOOLGYM_PACK_WHEELS=0 writes the model's shape alone (no build, no download).
#
# .gpu/wheels: toolgym's own wheel (built for PYTHON: its search kernel is compiled) and the
#   dependencies a torch + transformers image usually lacks (gymnasium, jsonschema and theirs), for
#   PYTHON's version on manylinux x86-64; installed there with `pip --no-index --no-deps`.
# .gpu/model-shape: the embedded SmolLM2-135M-Instruct's config, tokenizer and chat template without
#   its weights (the 98 MB model file does not fit such a copy): gpu_smoke.sh builds a randomly
#   initialised model of that shape there. Throughput (tokens/s, steps/min, weight-sync seconds) does
#   not depend on the weights' values; rewards do, so a random model's rewards mean nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-python3.12}
out=${TOOLGYM_SMOKE_PACK:-.gpu}
rm -rf "$out"
mkdir -p "$out/model-shape"

if [ "${TOOLGYM_PACK_WHEELS:-1}" != 0 ]; then
  version=$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  mkdir -p "$out/wheels"
  echo "gpu_pack: toolgym's wheel for Python $version"
  "$py" -m pip wheel -q --no-deps -w "$out/wheels" .
  echo "gpu_pack: dependencies for Python $version"
  platforms=()
  for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
  done
  python -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
    "${platforms[@]}" -d "$out/wheels" \
    gymnasium==1.4.0 farama-notifications==0.0.6 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 \
    referencing==0.37.0 rpds-py==0.30.0
fi

echo "gpu_pack: the embedded model's shape (config, tokenizer, chat template; no weights)"
python - "$out/model-shape" <<'PY'
import shutil
import sys
from pathlib import Path

from toolgym.agents.policies.models import smollm2_path

source, target = smollm2_path(show_progress=False), Path(sys.argv[1])
for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    if (source / name).is_file():
        shutil.copy2(source / name, target / name)
PY
du -sh "$out"
echo "gpu_pack: done; send the repository with $out/ and run: bash bench/gpu_smoke.sh runs/gpu-smoke"
echo "gpu_pack: the sampler benchmark from the same pack: python bench/gpu.py --device cuda --shapes 135m,1b --episodes 8,32,64 --shape-dir $out/model-shape --out runs/gpu.json"
