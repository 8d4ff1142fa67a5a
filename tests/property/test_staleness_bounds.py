"""The pipelined loop never trains on rollouts older than its staleness bound, and never holds more
than K steps' rollouts ahead of the trainer: the controller's issue order (``runtime.ahead``)
played against an engine that runs its calls in the order issued, as a Ray actor does."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowc.passes.steady_period import play as play_planned
from flowc.runtime.ahead import PendingSync, SyncQueue, issued_ahead


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


def timed(gen: list[float], train: list[float], k: int, sync: float, *, deferred: bool = True) -> list[float]:
    """When each step of the pipelined loop ends (the controller moves on), with the generate of
    step ``s`` taking ``gen[s]``, the trainer's ops of step ``s`` ``train[s]`` and a weight sync
    ``sync`` on the engine. The engine runs its calls in the order issued; the controller issues a
    step's generates at its start and its sync when the trainer is done (and the syncs due in the
    step before it: :class:`SyncQueue`), and at the step's end waits for the syncs due by then
    (``deferred``) or for the step's own (the loop before)."""
    steps = len(gen)
    engine_free = 0.0

    def on_engine(issued_at: float, seconds: float) -> float:
        nonlocal engine_free
        engine_free = max(issued_at, engine_free) + seconds
        return engine_free

    gen_end: dict[int, float] = {}
    sync_end: dict[int, float] = {}
    clock = trainer = 0.0
    queue: SyncQueue[None] = SyncQueue(steps)
    ends = []
    for s in range(steps):
        for t in [s, *issued_ahead(s, k, steps)]:
            if t not in gen_end:
                gen_end[t] = on_engine(clock, gen[t])
        trainer = max(clock, gen_end[s], trainer) + train[s]
        if not deferred:
            sync_end[s] = on_engine(trainer, sync)
            clock = max(trainer, sync_end[s])
        else:
            issued_at = max([trainer, *(sync_end[q.step] for q in queue.take_due(s))])
            sync_end[s] = on_engine(issued_at, sync)
            queue.add(PendingSync(s, k, None, []))
            queue.take_due(s)
            clock = max([issued_at, *(sync_end[q.step] for q in queue.report())])
        ends.append(clock)
    return ends


seconds = st.floats(0.01, 10.0)


@settings(max_examples=300, deadline=None)
@given(k=st.integers(1, 6), sync=st.floats(0.0, 1.0), data=st.data())
def test_a_step_waits_only_for_its_own_training_and_the_next_steps_rollouts(k, sync, data):
    """With the sync waits deferred, the controller leaves step s as soon as its own training is done
    and the rollouts of step s+1 exist (with the one sync the engine runs after them) — never for a
    generate further ahead, whatever the times; and the run is never slower than waiting for each
    step's own sync (the loop before), at K = 1 exactly as fast."""
    steps = data.draw(st.integers(2, 12))
    gen = data.draw(st.lists(seconds, min_size=steps, max_size=steps))
    train = data.draw(st.lists(seconds, min_size=steps, max_size=steps))
    ends = timed(gen, train, k, sync)
    before = timed(gen, train, k, sync, deferred=False)
    assert ends[-1] <= before[-1] + 1e-9
    if k == 1:
        assert ends == before
    # replay to read each step's trainer end and the next generate's end
    engine_free, gen_end, clock, trainer = 0.0, {}, 0.0, 0.0
    for s in range(steps - 1):
        for t in [s, *issued_ahead(s, k, steps)]:
            if t not in gen_end:
                engine_free = gen_end[t] = max(clock, engine_free) + gen[t]
        trainer = max(clock, gen_end[s], trainer) + train[s]
        engine_free = max(trainer, engine_free) + sync
        assert ends[s] <= max(trainer, gen_end[s + 1]) + sync + 1e-9
        clock = ends[s]


@settings(max_examples=300, deadline=None)
@given(k=st.integers(0, 6), sync=st.floats(0.0, 1.0), data=st.data())
def test_the_planner_plays_the_loop_as_the_controller_runs_it(k, sync, data):
    """The planner's model of the loop (``steady_period.play``, which prices a varying generate)
    ends every step when the controller's own queue of deferred syncs does, with the sync on the
    engine alone; with the sync also holding the trainer (the cost model's transfer) never sooner."""
    steps = data.draw(st.integers(1, 12))
    gen = data.draw(st.lists(seconds, min_size=steps, max_size=steps))
    train = data.draw(st.lists(seconds, min_size=steps, max_size=steps))
    runtime = timed(gen, train, k, sync)
    planner = [float(x) for x in play_planned(gen, train, [sync] * steps, k, sync_on_trainer=False)]
    assert planner == pytest.approx(runtime, rel=1e-12, abs=1e-12)
    both = [float(x) for x in play_planned(gen, train, [sync] * steps, k)]
    assert all(b >= r - 1e-9 for b, r in zip(both, runtime, strict=True))


def test_a_slow_generate_is_absorbed_by_the_rollouts_issued_ahead():
    """Generates alternately slow (1.6 s) and fast (0.2 s), training 1 s a step: on average the engine
    keeps up (0.9 s a step), so at K = 2 the buffer absorbs the slow ones and the loop runs at the
    trainer's pace; waiting for each step's own sync, every slow generate two steps ahead held the
    trainer (1.3 s a step) — as K = 1 does, whatever the waits."""
    steps = 40
    gen = [1.6 if s % 2 else 0.2 for s in range(steps)]
    train = [1.0] * steps
    per_step = {
        name: (ends[30] - ends[10]) / 20  # 20 steps of the steady state, away from the run's ends
        for name, ends in {
            "deferred": timed(gen, train, 2, 0.0),
            "before": timed(gen, train, 2, 0.0, deferred=False),
            "k1": timed(gen, train, 1, 0.0),
        }.items()
    }
    assert per_step["deferred"] == pytest.approx(1.0)
    assert per_step["before"] == pytest.approx(1.3)
    assert per_step["k1"] == pytest.approx(1.3)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_every_sync_is_checked_once_in_order_before_any_rollout_sampled_after_it_is_trained_on(data):
    """With K changed between steps (a re-plan), the controller's real queue of deferred syncs
    (:class:`SyncQueue`) still checks each sync exactly once, in the order issued, and before the
    trainer trains on any rollouts the engine sampled after that sync ran (their weights are the
    ones the check vouches for); a run's last step leaves nothing unchecked; and before a step
    issues its own sync at most max(K − 1, 1) exported copies are alive (K ≥ 1)."""
    steps = data.draw(st.integers(1, 30))
    ks = data.draw(st.lists(st.integers(0, 6), min_size=steps, max_size=steps))
    engine: list[tuple[str, int]] = []
    issued: set[int] = set()
    queue: SyncQueue[None] = SyncQueue(steps)
    checked_at: dict[int, int] = {}
    order: list[int] = []
    for s, k in enumerate(ks):
        for t in [s, *issued_ahead(s, k, steps)]:
            if t not in issued:
                engine.append(("generate", t))
                issued.add(t)
        for q in queue.take_due(s):  # before the step's own sync is issued
            checked_at[q.step] = s
        if k >= 1:
            assert len(queue.pending) + 1 <= max(k - 1, 1) or any(p.staleness > k for p in queue.pending)
        engine.append(("sync", s))
        queue.add(PendingSync(s, k, None, []))
        queue.take_due(s)
        for q in queue.report():
            checked_at.setdefault(q.step, s)
            order.append(q.step)
    assert not queue.pending and not queue.taken
    assert order == list(range(steps))  # each once, in the order issued
    for i, (what, s) in enumerate(engine):
        if what == "sync":
            sampled_after = [t for w, t in engine[i + 1 :] if w == "generate"]
            assert all(checked_at[s] < t for t in sampled_after)  # checked before step t trains on them
