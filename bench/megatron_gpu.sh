#!/usr/bin/env bash
# Megatron backend check, prepared for one H200 (or any one CUDA GPU with >= 40 GB):
#  1. the GPU tests: one Megatron update (distributed optimizer, schedule) equals one FSDP2 update;
#  2. PPO (actor, critic, reference, reward model) on a random-init model of Qwen2.5-0.5B's
#     shape, the same seed and steps with backend=fsdp2 and backend=megatron (tp=1 pp=1: one
#     GPU), generation with vLLM; prints both loss curves and their largest difference;
#  3. GRPO on a small random-init Qwen3-MoE through megatron (ep=1: experts need more GPUs
#     than one to split).
#
#   bash bench/megatron_gpu.sh           # results under ${OUT:-runs}/megatron-gpu
#
# Needs a CUDA build of torch, vLLM and megatron-core: pip install -e '.[vllm,megatron]'.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs}/megatron-gpu
STEPS=${STEPS:-4}
PORT=${PORT:-6392}
python - <<'PY'
import torch, megatron.core
assert torch.cuda.is_available(), "no CUDA device: this check is for a GPU machine"
print(f"torch {torch.__version__}, megatron-core {megatron.core.__version__}, {torch.cuda.get_device_name(0)}")
PY
python -m pytest -q -m gpu tests/integration/test_megatron_gpu.py
ray start --head --port="$PORT" --num-gpus=1 --num-cpus=8 --include-dashboard=false >/dev/null
trap 'ray stop --force >/dev/null 2>&1 || true' EXIT
rm -rf "$OUT" && mkdir -p "$OUT"
common=(--cluster "127.0.0.1:$PORT" --set init=random --rollout vllm --steps "$STEPS" --workload prompts=16,prompt_len=64,response_len=128 -q)
for backend in fsdp2 megatron; do
  flowc run examples/ppo.py --device H200 --model actor=qwen2.5-0.5b --model rm=qwen2.5-0.5b "${common[@]}" \
    --pin actor.train.backend=$backend --pin critic.train.backend=$backend \
    --pin ref.forward.backend=$backend --pin rm.forward.backend=$backend --out "$OUT/ppo-$backend"
done
cat > "$OUT/moe.json" <<'JSON'
{"model_type": "qwen3_moe", "hidden_size": 512, "intermediate_size": 1536, "moe_intermediate_size": 256,
 "num_experts": 16, "num_experts_per_tok": 4, "num_hidden_layers": 4, "num_attention_heads": 8,
 "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 32000, "tie_word_embeddings": false}
JSON
flowc run examples/grpo.py --device H200 --model actor="$OUT/moe.json" "${common[@]}" \
  --pin actor.train.backend=megatron --pin ref.forward.backend=megatron --out "$OUT/grpo-moe-megatron"
python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def rows(name):
    return [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines() if '"step_s"' in x]
f, m = rows("ppo-fsdp2"), rows("ppo-megatron")
print("| step | actor/pg_loss fsdp2 | megatron | critic/vf_loss fsdp2 | megatron | step s fsdp2 | megatron |")
print("|---:|---:|---:|---:|---:|---:|---:|")
for a, b in zip(f, m):
    print(f"| {a['step']} | {a['actor/pg_loss']:.5f} | {b['actor/pg_loss']:.5f} | {a['critic/vf_loss']:.5f} | {b['critic/vf_loss']:.5f} | {a['step_s']:.2f} | {b['step_s']:.2f} |")
for k in ("actor/pg_loss", "critic/vf_loss"):
    print(f"largest |fsdp2 - megatron| {k}: {max(abs(a[k] - b[k]) for a, b in zip(f, m)):.2e}")
print(f"megatron sync: {m[-1]['actor/sync_bytes_per_device'] / 1e9:.3f} GB measured, {m[-1]['actor/sync_bytes_predicted'] / 1e9:.3f} GB predicted")
g = rows("grpo-moe-megatron")
print("MoE GRPO (megatron): " + ", ".join(f"step {r['step']}: pg_loss {r['actor/pg_loss']:.4f}, {r['step_s']:.2f} s" for r in g))
PY
