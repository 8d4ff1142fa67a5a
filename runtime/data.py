"""Prompt sources and reward functions as the controller sees them.

A ``Records`` source is a list of rows (dicts with a ``prompt`` column and
whatever columns a reward reads). Batches are drawn by a seeded permutation
per epoch, so the rows of step *s* depend only on the seed and *s* — a resumed
run draws exactly what an uninterrupted one would.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from flowc.errors import DataError
from flowc.ir.functional import PromptBatch, Rollout
from flowc.runtime.reward_calls import RewardFn, score_reward


@dataclass
class Records:
    rows: list[dict[str, Any]]
    name: str = "data"
    prompt_key: str = "prompt"
    lines: list[int] | None = None  # each row's line (JSONL) or row number (Parquet, CSV, a split), for errors
    _orders: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)  # the last permutation

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
            order = self._order(seed, epoch)
            take = min(size - len(out), len(self.rows) - offset)
            out.extend(order[offset : offset + take])
            pos += take
        return out

    def _order(self, seed: int | str, epoch: int) -> list[int]:
        """Epoch ``epoch``'s permutation, shuffled once (a step draws a slice of it; shuffling
        20k rows took ~10 ms of every step's controller time)."""
        key = (str(seed), epoch)
        if self._orders.get("key") != key:
            order = list(range(len(self.rows)))
            random.Random(f"{seed}:{epoch}").shuffle(order)
            self._orders = {"key": key, "order": order}
        return self._orders["order"]

    def rows_named(self, indices: list[int], most: int = 4) -> str:
        """``file:line`` of the first ``most`` of these rows, and how many more."""
        shown = ", ".join(self.where(i) for i in indices[:most])
        return shown + (f" and {len(indices) - most} more" if len(indices) > most else "")

    def head(self, size: int | None) -> list[dict[str, Any]]:
        return self.rows if size is None else self.rows[:size]


Prompt = str | list[dict[str, Any]]  # text, or chat messages (role, content)


def is_chat(prompt: Any) -> bool:
    return isinstance(prompt, list)


def render_prompt(tok: Any, prompt: Prompt) -> str:
    """A chat prompt through the tokenizer's own chat template (with the generation prompt), or
    the text as it is (TRL's rule: only conversational prompts are templated)."""
    if not is_chat(prompt):
        return prompt  # type: ignore[return-value]
    if not getattr(tok, "chat_template", None):
        raise DataError(
            "a prompt is a list of chat messages, but the policy's tokenizer has no chat template",
            fix="use an instruct model's tokenizer (it ships a chat template), or give prompts as text",
        )
    return tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)


def encode_prompts(tok: Any, prompts: list[Prompt]) -> list[list[int]]:
    """Each prompt's token ids: text with the tokenizer's special tokens, a templated chat
    prompt as the template wrote it (its special tokens are in the text)."""
    out = []
    for p in prompts:
        if is_chat(p):
            out.append(tok(render_prompt(tok, p), add_special_tokens=False, truncation=False)["input_ids"])
        else:
            out.append(tok(p, truncation=False)["input_ids"])
    return out


def prompt_lengths(tok: Any, prompts: list[Prompt]) -> list[int]:
    """Each prompt's length in tokens, as :func:`tokenize_prompts` encodes it."""
    return [len(x) for x in encode_prompts(tok, prompts)]


def tokenize_prompts(tok: Any, prompts: list[Prompt], max_len: int) -> PromptBatch:
    """Left-padded prompt ids ``[B, max_len]`` (an error names a prompt that is too long)."""
    ids = encode_prompts(tok, prompts)
    lens = [len(x) for x in ids]
    if max(lens, default=0) > max_len:
        i = max(range(len(lens)), key=lens.__getitem__)
        raise DataError(
            f"prompt {prompts[i]!r} is {lens[i]} tokens, longer than the workload's prompt_len {max_len}",
            fix=f"raise it: --workload prompt_len={lens[i]}",
        )
    out = torch.full((len(ids), max_len), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(ids), max_len), dtype=torch.bool)
    for i, row in enumerate(ids):
        if row:
            out[i, max_len - len(row) :] = torch.tensor(row, dtype=torch.long)
            mask[i, max_len - len(row) :] = True
    return PromptBatch(out, mask)


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
    """Call a user's reward function and check what it returns: one score per response."""
    return torch.tensor(score_reward(fn, name, prompts, responses, columns)[0], dtype=torch.float32)
