"""The pipelined loop's period when generation time varies from step to step.

A step's generate ends when its longest response does, and which response is longest changes from
step to step: a batch that draws a response at the limit takes longer than one that does not
(:func:`longest_spread`). Lock-step and at staleness K = 1 every step waits for the next step's
rollouts, so a slow generate holds the trainer whenever it outlasts the training beside it, and the
loop's mean period is the mean of ``max(train, generate)`` — more than the period at the mean
generate. At K ≥ 2 the rollouts issued further ahead absorb a slow generate: the trainer waits only
when the buffer runs dry. :func:`play` runs the controller's issue rules
(:mod:`flowc.ir.pipelining`) over a sequence of steps to price that, and :func:`varied_period`
reduces a plan's steady-state step to the three quantities the rules need.

Only the longest response's variation is priced: the rest of a batch's lengths average out over
hundreds of responses, and training time varies with the step's tokens by far less.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

import numpy as np

from flowc.ir.pipelining import issued_ahead, sync_due_at

#: quantiles of a step's longest response the variation is taken at
SPREAD_POINTS = 16
#: steps :func:`varied_period` plays: the first :data:`SPREAD_POINTS` fill the pipeline, the mean
#: period is taken over the next whole multiple of them
PLAYED_STEPS = 5 * SPREAD_POINTS


def longest_spread(quantile: Callable[[float], float], n: float, step_s: float, *, waves: int = 1) -> tuple[float, ...]:
    """How much longer than on average a generate takes when its longest response (of ``n``) is at
    each of :data:`SPREAD_POINTS` quantiles of where the longest of ``n`` falls
    (``quantile(((j + ½)/P)^(1/n))``): the difference in length times ``step_s``, the seconds of
    a decode step that runs once the others have ended. ``waves`` batches decoded one after
    another each end with their own longest: their sum varies √waves times as far. The values sum to 0."""
    p = SPREAD_POINTS
    xs = [quantile(((j + 0.5) / p) ** (1.0 / max(n, 1.0))) for j in range(p)]
    mean = sum(xs) / p
    f = step_s * math.sqrt(max(waves, 1))
    return tuple((x - mean) * f for x in xs)


def play(
    gen: Sequence[np.ndarray | float],
    train: Sequence[np.ndarray | float],
    sync: Sequence[np.ndarray | float],
    k: int,
    *,
    sync_on_trainer: bool = True,
) -> list[np.ndarray]:
    """When each step of a pipelined loop with staleness ``k`` ends (the controller moves on), with
    step ``s``'s generate taking ``gen[s]`` on the engine, its trainer ops ``train[s]`` and its weight
    sync ``sync[s]``. The engine runs its calls in the order issued; the controller issues a step's
    rollouts and those of the steps ahead (:func:`issued_ahead`) at the step's start, and its sync
    when the training is done and the syncs due by then (:func:`sync_due_at`) are, and the step ends
    when that sync is issued and every sync due at it is done. ``sync_on_trainer``: the sync also
    occupies the trainer (the cost model's transfer holds both pools' links), else only the engine
    (an object-store sync whose export is free). Elementwise over arrays (one per candidate plan)."""
    steps = len(train)
    engine = trainer = clock = np.float64(0.0)
    gen_end: dict[int, np.ndarray] = {}
    sync_end: dict[int, np.ndarray] = {}
    pending: list[int] = []

    def take_due(s: int) -> list[int]:
        due = [i for i, q in enumerate(pending) if sync_due_at(q, k, steps) <= s]
        n = due[-1] + 1 if due else 0
        out = pending[:n]
        del pending[:n]
        return out

    ends = []
    for s in range(steps):
        for t in [s, *issued_ahead(s, k, steps)]:
            if t not in gen_end:
                engine = gen_end[t] = np.maximum(engine, clock) + gen[t]
        trainer = np.maximum(np.maximum(clock, gen_end[s]), trainer) + train[s]
        taken = take_due(s)
        issued_at = trainer
        for q in taken:
            issued_at = np.maximum(issued_at, sync_end[q])
        engine = sync_end[s] = np.maximum(engine, issued_at) + sync[s]
        if sync_on_trainer:
            trainer = issued_at + sync[s]
        pending.append(s)
        clock = issued_at
        for q in taken + take_due(s):
            clock = np.maximum(clock, sync_end[q])
        ends.append(clock)
    return ends


@dataclass(frozen=True)
class Variation:
    """How a step's times vary from step to step.

    Attributes:
        spread: each generate op's seconds over its mean at :data:`SPREAD_POINTS` quantiles of
            where its longest response falls (:func:`longest_spread`), ``(points, candidates)``.
        cv: the coefficient of variation of a step's mean response length (the workload's
            ``mean_response_cv``): a step whose responses run longer on the whole generates and
            trains for longer alike.
    """

    spread: dict[str, np.ndarray] = field(default_factory=dict)
    cv: float = 0.0

    def __bool__(self) -> bool:
        return self.cv > 0 or any(np.any(v) for v in self.spread.values())


def varied_period(
    at: Callable[[float, bool], np.ndarray], mean_gen: np.ndarray, deviation: np.ndarray, cv: float, k: int, period: np.ndarray
) -> np.ndarray:
    """The mean period of a pipelined loop (staleness ``k`` ≥ 1) whose generate time varies by
    ``deviation`` (``(SPREAD_POINTS, n)``: seconds over ``mean_gen``, the steady-state step's
    generates at the mean, per candidate) and whose steps' lengths vary by ``cv`` as a whole.
    ``at(x, syncs)``: the steady-state step's end with every generate issued ahead ``x`` times as
    long (``syncs`` False: the weight syncs take no time); ``period``: ``at(1, True)``.

    The step's end is a max-plus expression of the op times, so as a function of one generate
    scale it is ``max(a, b + x·s)``: ``a`` what does not wait for the generate (the training and
    its sync), ``b`` what runs after it on its pool (the sync), ``s`` the generate's seconds on
    its path — read off at ``x`` = 0 and two large values. :func:`play` then runs the loop with
    ``train = (a − b)·f`` and ``sync = b`` over :data:`PLAYED_STEPS` steps whose generates take
    ``s·(x + f − 1)`` (``x`` the longest response's deviation, ``f`` the step's length factor
    ``1 + cv·z`` at normal quantiles ``z``, each in its own fixed shuffled order), and the mean
    period of its steady part, less its value without variation, is added to ``period`` (so that
    without variation the result is exactly ``period``).

    Where ``b`` holds more than the syncs — ops of the step itself queued behind the generate on
    its pool (a reference or reward model sharing the generation pool), which every step waits
    for — the rollouts issued further ahead cannot absorb anything: the controller issues them
    before the step's own ops, so those wait for them too. Such candidates are played at K = 1."""
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        ok = np.isfinite(period) & (mean_gen > 0)
        if not ok.any():
            return period
        g = np.where(ok, mean_gen, 1.0)
        per = np.where(ok, period, 0.0)
        big = float(np.max((2.0 * per + 1.0) / g)) * 4.0 + 4.0  # the generate's path dominates at this scale
        p0, p1, p2 = at(0.0, True), at(big, True), at(2.0 * big, True)
        slope = np.where(ok, (p2 - p1) / big, 0.0)
        b = np.where(ok, p1 - big * slope, 0.0)
        a = np.where(ok, p0, 0.0)
        own = np.where(ok, at(big, False) - big * slope, 0.0)  # b without the syncs: the step's own ops
        queued = own > 1e-3 * np.maximum(per, 1e-3)  # (a share of the step: not the rounding of a transfer)
        x = np.where(ok, np.maximum(1.0 + deviation / g, 0.0), 1.0)  # (points, n)
        points = x.shape[0]
        z = [NormalDist().inv_cdf((j + 0.5) / points) for j in range(points)]
        scale = [max(1.0 + cv * zj, 0.0) for zj in z]
        scale = [f * points / sum(scale) for f in scale]  # mean 1 also where a wide cv clips the shortest at 0
        longest, whole = _order(points, 0), _order(points, 1)
        train, tail = np.maximum(a - b, 0.0), b
        gens = [slope * np.maximum(x[i] + scale[j] - 1.0, 0.0) for i, j in zip(longest, whole, strict=True)]
        trains = [train * scale[j] for j in whole]

        def excess(kk: int) -> np.ndarray:
            flat = _mean_period([slope] * PLAYED_STEPS, [train] * PLAYED_STEPS, tail, kk)
            return np.maximum(_mean_period(gens, trains, tail, kk) - flat, 0.0)  # (≥ 0: the mean of a max)

        extra = excess(k)
        if k > 1 and queued.any():
            extra = np.where(queued, excess(1), extra)
        return np.where(ok, period + extra, period)


def _order(points: int, seed: int) -> list[int]:
    """An order of the points over :data:`PLAYED_STEPS` steps: one fixed shuffle of them (slow
    steps come in runs, as chance gives), repeated, so that any ``points`` consecutive steps draw
    every point once."""
    r = list(range(points))
    random.Random(seed).shuffle(r)
    return (r * -(-PLAYED_STEPS // points))[:PLAYED_STEPS]


def _mean_period(gens: list[np.ndarray], train: list[np.ndarray], tail: np.ndarray, k: int) -> np.ndarray:
    """Mean period of the loop's steps after the first :data:`SPREAD_POINTS` (the pipeline filling),
    up to the last ``k + 1`` (the run's end issues nothing ahead)."""
    gens, train = gens + gens[: k + 1], train + train[: k + 1]
    ends = play(gens, train, [tail] * len(train), k)
    lo, hi = SPREAD_POINTS - 1, len(ends) - k - 2
    return (ends[hi] - ends[lo]) / (hi - lo)


__all__ = ["PLAYED_STEPS", "SPREAD_POINTS", "Variation", "longest_spread", "play", "varied_period"]
