"""The algorithms learn: each flow, on the built-in task, raises held-out accuracy.

Marked slow (CI runs them once): each trains the shipped tiny model for a few
hundred steps on this machine's CPUs and compares held-out accuracy (1,000
problems, greedy) before and after. The margins are about half of what
bench/algorithms.py measured (docs/algorithms.md), so a regression that
halves learning fails while seed-to-seed noise (±1.6 points of standard
error at 1,000 problems) does not."""

from __future__ import annotations

import json

import pytest
from helpers import EXAMPLES

from flowc.ir.run_config import RunConfig
from flowc.loader import load_flow
from flowc.run import BUILTIN_WORKLOAD, RunRequest, run

# flow: (steps, minimum gain in held-out accuracy, absolute points)
LEARNING = {
    "grpo": (200, 0.04),
    "rloo": (200, 0.04),
    "reinforce_pp": (200, 0.04),
    "ppo_rlvr": (200, 0.04),
}


def _run(tmp_path, flow: str, steps: int) -> list[dict]:
    req = RunRequest(
        flow=load_flow(str(EXAMPLES / f"{flow}.py")),
        overrides={},
        models={},
        data=None,
        eval_data=None,
        rewards={},
        cluster="local",
        workload=BUILTIN_WORKLOAD,
        steps=steps,
        out=str(tmp_path / flow),
        resume=None,
        rollout=None,
        pins=[],
        config=RunConfig(steps=steps, eval_every=steps, checkpoint_every=0),
    )
    out = run(req, progress=False)
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("flow", list(LEARNING))
def test_the_flow_raises_held_out_accuracy(ray_cluster, tmp_path, flow):
    steps, gain = LEARNING[flow]
    evals = [(r["step"], r["eval/accuracy"]) for r in _run(tmp_path, flow, steps) if "eval/accuracy" in r]
    assert [s for s, _ in evals] == [0, steps]
    before, after = evals[0][1], evals[-1][1]
    assert after - before >= gain, f"{flow}: held-out accuracy {before:.3f} -> {after:.3f} in {steps} steps"


@pytest.mark.slow
def test_dpo_prefers_the_chosen_answers_of_held_out_pairs(ray_cluster, tmp_path):
    steps = 100
    rows = [r for r in _run(tmp_path, "dpo", steps) if "eval/dpo_accuracy" in r]
    before, after = rows[0], rows[-1]
    assert before["eval/dpo_margin"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as the reference
    assert after["eval/dpo_margin"] > 0.5 and after["eval/dpo_accuracy"] >= 0.8, after
