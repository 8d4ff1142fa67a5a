#!/usr/bin/env bash
# GPU smoke check, prepared for one H200 (or any one CUDA GPU with >= 40 GB):
# GRPO on a random-init model of Qwen2.5-0.5B's shape, vLLM generation and FSDP2
# training co-located on the one GPU, a few steps; prints generation tokens/s,
# training tokens/s, weight-sync seconds (measured beside the planner's
# prediction) and the device memory in use. Must finish within a few minutes.
#
#   bash bench/gpu_smoke.sh            # results under ${OUT:-runs}/gpu-smoke
#
# Needs a CUDA build of torch and vLLM: pip install -e '.[vllm]' (not the CPU build).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs}
STEPS=${STEPS:-6}
PORT=${PORT:-6391}
python - <<'EOF'
import torch, vllm
assert torch.cuda.is_available(), "no CUDA device: this check is for a GPU machine"
print(f"torch {torch.__version__}, vllm {vllm.__version__}, {torch.cuda.get_device_name(0)}")
EOF
ray start --head --port="$PORT" --num-gpus=1 --num-cpus=8 --include-dashboard=false >/dev/null
trap 'ray stop --force >/dev/null 2>&1 || true' EXIT
rm -rf "$OUT/gpu-smoke"
flowc run examples/grpo.py --device H200 \
  --cluster "127.0.0.1:$PORT" --model actor=qwen2.5-0.5b --set init=random --rollout vllm \
  --steps "$STEPS" --workload prompts=32,prompt_len=64,response_len=256 \
  --out "$OUT/gpu-smoke" -q
python - "$OUT/gpu-smoke" <<'EOF'
import json, statistics, sys
from pathlib import Path
run = Path(sys.argv[1])
rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if '"step_s"' in x][1:]  # step 1 warms up
plan = json.loads((run / "plan.json").read_text())
w = plan["workload"]
med = lambda k: statistics.median(r[k] for r in rows)
train_tokens = [w["prompts"] * 8 * (w["prompt_len"] + r["response_length/mean"]) for r in rows]  # n=8 samples a prompt
print("| metric | value |\n|---|---:|")
print(f"| generation tokens/s | {statistics.median(r['gen_tokens'] / r['measured_s']['actor.generate'] for r in rows):.0f} |")
print(f"| training tokens/s | {statistics.median(t / r['measured_s']['actor.update'] for t, r in zip(train_tokens, rows)):.0f} |")
print(f"| weight sync | {med('actor/sync_s'):.3f} s measured, {rows[-1]['predicted_s']['actor.weight_sync']:.3f} s predicted |")
print(f"| sync bytes per device | {med('actor/sync_bytes_per_device') / 1e9:.2f} GB measured, {rows[-1]['actor/sync_bytes_predicted'] / 1e9:.2f} GB predicted |")
print(f"| step | {med('step_s'):.2f} s measured, {plan['predicted']['step_time_s']:.2f} s predicted |")
print(f"| device memory in use (max after an op) | {max(r.get('device_gb', 0) for r in rows):.1f} GB |")
EOF
