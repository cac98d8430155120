#!/usr/bin/env bash
# GPU smoke check (CUDA machine; never run in CI). With vLLM installed (toolgym[vllm]): a few GRPO
# steps on SearchQA's train split with rollouts from an in-process vLLM engine, then an evaluation of
# the run's inference export through vLLM on the test split. Without vLLM: the demo (warm start, GRPO,
# held-out evaluation of base vs trained on 100 test questions) with the transformers policy and its
# learner on the GPU. Either way it prints tokens/s, steps/min and the weight-sync seconds per step.
#
#   bash bench/gpu_smoke.sh [OUT_DIR] [extra train overrides ...]
#   e.g. bash bench/gpu_smoke.sh runs/gpu-smoke policy.model=/models/Qwen2.5-0.5B-Instruct
set -euo pipefail
out=${1:-runs/gpu-smoke}
shift || true
python - <<'PY'
import sys
import torch
if not torch.cuda.is_available():
    sys.exit("gpu_smoke: torch sees no CUDA device; this check is for a GPU machine")
print("gpu:", torch.cuda.get_device_name(0), "| torch", torch.__version__)
PY
start=$(date +%s)
if python -c "import vllm" 2>/dev/null; then
  engine=vllm
  toolgym train --config gpu --out "$out" train.steps=6 train.checkpoint_every=3 heldout.n=0 "$@"
else
  echo "gpu_smoke: vllm is not installed (pip install 'toolgym[vllm]'): checking the transformers path"
  engine=hf
  toolgym train --config demo --out "$out" policy.learner_device=cuda heldout.engine=hf "$@"
fi
train_s=$(( $(date +%s) - start ))
python - "$out" "$train_s" <<'PY'
import json, sys
from pathlib import Path
rows = [json.loads(x) for x in (Path(sys.argv[1]) / "metrics.jsonl").read_text().splitlines() if x.strip()]
wall = float(sys.argv[2])
tokens = sum(r.get("loss/tokens", 0.0) for r in rows)
learn = sum(r.get("time/learn", 0.0) for r in rows)
sync = [r.get("time/weight_sync", 0.0) for r in rows]
print(f"steps: {len(rows)} in {wall:.0f} s wall (start-up included) -> {60 * len(rows) / wall:.2f} steps/min")
print(f"learner: {tokens:.0f} trained tokens in {learn:.1f} s -> {tokens / max(learn, 1e-9):.0f} tokens/s")
print("weight sync per step (s):", ", ".join(f"{s:.2f}" for s in sync))
print("reward/mean per step:", ", ".join(f"{r['reward/mean']:.3f}" for r in rows))
PY
if [ "$engine" = hf ]; then
  toolgym report "$out" | head -40
  echo "gpu_smoke: done in $(( $(date +%s) - start )) s"
  exit 0
fi
toolgym eval --env toolgym/SearchQA-v0 --env-arg split=test --env-arg max_turns=4 --env-arg metric=f1 \
  --policy "vllm:run:$out" --harness bare,scaffold --n 50 --max-tokens 256 --out "$out/eval-test"
echo "gpu_smoke: done in $(( $(date +%s) - start )) s"
