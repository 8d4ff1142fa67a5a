"""Which built-in task a flow runs when the user gives no data: arithmetic for single-turn flows,
the calculator tool task for flows with an environment (``fc.Environment``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowc.ir.graph import FlowGraph
from flowc.ir.ops import RoleKind


@dataclass(frozen=True)
class BuiltinTask:
    """A built-in task: its data, scoring, environment, shipped model and defaults."""

    name: str
    model: str  # the built-in model name a role without --model gets
    reward: tuple[Callable[..., Any], str]  # a Reward role's function and its name
    env: tuple[type, str] | None  # an Environment role's class and its name
    workload: str
    steps: int
    eval_every: int

    def split(self) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
        """(training rows, held-out rows)."""
        from flowc.tasks import arithmetic, calculator

        mod = calculator if self.name == "calculator" else arithmetic
        train, held = mod.split()
        return mod.records(train), mod.records(held)


def arithmetic_task() -> BuiltinTask:
    from flowc.tasks import arithmetic

    return BuiltinTask(
        "arithmetic",
        "flowc-tiny",
        (arithmetic.exact_match, "flowc.tasks.arithmetic:exact_match"),
        None,
        "prompts=64,prompt_len=8,response_len=6",
        800,  # ~7 minutes on 2 CPU cores; held-out accuracy rises by ~20 points (docs/runtime.md)
        20,
    )


def calculator_task() -> BuiltinTask:
    from flowc.tasks import calculator

    return BuiltinTask(
        "calculator",
        "flowc-calc-tiny",
        (calculator.final_answer, "flowc.tasks.calculator:final_answer"),
        (calculator.Calculator, "flowc.tasks.calculator:Calculator"),
        # a trajectory: "(37*48)" 7 tokens, "1776|" 5, "1776</s>" 5 — 17 of 20
        "prompts=32,prompt_len=8,response_len=20",
        200,
        20,
    )


def builtin_task(g: FlowGraph) -> BuiltinTask:
    """The task a flow runs on without ``--data``: the calculator when it has an environment."""
    if any(r.kind == RoleKind.ENVIRONMENT for r in g.roles.values()):
        return calculator_task()
    return arithmetic_task()


def builtin_model_dir(name: str, *, scores: bool = False) -> Path:
    """The shipped checkpoint of a built-in model name (``scores``: the arithmetic reward model)."""
    from flowc.tasks import arithmetic, calculator

    if name == "flowc-calc-tiny":
        return calculator.asset_dir()
    return arithmetic.reward_model_dir() if scores else arithmetic.asset_dir()
