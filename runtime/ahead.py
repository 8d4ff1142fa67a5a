"""The controller's state for a pipelined loop (staleness K): the rollouts issued ahead and the weight
syncs not waited for yet, by the issue rules of :mod:`flowc.ir.pipelining`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from flowc.errors import RuntimeFailure
from flowc.ir.pipelining import issued_ahead, sync_due_at

T = TypeVar("T")


@dataclass
class PendingSync(Generic[T]):
    """A weight sync issued and not waited for yet: its step, the staleness it was issued under,
    what it returns (``refs``) and the trainer's side of its probe, when the trainer returned it apart."""

    step: int
    staleness: int
    sync: T
    refs: list[Any]
    trainer_probe: list[float] | None = None


@dataclass
class SyncQueue(Generic[T]):
    """The weight syncs issued and not yet waited for, in the order issued.

    The controller takes the due ones (:func:`sync_due_at`) twice a step: before it issues the
    step's own syncs — so that an object-store sync holds at most ``max(K − 1, 1)`` exported copies
    of the weights in the store at once, as many as lock-step at K ≤ 2 — and at the step's end,
    where it reports and checks everything taken during the step."""

    steps: int
    pending: list[PendingSync[T]] = field(default_factory=list)
    taken: list[PendingSync[T]] = field(default_factory=list)  # due this step, not reported yet

    def add(self, q: PendingSync[T]) -> None:
        self.pending.append(q)

    def take_due(self, step: int) -> list[PendingSync[T]]:
        """The pending syncs due by the end of ``step`` (those it has not taken already), in order,
        with every one issued before a due one (the engine ran them first: a sync issued under a
        larger K, then K lowered, is not checked after a later one)."""
        due = [i for i, q in enumerate(self.pending) if sync_due_at(q.step, q.staleness, self.steps) <= step]
        n = due[-1] + 1 if due else 0
        now, self.pending = self.pending[:n], self.pending[n:]
        self.taken += now
        return now

    def report(self) -> list[PendingSync[T]]:
        """Everything taken since the last report, in the order issued."""
        out, self.taken = self.taken, []
        return out

    def flush(self) -> list[PendingSync[T]]:
        """Every sync issued and not reported (a run that stops before its last step)."""
        out, self.taken, self.pending = self.taken + self.pending, [], []
        return out


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


__all__ = ["PendingSync", "RolloutBuffer", "SyncQueue", "issued_ahead", "sync_due_at"]
