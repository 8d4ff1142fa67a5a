"""Build the shipped reward model of the arithmetic task.

    python -m flowc.tasks.make_reward_model [--out DIR] [--steps 600]

A ``Qwen2ForSequenceClassification`` with one label, its trunk warm-started
from the shipped policy (``arith-tiny``), trained with the Bradley–Terry loss
to score a right answer above a wrong one: a near miss (off by 1–10), a random
number, a digit dropped or added, or an empty answer. Each sequence is the
prompt, the answer and EOS, scored at its last token — as flowc's reward-model
role and transformers both score it. Deterministic for a seed; the result (HF
format, with the tokenizer) is what ``reward_model_dir()`` ships and what a
flow's ``fc.RewardModel`` role uses on the built-in task.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from flowc.tasks.arithmetic import Problem, asset_dir, build_tokenizer, reward_model_dir, split
from flowc.tasks.make_checkpoint import seeded, training_args


def wrong_answer(p: Problem, rng: random.Random) -> str:
    """A plausible mistake a policy makes."""
    right = int(p.answer)
    kind = rng.randrange(5)
    if kind == 0:
        return str(right + rng.choice([-1, 1]) * rng.randint(1, 10))
    if kind == 1:
        return str(rng.randint(-99, 198))
    if kind == 2 and len(p.answer.lstrip("-")) > 1:
        return p.answer[:-1]
    if kind == 3:
        return p.answer + str(rng.randrange(10))
    return "" if kind == 4 else str(right + rng.choice([-1, 1]))


def encode(tok, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tok([t + tok.eos_token for t in texts], padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def scores(model, tok, texts: list[str]) -> torch.Tensor:
    """One score per text (left-padded, so the last column is every row's EOS)."""
    from flowc.runtime.modeling import positions

    ids, mask = encode(tok, texts)
    return model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits[:, 0]


def pair_accuracy(model, tok, problems: list[Problem], seed: int) -> float:
    rng = random.Random(seed)
    with torch.no_grad():
        good = scores(model, tok, [p.prompt + p.answer for p in problems])
        bad = scores(model, tok, [p.prompt + wrong_answer(p, rng) for p in problems])
    return float((good > bad).float().mean())


def main() -> None:
    from transformers import AutoModelForSequenceClassification

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(reward_model_dir()))
    training_args(ap, "--steps", 600)
    args = ap.parse_args()
    rng = seeded(args.seed)
    tok = build_tokenizer()
    model = AutoModelForSequenceClassification.from_pretrained(str(asset_dir()), num_labels=1)
    model.config.pad_token_id = tok.pad_token_id
    torch.nn.init.zeros_(model.score.weight)
    train, held_out = split()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    t0 = time.time()
    for step in range(1, args.steps + 1):
        batch = rng.sample(train, args.batch)
        good = scores(model, tok, [p.prompt + p.answer for p in batch])
        bad = scores(model, tok, [p.prompt + wrong_answer(p, rng) for p in batch])
        loss = -F.logsigmoid(good - bad).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == args.steps:
            acc = pair_accuracy(model, tok, held_out, args.seed)
            print(f"step {step}  loss {loss.item():.3f}  held-out pair accuracy {acc:.3f}  {time.time() - t0:.0f}s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    print(f"saved {out}")


if __name__ == "__main__":
    main()
