"""`flowc plan FILE` plans exactly what `flowc run FILE` runs (workload, backends, worker split):
the plan it prints equals the one `flowc run FILE --dry-run` prints, for the built-in default
and for the user's own data; and --dry-run starts nothing and writes no run folder."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers import EXAMPLES, ROOT, flowc_cmd


def flowc(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    r = subprocess.run(flowc_cmd(*args), cwd=cwd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture
def user_data(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(32)))
    rw = tmp_path / "rw.py"
    rw.write_text(
        "def exact(prompts, responses, answer):\n    return [float(r.strip() == a) for r, a in zip(responses, answer)]\n"
    )
    return ["--data", str(data), "--reward", f"reward={rw}:exact"]


@pytest.mark.parametrize("inputs", ["builtin", "user"])
def test_plan_equals_the_plan_the_run_runs(inputs, user_data, tmp_path):
    grpo = str(EXAMPLES / "grpo.py")
    extra = user_data if inputs == "user" else []
    planned = flowc("plan", grpo, *extra).stdout
    dry = flowc("run", grpo, *extra, "--dry-run", "--out", str(tmp_path / "never")).stdout
    assert planned == dry
    assert not (tmp_path / "never").exists()  # a dry run writes no run folder
    from flowc.run import BUILTIN_WORKLOAD, USER_WORKLOAD

    wl = dict(kv.split("=") for kv in (USER_WORKLOAD if inputs == "user" else BUILTIN_WORKLOAD).split(","))
    assert f"workload  {wl['prompts']} prompts/step, prompt {wl['prompt_len']}, response {wl['response_len']}" in planned
    as_json = json.loads(flowc("plan", grpo, *extra, "--json").stdout)
    assert as_json["workload"]["prompts"] == int(wl["prompts"])


def test_config_and_sets_reach_the_plan(tmp_path):
    grpo = str(EXAMPLES / "grpo.py")
    cfg = tmp_path / "run.yaml"
    cfg.write_text("workload: prompts=16,prompt_len=8,response_len=6\n")
    args = ["--config", str(cfg), "--set", "workload.prompts=32", "--set", "rollout=hf"]
    planned = flowc("plan", grpo, *args).stdout
    assert planned == flowc("run", grpo, *args, "--dry-run").stdout
    assert "workload  32 prompts/step, prompt 8, response 6" in planned
    assert " hf " in planned and "vllm" not in planned


def test_a_hardware_what_if_keeps_the_planner_workload():
    r = flowc("plan", str(EXAMPLES / "grpo.py"), "--model", "actor=qwen2.5-7b", "--cluster", "8xH100", "--json")
    assert json.loads(r.stdout)["workload"]["prompts"] == 1024


def test_a_wrong_set_key_fails_before_planning():
    r = subprocess.run(
        flowc_cmd("run", str(EXAMPLES / "grpo.py"), "--dry-run", "--set", "optim.actor.lrr=1e-5"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1 and "did you mean 'lr'" in r.stderr and "fix: valid keys: lr, lr_scheduler" in r.stderr


def test_pins_that_need_two_pools_split_the_local_cores(monkeypatch):
    """On this machine's CPUs the worker split is a decision too: a pin that puts generation in a
    pool of its own cannot fit one worker, so the run plans two (it used to fail on the first
    split tried)."""
    import os

    from flowc.compile import compile_plan
    from flowc.errors import InfeasibleError
    from flowc.ir.cluster import ClusterSpec
    from flowc.ir.run_config import RunConfig
    from flowc.ir.workload import WorkloadSpec
    from flowc.loader import load_flow

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    g = load_flow(str(EXAMPLES / "grpo_async.py")).trace()
    sources = {"actor": "flowc-tiny", "ref": "flowc-tiny"}
    common = dict(rollout="hf", split_local=True)
    wl = WorkloadSpec(prompts=64, prompt_len=8, response_len=6)
    plan = compile_plan(
        g, sources, ClusterSpec.local(2), wl, RunConfig(staleness=1), pin_words=["colocate=actor.train,ref;actor.gen"], **common
    )
    assert sorted(p.device_count for p in plan.pools) == [1, 1] and plan.staleness == 1
    with pytest.raises(InfeasibleError, match="no co-location fits on 2 devices"):  # three pools: two cores cannot
        compile_plan(
            g, sources, ClusterSpec.local(2), wl, RunConfig(), pin_words=["colocate=actor.train;ref;actor.gen"], **common
        )


def test_an_explicit_lock_step_and_a_staleness_pin_disagree():
    from flowc.compile import compile_plan
    from flowc.errors import SpecError
    from flowc.ir.cluster import ClusterSpec
    from flowc.ir.run_config import RunConfig
    from flowc.ir.workload import WorkloadSpec
    from flowc.loader import load_flow

    g = load_flow(str(EXAMPLES / "grpo_async.py")).trace()
    with pytest.raises(SpecError, match="disagree"):
        compile_plan(
            g, {"actor": "flowc-tiny", "ref": "flowc-tiny"}, ClusterSpec.local(1), WorkloadSpec(prompts=8, prompt_len=8, response_len=6),
            RunConfig(staleness=0), pin_words=["staleness=1"], rollout="hf", split_local=False,
        )  # fmt: skip
