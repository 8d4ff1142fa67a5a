"""Re-planning when the measured response lengths drift from the plan's (``flowc.replan``)."""

from __future__ import annotations

import pytest
from helpers import DECOUPLED_FLOW

from flowc.ir.cluster import ClusterSpec
from flowc.ir.models import ModelSpec
from flowc.ir.workload import WorkloadSpec
from flowc.loader import load_flow
from flowc.passes.pins import parse_pins, pins_from_plan
from flowc.passes.pipeline import AUTO_TOLERANCE, make_plan
from flowc.planning import read_plan
from flowc.replan import REPLACE_GAIN, at_length, measured_length, planned_length, replan

M = ModelSpec.resolve("qwen2.5-1.5b")
MODELS = {"actor": M, "ref": M}
CLUSTER = ClusterSpec.parse("4x8xH100")
SHORT = WorkloadSpec(prompts=128, prompt_len=512, response_len=4096, mean_response_len=60)
SPLIT = ["colocate=actor.train,ref;actor.gen"]


def _graph(tmp_path, decl: str = ""):
    path = tmp_path / f"flow{abs(hash(decl))}.py"
    path.write_text(DECOUPLED_FLOW.replace("@fc.flow\n", f"@fc.flow{decl}\n").replace("{loss}", "decoupled_ppo(0.2)"))
    return load_flow(str(path)).trace()


def _best(g):
    return lambda wl: make_plan(g, MODELS, CLUSTER, wl, parse_pins(["staleness=auto"]))[0]


def test_lengths_measured_planned_and_moved():
    rows = [{"response_length/mean": 10.0}, {"step_s": 1.0}, {"response_length/mean": 20}]
    assert measured_length(rows) == 15.0 and measured_length([{"step_s": 1.0}]) is None
    assert planned_length(SHORT) == 60.0 and planned_length(SHORT.model_copy(update={"mean_response_len": None})) == 4096
    moved = at_length(SHORT.model_copy(update={"response_percentiles": (1, 50, 90, 99, 4000)}), 9000.0)
    assert moved.mean_response_len == 4096 and moved.response_percentiles is None  # capped; old distribution dropped
    assert at_length(SHORT, 0.2).mean_response_len == 1.0
    varied = at_length(SHORT.model_copy(update={"mean_response_cv": 0.05}), 100.0, 0.3)
    assert varied.mean_response_cv == 0.3  # the steps' measured variation replaces the planned one
    assert at_length(varied, 100.0).mean_response_cv == 0.3  # not measured: kept


def test_longer_responses_switch_a_lock_step_split_to_one_step_off(tmp_path):
    """Planned lock-step on separate pools for 60-token responses; the run measures 1,200: on that
    placement staleness 1 is now faster, so a run whose staleness is the planner's switches in
    place, and the event says by how much; the best placement over all is priced beside it."""
    g = _graph(tmp_path)
    plan = make_plan(g, MODELS, CLUSTER, SHORT, parse_pins([*SPLIT, "staleness=0"]))[0]
    r = replan(12, plan, g, MODELS, 1200.0, may_switch=True, best_plan=_best(g), out_dir=tmp_path)
    again = make_plan(g, MODELS, CLUSTER, at_length(SHORT, 1200.0), pins_from_plan(plan))[0]
    assert r.current_s == pytest.approx(again.predicted.step_time_s)  # the run's own plan at the measured length
    assert set(r.by_staleness) == {0, 1, 2} and r.by_staleness[0] == r.current_s
    assert r.by_staleness[2] == pytest.approx(r.by_staleness[1], rel=AUTO_TOLERANCE)  # no variation measured: K = 1 suffices
    assert r.by_staleness[1] < r.by_staleness[0] and r.switched and (r.staleness_from, r.staleness_to) == (0, 1)
    ev = r.event()
    assert ev["event"] == "replan" and ev["step"] == 12
    assert ev["replan/planned_response_len"] == 60.0 and ev["replan/measured_response_len"] == 1200.0
    assert ev["replan/staleness_gain"] == pytest.approx(r.by_staleness[0] / r.by_staleness[1], rel=1e-3)
    assert ev["replan/staleness_gain"] > 1.02
    assert ev["replan/best_step_s"] <= min(r.by_staleness.values()) * 1.0001  # the search includes this placement
    assert "staleness 0 → 1 on the same placement" in r.message()
    assert r.best_path is not None  # a better placement (separate pools of another size) is written, loadable, said
    assert r.best_gain > 1 + REPLACE_GAIN and read_plan(r.best_path).predicted.step_time_s == ev["replan/best_step_s"]
    assert str(r.best_path) in r.message() and "needs a new run" in r.message()
    kept = replan(12, plan, g, MODELS, 1200.0, may_switch=False, best_plan=_best(g))
    assert not kept.switched and kept.staleness_to == 0 and "→" not in kept.message().split("re-planned")[1].split(";")[0]


def test_a_flow_bounded_at_lock_step_or_without_a_correction_never_switches(tmp_path):
    g = _graph(tmp_path, "(max_staleness=0)")
    plan = make_plan(g, MODELS, CLUSTER, SHORT, parse_pins(SPLIT))[0]
    r = replan(4, plan, g, MODELS, 1200.0, may_switch=True, best_plan=_best(g))
    assert set(r.by_staleness) == {0} and not r.switched


def test_a_co_located_run_ahead_switches_down_to_lock_step(tmp_path):
    """On one shared pool running ahead buys nothing: the planner would now choose lock-step, and a
    re-plan switches down (fresher samples at no cost)."""
    g = _graph(tmp_path)
    plan = make_plan(g, MODELS, CLUSTER, SHORT, parse_pins(["colocate=actor.train,actor.gen,ref", "staleness=1"]))[0]
    r = replan(3, plan, g, MODELS, 1200.0, may_switch=True, best_plan=_best(g))
    assert r.by_staleness[0] == pytest.approx(r.by_staleness[1], rel=1e-6)
    assert r.switched and (r.staleness_from, r.staleness_to) == (1, 0)


def test_a_flow_without_a_correction_never_switches(tmp_path):
    path = tmp_path / "naive.py"
    path.write_text(DECOUPLED_FLOW.replace("{loss}", "ppo_clip(0.2)"))
    g = load_flow(str(path)).trace()
    plan = make_plan(g, MODELS, CLUSTER, SHORT, parse_pins(SPLIT))[0]
    r = replan(4, plan, g, MODELS, 1200.0, may_switch=True, best_plan=_best(g))
    assert set(r.by_staleness) == {0} and not r.switched


# ----------------------------------------------------------- the run's side: flowc.replan.maybe_replan
class _Log:
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def write(self, m: dict) -> None:
        self.rows.append(m)


class _Ctl:
    def __init__(self, lengths: list[float]) -> None:
        self.history = [{"step": i + 1, "step_s": 1.0, "response_length/mean": x} for i, x in enumerate(lengths)]
        self.switched_to: list[int] = []

    def set_staleness(self, k: int) -> None:
        self.switched_to.append(k)


def _replan_in_run(tmp_path, *, config, pins=(), plan_file=None, sources=None, lengths=(1200.0, 1200.0)):
    from types import SimpleNamespace

    from flowc.replan import maybe_replan

    flow_path = tmp_path / "declared.py"
    flow_path.write_text(
        DECOUPLED_FLOW.replace("@fc.flow\n", "@fc.flow(max_staleness=1)\n").replace("{loss}", "decoupled_ppo(0.2)")
    )
    flow = load_flow(str(flow_path))
    g = flow.trace()
    plan = make_plan(g, MODELS, CLUSTER, SHORT, parse_pins([*SPLIT, "staleness=0"]))[0]
    req = SimpleNamespace(flow=flow, overrides={}, pins=[*SPLIT, *pins], plan_file=plan_file, rollout=None, cluster="4x8xH100")
    run = SimpleNamespace(
        config=config, model_sources=sources or {"actor": "qwen2.5-1.5b", "ref": "qwen2.5-1.5b"}, out_dir=tmp_path
    )
    ctl, log = _Ctl(list(lengths)), _Log()
    after = maybe_replan(req, SimpleNamespace(run=run, address="ray://elsewhere"), ctl, plan, 2, log)
    return after, ctl, log


def test_the_run_switches_only_a_staleness_the_planner_chose(tmp_path):
    from flowc.ir.run_config import RunConfig

    cfg = RunConfig(replan_every=2)  # the flow declares max_staleness=1 and the run asks nothing: the planner's
    after, ctl, log = _replan_in_run(tmp_path, config=cfg)
    (ev,) = log.rows
    assert ctl.switched_to == [1] and ev["replan/switched"] and after.staleness == 1
    assert after.workload["mean_response_len"] == 1200.0  # the next check compares with the measured length
    for asked in (dict(config=RunConfig(replan_every=2, staleness=0)), dict(config=cfg, pins=["staleness=0"])):
        _, ctl, log = _replan_in_run(tmp_path, **asked)  # an explicit lock-step stays lock-step
        assert ctl.switched_to == [] and not log.rows[0]["replan/switched"]
    _, ctl, _ = _replan_in_run(tmp_path, config=cfg, plan_file="saved.json")  # a saved plan runs unchanged
    assert ctl.switched_to == []
    same, ctl, log = _replan_in_run(tmp_path, config=cfg, lengths=(70.0, 66.0))  # within the drift: nothing
    assert log.rows == [] and ctl.switched_to == [] and same.workload["mean_response_len"] == 60.0


def test_a_failing_replan_is_said_and_the_run_goes_on(tmp_path, capsys):
    from flowc.ir.run_config import RunConfig

    after, ctl, log = _replan_in_run(
        tmp_path, config=RunConfig(replan_every=2), sources={"actor": "no-such-model", "ref": "no-such-model"}
    )
    (ev,) = log.rows
    assert ev["event"] == "replan" and "no-such-model" in ev["replan/error"] and ctl.switched_to == []
    assert "the run goes on with its plan" in capsys.readouterr().err
    assert after.staleness == 0 and after.workload["mean_response_len"] == 1200.0  # not retried until it moves again


def test_a_replan_that_fails_outside_the_planner_does_not_stop_the_run_either(tmp_path, capsys):
    """A file where the re-plan writes its plans: an OSError, said, and the run goes on."""
    from flowc.ir.run_config import RunConfig

    (tmp_path / "replans").write_text("in the way")
    _, ctl, log = _replan_in_run(tmp_path, config=RunConfig(replan_every=2))
    (ev,) = log.rows
    assert ev["replan/error"].startswith(("FileExistsError", "NotADirectoryError")) and ctl.switched_to == []
    assert "the run goes on with its plan" in capsys.readouterr().err
