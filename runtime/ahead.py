"""Which steps' rollouts the controller issues ahead of the trainer (staleness K).

During step ``s`` the controller issues the prompts and generates of steps ``s+1 … s+K`` (within
the run) before it issues step ``s``'s weight sync. Each worker group runs its calls in the order
issued, so step ``t``'s rollouts are sampled with the weights of the syncs issued before them: at
step ``t`` that is ``max(t − K, 0)`` syncs, a lag of ``min(t, K)`` versions, and at most ``K``
steps' rollouts wait issued ahead of the trainer (the buffer's bound).
"""

from __future__ import annotations


def issued_ahead(step: int, staleness: int, steps: int) -> range:
    """The steps whose rollouts are issued during ``step`` of a ``steps``-step run, before its sync."""
    return range(step + 1, min(step + staleness, steps - 1) + 1)


__all__ = ["issued_ahead"]
