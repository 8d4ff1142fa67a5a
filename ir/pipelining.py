"""The issue rules of a pipelined loop (staleness K): which later steps' rollouts the controller
issues during a step, and at which step it waits for a step's weight sync.

The runtime's controller follows them (``flowc.runtime.ahead``) and the planner prices the loop's
period by playing them (``flowc.passes.steady_period``), so both read this one definition.

During step ``s`` the controller issues the prompts and generates of steps ``s+1 … s+K`` (within
the run) before it issues step ``s``'s weight sync, and waits for that sync only in step ``s+K−1``
(:func:`sync_due_at`), so the trainer never waits for rollouts it does not train on next. Each
worker group runs its calls in the order issued, so step ``t``'s rollouts are sampled with the
weights of the syncs issued before them: at step ``t`` that is ``max(t − K, 0)`` syncs, a lag of
``min(t, K)`` versions, and at most ``K`` steps' rollouts wait issued ahead of the trainer (the
buffer's bound).
"""

from __future__ import annotations


def issued_ahead(step: int, staleness: int, steps: int) -> range:
    """The steps whose rollouts are issued during ``step`` of a ``steps``-step run, before its sync."""
    return range(step + 1, min(step + staleness, steps - 1) + 1)


def sync_due_at(step: int, staleness: int, steps: int) -> int:
    """The step at whose end the controller waits for (and checks) the weight sync of ``step``,
    issued under staleness ``staleness`` in a ``steps``-step run.

    The engine runs step ``s``'s sync after the generate of step ``s + K`` (issued before it), so
    waiting for it at the end of step ``s`` would hold the trainer until the rollouts of ``s + K``
    exist, though step ``s + 1`` needs only those of ``s + 1``: with K ≥ 2 a slow generate could
    not be absorbed by the buffer. The wait is therefore deferred to step ``s + K − 1``, just
    before the trainer needs step ``s + K``'s rollouts, which the engine finishes just before that
    sync anyway; the first generate the engine runs after the sync (of step ``s + K + 1`` or later,
    whatever K becomes) is trained on only after the check. Lock-step and K = 1 wait at the end of
    the step itself; the last step waits for every sync (nothing is issued ahead of it)."""
    return min(step + max(staleness, 1) - 1, steps - 1)


__all__ = ["issued_ahead", "sync_due_at"]
