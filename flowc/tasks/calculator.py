"""A built-in tool-using task: two-digit multiplication with a calculator.

Problems are ``a*b=`` with ``a, b`` in 10–99 (8,100 in all); the answer is the
product's digits. A fixed, seeded set of 500 is held out for evaluation;
training draws from the rest. The shipped tiny model cannot multiply in its
head, but it can call the calculator and copy its result.

A trajectory, as text (the tokenizer is character-level)::

    37*48=1776</s>                      a direct answer: one policy turn
    37*48=(37*48)1776|1776</s>          a tool call: policy turn 1 is ``(37*48)``
                                        (it ends at the stop token ``)``), the
                                        environment's observation ``1776|`` is
                                        appended (not the policy's tokens), and
                                        policy turn 2 is the answer ``1776</s>``

:class:`Calculator` is the environment (``reset``/``step``); its reward is 1.0
for an exact final answer. :func:`final_answer` scores a whole response text
the same way, for flows that score with a reward function instead.

The tokenizer is arithmetic's character-level one with ``*``, ``(``, ``)`` and
``|`` appended (ids 16–19; the first 16 ids are arithmetic's), so the shipped
model's 32-row vocabulary holds it.
"""

from __future__ import annotations

import random
import re
from importlib import resources
from pathlib import Path

from flowc.tasks.arithmetic import VOCAB as ARITH_VOCAB
from flowc.tasks.arithmetic import Problem
from flowc.tasks.arithmetic import build_tokenizer as _build_tokenizer
from flowc.tasks.arithmetic import records as records  # the same rows: "prompt" and "answer"

TOOL_CHARS = ("*", "(", ")", "|")
VOCAB = (*ARITH_VOCAB, *TOOL_CHARS)
EVAL_SIZE = 500
SEED = 20261203
CALL_OPEN, CALL_CLOSE, RESULT_END = "(", ")", "|"
# a tool call's expression: int op int, op in + - * (digits bounded, so no huge products)
_EXPR = re.compile(r"\s*(-?\d{1,9})\s*([-+*])\s*(-?\d{1,9})\s*")


def all_problems() -> list[Problem]:
    return [Problem(f"{a}*{b}=", str(a * b)) for a in range(10, 100) for b in range(10, 100)]


def split(seed: int = SEED) -> tuple[list[Problem], list[Problem]]:
    """(train, eval): a fixed, seeded hold-out of EVAL_SIZE problems."""
    problems = all_problems()
    rng = random.Random(seed)
    rng.shuffle(problems)
    return problems[EVAL_SIZE:], problems[:EVAL_SIZE]


def build_tokenizer():
    """The character-level tokenizer over arithmetic's vocabulary plus ``* ( ) |``."""
    return _build_tokenizer(VOCAB)


def evaluate(expr: str) -> int | None:
    """``int op int`` (op in + - *) evaluated without eval(); None when ``expr`` is not one."""
    m = _EXPR.fullmatch(expr)
    if m is None:
        return None
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return a + b if op == "+" else a - b if op == "-" else a * b


def tool_text(p: Problem) -> str:
    """The text after the prompt of a tool trajectory (policy and observation tokens alike):
    ``(37*48)1776|1776`` (EOS follows)."""
    expr = p.prompt.rstrip("=")
    return f"{CALL_OPEN}{expr}{CALL_CLOSE}{p.answer}{RESULT_END}{p.answer}"


class Calculator:
    """The environment: a policy turn ending in ``)`` is a calculator call whose result
    (``"<value>|"``, or ``"|"`` for a malformed call) is the next observation; any other turn
    is the final answer, rewarded 1.0 when it is exactly the answer."""

    stop: tuple[str, ...] = (CALL_CLOSE,)  # strings that end a policy turn besides EOS (one token each)
    max_turns: int = 3

    def __init__(self) -> None:
        self.record: dict | None = None

    def reset(self, record: dict) -> str:
        """Start an episode on ``record`` (``prompt`` and ``answer``); the first observation."""
        self.record = record
        return ""

    def step(self, action: str) -> tuple[str, float, bool, dict[str, float]]:
        """(observation, reward, done, metrics) after the policy's turn ``action`` (its text)."""
        if self.record is None:
            raise RuntimeError("Calculator.step before reset")
        if action.endswith(CALL_CLOSE):
            body = action[:-1]
            value = evaluate(body[1:]) if body.startswith(CALL_OPEN) else None
            if value is None:
                return RESULT_END, 0.0, False, {"tool_calls": 1.0, "tool_ok": 0.0}
            return f"{value}{RESULT_END}", 0.0, False, {"tool_calls": 1.0, "tool_ok": 1.0}
        correct = 1.0 if action.strip() == str(self.record["answer"]) else 0.0
        return "", correct, True, {"correct": correct}


def final_answer(prompts: list[str], responses: list[str], answer: list[str], **_: object) -> list[float]:
    """Reward: 1.0 when the text after the last ``|`` (the whole response when there is
    none), stripped, is exactly the answer."""
    return [1.0 if r.rsplit(RESULT_END, 1)[-1].strip() == a else 0.0 for r, a in zip(responses, answer, strict=True)]


def asset_dir() -> Path:
    """The shipped warm-started model (HF format: config, safetensors, tokenizer)."""
    return Path(str(resources.files("flowc.tasks").joinpath("assets/calc-tiny")))


__all__ = [
    "EVAL_SIZE",
    "VOCAB",
    "Calculator",
    "Problem",
    "all_problems",
    "asset_dir",
    "build_tokenizer",
    "evaluate",
    "final_answer",
    "records",
    "split",
    "tool_text",
]
