"""Build the shipped warm-start model of the arithmetic task.

    python -m flowc.tasks.make_checkpoint [--out DIR] [--target 0.30]

A tiny Qwen2 (the catalogue's ``flowc-tiny``: hidden 128, 2 layers) is
trained supervised on the training problems until its greedy accuracy on the
held-out set first reaches ``--target`` — deliberately short of good, so that
reinforcement learning has something to improve. Deterministic for a seed;
the result (HF format: config, safetensors, tokenizer) is what
``flowc.tasks.arithmetic.asset_dir()`` ships.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from flowc.ir.models import ModelSpec
from flowc.ir.sampling import SamplingParams
from flowc.runtime.modeling import load_causal_lm, positions
from flowc.runtime.sampling import sample
from flowc.tasks.arithmetic import Problem, asset_dir, build_tokenizer, split


def batch_for(tok, problems: list[Problem]):
    texts = [p.prompt + p.answer + tok.eos_token for p in problems]
    enc = tok(texts, padding=True, return_tensors="pt")
    prompt_lens = [len(tok(p.prompt)["input_ids"]) for p in problems]
    ids, mask = enc["input_ids"], enc["attention_mask"]
    labels = ids.clone()
    width = ids.shape[1]
    for i, (pl, m) in enumerate(zip(prompt_lens, mask.sum(-1).tolist(), strict=True)):
        pad = width - m
        labels[i, : pad + pl] = -100  # no loss on padding and prompt
    return ids, mask, labels


def accuracy(model, tok, problems: list[Problem], max_tokens: int = 6) -> float:
    model.eval()
    enc = tok([p.prompt for p in problems], padding=True, return_tensors="pt")
    out = sample(
        model,
        enc["input_ids"],
        enc["attention_mask"],
        SamplingParams(greedy=True),
        max_tokens=max_tokens,
        eos_id=tok.eos_token_id,
        pad_id=tok.pad_token_id,
    )
    texts = tok.batch_decode(out.response_ids, skip_special_tokens=True)
    model.train()
    return sum(t == p.answer for t, p in zip(texts, problems, strict=True)) / len(problems)


def training_args(ap: argparse.ArgumentParser, steps_flag: str, steps: int) -> None:
    """The options every shipped-model script takes: batch, learning rate, steps, seed."""
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument(steps_flag, type=int, default=steps)
    ap.add_argument("--seed", type=int, default=0)


def seeded(seed: int) -> random.Random:
    """Seed torch (2 threads, as the scripts' figures were measured) and return the batches' RNG."""
    torch.manual_seed(seed)
    torch.set_num_threads(2)
    return random.Random(seed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(asset_dir()))
    ap.add_argument("--target", type=float, default=0.30)
    training_args(ap, "--max-steps", 4000)
    args = ap.parse_args()
    rng = seeded(args.seed)
    tok = build_tokenizer()
    spec = ModelSpec.resolve("flowc-tiny")
    model = load_causal_lm(spec, seed=args.seed)
    train, held_out = split()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    t0 = time.time()
    last_acc = 0.0
    for step in range(1, args.max_steps + 1):
        ids, mask, labels = batch_for(tok, rng.sample(train, args.batch))
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        every = 5 if last_acc >= args.target / 2 else 25  # look closely near the target
        if step % every == 0:
            acc = last_acc = accuracy(model, tok, held_out)
            print(f"step {step}  loss {loss.item():.3f}  held-out accuracy {acc:.3f}  {time.time() - t0:.0f}s", flush=True)
            if acc >= args.target:
                break
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    print(f"saved {out}")


if __name__ == "__main__":
    main()
