"""Re-planning when the measured response lengths drift from the plan's (``flowc.replan``)."""

from __future__ import annotations

import pytest
from helpers import DECOUPLED_FLOW

from flowc.ir.cluster import ClusterSpec
from flowc.ir.models import ModelSpec
from flowc.ir.workload import WorkloadSpec
from flowc.loader import load_flow
from flowc.passes.pins import parse_pins, pins_from_plan
from flowc.passes.pipeline import make_plan
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


def test_longer_responses_switch_a_lock_step_split_to_one_step_off(tmp_path):
    """Planned lock-step on separate pools for 60-token responses; the run measures 1,200: on that
    placement staleness 1 is now faster, so a run whose staleness is the planner's switches in
    place, and the event says by how much; the best placement over all is priced beside it."""
    g = _graph(tmp_path)
    plan = make_plan(g, MODELS, CLUSTER, SHORT, parse_pins([*SPLIT, "staleness=0"]))[0]
    r = replan(12, plan, g, 1200.0, may_switch=True, best_plan=_best(g), out_dir=tmp_path)
    again = make_plan(g, MODELS, CLUSTER, at_length(SHORT, 1200.0), pins_from_plan(plan))[0]
    assert r.current_s == pytest.approx(again.predicted.step_time_s)  # the run's own plan at the measured length
    assert set(r.by_staleness) == {0, 1} and r.by_staleness[0] == r.current_s
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
    kept = replan(12, plan, g, 1200.0, may_switch=False, best_plan=_best(g))
    assert not kept.switched and kept.staleness_to == 0 and "→" not in kept.message().split("re-planned")[1].split(";")[0]


def test_a_flow_bounded_at_lock_step_or_without_a_correction_never_switches(tmp_path):
    g = _graph(tmp_path, "(max_staleness=0)")
    plan = make_plan(g, MODELS, CLUSTER, SHORT, parse_pins(SPLIT))[0]
    r = replan(4, plan, g, 1200.0, may_switch=True, best_plan=_best(g))
    assert set(r.by_staleness) == {0} and not r.switched
