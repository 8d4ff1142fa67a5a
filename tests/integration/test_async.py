"""Rollouts that lag the trainer (``staleness`` K): the generation engine samples step s+K while
the trainer trains step s, on real Ray workers with the generation engine in a pool of its own."""

from __future__ import annotations

import json

import pytest
from helpers import request

from flowc.errors import SpecError
from flowc.ir.run_config import RunConfig
from flowc.loader import load_flow
from flowc.run import prepare, run

WORKLOAD = "prompts=8,prompt_len=8,response_len=6"
SEPARATE = ["colocate=actor.train;actor.gen"]  # the engine in its own pool: it generates while the trainer trains

FLOW = """
import flowc as fc

@fc.flow
def decoupled(prompts: fc.Prompts, actor: fc.Policy, reward: fc.Reward, *, n: int = 4):
    rollout = actor.generate(prompts, n=n)
    old = actor.logprobs(rollout)
    adv = fc.ops.group_normalize(reward(rollout), group_size=n)
    actor.update(rollout, advantages=adv, old_logprobs=old, loss=fc.losses.{loss})
"""


def _flow(tmp_path, loss: str = "decoupled_ppo(0.2)"):
    path = tmp_path / "flow.py"
    path.write_text(FLOW.replace("{loss}", loss))
    return load_flow(str(path))


def _rows(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"step_s"' in x]


@pytest.mark.parametrize("k", [1, 2])
def test_rollouts_lag_the_trainer_by_at_most_k_versions(ray_cluster, tmp_path, k):
    """Step s trains on rollouts sampled with the weights of step s−K (or the initial weights):
    the lag is 0, 1, …, K, K, …; the engine's samples then differ from the trainer's policy
    (the mismatch the correction weighs), and every sync still delivers the trained weights."""
    cfg = RunConfig(steps=4, eval_every=0, checkpoint_every=0, staleness=k)
    req = request(tmp_path, flow=_flow(tmp_path), cluster="local:2", workload=WORKLOAD, config=cfg, steps=4, pins=SEPARATE)
    rows = _rows(run(req, progress=False))
    assert [m["rollout/staleness"] for m in rows] == [min(s, k) for s in range(4)]
    assert rows[0]["actor/mismatch_kl"] < 1e-6  # step 0 samples with the weights it trains
    assert all(m["actor/mismatch_kl"] > 1e-6 for m in rows[1:])  # later steps with older ones
    assert all(m["actor/sync_probe_diff"] < 1e-5 for m in rows)
    assert all(m["actor/is_weight"] > 0 for m in rows)
    for pool in ("actor.gen", "actor.train"):  # each pool's measured share of the step, beside the plan's
        assert all(m[f"pool/{pool}/busy_s"] > 0 and m[f"pool/{pool}/busy_predicted_s"] > 0 for m in rows)
        assert all(0.0 <= m[f"pool/{pool}/idle_fraction"] <= 1.0 for m in rows)


def test_the_lock_step_run_is_unchanged_by_the_pipeline(ray_cluster, tmp_path):
    """staleness 0 issues the same calls as before: the first step of a K=1 run (which samples the
    same initial weights) equals the lock-step run's."""
    outs = {}
    for k in (0, 1):
        cfg = RunConfig(steps=2, eval_every=0, checkpoint_every=0, staleness=k, seed=3)
        req = request(
            tmp_path / str(k), flow=_flow(tmp_path), cluster="local:2", workload=WORKLOAD, config=cfg, steps=2, pins=SEPARATE
        )
        outs[k] = _rows(run(req, progress=False))
    keys = ["reward", "actor/pg_loss", "actor/entropy", "response_length/mean"]
    assert {x: outs[0][0][x] for x in keys} == {x: outs[1][0][x] for x in keys}
    assert "rollout/staleness" not in outs[0][0]


@pytest.mark.parametrize(
    "loss, match",
    [
        ("ppo_clip(0.2)", "assumes on-policy samples"),
        ("policy_gradient()", "assumes on-policy samples"),
    ],
)
def test_staleness_without_a_correction_is_refused(tmp_path, loss, match):
    cfg = RunConfig(steps=2, eval_every=0, checkpoint_every=0, staleness=1)
    with pytest.raises(SpecError, match=match) as e:  # when it is planned, before anything starts
        prepare(request(tmp_path, flow=_flow(tmp_path, loss), cluster="local:1", workload=WORKLOAD, config=cfg))
    assert "decoupled_ppo" in e.value.fix and "staleness=0" in e.value.fix


def test_staleness_with_dynamic_sampling_is_refused(tmp_path):
    cfg = RunConfig(steps=2, eval_every=0, checkpoint_every=0, staleness=1)
    with pytest.raises(SpecError, match="filter"):
        prepare(request(tmp_path, flow="dapo", cluster="local:1", workload=WORKLOAD, config=cfg))


def test_a_saved_lock_step_plan_is_not_run_ahead(tmp_path):
    """The staleness is the plan's decision: a saved lock-step plan run with --staleness 1 is refused."""
    cfg0 = RunConfig(steps=2, eval_every=0, checkpoint_every=0)
    prep = prepare(request(tmp_path, flow=_flow(tmp_path), cluster="local:1", workload=WORKLOAD, config=cfg0))
    assert prep.plan.staleness == 0 and prep.run.program.staleness == 0
    saved = tmp_path / "plan.json"
    saved.write_text(prep.plan.model_dump_json())
    cfg1 = RunConfig(steps=2, eval_every=0, checkpoint_every=0, staleness=1)
    with pytest.raises(SpecError, match=r"staleness=1 \(the plan's: 0\)"):
        prepare(request(tmp_path, flow=_flow(tmp_path), cluster="local:1", config=cfg1, plan_file=str(saved), workload=None))
    ahead = prepare(request(tmp_path, flow=_flow(tmp_path), cluster="local:1", workload=WORKLOAD, config=cfg1))
    assert ahead.plan.staleness == 1 and ahead.run.program.staleness == 1
