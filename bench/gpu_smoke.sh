#!/usr/bin/env bash
# GPU smoke check (CUDA machine; never run in CI). With vLLM installed (toolgym[vllm]): a few GRPO
# steps on SearchQA's train split with rollouts from an in-process vLLM engine, then an evaluation of
# the run's inference export through vLLM on the test split. Without vLLM: the demo (warm start, GRPO,
# held-out evaluation of base vs trained) with the transformers policy, sampler and learner on the
# GPU in bf16 with fp32 master weights. Either way it prints tokens/s, steps/min and the weight-sync
# seconds per step.
#
#   bash bench/gpu_smoke.sh [OUT_DIR] [extra train overrides ...]
#   e.g. bash bench/gpu_smoke.sh runs/gpu-smoke policy.model=/models/Qwen2.5-0.5B-Instruct
#
# A machine without network access: run `bash bench/gpu_pack.sh` first where pip works and send the
# repository with its .gpu/ folder. This script then installs .gpu/wheels (no index, no
# dependencies) and, unless policy.model is given, trains a randomly initialised model of the
# embedded SmolLM2-135M's shape (.gpu/model-shape): the throughput figures hold, the rewards mean
# nothing, so its groups are trained even without reward variance (the learner's work is timed).
#
# PYTHON picks the interpreter (default python3). TOOLGYM_SMOKE_DEVICE=cpu runs the same script on a
# machine without a GPU (fp32), to check the packing and the commands before a GPU is at hand;
# TOOLGYM_SMOKE_ENGINE=hf takes the transformers path even where vLLM is installed;
# TOOLGYM_SMOKE_PACK names the packed folder (default .gpu).
set -euo pipefail
out=${1:-runs/gpu-smoke}
shift || true
py=${PYTHON:-python3}
device=${TOOLGYM_SMOKE_DEVICE:-cuda}
pack=${TOOLGYM_SMOKE_PACK:-.gpu}
start=$(date +%s)
"$py" - "$device" <<'PY'
import sys
import torch
if sys.argv[1] == "cuda" and not torch.cuda.is_available():
    sys.exit("gpu_smoke: torch sees no CUDA device; this check is for a GPU machine (TOOLGYM_SMOKE_DEVICE=cpu: a dry run)")
name = torch.cuda.get_device_name(0) if sys.argv[1] == "cuda" else "none (dry run on CPU)"
print("gpu:", name, "| torch", torch.__version__)
PY
if [ -d "$pack/wheels" ]; then
  echo "gpu_smoke: installing $pack/wheels (no index, no dependencies)"
  "$py" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check "$pack"/wheels/*.whl
fi
"$py" -c "import toolgym, transformers; print('toolgym', toolgym.__version__, '| transformers', transformers.__version__)"
model=()
case " $* " in
  *" policy.model="*) ;;
  *)
    if [ -d "$pack/model-shape" ]; then
      shaped=${TMPDIR:-/tmp}/toolgym-smoke-model
      echo "gpu_smoke: a randomly initialised model of the embedded model's shape in $shaped"
      "$py" - "$pack/model-shape" "$shaped" <<'PY'
import shutil
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

shape, target = sys.argv[1:]
shutil.copytree(shape, target, dirs_exist_ok=True)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(shape)).save_pretrained(target)
PY
      model=("policy.model=$shaped" train.skip_zero_variance=false train.dynamic_sampling=false)
    fi
    ;;
esac
if [ "$device" = cuda ]; then dtype=bfloat16; else dtype=float32; fi
if [ "${TOOLGYM_SMOKE_ENGINE:-auto}" != hf ] && "$py" -c "import vllm" 2>/dev/null; then
  engine=vllm
  "$py" -m toolgym train --config gpu --out "$out" train.steps=6 train.checkpoint_every=3 heldout.n=0 \
    "${model[@]}" "$@"
else
  echo "gpu_smoke: vllm is not installed (pip install 'toolgym[vllm]'): checking the transformers path"
  engine=hf
  "$py" -m toolgym train --config demo --out "$out" policy.kind=hf \
    "policy.dtype=$dtype" "policy.learner_device=$device" heldout.engine=hf "${model[@]}" "$@"
fi
train_s=$(( $(date +%s) - start ))
"$py" - "$out" "$train_s" <<'PY'
import json, sys
from pathlib import Path
rows = [json.loads(x) for x in (Path(sys.argv[1]) / "metrics.jsonl").read_text().splitlines() if x.strip()]
wall = float(sys.argv[2])
tokens = sum(r.get("loss/tokens", 0.0) for r in rows)
learn = sum(r.get("time/learn", 0.0) for r in rows)
sync = [r.get("time/weight_sync", 0.0) for r in rows]
sampled = sum(r.get("response/tokens_mean", 0.0) for r in rows)
generate = sum(r.get("time/generate", 0.0) for r in rows)
print(f"steps: {len(rows)} in {wall:.0f} s wall (start-up, warm start and held-out included) -> {60 * len(rows) / wall:.2f} steps/min")
print(f"learner: {tokens:.0f} trained tokens in {learn:.1f} s -> {tokens / max(learn, 1e-9):.0f} tokens/s")
print(f"sampler: {sampled / max(len(rows), 1):.0f} tokens per episode in {generate / max(len(rows), 1):.2f} s -> {sampled / max(generate, 1e-9):.0f} tokens/s per episode")
print("weight sync per step (s):", ", ".join(f"{s:.2f}" for s in sync))
print("reward/mean per step:", ", ".join(f"{r['reward/mean']:.3f}" for r in rows))
PY
if [ "$engine" = hf ]; then
  "$py" -m toolgym report "$out" | head -40
  echo "gpu_smoke: done in $(( $(date +%s) - start )) s"
  exit 0
fi
"$py" -m toolgym eval --env toolgym/SearchQA-v0 --env-arg split=test --env-arg max_turns=4 --env-arg metric=f1 \
  --policy "vllm:run:$out" --harness bare,scaffold --n 50 --max-tokens 256 --out "$out/eval-test"
echo "gpu_smoke: done in $(( $(date +%s) - start )) s"
