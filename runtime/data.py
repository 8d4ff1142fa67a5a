"""Prompt sources and reward functions as the controller sees them.

A ``Records`` source is a list of rows (dicts with a ``prompt`` column and
whatever columns a reward reads). Batches are drawn by a seeded permutation
per epoch, so the rows of step *s* depend only on the seed and *s* — a resumed
run draws exactly what an uninterrupted one would.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from flowc.errors import DataError
from flowc.ir.functional import PromptBatch, Rollout

RewardFn = Callable[..., Sequence[float]]


@dataclass
class Records:
    rows: list[dict[str, Any]]
    name: str = "data"
    prompt_key: str = "prompt"
    lines: list[int] | None = None  # each row's line (JSONL) or row number (Parquet) in its file, for errors

    def where(self, i: int) -> str:
        """``file:line`` of row ``i``."""
        return f"{self.name}:{self.lines[i] if self.lines else i + 1}"

    def __post_init__(self) -> None:
        if not self.rows:
            raise DataError(f"{self.name} has no rows")
        if self.prompt_key not in self.rows[0]:
            cols = ", ".join(self.rows[0])
            raise DataError(
                f"{self.name} has no {self.prompt_key!r} column (columns: {cols})", fix="name the prompt column 'prompt'"
            )

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, step: int, size: int, seed: int | str) -> list[dict[str, Any]]:
        """Rows of step ``step`` (0-based): consecutive slices of per-epoch permutations."""
        return [self.rows[i] for i in self.batch_indices(step, size, seed)]

    def batch_indices(self, step: int, size: int, seed: int | str) -> list[int]:
        """The row numbers :meth:`batch` draws."""
        out: list[int] = []
        pos = step * size
        while len(out) < size:
            epoch, offset = divmod(pos, len(self.rows))
            order = list(range(len(self.rows)))
            random.Random(f"{seed}:{epoch}").shuffle(order)
            take = min(size - len(out), len(self.rows) - offset)
            out.extend(order[offset : offset + take])
            pos += take
        return out

    def rows_named(self, indices: list[int], most: int = 4) -> str:
        """``file:line`` of the first ``most`` of these rows, and how many more."""
        shown = ", ".join(self.where(i) for i in indices[:most])
        return shown + (f" and {len(indices) - most} more" if len(indices) > most else "")

    def head(self, size: int | None) -> list[dict[str, Any]]:
        return self.rows if size is None else self.rows[:size]


def prompt_lengths(tok: Any, prompts: list[str]) -> list[int]:
    """Each prompt's length in tokens, as :func:`tokenize_prompts` encodes it."""
    return [len(x) for x in tok(prompts, truncation=False)["input_ids"]]


def tokenize_prompts(tok: Any, prompts: list[str], max_len: int) -> PromptBatch:
    """Left-padded prompt ids ``[B, max_len]`` (an error names a prompt that is too long)."""
    lens = prompt_lengths(tok, prompts)
    if max(lens, default=0) > max_len:
        i = max(range(len(lens)), key=lens.__getitem__)
        raise DataError(
            f"prompt {prompts[i]!r} is {lens[i]} tokens, longer than the workload's prompt_len {max_len}",
            fix=f"raise it: --workload prompt_len={lens[i]}",
        )
    enc = tok(prompts, padding="max_length", max_length=max_len, truncation=False, return_tensors="pt")
    return PromptBatch(enc["input_ids"], enc["attention_mask"].bool())


def tokenize_pairs(
    tok: Any, prompts: list[str], chosen: list[str], rejected: list[str], prompt_len: int, response_len: int
) -> Rollout:
    """Preference pairs as a rollout of ``2B`` rows: ``2i`` prompt ``i`` + chosen, ``2i+1`` + rejected.

    Prompts are left-padded to ``prompt_len``; responses get EOS appended and
    are right-padded to ``response_len`` (a longer one is an error that says so)."""
    p = tokenize_prompts(tok, prompts, prompt_len)
    texts = [t for pair in zip(chosen, rejected, strict=True) for t in pair]
    ids = torch.full((len(texts), response_len), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(texts), response_len), dtype=torch.bool)
    for i, text in enumerate(texts):
        toks = [*tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id]
        if len(toks) > response_len:
            raise DataError(
                f"response {text!r} of pair {i // 2} is {len(toks)} tokens with EOS, longer than the workload's "
                f"response_len {response_len}",
                fix=f"raise it: --workload response_len={len(toks)}",
            )
        ids[i, : len(toks)] = torch.tensor(toks)
        mask[i, : len(toks)] = True
    rows = torch.arange(len(prompts)).repeat_interleave(2)
    return Rollout(p.input_ids[rows], p.attention_mask[rows], ids, mask, torch.zeros(ids.shape, dtype=torch.float32))


def call_reward(fn: RewardFn, name: str, prompts: list[str], responses: list[str], columns: dict[str, list[Any]]) -> torch.Tensor:
    """Call a user's reward function and check what it returns."""
    try:
        sig = inspect.signature(fn)
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        cols = columns if takes_kwargs else {k: v for k, v in columns.items() if k in sig.parameters}
        out = fn(prompts, responses, **cols)
    except DataError:
        raise
    except Exception as e:
        raise DataError(
            f"reward function {name} raised {type(e).__name__}: {e}",
            fix="it is called as fn(prompts: list[str], responses: list[str], **columns) and must return one float per response",
        ) from e
    try:
        scores = torch.as_tensor(list(out), dtype=torch.float32)
    except Exception as e:
        raise DataError(
            f"reward function {name} returned {type(out).__name__}, not a sequence of numbers",
            fix="return a list of floats, one per response",
        ) from e
    if scores.shape != (len(responses),):
        raise DataError(
            f"reward function {name} returned {tuple(scores.shape)} scores for {len(responses)} responses",
            fix="return one float per response",
        )
    if not torch.isfinite(scores).all():
        raise DataError(f"reward function {name} returned a non-finite score", fix="return finite floats")
    return scores
