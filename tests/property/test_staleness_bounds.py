"""The pipelined loop never trains on rollouts older than its staleness bound, and never holds more
than K steps' rollouts ahead of the trainer: the controller's issue order (``runtime.ahead``)
played against an engine that runs its calls in the order issued, as a Ray actor does."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from flowc.runtime.ahead import issued_ahead


def play(staleness: int, steps: int, start: int = 0) -> tuple[list[int], int]:
    """Each step's lag (weight versions between its rollouts and the trainer) and the most steps
    issued ahead at once, with the controller's order: this step's rollouts (unless issued
    already), the steps ahead, then this step's weight sync — one queue the engine runs in order.
    ``start``: a run resumed at that step (``start`` syncs already done)."""
    queue: list[tuple[str, int]] = []
    issued: set[int] = set()
    most = 0
    for s in range(start, steps):
        if s not in issued:
            queue.append(("generate", s))
            issued.add(s)
        for t in issued_ahead(s, staleness, steps):
            if t not in issued:
                queue.append(("generate", t))
                issued.add(t)
        most = max(most, len([t for t in issued if t > s]))
        queue.append(("sync", s))
    version, sampled = start, {}
    for what, s in queue:  # the engine, one call after another
        if what == "generate":
            sampled[s] = version
        else:
            version += 1
    return [s - sampled[s] for s in range(start, steps)], most


@settings(max_examples=200, deadline=None)
@given(k=st.integers(0, 16), steps=st.integers(1, 60), start=st.integers(0, 30))
def test_the_lag_is_min_of_the_step_and_k_and_the_buffer_holds_at_most_k(k, steps, start):
    start = min(start, steps - 1)
    lags, most = play(k, steps, start)
    assert lags == [min(s - start, k) for s in range(start, steps)]  # never more than K, K once the pipe is full
    assert most <= k
    assert all(t < steps for s in range(steps) for t in issued_ahead(s, k, steps))  # nothing past the run's end


def test_lock_step_issues_nothing_ahead():
    assert all(not issued_ahead(s, 0, 10) for s in range(10))
    assert play(0, 10) == ([0] * 10, 0)
