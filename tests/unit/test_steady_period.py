"""The pipelined loop's period when generation time varies from step to step
(``passes/steady_period.py``): the variation of a step's longest response, of its mean length, and
the staleness that absorbs it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import DECOUPLED_FLOW
from hypothesis import given, settings
from hypothesis import strategies as st

from flowc.ir.cluster import ClusterSpec
from flowc.ir.models import ModelSpec
from flowc.ir.plan_text import format_plan
from flowc.ir.plan_verify import verify_plan
from flowc.ir.workload import WorkloadSpec
from flowc.loader import load_flow
from flowc.passes.pins import parse_pins
from flowc.passes.pipeline import make_plan
from flowc.passes.response_lengths import LengthDist
from flowc.passes.schedule import OpSpec, SyncSpec, simulate
from flowc.passes.steady_period import SPREAD_POINTS, Variation, longest_spread, varied_period


def two_pools(a: float, b: float, s: float):
    """``at(x)`` of a step whose training and sync take ``a`` apart from the generate and whose
    generate (``s`` seconds at x = 1) is followed by ``b`` on its pool."""
    return lambda x, syncs=True: np.array([max(a, b + x * s)])  # (b: a sync)


def period(a: float, b: float, s: float, dev: np.ndarray, k: int, cv: float = 0.0) -> float:
    at = two_pools(a, b, s)
    return float(varied_period(at, np.array([s]), dev.reshape(SPREAD_POINTS, 1), cv, k, at(1.0, True))[0])


def test_the_longest_responses_spread_sums_to_zero_and_grows_with_the_tail():
    tailed = LengthDist.of(16384, 2000)  # the last percent spreads to the limit: a batch's longest varies
    spread = longest_spread(tailed.quantile, 512, 0.01)
    assert len(spread) == SPREAD_POINTS and sum(spread) == pytest.approx(0.0, abs=1e-9)
    assert list(spread) == sorted(spread) and spread[-1] > 0 > spread[0]
    # the longest of 512 falls beyond the 99th percentile, where the tail runs linearly to the limit
    top, edge = 16384.0, tailed.quantile(0.99)
    assert spread[-1] - spread[0] == pytest.approx(
        0.01 * (top - edge) * ((1 - 0.5 / 16) ** (1 / 512) - (0.5 / 16) ** (1 / 512)) / 0.01, rel=1e-6
    )
    at_limit = LengthDist.of(4096, 2000)  # the exponential reaches the limit before its 99th percentile
    assert all(x == pytest.approx(0.0, abs=1e-9) for x in longest_spread(at_limit.quantile, 512, 0.01))
    assert all(x == 0 for x in longest_spread(LengthDist(256).quantile, 64, 0.01))  # every response at the limit
    one_wave, four = longest_spread(tailed.quantile, 64, 0.5), longest_spread(tailed.quantile, 64, 0.5, waves=4)
    assert four == pytest.approx([2 * x for x in one_wave])  # four waves' longest vary √4 times as far


def test_no_variation_leaves_the_period_as_it_is():
    dev = np.zeros(SPREAD_POINTS)
    for k in (1, 2, 3):
        for a, b, s in ((5.0, 0.5, 3.0), (2.0, 0.5, 3.0), (0.2, 4.0, 1.0)):
            assert period(a, b, s, dev, k) == pytest.approx(max(a, b + s), abs=1e-9)


@pytest.mark.parametrize("cv", [0.1, 0.5, 0.8, 1.0])
def test_the_steps_length_factors_average_to_one_however_wide(cv):
    """Nothing overlaps the generate (its pool is the step): the period is its mean at any cv, also
    where 1 + cv·z would fall below 0 for the shortest steps and is clipped there."""
    assert period(0.0, 0.5, 2.0, np.zeros(SPREAD_POINTS), 1, cv) == pytest.approx(2.5, rel=1e-9)


def test_a_slow_generate_holds_the_trainer_at_k1_and_the_rollouts_issued_ahead_absorb_it_at_k2():
    """Training 1 s, generates half 1.6 s and half 0.2 s (0.9 s on average), a free sync: at K = 1
    every slow generate holds the next step (1.3 s a step on average); at K = 2 the buffer absorbs
    most of them (the played order brings a few slow ones in a row, which it cannot)."""
    dev = np.array([-0.7] * (SPREAD_POINTS // 2) + [0.7] * (SPREAD_POINTS // 2))
    k1, k2 = period(1.0, 0.0, 0.9, dev, 1), period(1.0, 0.0, 0.9, dev, 2)
    assert k1 == pytest.approx(1.3, abs=0.03)
    assert 1.0 <= k2 < 1.1
    assert period(1.0, 0.0, 0.9, dev, 4) <= k2 + 1e-9  # a deeper buffer absorbs the runs too
    assert period(1.0, 0.0, 0.9, dev, 4) == pytest.approx(1.0, abs=0.02)


@settings(max_examples=150, deadline=None)
@given(
    a=st.floats(0.0, 10.0),
    b=st.floats(0.0, 3.0),
    s=st.floats(0.1, 10.0),
    cv=st.floats(0.0, 0.5),
    raw=st.lists(st.floats(-1.0, 1.0), min_size=SPREAD_POINTS, max_size=SPREAD_POINTS),
)
def test_variation_only_adds_to_the_period_and_a_deeper_buffer_never_hurts(a, b, s, cv, raw):
    dev = np.array(raw) - np.mean(raw)
    if np.min(dev) < -s:  # a generate takes no less than no time
        dev = dev * s / -np.min(dev)
    flat = max(a, b + s)
    k1, k2 = period(a, b, s, dev, 1, cv), period(a, b, s, dev, 2, cv)
    assert k1 >= flat - 1e-9 and k2 >= flat - 1e-9  # the mean of a max is at least the max of the means
    assert k2 <= k1 + 1e-6 * max(1.0, flat)
    if a <= b:  # nothing overlaps the generate on its own pool: the period is its mean, whatever K
        assert k1 == pytest.approx(k2, rel=1e-6)
        if cv == 0:
            assert k1 == pytest.approx(b + s, rel=1e-6)


def test_the_schedule_prices_the_variation_of_an_overlapped_generate():
    """``simulate`` with a variation: a generate on its own pool beside 1 s of training pays for its
    slow steps at K = 1, less at K = 2; the drawn steady state is the mean lengths'."""
    specs = [OpSpec("gen", 0, (), True), OpSpec("upd", 1, (("gen", 0.0),), False)]
    syncs = [SyncSpec("actor", "upd", (1, 0))]
    times = {"gen": np.array([0.9]), "upd": np.array([1.0])}
    sync = {syncs[0].id: np.array([0.0])}
    sizes = [np.array([1.0]), np.array([1.0])]
    dev = np.array([-0.7] * 8 + [0.7] * 8).reshape(SPREAD_POINTS, 1)
    out = {}
    for k in (1, 2):
        win: dict = {}
        per, _, _ = simulate(
            specs, syncs, times, sync, sizes, 1e12, 1e12, staleness=k, window=win, variation=Variation({"gen": dev})
        )
        out[k] = float(per[0])
        assert max(float(e[0]) for _, e in win.values()) == pytest.approx(1.0)  # the steady step at the mean
    assert out[1] == pytest.approx(1.3, abs=0.03) and out[2] < 1.1
    lock, _, _ = simulate(specs, syncs, times, sync, sizes, 1e12, 1e12, variation=Variation({"gen": dev}))
    assert float(lock[0]) == pytest.approx(1.9)  # lock-step: the generate's mean is on the path, its variation averages out


def test_a_step_whose_own_ops_queue_behind_the_generate_gains_nothing_from_a_deeper_buffer():
    """A reward model on the generation pool: the controller issues the rollouts ahead before the
    step's own ops, so the step's scoring waits behind every generate on that pool, and the update
    behind it, at any K: K = 2 is priced as K = 1 (no buffer absorbs a slow generate)."""
    specs = [
        OpSpec("gen", 0, (), True),
        OpSpec("lp", 1, (("gen", 0.0),), False),
        OpSpec("rm", 0, (("gen", 0.0),), False),
        OpSpec("upd", 1, (("lp", 0.0), ("rm", 0.0)), False),
    ]
    syncs = [SyncSpec("actor", "upd", (1, 0))]
    times = {"gen": np.array([0.9]), "lp": np.array([1.0]), "rm": np.array([0.1]), "upd": np.array([0.2])}
    sync = {syncs[0].id: np.array([0.05])}
    sizes = [np.array([1.0]), np.array([1.0])]
    dev = np.array([-0.7] * 8 + [0.7] * 8).reshape(SPREAD_POINTS, 1)
    per = {
        k: float(simulate(specs, syncs, times, sync, sizes, 1e12, 1e12, staleness=k, variation=Variation({"gen": dev}))[0][0])
        for k in (1, 2, 3)
    }
    steady = float(simulate(specs, syncs, times, sync, sizes, 1e12, 1e12, staleness=1)[0][0])
    assert steady == pytest.approx(1.25)  # max(lp 1.0, gen 0.9 + rm 0.1) + upd 0.2 + sync 0.05
    assert per[1] > steady * 1.1 and per[2] == pytest.approx(per[1]) and per[3] == pytest.approx(per[1])


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    path = tmp_path_factory.mktemp("flow") / "decoupled.py"
    path.write_text(DECOUPLED_FLOW.replace("{loss}", "decoupled_ppo(0.2)"))
    return load_flow(str(path)).trace()


def test_auto_staleness_takes_k2_where_measured_step_variation_holds_the_trainer_at_k1(graph):
    """Qwen2.5-7B on 32 H100s, 512 prompts, responses to 16k (mean 2k): the trainer is the busier
    pool. With the steps' means varying by 20 % (what lengths_from measures), a slow generate holds
    it at K = 1 (+6 %), and auto takes K = 2, which absorbs it; with no such variation, K = 1
    (the longest response alone varies little: the longest of 512 is near the limit every step)."""
    m = ModelSpec.resolve("qwen2.5-7b")
    cluster = ClusterSpec.parse("4x8xH100")

    def plan(cv: float, k: str):
        wl = WorkloadSpec(prompts=512, prompt_len=512, response_len=16384, mean_response_len=2000, mean_response_cv=cv)
        return make_plan(graph, {"actor": m, "ref": m}, cluster, wl, parse_pins([f"staleness={k}"]))[0]

    varied = {k: plan(0.2, k) for k in ("1", "2", "auto")}
    for p in varied.values():
        verify_plan(p)
    k1, k2 = varied["1"].predicted, varied["2"].predicted
    assert k1.step_time_s > k1.steady_step_s * 1.02  # the variation costs K = 1
    assert k2.step_time_s == pytest.approx(k2.steady_step_s, rel=1e-3)  # and K = 2 absorbs it
    assert varied["auto"].staleness == 2
    assert varied["auto"].why[0].startswith("Staleness (auto): 2 — step time by staleness: 0 → ")
    text = format_plan(varied["1"])
    assert (
        f"{k1.steady_step_s:.2f} s a step at the mean lengths, +{k1.step_time_s - k1.steady_step_s:.2f} s as generation varies"
        in text
    )
    assert "step means ±20 %" in text
    assert "a staleness of 2 or more absorbs slow generates" in " ".join(varied["1"].why)
    assert plan(0.0, "auto").staleness == 1
    assert math.isclose(plan(0.0, "1").predicted.step_time_s, k2.step_time_s, rel_tol=0.01)


def test_why_says_when_a_deeper_buffer_absorbs_the_variation_and_when_nothing_can(graph, tmp_path):
    """At K = 2 the variation may cost nothing for two opposite reasons, and why tells them apart:
    the buffer absorbs slow generates (the trainer is the busier pool), or the step waits for its
    generate anyway (the reference model queued behind it on its pool: the period follows the
    generate's mean). At K = 1 the advice to raise K respects the flow's declared bound."""
    m = ModelSpec.resolve("qwen2.5-7b")
    cluster = ClusterSpec.parse("4x8xH100")
    wl = WorkloadSpec(prompts=512, prompt_len=512, response_len=16384, mean_response_len=2000, mean_response_cv=0.2)

    def why(g, pins: list[str]) -> str:
        return " ".join(make_plan(g, {"actor": m, "ref": m}, cluster, wl, parse_pins(pins))[0].why)

    assert "the rollouts issued up to 2 steps ahead absorb them" in why(graph, ["staleness=2"])
    queued = why(graph, ["staleness=2", "colocate=actor.gen,ref;actor.train"])
    assert "period follows the generate's mean" in queued and "absorb them" not in queued
    assert "raise it" not in why(graph, ["staleness=1"])
    path = tmp_path / "bounded.py"
    path.write_text(DECOUPLED_FLOW.replace("{loss}", "decoupled_ppo(0.2)").replace("@fc.flow", "@fc.flow(max_staleness=1)"))
    bounded = load_flow(str(path)).trace()
    assert "this flow declares max_staleness=1: raise it to let the planner price 2" in why(bounded, ["staleness=1"])


def test_a_bad_variation_says_what_the_key_means():
    from flowc.errors import SpecError

    with pytest.raises(SpecError, match="less than or equal to 1") as e:
        WorkloadSpec.parse("prompts=8,mean_response_cv=1.5")
    assert "from 0 to 1 (0.2: ±20 %)" in e.value.fix
