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
    # the dict's other numbers are metrics: verl_style's "acc" is its 0/1 score as a bool
    assert [r["reward/acc/mean"] for r in verl] == [r["reward"] for r in verl]
    assert not any(k.endswith("/acc/mean") for k in trl[0])


def test_a_split_of_a_folder_and_a_held_out_split_reach_the_run(ray_cluster, tmp_path):
    """``--data FOLDER:train[:…]`` and ``--eval-data FOLDER`` (its ``test`` split) in verl's layout."""
    import pyarrow.parquet as pq

    table = pq.read_table(DATA / "arith_verl.parquet")
    (tmp_path / "d").mkdir()
    pq.write_table(table.slice(0, 200), tmp_path / "d" / "train.parquet")
    pq.write_table(table.slice(200), tmp_path / "d" / "test.parquet")
    cfg = RunConfig(steps=1, eval_every=1, checkpoint_every=0)
    req = request(
        tmp_path / "run", data=f"{tmp_path / 'd'}:train[:64]", eval_data=str(tmp_path / "d"),
        rewards={"reward": str(REWARDS / "verl_style.py:compute_score")}, config=cfg, steps=1,
        workload="prompts=8,prompt_len=8,response_len=6",
    )  # fmt: skip
    rows = read_metrics(run(req, progress=False) / "metrics.jsonl")
    assert any("eval/accuracy" in r for r in rows) and any(r.get("step") == 1 and "reward" in r for r in rows)
