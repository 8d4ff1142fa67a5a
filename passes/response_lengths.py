"""The response-length distribution that generation is priced over, and a paged, continuously
batched engine's schedule over it (what vLLM does with a batch of requests).

A batch of rollouts ends when its longest response does, and the last responses decode a few
sequences at a time, at the step's fixed cost (the long tail). Pricing generation at the mean
length hides both. :class:`LengthDist` is the distribution the workload describes: measured
percentiles when it gives them (``response_percentiles``, e.g. from ``lengths_from=RUN_DIR``),
otherwise an exponential body with the workload's mean whose last percent of responses spreads
up to the response limit (:data:`TAIL_FROM`: a batch's longest response reaches the limit, the
clipped share every RL run reports), or every response at the limit when no mean is given.

:func:`continuous_batch` plays one replica's requests through an engine with a KV cache of
``cap_tokens`` tokens: a request is admitted (in submission order) when the cache holds its
prompt, a running sequence holds its prompt and what it generated so far in whole blocks, a
finished one frees them; when the running sequences fill the cache the last admitted is
preempted and later re-admitted with its prompt and generated tokens recomputed (vLLM's
recompute preemption). The result is the number of sequences decoding over time, which the
cost model turns into decode seconds, plus the cache's peak demand and the tokens recomputed.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass
from functools import lru_cache

from flowc.ir.workload import PERCENTILE_SHARES, percentiles_mean

#: quantile points a schedule is played with: a replica's requests beyond this many are priced
#: with this many representatives (their cache and sequence cap scaled alike)
MAX_SIMULATED = 512
#: duration-weighted levels the batch-size profile is reduced to for pricing
PROFILE_LEVELS = 12
#: with only a mean, the share of responses below which lengths follow the exponential; the rest
#: spread evenly up to the response limit. An exponential alone has its longest of ``n`` responses
#: near ``θ·ln n``: a tenth of a 28k limit at a 1.2k mean, where runs report responses clipped at
#: the limit, and generation that does not speed up with more replicas because the longest
#: response sets it (verl's DAPO-7B on 64 and 128 H20: 151 and 178 s; docs/planner.md)
TAIL_FROM = 0.99
#: the longest response the default distribution reaches, in means (when the limit is further):
#: a 1 % tail to a limit thousands of means away would carry most of the mean
TAIL_REACH = 100.0


@dataclass(frozen=True)
class LengthDist:
    """Response lengths under a limit, as a quantile function.

    Attributes:
        limit: the response limit (no response is longer).
        theta: scale of the exponential the lengths follow up to the :data:`TAIL_FROM` quantile
            (beyond it they run linearly up to ``reach``; ``inf``: every response at the limit);
            used when ``knots`` is empty.
        reach: the longest response of the ``theta`` form: the limit, or :data:`TAIL_REACH`
            means when the limit is further (less for a mean within a token or so of 1, which
            a tail that long would exceed).
        knots: ``(u, length)`` points of a piecewise-linear quantile function (u from 0 to 1),
            from measured percentiles.
    """

    limit: float
    theta: float = math.inf
    knots: tuple[tuple[float, float], ...] = ()
    reach: float = 0.0  # with ``theta``: the longest response (0: the limit)

    @staticmethod
    def of(limit: float, mean: float, percentiles: tuple[float, ...] | None = None) -> LengthDist:
        """The distribution a workload describes: ``percentiles`` (min, p50, p90, p99, max) when
        given, else an exponential body whose top percent spreads up to ``limit``, of mean ``mean``."""
        return _dist(float(limit), float(mean), tuple(percentiles) if percentiles else None)

    def quantile(self, u: float) -> float:
        """The length below which a share ``u`` of responses end."""
        u = min(max(u, 0.0), 1.0)
        if self.knots:
            for (u0, x0), (u1, x1) in zip(self.knots, self.knots[1:], strict=False):
                if u <= u1:
                    return x0 if u1 <= u0 else x0 + (x1 - x0) * (u - u0) / (u1 - u0)
            return self.knots[-1][1]
        if math.isinf(self.theta):
            return self.limit
        top = self.reach or self.limit
        if u >= 1.0:
            return top
        if u > TAIL_FROM:
            edge = _exp_quantile(self.theta, top, TAIL_FROM)
            return edge + (top - edge) * (u - TAIL_FROM) / (1.0 - TAIL_FROM)
        return _exp_quantile(self.theta, top, u)

    @property
    def mean(self) -> float:
        return _mean(self)

    def expected_max(self, n: float) -> float:
        """Expected longest of ``n`` responses (what a padded batch of ``n`` decodes for):
        ``∫ x(v^(1/n)) dv`` by the midpoint rule."""
        return self.mean if n <= 1 else _expected_max(self, float(n))

    def lengths(self, n: int) -> tuple[float, ...]:
        """``n`` representative lengths: the quantiles at ``(i + ½)/n``, ascending."""
        return _lengths(self, n)

    @property
    def held_mean(self) -> float:
        """Mean response tokens a sequence holds while it decodes (length-biased: a response of
        length L is in flight for L steps, holding L/2 tokens on average): ``E[L²] / 2E[L]``."""
        return _held_mean(self)


def _exp_quantile(theta: float, limit: float, u: float) -> float:
    return min(limit, max(1.0, -theta * math.log1p(-u)))


def _tailed_mean(theta: float, limit: float) -> float:
    """Mean of the default distribution: the exponential of scale ``theta`` capped at ``limit`` (its
    reach) up to the :data:`TAIL_FROM` quantile, then linear from there to ``limit``.
    ``∫₀ᵁ −θ·ln(1−u) du = θ((1−U)·ln(1−U) + U)``; past ``u_c = 1 − e^(−limit/θ)`` it is ``limit``.
    The lengths are at least 1 token: the first ``u₁ = 1 − e^(−1/θ)`` of u, where ``−θ·ln(1−u) < 1``,
    sit at 1, which adds ``∫₀^u₁ (1 + θ·ln(1−u)) du = 1 − θ·u₁``."""
    top = TAIL_FROM
    u_c = -math.expm1(-limit / theta)  # where the exponential reaches the limit
    u = min(top, u_c)
    body = theta * ((1.0 - u) * math.log1p(-u) + u) + limit * (top - u)
    u1 = -math.expm1(-1.0 / theta)  # below it the exponential is under one token
    if u1 < u:
        body += 1.0 - theta * u1
    else:  # every length up to ``u`` is one token
        body = u + limit * (top - u)
    return body + (1.0 - top) * (_exp_quantile(theta, limit, top) + limit) / 2.0


@lru_cache(maxsize=4096)
def _expected_max(d: LengthDist, n: float) -> float:
    k = 256
    return sum(d.quantile(((j + 0.5) / k) ** (1.0 / n)) for j in range(k)) / k


@lru_cache(maxsize=1024)
def _lengths(d: LengthDist, n: int) -> tuple[float, ...]:
    return tuple(d.quantile((i + 0.5) / n) for i in range(n))


@lru_cache(maxsize=1024)
def _held_mean(d: LengthDist) -> float:
    xs = d.lengths(256)
    return sum(x * x for x in xs) / (2.0 * sum(xs))


def _to_mean(q: tuple[float, ...], mean: float) -> tuple[float, ...]:
    """Percentiles ``q`` (min, p50, p90, p99, max) whose distribution has the mean ``mean``: the
    interior ones scaled about the minimum (and kept within the maximum) until it does, as close
    as they can get. A workload that gives both (``lengths_from=RUN_DIR`` writes a run's measured
    mean and the medians of its steps' percentiles, which need not agree) is then priced at one
    mean in generation and training alike; without a separate mean, ``q`` is returned as it is."""
    lo, hi = q[0], q[-1]
    if abs(percentiles_mean(q) - mean) <= 1e-9 * max(hi, 1.0) or hi <= lo:
        return q

    def scaled(f: float) -> tuple[float, ...]:
        return (lo, *(min(lo + (x - lo) * f, hi) for x in q[1:-1]), hi)

    a, b = 0.0, 1.0
    while percentiles_mean(scaled(b)) < mean and b < 1e9:
        a, b = b, b * 2.0
    for _ in range(60):  # the mean only grows with the factor
        mid = 0.5 * (a + b)
        a, b = (mid, b) if percentiles_mean(scaled(mid)) < mean else (a, mid)
    return scaled(0.5 * (a + b))


@lru_cache(maxsize=4096)
def _dist(limit: float, mean: float, percentiles: tuple[float, ...] | None) -> LengthDist:
    if percentiles:
        xs = tuple(min(max(float(x), 1.0), limit) for x in percentiles)
        return LengthDist(limit, knots=tuple(zip(PERCENTILE_SHARES, _to_mean(xs, mean), strict=True)))
    mean = min(max(mean, 1.0), limit)
    if mean >= limit * (1.0 - 1e-6):
        return LengthDist(limit)
    # the mean rises with θ from TAIL_FROM·1 + (1 − TAIL_FROM)·(1 + reach)/2 (every length below the
    # tail at one token), which the reach keeps at most the mean, to the reach
    reach = min(limit, TAIL_REACH * mean, max(1.0, 2.0 * (mean - TAIL_FROM) / (1.0 - TAIL_FROM) - 1.0))
    lo, hi = 1e-9, mean
    while _tailed_mean(hi, reach) < mean:
        hi *= 2.0
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if _tailed_mean(mid, reach) < mean:
            lo = mid
        else:
            hi = mid
    return LengthDist(limit, theta=0.5 * (lo + hi), reach=0.0 if reach >= limit else reach)


@lru_cache(maxsize=4096)
def _mean(d: LengthDist) -> float:
    if d.knots:
        return percentiles_mean(tuple(x for _, x in d.knots))
    if math.isinf(d.theta):
        return d.limit
    return _tailed_mean(d.theta, d.reach or d.limit)


@dataclass(frozen=True)
class Schedule:
    """One replica's decode under continuous batching.

    Attributes:
        levels: ``(steps, running)`` pairs: how many decode steps run with how many sequences
            (duration-weighted levels, ascending in ``running``).
        steps: decode steps from the first admission to the last response's end.
        peak_tokens: the most cache tokens the running sequences held at once.
        most_running: the most sequences decoding at once.
        preempted: preemptions (each re-admitted sequence recomputes its tokens).
        recomputed_tokens: prompt and generated tokens prefilled again after preemptions.
        tail_steps: steps in which fewer than a quarter of ``most_running`` sequences ran.
    """

    levels: tuple[tuple[float, float], ...]
    steps: float
    peak_tokens: float
    most_running: float
    preempted: int
    recomputed_tokens: float
    tail_steps: float


def continuous_batch(
    dist: LengthDist, n: int, prompt: float, cap_tokens: float, block: int, max_seqs: int | None, *, longest_of: int | None = None
) -> Schedule:
    """Play ``n`` requests of ``prompt`` tokens with lengths from ``dist`` through an engine whose
    KV cache holds ``cap_tokens`` tokens in blocks of ``block`` and that runs at most ``max_seqs``
    sequences at once (None: no such limit). The cache must hold one whole sequence.
    ``longest_of``: the batch ends with the longest of this many responses (default ``n``) — of
    all replicas' requests when the caller waits for every replica: the slowest replica is the
    one that drew the batch's longest response, which decodes on alone."""
    need = prompt + dist.limit + block
    # scaled down only while the scaled cache and sequence cap still hold a few sequences each
    scale = max(1.0, min(n / MAX_SIMULATED, cap_tokens / (4.0 * need), (max_seqs or math.inf) / 4.0))
    m = max(1, round(n / scale))
    scale = n / m
    seqs = None if max_seqs is None else max(1, round(max_seqs / scale))
    # quantise the cache (2 % steps, downward) so that nearby candidates share one schedule
    cap = cap_tokens / scale
    cap = math.exp(math.floor(math.log(max(cap, 1.0)) / 0.02) * 0.02)
    s = _play(dist, m, float(prompt), max(cap, need), int(block), seqs)
    # the representatives' longest is the (m - ½)/m quantile, the batch's the longest of n: where that
    # is longer (always when scaled down; where the tail is steep, e.g. a 1 % tail to the limit, at
    # any m) the longest response decodes on alone for the difference (a lower bound on the tail)
    extra = max(0.0, dist.expected_max(max(n, longest_of or n)) - dist.lengths(m)[-1])
    return Schedule(
        ((extra, 1.0),) * (extra > 0) + tuple((steps, running * scale) for steps, running in s.levels),
        s.steps + extra,
        min(s.peak_tokens * scale, cap_tokens),
        s.most_running * scale,
        round(s.preempted * scale),
        s.recomputed_tokens * scale,
        s.tail_steps + extra,
    )


@lru_cache(maxsize=2048)
def _play(dist: LengthDist, n: int, prompt: float, cap: float, block: int, max_seqs: int | None) -> Schedule:
    lengths = list(dist.lengths(n))
    limit = max_seqs or n
    if n <= limit:  # every request admitted at once: exact in whole blocks, if the cache holds them
        blocks = [n * -(-(prompt + 1) // block) * block] + [
            (n - k) * -(-(prompt + x) // block) * block for k, x in enumerate(lengths)
        ]  # the peak comes just before a response ends: the running ones hold the prompt and x tokens
        if max(blocks) <= cap:
            segments = [(x - prev, n - k) for k, (prev, x) in enumerate(zip([0.0, *lengths], lengths, strict=False))]
            tail = sum(d for d, a in segments if a < n / 4.0)
            return Schedule(_levels(segments), lengths[-1], max(blocks), n, 0, 0.0, tail)
    random.Random(n).shuffle(lengths)  # submission order is unrelated to length
    half = block / 2.0  # a sequence's last block is half empty on average
    waiting: deque[tuple[int, float]] = deque((i, 0.0) for i in range(n))
    running: dict[int, float] = {}  # index -> virtual start (now - generated), in admission order
    ends: list[tuple[float, int, int]] = []  # (end time, index, admission) with stale entries
    admission = [0] * n
    t = 0.0
    start_sum = 0.0  # Σ virtual starts of the running sequences
    segments: list[tuple[float, int]] = []
    peak = 0.0
    preempted = 0
    recomputed = 0.0

    def held(at: float) -> float:
        return len(running) * (prompt + half + at) - start_sum

    def admit(at: float) -> None:
        nonlocal start_sum, recomputed
        while waiting and len(running) < limit:
            i, done = waiting[0]
            if running and held(at) + prompt + done + half > cap:
                return
            waiting.popleft()
            running[i] = at - done
            start_sum += at - done
            admission[i] += 1
            heapq.heappush(ends, (at - done + lengths[i], i, admission[i]))
            if admission[i] > 1:  # back after a preemption: its prompt and generated tokens prefilled again
                recomputed += prompt + done

    admit(0.0)
    while running:
        while ends and (ends[0][1] not in running or ends[0][2] != admission[ends[0][1]]):
            heapq.heappop(ends)
        end = ends[0][0]
        a = len(running)
        full = t + (cap - held(t)) / a  # the cache fills while every running sequence grows a token a step
        if full < end - 1e-9:
            segments.append((full - t, a))
            t = full
            peak = max(peak, held(t))
            i, start = running.popitem()  # vLLM preempts the last admitted
            start_sum -= start
            waiting.appendleft((i, t - start))
            preempted += 1
            if not running:  # one sequence alone outgrew the cache (never: the caller sizes it for one)
                raise ValueError("the KV cache does not hold one sequence")
            continue
        segments.append((end - t, a))
        t = end
        peak = max(peak, held(t))
        while ends and ends[0][0] <= t + 1e-9:
            _, i, adm = heapq.heappop(ends)
            if i in running and adm == admission[i]:
                start_sum -= running.pop(i)
        admit(t)
    most = max((a for _, a in segments), default=0)
    tail = sum(d for d, a in segments if a < most / 4.0)
    # reported with a whole block per sequence (what partly filled last blocks can add)
    return Schedule(_levels(segments), t, min(cap, peak + most * half), most, preempted, recomputed, tail)


def _levels(segments: list[tuple[float, int]]) -> tuple[tuple[float, float], ...]:
    """``segments`` reduced to at most :data:`PROFILE_LEVELS` (steps, mean running) levels of
    about equal steps, sorted by how many sequences run (the step cost is linear in the batch
    size except at the memory/compute knee, so this keeps the priced total)."""
    segs = sorted((a, d) for d, a in segments if d > 0)
    total = sum(d for _, d in segs)
    if total <= 0:
        return ()
    out: list[tuple[float, float]] = []
    width = total / PROFILE_LEVELS
    acc_d = acc_ad = 0.0
    for a, d in segs:
        acc_d += d
        acc_ad += a * d
        if acc_d >= width:
            out.append((acc_d, acc_ad / acc_d))
            acc_d = acc_ad = 0.0
    if acc_d > 0:
        out.append((acc_d, acc_ad / acc_d))
    return tuple(out)


__all__ = ["LengthDist", "Schedule", "continuous_batch"]
