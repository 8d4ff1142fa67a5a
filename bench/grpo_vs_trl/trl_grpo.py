"""TRL's side of the benchmark (runs in bench/.venv-trl, where TRL is installed).

    python trl_grpo.py --model DIR --steps K --lr LR [--bf16] --out result.json

GRPOTrainer on the built-in arithmetic task: the same prompts, reward,
batch (8 prompts x 8 samples), response limit, learning rate and steps as
flowc's side; no vLLM and no reference model (beta = 0).
"""

import argparse
import json
import random
import time

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer


def problems(seed):
    rows = []
    for a in range(100):
        for b in range(100):
            rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
            rows.append({"prompt": f"{a}-{b}=", "answer": str(a - b)})
    random.Random(seed).shuffle(rows)
    return rows


def exact_match(prompts, completions, answer, **_):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer, strict=True)]


class Timer(TrainerCallback):
    def __init__(self):
        self.starts, self.times = [], []

    def on_step_begin(self, args, state, control, **kw):
        self.starts.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kw):
        self.times.append(time.perf_counter() - self.starts[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--bf16", action="store_true", help="mixed precision (fp32 weights, bf16 autocast)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)
    ds = Dataset.from_list(problems(0)[: a.prompts * (a.steps + 2)])
    cfg = GRPOConfig(
        output_dir=f"{a.out}.trainer",
        per_device_train_batch_size=a.prompts * a.n,
        num_generations=a.n,
        max_completion_length=a.max_tokens,
        learning_rate=a.lr,
        max_steps=a.steps,
        beta=0.0,
        epsilon=0.2,
        num_iterations=1,
        temperature=1.0,
        loss_type="dapo",
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=a.bf16,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    timer = Timer()
    trainer = GRPOTrainer(
        model=model, reward_funcs=exact_match, args=cfg, train_dataset=ds, processing_class=tok, callbacks=[timer]
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    lengths = [h["completions/mean_length"] for h in logs]
    rewards = [h.get("reward", 0.0) for h in logs]
    json.dump(
        {"step_s": timer.times, "mean_length": lengths, "reward": rewards, "samples_per_step": a.prompts * a.n}, open(a.out, "w")
    )


if __name__ == "__main__":
    main()
