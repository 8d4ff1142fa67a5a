"""Which steps' rollouts the controller issues ahead of the trainer (staleness K).

During step ``s`` the controller issues the prompts and generates of steps ``s+1 … s+K`` (within
the run) before it issues step ``s``'s weight sync. Each worker group runs its calls in the order
issued, so step ``t``'s rollouts are sampled with the weights of the syncs issued before them: at
step ``t`` that is ``max(t − K, 0)`` syncs, a lag of ``min(t, K)`` versions, and at most ``K``
steps' rollouts wait issued ahead of the trainer (the buffer's bound).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from flowc.errors import RuntimeFailure

T = TypeVar("T")


def issued_ahead(step: int, staleness: int, steps: int) -> range:
    """The steps whose rollouts are issued during ``step`` of a ``steps``-step run, before its sync."""
    return range(step + 1, min(step + staleness, steps - 1) + 1)


@dataclass
class RolloutBuffer(Generic[T]):
    """The later steps' rollouts issued ahead of the trainer (staleness K), each with the K it was
    issued under: a re-plan may lower K while they wait, and their lag stays within that."""

    waiting: dict[int, T] = field(default_factory=dict)
    issued_under: dict[int, int] = field(default_factory=dict)
    ran_ahead: bool = False  # the run has issued ahead (its lag and buffer are reported, also after K drops to 0)

    def take(self, step: int) -> T | None:
        """Step ``step``'s rollouts, when they were issued ahead."""
        return self.waiting.pop(step, None)

    def fill(self, step: int, staleness: int, steps: int, issue: Callable[[int], T]) -> None:
        """During ``step``, issue the rollouts of every later step up to ``step + staleness`` not issued yet."""
        self.ran_ahead = self.ran_ahead or staleness > 0
        for s in issued_ahead(step, staleness, steps):
            if s not in self.waiting:
                self.waiting[s] = issue(s)
                self.issued_under[s] = staleness

    def lag(self, step: int, staleness: int, version: int, node: str, loaded: int) -> int:
        """How many weight versions behind the trainer ``node`` sampled step ``step``'s rollouts
        (with weight ``version``, after ``loaded`` syncs its engine reported): at most the staleness
        they were issued under, else a flowc bug (a sync that did not reach the engine, calls out
        of order) fails the run."""
        bound = max(staleness, self.issued_under.get(step, 0))
        lag = step - version
        if not 0 <= lag <= bound:
            raise RuntimeFailure(
                f"step {step + 1}: {node} sampled with weight version {version} (its engine had loaded {loaded} weight"
                f" syncs), {lag} version(s) behind the trainer; staleness={bound} allows 0{f' to {bound}' if bound else ''}",
                fix="this is a flowc bug (a weight sync that did not reach the engine, or calls out of order); report it",
            )
        return lag

    def trained(self, step: int) -> None:
        """Step ``step`` has trained on its rollouts."""
        self.issued_under.pop(step, None)


__all__ = ["RolloutBuffer", "issued_ahead"]
