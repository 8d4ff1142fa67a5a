"""Build the shipped warm-start model of the calculator task.

    python -m flowc.tasks.make_tool_checkpoint [--out DIR] [--tool-frac 0.25] [--seed 0]

The catalogue's ``flowc-tiny`` Qwen2 (hidden 128, 2 layers, a 32-row vocabulary
that holds the calculator's 20 tokens; randomly initialised, or started from the
arithmetic task's ``arith-tiny`` weights with ``--init arith``, which took twice
the steps) is trained supervised on a mixture of the training
problems: a fraction ``--tool-frac`` as tool trajectories
(``37*48=(37*48)1776|1776</s>``), the rest as direct answers
(``37*48=1776</s>``). The loss is on the policy's tokens only: the prompt,
padding and the calculator's observation (``1776|``) get no loss.

Every ``--eval-every`` steps the held-out problems are played with a small
agent loop (sample a turn up to EOS or ``)``, :meth:`Calculator.step`, append
the observation, continue; at most ``Calculator.max_turns`` turns), greedily and
sampled at temperature 1. Training stops at the first evaluation where the
sampled tool-use rate is within ``--tool-rate``, the tool is used well (accuracy
when used ≥ ``--min-tool-acc``) and direct answers are mostly wrong (accuracy
when not used ≤ ``--max-direct-acc``): a policy that calls the calculator
sometimes and right, so reinforcement learning has tool use to raise.
Deterministic for a seed; the result (HF format: config, safetensors,
tokenizer) is what ``flowc.tasks.calculator.asset_dir()`` ships.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from flowc.ir.models import ModelSpec
from flowc.ir.sampling import SamplingParams
from flowc.runtime.modeling import load_causal_lm, positions
from flowc.runtime.sampling import sample
from flowc.tasks import arithmetic
from flowc.tasks.calculator import Calculator, Problem, asset_dir, build_tokenizer, split, tool_text
from flowc.tasks.make_checkpoint import seeded, training_args

TURN_TOKENS = 8  # a turn's token limit: "(99*99)" is 7 tokens, "9801</s>" 5


def encode(tok, text: str) -> list[int]:
    """Token ids of ``text`` without BOS (the tokenizer is character-level)."""
    return tok(text, add_special_tokens=False)["input_ids"]


def example(tok, p: Problem, use_tool: bool) -> tuple[list[int], list[int]]:
    """(ids, labels) of one trajectory: BOS, the prompt, then the policy's turns (labelled)
    and the calculator's observation (label -100)."""
    ids = [tok.bos_token_id, *encode(tok, p.prompt)]
    labels = [-100] * len(ids)
    if use_tool:
        call, obs = f"({p.prompt.rstrip('=')})", f"{p.answer}|"  # "(37*48)", "1776|"
        assert call + obs + p.answer == tool_text(p)
        for text, learn in ((call, True), (obs, False)):
            piece = encode(tok, text)
            ids += piece
            labels += piece if learn else [-100] * len(piece)
    answer = [*encode(tok, p.answer), tok.eos_token_id]
    return ids + answer, labels + answer


def batch_for(tok, problems: list[Problem], tool: list[bool]):
    """Left-padded ids, mask and labels (-100 on padding, prompt and observations)."""
    rows = [example(tok, p, t) for p, t in zip(problems, tool, strict=True)]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r_ids, r_labels) in enumerate(rows):
        n = len(r_ids)
        ids[i, width - n :] = torch.tensor(r_ids)
        labels[i, width - n :] = torch.tensor(r_labels)
        mask[i, width - n :] = 1
    return ids, mask, labels


@dataclass
class Episode:
    correct: float = 0.0
    tool_calls: int = 0
    tool_ok: int = 0
    text: str = ""  # everything after the prompt, observations included


def left_pad(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask


@torch.no_grad()
def play(model, tok, problems: list[Problem], *, greedy: bool, seed: int = 0) -> list[Episode]:
    """Each problem played with the calculator: a policy turn is sampled up to EOS or a stop
    token (the sampler stops at EOS only: a turn is cut at its first stop token, and the
    tokens drawn after it are dropped, which is the same draw, as a token depends only on its
    row's seed and position), :meth:`Calculator.step` scores it or answers the call, and the
    observation is appended to the context of the next turn."""
    was_training = model.training
    model.eval()
    stop_ids = {tok.eos_token_id, *(tok.convert_tokens_to_ids(s) for s in Calculator.stop)}
    envs = [Calculator() for _ in problems]
    eps = [Episode() for _ in problems]
    ctx = []
    for env, p in zip(envs, problems, strict=True):
        first = env.reset({"prompt": p.prompt, "answer": p.answer})
        ctx.append([tok.bos_token_id, *encode(tok, p.prompt + first)])
    live = list(range(len(problems)))
    sp = SamplingParams(greedy=True) if greedy else SamplingParams(temperature=1.0)
    for turn in range(Calculator.max_turns):
        if not live:
            break
        ids, mask = left_pad([ctx[i] for i in live], tok.pad_token_id)
        seeds = None if greedy else torch.tensor([(seed * 1_000_003 + i * 7 + turn) % 2**31 for i in live])
        out = sample(
            model,
            ids,
            mask,
            sp,
            max_tokens=TURN_TOKENS,
            eos_id=tok.eos_token_id,
            pad_id=tok.pad_token_id,
            seeds=seeds,
        )
        still = []
        for row, i in enumerate(live):
            resp = out.response_ids[row][out.response_mask[row]].tolist()
            cut = next((k + 1 for k, t in enumerate(resp) if t in stop_ids), len(resp))
            resp = resp[:cut]
            action = tok.decode(resp, skip_special_tokens=True)
            obs, reward, done, metrics = envs[i].step(action)
            eps[i].tool_calls += int(metrics.get("tool_calls", 0))
            eps[i].tool_ok += int(metrics.get("tool_ok", 0))
            eps[i].text += action + obs
            if done:
                eps[i].correct = reward
            else:
                ctx[i] += resp + encode(tok, obs)
                still.append(i)
        live = still
    model.train(was_training)
    return eps


def report(model, tok, problems: list[Problem], seed: int) -> dict[str, float]:
    """Greedy accuracy; sampled (temperature 1) tool-use rate, accuracy, and accuracy with
    and without the tool; the share of calls that were well-formed."""
    greedy = play(model, tok, problems, greedy=True)
    sampled = play(model, tok, problems, greedy=False, seed=seed)
    used = [e for e in sampled if e.tool_calls]
    direct = [e for e in sampled if not e.tool_calls]
    calls = sum(e.tool_calls for e in sampled)

    def mean(xs):
        return sum(xs) / len(xs) if xs else float("nan")

    return {
        "greedy_acc": mean([e.correct for e in greedy]),
        "greedy_tool_rate": mean([float(e.tool_calls > 0) for e in greedy]),
        "tool_rate": len(used) / len(sampled),
        "sampled_acc": mean([e.correct for e in sampled]),
        "acc_tool": mean([e.correct for e in used]),
        "acc_direct": mean([e.correct for e in direct]),
        "calls_ok": sum(e.tool_ok for e in sampled) / calls if calls else float("nan"),
    }


def fmt(m: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.3f}" for k, v in m.items())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(asset_dir()))
    ap.add_argument(
        "--init",
        default="scratch",
        help="'scratch' (--model, randomly initialised), 'arith' (the arith-tiny weights), or a model directory",
    )
    ap.add_argument("--model", default="flowc-tiny", help="the catalogue model when --init scratch")
    ap.add_argument("--tool-frac", type=float, default=0.25)
    ap.add_argument("--tool-rate", type=float, nargs=2, default=(0.15, 0.40), metavar=("LO", "HI"))
    ap.add_argument("--min-tool-acc", type=float, default=0.95)
    ap.add_argument("--max-direct-acc", type=float, default=0.3)
    ap.add_argument("--eval-every", type=int, default=50)
    training_args(ap, "--max-steps", 6000)
    args = ap.parse_args()
    rng = seeded(args.seed)
    tok = build_tokenizer()
    if args.init == "scratch":
        model = load_causal_lm(ModelSpec.resolve(args.model), seed=args.seed)
    else:
        model = load_causal_lm(arithmetic.asset_dir() if args.init == "arith" else args.init)
    if model.config.vocab_size < len(tok):
        sys.exit(f"the model's vocabulary ({model.config.vocab_size}) is smaller than the tokenizer's ({len(tok)})")
    model.train()
    train, held_out = split()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    t0 = time.time()
    lo, hi = args.tool_rate
    done = None
    for step in range(1, args.max_steps + 1):
        problems = rng.sample(train, args.batch)
        tool = [rng.random() < args.tool_frac for _ in problems]
        ids, mask, labels = batch_for(tok, problems, tool)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask)).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % args.eval_every == 0:
            m = report(model, tok, held_out, seed=args.seed)
            print(f"step {step}  loss {loss.item():.3f}  {fmt(m)}  {time.time() - t0:.0f}s", flush=True)
            if lo <= m["tool_rate"] <= hi and m["acc_tool"] >= args.min_tool_acc and m["acc_direct"] <= args.max_direct_acc:
                done = m
                break
    if done is None:
        sys.exit(f"no evaluation met the targets in {args.max_steps} steps; nothing saved")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out, save_jinja_files=False)  # the chat template in tokenizer_config.json, as arith-tiny
    print(f"saved {out}  ({fmt(done)}; {time.time() - t0:.0f}s)")


if __name__ == "__main__":
    main()
