"""``reward_workers``: a call's responses are shared, in contiguous order, among a pool of reward
processes that score at once; errors still name the response's place in the whole batch, and
a dict's extra numbers are the whole batch's means."""

from __future__ import annotations

import os
import time

import pytest
import ray
import torch

from flowc.errors import DataError
from flowc.rewards import adapt
from flowc.runtime.rewards import Rewards, _shares
from flowc.tasks.arithmetic import exact_match

pytestmark = pytest.mark.slow


def pid_and_index(prompts, responses, **columns):
    return [{"score": float(os.getpid()), "index": float(i)} for i in columns["i"]]


def sleepy(data_source, solution_str, ground_truth):
    time.sleep(0.5)
    return float(solution_str == ground_truth)


def none_at_5(prompts, responses, **columns):
    return [None if i == 5 else 0.0 for i in columns["i"]]


def test_shares_are_contiguous_and_cover_every_response():
    assert _shares(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert _shares(2, 4) == [(0, 1), (1, 2)] and _shares(0, 4) == [(0, 0)]


def test_a_pool_shares_a_call_among_its_processes(ray_cluster):
    fns = {"a": pid_and_index, "slow": adapt(sleepy), "bad": none_at_5}
    pool = Rewards(fns, {}, timeout_s=60, workers=3)
    try:
        cols = {"i": list(range(9))}
        scores, extras = pool.score_with_metrics("a", ["p"] * 9, ["r"] * 9, cols, where="test")
        pids = scores.tolist()
        assert len(set(pids)) == 3 and pids == sorted(pids, key=pids.index)  # three processes, contiguous shares
        assert extras == {"index": pytest.approx(4.0)}  # the whole batch's mean, not a share's
        # per-sample calls that take 0.5 s each: 6 responses in 2 rounds of 3, not 6 one after another
        verl_cols = {"data_source": ["d"] * 6, "reward_model": [{"ground_truth": "1"}] * 6}
        pool.score("slow", ["p"] * 6, ["1"] * 6, verl_cols, where="warm-up")  # actors started
        t = time.perf_counter()
        assert pool.score("slow", ["p"] * 6, ["1", "2"] * 3, verl_cols, where="test").tolist() == [1.0, 0.0] * 3
        assert time.perf_counter() - t < 2.5
        with pytest.raises(DataError, match=r"at step 3: reward function bad returned None for response 5"):
            pool.score("bad", ["p"] * 9, ["r"] * 9, cols, where="step 3")
    finally:
        pool.stop()


def verl_match(data_source, solution_str, ground_truth):
    return float(solution_str == ground_truth)


def test_a_reward_process_holds_no_torch(ray_cluster):
    """The built-in task's reward and a verl-convention one (behind flowc's adapter) need no torch,
    so their process loads none (a second copy of torch is ~250 MB resident per reward worker);
    scores still come back as one float32 tensor."""
    pool = Rewards({"r": exact_match, "v": adapt(verl_match)}, {}, timeout_s=60)
    try:
        got = pool.score("r", ["1+1=", "2+2="], ["2", "5"], {"answer": ["2", "4"]}, where="test")
        assert got.dtype == torch.float32 and got.tolist() == [1.0, 0.0]
        verl_cols = {"data_source": ["d"] * 2, "reward_model": [{"ground_truth": "1"}] * 2}
        assert pool.score("v", ["p"] * 2, ["1", "2"], verl_cols, where="test").tolist() == [1.0, 0.0]
        assert not ray.get(pool._actors()[0].imported.remote("torch"))
    finally:
        pool.stop()
