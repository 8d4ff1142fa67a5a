"""The response-length distribution and continuous batching over it (passes/response_lengths.py)."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flowc as fc
from flowc.errors import SpecError
from flowc.ir.workload import WorkloadSpec
from flowc.passes.response_lengths import MAX_SIMULATED, TAIL_FROM, TAIL_REACH, LengthDist, continuous_batch


def test_no_mean_is_every_response_at_the_limit():
    d = LengthDist.of(512, 512)
    assert d.mean == 512 and d.quantile(0.0) == 512 and d.expected_max(100) == 512 and d.held_mean == 256


def test_an_exponential_cut_at_the_limit_keeps_the_mean_and_its_clipped_share():
    d = LengthDist.of(4096, 1960)  # the exponential reaches the limit before the last percent: nothing to spread
    assert d.mean == pytest.approx(1960, rel=1e-6)
    # θ(1 - e^(-L/θ)) = mean, and the share cut at the limit is e^(-L/θ)
    assert d.theta * -math.expm1(-4096 / d.theta) == pytest.approx(1960, rel=1e-6)
    clipped = math.exp(-4096 / d.theta)
    assert d.quantile(1 - clipped / 2) == 4096 and d.quantile(1 - clipped * 2) < 4096
    assert d.quantile(0.5) == pytest.approx(d.theta * math.log(2))


def test_a_limit_many_means_away_is_reached_by_the_last_percent():
    """An exponential alone puts the longest of 1024 responses near θ·ln 1024 (about 9k of a 28k
    limit at a 1.2k mean); the default spreads its last percent up to the limit instead."""
    d = LengthDist.of(28672, 1201)
    assert d.mean == pytest.approx(1201, rel=1e-6)
    assert d.quantile(TAIL_FROM) == pytest.approx(-d.theta * math.log(1 - TAIL_FROM))  # the exponential's body
    assert d.quantile(1.0) == 28672 and d.quantile(0.995) == pytest.approx((d.quantile(TAIL_FROM) + 28672) / 2)
    assert d.expected_max(1024) > 0.9 * 28672 > 3 * d.theta * math.log(1024)
    rng = random.Random(0)  # the mean of draws through the quantile function
    assert sum(d.quantile(rng.random()) for _ in range(200_000)) / 200_000 == pytest.approx(1201, rel=0.02)


def test_a_limit_beyond_the_tail_reach_stops_the_tail_there():
    d = LengthDist.of(100_000, 50)
    assert d.mean == pytest.approx(50, rel=1e-6)
    assert d.quantile(1.0) == TAIL_REACH * 50 < 100_000


@settings(max_examples=200, deadline=None)
@given(limit=st.integers(2, 1_000_000), share=st.floats(1e-4, 1.0))
def test_the_default_keeps_the_mean_within_the_limit(limit, share):
    mean = max(1.0, share * limit)
    d = LengthDist.of(limit, mean)
    assert d.mean == pytest.approx(min(mean, limit), rel=1e-6, abs=1e-6)
    # the mean of the quantile function itself (not the closed form the fit inverts), lengths ≥ 1 token
    k = 20_000
    assert sum(d.quantile((i + 0.5) / k) for i in range(k)) / k == pytest.approx(min(mean, limit), rel=2e-3)
    xs = [d.quantile(i / 400) for i in range(401)]
    assert all(a <= b + 1e-9 for a, b in itertools.pairwise(xs)) and xs[0] >= 1.0 and xs[-1] <= limit
    assert xs[-1] <= max(TAIL_REACH * mean, limit if d.theta == math.inf else 0.0) + 1e-6


def test_expected_longest_against_sampling():
    d = LengthDist.of(4096, 600)
    rng = random.Random(0)
    for n in (1, 8, 64):
        draws = [max(min(rng.expovariate(1 / d.theta), 4096) for _ in range(n)) for _ in range(4000)]
        assert d.expected_max(n) == pytest.approx(sum(draws) / len(draws), rel=0.04), n
    assert d.expected_max(1) == pytest.approx(d.mean)
    assert d.expected_max(10**6) == pytest.approx(4096, rel=1e-3)  # a million responses: one reaches the limit


def test_measured_percentiles_are_the_quantile_function():
    d = LengthDist.of(512, 195.56, (10, 150, 400, 500, 512))
    assert d.quantile(0) == 10 and d.quantile(0.5) == 150 and d.quantile(0.9) == 400 and d.quantile(1) == 512
    assert d.quantile(0.7) == pytest.approx(275)
    # the knots' mean by hand: ½·(10+150)/2 + 0.4·(150+400)/2 + 0.09·(400+500)/2 + 0.01·(500+512)/2
    assert d.mean == pytest.approx(40 + 110 + 40.5 + 5.06)


def test_the_workload_takes_percentiles_as_text_and_checks_them():
    w = WorkloadSpec.parse("response_len=512,mean_response_len=200,response_percentiles=10/150/400/500/512")
    assert w.response_percentiles == (10, 150, 400, 500, 512)
    with pytest.raises(SpecError, match="ascending, from 1 to response_len 512"):
        WorkloadSpec.parse("response_len=512,response_percentiles=10/150/100/500/512")
    with pytest.raises(SpecError, match="ascending, from 1 to response_len 256"):
        WorkloadSpec.parse("response_len=256,response_percentiles=10/150/200/250/512")
    with pytest.raises(SpecError, match="outside response_percentiles' min 10 and max 500"):
        WorkloadSpec.parse("response_len=512,mean_response_len=501,response_percentiles=10/150/400/500/500")
    # without a mean, training is priced at the distribution's mean (the mean generation sees), not the limit
    alone = WorkloadSpec.parse("response_len=512,response_percentiles=10/150/400/500/512")
    assert alone.avg_response_len == pytest.approx(LengthDist.of(512, alone.avg_response_len, alone.response_percentiles).mean)
    assert alone.avg_response_len == pytest.approx(195.56)


def test_a_given_mean_beside_percentiles_is_the_mean_generation_is_priced_at():
    """lengths_from writes a run's measured mean and the medians of its percentiles, which need not
    agree: the interior percentiles are scaled about the minimum until the distribution's mean is the
    given one, so generation and training are priced at one mean."""
    q = (10, 150, 400, 500, 512)  # their own mean: 195.56
    for mean in (120.0, 195.56, 230.0):
        d = LengthDist.of(512, mean, q)
        xs = [x for _, x in d.knots]
        assert d.mean == pytest.approx(mean, rel=1e-6)
        assert xs[0] == 10 and xs[-1] == 512 and xs == sorted(xs)
    assert [x for _, x in LengthDist.of(512, 195.56, q).knots] == pytest.approx(q, abs=0.01)  # agreeing: unchanged
    # a mean no such scaling reaches (interior all at the maximum): as close as it gets
    far = LengthDist.of(512, 500, q)
    assert [x for _, x in far.knots][1:] == pytest.approx([512] * 4) and far.mean < 500
    # the workload prices training at its mean: the same one
    w = WorkloadSpec.parse("response_len=512,mean_response_len=230,response_percentiles=10/150/400/500/512")
    assert LengthDist.of(512, w.avg_response_len, w.response_percentiles).mean == pytest.approx(w.avg_response_len)


def test_everything_fits_the_batch_shrinks_as_responses_end():
    d = LengthDist.of(64, 64, (1, 16, 40, 60, 64))
    s = continuous_batch(d, 8, 10, 1e9, 16, None)
    lengths = d.lengths(8)
    assert s.steps == pytest.approx(max(lengths)) and s.preempted == 0 and s.most_running == 8
    assert sum(n * r for n, r in s.levels) == pytest.approx(sum(lengths))  # one token per running sequence per step
    # the peak in whole 16-token blocks, just before a response ends
    ordered = sorted(lengths)
    assert s.peak_tokens == max((8 - k) * math.ceil((10 + x) / 16) * 16 for k, x in enumerate(ordered))
    # the tail: steps with under a quarter of the batch (1 of 8) still running
    assert s.tail_steps == pytest.approx(ordered[-1] - ordered[-2])


def test_a_small_cache_queues_preempts_and_recomputes():
    d = LengthDist.of(1024, 1024)
    roomy = continuous_batch(d, 64, 128, 64 * (128 + 1024 + 16), 16, None)
    assert roomy.preempted == 0 and roomy.steps == 1024
    small = continuous_batch(d, 64, 128, 16 * (128 + 1024), 16, None)
    assert small.most_running <= 64 and small.preempted > 0 and small.recomputed_tokens > 0
    assert small.steps >= 64 / small.most_running * 1024 * 0.9  # the queue drains a cache-full at a time
    capped = continuous_batch(d, 64, 128, 1e9, 16, 16)  # vLLM's max_num_seqs
    assert capped.most_running == 16 and capped.preempted == 0 and capped.steps == pytest.approx(4 * 1024)


@settings(max_examples=60, deadline=None)
@given(
    limit=st.integers(1, 2048),
    mean_share=st.floats(0.01, 1.0),
    n=st.integers(1, 3 * MAX_SIMULATED),
    prompt=st.integers(1, 512),
    cap_seqs=st.floats(1.0, 2000.0),
    block=st.sampled_from([16, 128]),
    max_seqs=st.one_of(st.none(), st.integers(1, 1024)),
)
def test_schedule_properties(limit, mean_share, n, prompt, cap_seqs, block, max_seqs):
    d = LengthDist.of(limit, max(1.0, mean_share * limit))
    cap = cap_seqs * (prompt + limit + block)
    s = continuous_batch(d, n, prompt, cap, block, max_seqs)
    # the longest of the n requests, where longer than the longest representative, decodes on alone
    lone = max(0.0, d.expected_max(n) - d.lengths(min(n, MAX_SIMULATED))[-1])
    work = sum(d.lengths(n)) + lone if n <= MAX_SIMULATED else None
    # every generated token is decoded once (a preempted sequence keeps its tokens; only their cache is recomputed)
    tokens = sum(k * r for k, r in s.levels)
    assert s.steps >= d.expected_max(n) * (1 - 1e-6)  # the batch ends with its longest response
    if work is not None:
        assert tokens == pytest.approx(work, rel=1e-6)
    else:  # n scaled to representatives of the same distribution
        assert tokens == pytest.approx(n * d.mean, rel=0.05, abs=n)
    assert s.steps >= d.quantile(1 - 0.5 / min(n, MAX_SIMULATED)) * (1 - 1e-6)  # the longest representative
    assert s.steps * s.most_running >= tokens * (1 - 1e-6)
    assert 1 <= s.most_running <= (max_seqs or n) * 1.01 + 1 and s.tail_steps <= s.steps + 1e-6
    assert s.peak_tokens <= max(cap, prompt + limit + block) * 1.000001
    assert (s.preempted > 0) == (s.recomputed_tokens > 0)
    if max_seqs is None and cap >= 1.03 * n * (prompt + limit + block):  # the whole batch fits at its peak
        assert s.preempted == 0 and s.most_running == pytest.approx(n)


def test_a_scaled_schedule_keeps_the_long_tail_of_all_its_requests():
    """4096 requests played as 512 representatives: the longest of 4096 still ends the batch (the
    representatives alone would end it at their own longest, a quarter of the steps earlier)."""
    from flowc.passes.response_lengths import _play

    d = LengthDist.of(16384, 500)
    scaled = continuous_batch(d, 4096, 512, 1e12, 16, 1024)
    exact = _play(d, 4096, 512.0, 1e12, 16, 1024)
    assert scaled.steps == pytest.approx(exact.steps, rel=0.15)
    assert scaled.tail_steps == pytest.approx(exact.tail_steps, rel=0.2)
    assert scaled.steps >= d.expected_max(4096)


def test_a_generate_waits_for_the_replica_that_drew_the_longest_of_all_responses():
    """8 replicas of 1,024 requests each (verl's DAPO-7B on 32 H20): the generate ends when the
    longest of all 8,192 responses does, decoded alone by its replica — about 2,000 steps after
    the longest of one replica's 1,024 (a 1 % tail to a 28k limit); fewer never shortens it."""
    d = LengthDist.of(28672, 1200)
    own = continuous_batch(d, 1024, 256, 1e12, 16, None)
    every = continuous_batch(d, 1024, 256, 1e12, 16, None, longest_of=8192)
    assert own.steps == pytest.approx(d.expected_max(1024), rel=1e-3)
    assert every.steps == pytest.approx(d.expected_max(8192), rel=1e-3) and every.steps > own.steps + 1500
    assert every.levels[0][1] == 1.0 == own.levels[0][1]  # the extra steps decode one sequence
    assert every.levels[0][0] - own.levels[0][0] == pytest.approx(every.steps - own.steps)
    assert continuous_batch(d, 1024, 256, 1e12, 16, None, longest_of=512).steps == own.steps


def test_a_generate_cut_below_the_limit_prices_the_cut_distribution_at_its_own_mean():
    """``generate(max_tokens=…)`` below the workload's limit: the workload's distribution cut at it,
    priced at that cut's mean (not the whole distribution's mean pulled down to the cut, which the
    rescaling to a given mean would have dragged every percentile up to)."""
    from flowc.ir.workload import percentiles_mean
    from flowc.passes.units import demands

    @fc.flow
    def short(prompts: fc.Prompts, actor: fc.Policy, reward: fc.Reward, *, n: int = 2):
        rollout = actor.generate(prompts, n=n, max_tokens=200)
        actor.update(rollout, advantages=fc.ops.group_normalize(reward(rollout), group_size=n), loss=fc.losses.ppo_clip(0.2))

    g = short.trace()
    q = (10.0, 100.0, 400.0, 900.0, 1000.0)
    for w in (
        WorkloadSpec(response_len=1000, response_percentiles=q),
        WorkloadSpec(response_len=1000, mean_response_len=300, response_percentiles=q),
    ):
        (gen,) = [d for d in demands(g, w).values() if d.response_len == 200]
        cut = tuple(min(x, 200.0) for _, x in LengthDist.of(1000, w.avg_response_len, q).knots)
        assert gen.percentiles == cut and gen.mean_response_len == pytest.approx(percentiles_mean(cut))
        assert gen.lengths.mean == pytest.approx(gen.mean_response_len)  # no rescaling left to do
    # the p50 stays the measured 100 (the rescaling to the uncut mean would have pulled it to the cut)
    w = WorkloadSpec(response_len=1000, response_percentiles=q)
    (plain,) = [d for d in demands(g, w).values() if d.response_len == 200]
    assert plain.percentiles == (10.0, 100.0, 200.0, 200.0, 200.0)
