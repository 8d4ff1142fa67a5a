"""``--workload lengths_from=RUN_DIR``: plan with the mean response length a run measured, and
the response-length percentiles a run records per step."""

from __future__ import annotations

import json
import math
import random
import statistics
import subprocess
from pathlib import Path

import pytest
from helpers import EXAMPLES, ROOT, flowc_cmd

from flowc.errors import SpecError
from flowc.ir.plan_text import format_plan
from flowc.lengths import LAST_STEPS, expand, step_cv
from flowc.loader import load_flow
from flowc.passes.pipeline import make_plan
from flowc.planning import build_request
from flowc.runtime.step_metrics import percentiles


def fake_run(tmp_path: Path, means: list[float], limit: int = 24) -> Path:
    run = tmp_path / "measured"
    run.mkdir()
    (run / "plan.json").write_text(json.dumps({"workload": {"prompts": 8, "response_len": limit}}))
    rows = [{"step": 0, "eval/accuracy": 0.3}]  # an evaluation row carries no lengths
    rows += [{"step": i + 1, "step_s": 1.0, "response_length/mean": m, "response_length/p90": m + 4} for i, m in enumerate(means)]
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 99, "step_'
    )  # a line being written
    return run


def test_the_mean_is_the_median_of_the_last_steps_and_the_limit_must_match(tmp_path):
    means = [24.0] * 5 + [float(x) for x in range(4, 4 + LAST_STEPS)]  # early steps run long, the last ten are 4..13
    run = fake_run(tmp_path, means)
    words, notes = expand(f"prompts=8,response_len=24,lengths_from={run}")
    assert words == "prompts=8,response_len=24,mean_response_len=8.5,mean_response_cv=0"  # a steady drift: no variation
    (note,) = notes
    assert "mean_response_len=8.5: measured by" in note and "steps 6-15" in note and "p90 12" in note and "limit 24" in note
    assert "step means ±0.0%" in note
    assert expand("prompts=8,response_len=24") == ("prompts=8,response_len=24", [])
    with pytest.raises(SpecError, match="sampled under response_len=24, this workload's is 48") as e:
        expand(f"response_len=48,lengths_from={run}")
    assert "response_len=24" in e.value.fix
    with pytest.raises(SpecError, match="both mean_response_len and lengths_from"):
        expand(f"response_len=24,mean_response_len=3,lengths_from={run}")
    with pytest.raises(SpecError, match="both mean_response_cv and lengths_from"):
        expand(f"response_len=24,mean_response_cv=0.3,lengths_from={run}")
    with pytest.raises(SpecError, match="not a run directory"):
        expand(f"response_len=24,lengths_from={tmp_path / 'nowhere'}")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "plan.json").write_text(json.dumps({"workload": {"response_len": 24}}))
    (empty / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/accuracy": 0.1}) + "\n")
    with pytest.raises(SpecError, match="no sampled response lengths"):
        expand(f"response_len=24,lengths_from={empty}")


def test_a_measured_mean_shortens_the_planned_generation(tmp_path):
    """The measured mean reaches the plan's workload, and a shorter mean prices a shorter rollout."""
    run = fake_run(tmp_path, [200.0] * LAST_STEPS, limit=2048)
    g = load_flow(str(EXAMPLES / "grpo.py")).trace()
    plans = {}
    for name, words in (
        ("limit", "prompts=256,response_len=2048"),
        ("measured", f"prompts=256,response_len=2048,lengths_from={run}"),
    ):
        req = build_request(g, model_words=["actor=qwen2.5-7b"], cluster="8xH100", workload=words, pin_words=None, plan_file=None)
        plans[name] = make_plan(g, req.models, req.cluster, req.workload, req.pins, target=req.target)[0]
        if name == "measured":
            assert req.workload.mean_response_len == 200 and any("measured by" in n for n in req.notes or [])
    gen = {k: p.roles["actor"].phases["generate"].time_s for k, p in plans.items()}
    assert gen["measured"] < 0.5 * gen["limit"], gen


def test_flowc_plan_takes_it_and_says_where_the_mean_came_from(tmp_path):
    run = fake_run(tmp_path, [5.0] * 3)
    args = ["plan", str(EXAMPLES / "grpo.py"), "--workload", f"prompts=8,prompt_len=8,response_len=24,lengths_from={run}"]
    r = subprocess.run(flowc_cmd(*args, "--json"), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout)["workload"]["mean_response_len"] == 5.0
    assert "mean_response_len=5.0: measured by" in r.stderr


def shaped_run(tmp_path: Path, name: str, mean: float, shape: tuple[float, ...], limit: int = 2048, steps: int = 3) -> Path:
    """A run whose every step recorded ``mean`` and ``shape`` as min/p50/p90/p99/max."""
    run = tmp_path / name
    run.mkdir()
    (run / "plan.json").write_text(json.dumps({"workload": {"prompts": 8, "response_len": limit}}))
    stats = dict(zip(("min", "p50", "p90", "p99", "max"), shape, strict=True))
    rows = [
        {"step": i, "step_s": 1.0, "response_length/mean": mean, **{f"response_length/{k}": v for k, v in stats.items()}}
        for i in range(steps)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_the_measured_shape_is_the_median_percentiles_made_ascending(tmp_path):
    run = tmp_path / "shape"
    run.mkdir()
    (run / "plan.json").write_text(json.dumps({"workload": {"response_len": 24}}))
    rows = [  # medians: min 2, p50 6, p90 5 (below p50: raised to 6), p99 20, max 24
        {"step": 1, "step_s": 1, "response_length/mean": 7, "response_length/min": 1, "response_length/p50": 6,
         "response_length/p90": 5, "response_length/p99": 20, "response_length/max": 24},
        {"step": 2, "step_s": 1, "response_length/mean": 8, "response_length/min": 2, "response_length/p50": 6,
         "response_length/p90": 4, "response_length/p99": 21, "response_length/max": 24},
        {"step": 3, "step_s": 1, "response_length/mean": 9, "response_length/min": 3, "response_length/p50": 7,
         "response_length/p90": 5, "response_length/p99": 19, "response_length/max": 24},
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    words, (note,) = expand(f"response_len=24,lengths_from={run}")
    assert words == "response_len=24,mean_response_len=8,response_percentiles=2/6/6/20/24,mean_response_cv=0"
    assert "min/p50/p90/p99/max 2/6/6/20/24" in note
    with pytest.raises(SpecError, match="both response_percentiles and lengths_from"):
        expand(f"response_len=24,response_percentiles=1/2/3/4/5,lengths_from={run}")


def test_a_measured_long_tail_costs_generation_time(tmp_path):
    """Of two runs, the one whose slowest responses run to the limit plans a longer rollout (the
    batch waits for them) than the one whose lengths are even, though its mean is shorter."""
    even = shaped_run(tmp_path, "even", 502, (480, 500, 520, 540, 560))
    tail = shaped_run(tmp_path, "tail", 475, (10, 200, 1100, 2048, 2048))
    g = load_flow(str(EXAMPLES / "grpo.py")).trace()
    gen = {}
    for name, run in (("even", even), ("tail", tail)):
        words = f"prompts=64,response_len=2048,lengths_from={run}"
        req = build_request(g, model_words=["actor=qwen2.5-7b"], cluster="8xH100", workload=words, pin_words=None, plan_file=None)
        assert req.workload.response_percentiles is not None
        plan = make_plan(g, req.models, req.cluster, req.workload, req.pins, target=req.target)[0]
        gen[name] = plan.roles["actor"].phases["generate"].time_s
        if name == "tail":
            assert "response 2048 (mean 475.0, min/p50/p90/p99/max 10/200/1100/2048/2048)" in format_plan(plan)
    assert gen["tail"] > 1.5 * gen["even"], gen


def test_the_step_to_step_variation_is_from_successive_differences(tmp_path):
    """Independent steps: their standard deviation; a steady drift of the means (a policy learning
    to answer longer) is no variation at all; a flat run has none; two steps say nothing. Above
    100 % the workload takes 100 % and the note says so."""
    assert step_cv([10.0, 10.0, 10.0]) == 0.0
    assert step_cv([float(x) for x in range(100, 1100, 100)]) == 0.0  # +100 a step, every step
    diffs = [4.0, -4.0] * 4 + [4.0]
    assert step_cv([8.0, 12.0] * 5) == pytest.approx(statistics.stdev(diffs) / math.sqrt(2) / 10)  # ±3.7 of 10
    rng = random.Random(0)
    noisy = [1000 + 100 * rng.gauss(0, 1) for _ in range(4000)]
    assert step_cv(noisy) == pytest.approx(0.1, rel=0.05)  # the steps' own spread
    drifting = [m + 0.5 * i for i, m in enumerate(noisy)]
    # the drift leaves the steps' spread alone (only the mean it is a share of grows)
    assert step_cv(drifting) == pytest.approx(step_cv(noisy) * statistics.fmean(noisy) / statistics.fmean(drifting), rel=1e-9)
    assert step_cv([1.0, 2.0]) is None
    run = fake_run(tmp_path, [100.0, 4000.0] * 5, limit=4096)
    words, (note,) = expand(f"response_len=4096,lengths_from={run}")
    assert words.endswith(",mean_response_cv=1") and "(priced as ±100%, the most the workload takes)" in note


def test_an_unreadable_run_is_refused_with_what_is_wrong(tmp_path):
    run = fake_run(tmp_path, [float("nan")] + [12.0] * 5)  # a non-finite mean (json writes NaN) is skipped
    words, _ = expand(f"response_len=24,lengths_from={run}")
    assert "mean_response_len=12," in words
    (run / "plan.json").write_text("{")
    with pytest.raises(SpecError, match=r"its plan\.json holds no workload\.response_len"):
        expand(f"response_len=24,lengths_from={run}")
    (run / "plan.json").write_text(json.dumps({"workload": {}}))
    with pytest.raises(SpecError, match=r"its plan\.json holds no workload\.response_len"):
        expand(f"response_len=24,lengths_from={run}")
    (tmp_path / "z").mkdir()
    empty = fake_run(tmp_path / "z", [0.0] * 5)
    with pytest.raises(SpecError, match="averaged 0 tokens — less than one"):
        expand(f"response_len=24,lengths_from={empty}")


def test_percentiles_are_nearest_rank():
    assert percentiles("x", list(range(1, 11))) == {"x/p50": 5.0, "x/p90": 9.0, "x/p99": 10.0}
    assert percentiles("x", [7]) == {"x/p50": 7.0, "x/p90": 7.0, "x/p99": 7.0} and percentiles("x", []) == {}
    assert percentiles("x", list(range(100, 0, -1)), (1, 100)) == {"x/p1": 1.0, "x/p100": 100.0}
