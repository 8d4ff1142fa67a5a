"""Which steps' rollouts the controller issues ahead of the trainer (staleness K).

During step ``s`` the controller issues the prompts and generates of steps ``s+1 … s+K`` (within
the run) before it issues step ``s``'s weight sync, and waits for that sync only at the end of step
``s+K−1`` (:func:`syncs_due`), so the trainer never waits for rollouts it does not train on next. Each worker group runs its calls in the order
issued, so step ``t``'s rollouts are sampled with the weights of the syncs issued before them: at
step ``t`` that is ``max(t − K, 0)`` syncs, a lag of ``min(t, K)`` versions, and at most ``K``
steps' rollouts wait issued ahead of the trainer (the buffer's bound).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from flowc.errors import RuntimeFailure

T = TypeVar("T")


def issued_ahead(step: int, staleness: int, steps: int) -> range:
    """The steps whose rollouts are issued during ``step`` of a ``steps``-step run, before its sync."""
    return range(step + 1, min(step + staleness, steps - 1) + 1)


def syncs_due(step: int, staleness: int, steps: int) -> int:
    """The last step whose weight sync the controller waits for (and checks) at the end of ``step``.

    The engine runs step ``s``'s sync after the generate of step ``s + K`` (issued before it), so
    waiting for it at the end of step ``s`` would hold the trainer until the rollouts of ``s + K``
    exist, though step ``s + 1`` needs only those of ``s + 1``: with K ≥ 2 a slow generate could
    not be absorbed by the buffer. The wait is therefore deferred to the end of step ``s + K − 1``,
    just before the trainer needs step ``s + K``'s rollouts, which the engine finishes just before
    that sync anyway. Lock-step and K = 1 wait at the end of the step itself; the last step waits
    for every sync (nothing is issued ahead of it)."""
    return step if step >= steps - 1 else step - max(staleness, 1) + 1


@dataclass
class PendingSync(Generic[T]):
    """A weight sync issued and not waited for yet (:func:`syncs_due`): its step, what it returns
    (``refs``) and the trainer's side of its probe, when the trainer returned it apart."""

    step: int
    sync: T
    refs: list[Any]
    trainer_probe: list[float] | None = None


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


__all__ = ["PendingSync", "RolloutBuffer", "issued_ahead", "syncs_due"]
