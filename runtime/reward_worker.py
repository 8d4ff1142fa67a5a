"""The Ray actor that calls the run's reward functions in a process of its own.

Its module imports Ray and :mod:`flowc.runtime.reward_calls`, never torch: the process holds the
user's function and what it imports (a test checks it, for a plain and an adapted function).
"""

from __future__ import annotations

import os
from typing import Any

import ray

from flowc.runtime.reward_calls import RewardFn, score_reward


@ray.remote(num_cpus=0, max_restarts=0)
class RewardWorker:
    """Holds the run's reward functions; one call at a time."""

    def __init__(self, fns: dict[str, RewardFn], names: dict[str, str]) -> None:
        self.fns, self.names = fns, names

    def score(
        self, role: str, prompts: list[str], responses: list[str], columns: dict[str, list[Any]], offset: int = 0
    ) -> tuple[list[float], dict[str, float]]:
        return score_reward(self.fns[role], self.names.get(role, role), prompts, responses, columns, offset=offset)

    def pid(self) -> int:
        return os.getpid()

    def imported(self, module: str) -> bool:
        """Whether this process has imported ``module`` (tests: a reward process holds no torch)."""
        import sys

        return module in sys.modules


__all__ = ["RewardWorker"]
