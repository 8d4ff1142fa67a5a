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
    # each sync is checked: at K = 2 at the end of the next step (the first step reports none, the last two)
    assert all(m["actor/sync_probe_diff"] < 1e-5 for m in rows[k - 1 :])
    assert [m.get("actor/sync_step") for m in rows] == ([None] * 4 if k == 1 else [None, 1, 2, None])
    assert all(m["actor/is_weight"] > 0 for m in rows)
    for pool in ("actor.gen", "actor.train"):  # each pool's measured share of the step, beside the plan's
        assert all(m[f"pool/{pool}/busy_s"] > 0 and m[f"pool/{pool}/busy_predicted_s"] > 0 for m in rows)
        assert all(0.0 <= m[f"pool/{pool}/idle_fraction"] <= 1.0 for m in rows)


def test_a_slow_trainer_never_trains_older_samples_nor_buffers_more_than_k(ray_cluster, tmp_path):
    """The trainer's side of the step is made slow (its reward sleeps) while generation is fast, so
    an unbounded engine would race ahead: the lag the engine reports stays 0, 1, 2, 2, …, at most
    K = 2 steps' rollouts wait issued ahead, the generation pool idles, and `flowc report` shows
    the histogram."""
    from flowc.report import pipeline_summary

    k, steps = 2, 6
    (tmp_path / "slow_reward.py").write_text(
        "import time\n\n\ndef slow(prompts, responses, **_):\n"
        "    time.sleep(1.2)\n"  # far longer than a generate, even on a loaded machine
        "    return [float(len(r) % 2) for r in responses]\n"
    )
    cfg = RunConfig(steps=steps, eval_every=0, checkpoint_every=0, staleness=k)
    req = request(tmp_path, flow=_flow(tmp_path), cluster="local:2", workload=WORKLOAD, config=cfg, steps=steps, pins=SEPARATE)
    req.rewards = {"reward": f"{tmp_path / 'slow_reward.py'}:slow"}
    out = run(req, progress=False)
    rows = _rows(out)
    assert [m["rollout/staleness"] for m in rows] == [min(s, k) for s in range(steps)]
    assert [m["rollout/buffered"] for m in rows] == [min(k, steps - 1 - s) for s in range(steps)]
    assert all(m["pool/actor.gen/idle_fraction"] > 0.5 for m in rows[1:])  # it waited for the trainer, not ran on
    text = pipeline_summary(out)
    assert f"  2 behind: {steps - 2} step(s)" in text and "at most 2 step(s) issued ahead" in text


def test_at_k_2_the_trainer_goes_on_while_the_engine_generates_two_steps_ahead(ray_cluster, tmp_path):
    """Generation is made slow (every trajectory's environment takes 50 ms to reset, one environment
    process: about 1.6 s a generate) and training fast. At K = 2 the engine runs step s−1's weight sync
    after the generate of step s+1, and the controller waits for (and checks) it only at the end of
    step s: so step s's training starts while that sync has not run yet — the trainer never waits
    for rollouts it does not train on next. Waiting for each step's own sync at its end would start
    step s's training only after it."""
    (tmp_path / "slow_env.py").write_text(
        "import time\n\nfrom flowc.tasks.calculator import Calculator\n\n\nclass SlowCalc(Calculator):\n"
        "    def reset(self, record):\n        time.sleep(0.05)\n        return super().reset(record)\n"
    )
    (tmp_path / "tool_flow.py").write_text(
        "import flowc as fc\n\n\n@fc.flow\n"
        "def tool_async(prompts: fc.Prompts, actor: fc.Policy, calc: fc.Environment, *, n: int = 4):\n"
        "    rollout = actor.generate(prompts, n=n, env=calc, max_turns=1)\n"
        "    old = actor.logprobs(rollout)\n"
        "    adv = fc.ops.group_normalize(rollout.env_reward, group_size=n)\n"
        "    actor.update(rollout, advantages=adv, old_logprobs=old, loss=fc.losses.decoupled_ppo(0.2))\n"
    )
    steps = 4
    cfg = RunConfig(steps=steps, eval_every=0, checkpoint_every=0, staleness=2, env_workers=1)
    req = request(
        tmp_path,
        flow=load_flow(str(tmp_path / "tool_flow.py")),
        cluster="local:2",
        workload=WORKLOAD,
        config=cfg,
        steps=steps,
        pins=SEPARATE,
        envs={"calc": f"{tmp_path / 'slow_env.py'}:SlowCalc"},
    )
    rows = _rows(run(req, progress=False))
    assert [m["rollout/staleness"] for m in rows] == [0, 1, 2, 2]
    assert [m.get("actor/sync_step") for m in rows] == [None, 1, 2, None]  # the last step checks the last two
    assert all(m["actor/sync_probe_diff"] < 1e-5 for m in rows[1:])
    for m in rows[1:3]:  # step s's row: its own ops and the sync of step s−1, from the step's start
        tl = m["timeline_s"]
        assert tl["actor.generate"][1] > 1.0  # (the slow environment)
        sync_end = tl["actor.weight_sync"][0] + tl["actor.weight_sync"][1]
        assert tl["actor.logprobs"][0] < sync_end - 0.3, tl


def test_a_run_stopped_early_checks_the_syncs_it_deferred(ray_cluster, tmp_path):
    """At K = 2 step s's sync is checked in step s+1; a run stopped after step 2 of 4 (a signal)
    checks the one left (flush_syncs, which flowc run calls before the stop's checkpoint)."""
    from flowc.runtime.controller import Controller

    cfg = RunConfig(steps=4, eval_every=0, checkpoint_every=0, staleness=2)
    spec = prepare(
        request(tmp_path, flow=_flow(tmp_path), cluster="local:2", workload=WORKLOAD, config=cfg, steps=4, pins=SEPARATE)
    ).run
    ctl = Controller(spec)
    try:
        ctl.start()
        rows = [ctl.run_step(s) for s in range(2)]
        assert "actor/sync_probe_diff" not in rows[0] and rows[1]["actor/sync_step"] == 1
        (check,) = ctl.syncs.checks.values()
        before = check.last
        ctl.flush_syncs()  # the sync of step 2, run by the engine after the generate of step 4's
        assert check.last is not None and check.last is not before
        assert not ctl.syncs.queue.pending and not ctl.syncs.queue.taken
    finally:
        ctl.shutdown()


def test_the_staleness_switches_between_steps_and_the_lag_stays_within_what_each_rollout_was_issued_under(ray_cluster, tmp_path):
    """A re-plan lowers K from 1 to 0 after step 2 and raises it back after step 4: the rollouts
    issued ahead under K = 1 are still trained on (lag 1, allowed: issued under K = 1), then
    lock-step (lag 0, nothing issued ahead), then ahead again."""
    from flowc.runtime.controller import Controller

    cfg = RunConfig(steps=6, eval_every=0, checkpoint_every=0, staleness=1)
    spec = prepare(
        request(tmp_path, flow=_flow(tmp_path), cluster="local:2", workload=WORKLOAD, config=cfg, steps=6, pins=SEPARATE)
    ).run
    ctl = Controller(spec)
    rows = []
    try:
        ctl.start()
        for s in range(6):
            if s == 2:
                ctl.set_staleness(0)
            if s == 4:
                ctl.set_staleness(1)
            rows.append(ctl.run_step(s))
        with pytest.raises(SpecError, match="assumes on-policy"):  # the verifier still holds
            Controller(
                prepare(
                    request(tmp_path / "naive", flow=_flow(tmp_path, "ppo_clip(0.2)"), cluster="local:2", workload=WORKLOAD)
                ).run
            ).set_staleness(1)
    finally:
        ctl.shutdown()
    assert [m["rollout/staleness"] for m in rows] == [0, 1, 1, 0, 0, 1]
    assert [m["rollout/buffered"] for m in rows] == [1, 1, 0, 0, 1, 0]
    assert all(m["actor/sync_probe_diff"] < 1e-5 for m in rows)


def test_a_run_replans_when_the_measured_lengths_drift(ray_cluster, tmp_path):
    """The plan assumes 1-token responses; the run measures ~6: every 2 steps it re-plans at the
    measured length and logs the event with its predicted figures (then the plan's length is the
    measured one: no second event while it holds)."""
    cfg = RunConfig(steps=5, eval_every=0, checkpoint_every=0, staleness="auto", replan_every=2)
    wl = f"{WORKLOAD},mean_response_len=1"
    out = run(
        request(tmp_path, flow=_flow(tmp_path), cluster="local:2", workload=wl, config=cfg, steps=5, pins=SEPARATE),
        progress=False,
    )
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    events = [e for e in lines if e.get("event") == "replan"]
    rows = _rows(out)
    assert len(events) == 1 and events[0]["step"] == 2
    (ev,) = events
    assert ev["replan/planned_response_len"] == 1.0
    assert ev["replan/measured_response_len"] == pytest.approx(sum(r["response_length/mean"] for r in rows[:2]) / 2, abs=1e-3)
    assert "replan/measured_response_cv" not in ev  # two steps say nothing of how the steps vary
    assert ev["replan/predicted_step_s"] > 0 and ev["replan/best_step_s"] > 0 and ev["replan/best_gain"] > 0
    assert ev["replan/staleness_to"] in (0, 1, 2) and set(ev["replan/staleness_step_s"]) == {"0", "1", "2"}
    assert ev["replan/best_placement"] == "actor.gen ×1 | actor.train ×1"  # the run's pins hold in the re-plan
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]


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


def test_a_saved_plan_may_not_lag_more_than_the_flow_declares(tmp_path):
    """A plan made at staleness 2 before the flow declared max_staleness=1 is refused when run."""
    cfg2 = RunConfig(steps=2, eval_every=0, checkpoint_every=0, staleness=2)
    prep = prepare(request(tmp_path, flow=_flow(tmp_path), cluster="local:1", workload=WORKLOAD, config=cfg2))
    saved = tmp_path / "plan.json"
    saved.write_text(prep.plan.model_dump_json())
    path = tmp_path / "bounded.py"
    path.write_text(FLOW.replace("@fc.flow\n", "@fc.flow(max_staleness=1)\n").replace("{loss}", "decoupled_ppo(0.2)"))
    cfg = RunConfig(steps=2, eval_every=0, checkpoint_every=0)
    with pytest.raises(SpecError, match=r"2 weight version\(s\) behind the trainer, but flow 'decoupled' declares") as e:
        prepare(request(tmp_path, flow=load_flow(str(path)), cluster="local:1", config=cfg, plan_file=str(saved), workload=None))
    assert "plan the flow again" in e.value.fix
