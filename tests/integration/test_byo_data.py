"""A verl-format and a TRL-format dataset train with their native reward signatures: verl's
parquet (chat-message prompts through the tokenizer's chat template, ``reward_model.ground_truth``)
with a per-sample ``compute_score``, and TRL's jsonl with a ``reward_func(prompts, completions,
**kwargs)``. Both files hold the same problems, so both runs must score identically."""

from __future__ import annotations

import pytest
from helpers import EXAMPLES, request

from flowc.ir.run_config import RunConfig
from flowc.report import read_metrics
from flowc.run import run

DATA = EXAMPLES / "data"
REWARDS = EXAMPLES / "rewards"

pytestmark = pytest.mark.slow


def _run(tmp_path, data: str, reward: str) -> list[dict]:
    cfg = RunConfig(steps=3, eval_every=0, checkpoint_every=0)
    req = request(
        tmp_path, data=str(DATA / data), rewards={"reward": str(REWARDS / reward)}, config=cfg,
        workload="prompts=8,prompt_len=8,response_len=6",
    )  # fmt: skip
    return [r for r in read_metrics(run(req, progress=False) / "metrics.jsonl") if "step_s" in r]


def test_verl_and_trl_layouts_train_with_their_own_rewards(ray_cluster, tmp_path):
    verl = _run(tmp_path / "verl", "arith_verl.parquet", "verl_style.py:compute_score")
    trl = _run(tmp_path / "trl", "arith_trl.jsonl", "trl_style.py:exact_answer")
    assert [r["step"] for r in verl] == [1, 2, 3] == [r["step"] for r in trl]
    # the chat template renders the same tokens as the text prompt, the ground truth reaches the
    # per-sample function: the same samples, the same scores
    assert [r["reward"] for r in verl] == [r["reward"] for r in trl]
    assert sum(r["reward"] for r in verl) > 0  # the warm-started model answers some: scores are read, not 0.0
