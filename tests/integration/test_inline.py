"""The inline executor: a plan of one local worker runs in the controller's process, its rewards
in a plain child process, and computes exactly what the same plan computes on Ray."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time

import pytest
import torch
from helpers import EXAMPLES, ROOT, flowc_cmd, request
from safetensors.torch import load_file

from flowc.errors import DataError, RuntimeFailure, SpecError, WorkerError
from flowc.ir.run_config import RunConfig
from flowc.rewards import adapt
from flowc.run import prepare, run
from flowc.runtime.controller import Controller
from flowc.runtime.inline import TIMEOUT_EXIT, InlineGroup, choose_executor
from flowc.runtime.program import EngineKey, EngineKind
from flowc.runtime.rewards import Rewards
from flowc.tasks.arithmetic import exact_match

WORKLOAD = "prompts=8,prompt_len=8,response_len=6"


def _rows(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"step_s"' in x]


def _weights(out) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted((out / "final").glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_auto_runs_one_local_cpu_worker_inline_and_everything_else_on_ray(tmp_path):
    one = prepare(request(tmp_path, cluster="local:1", workload=WORKLOAD), dry_run=True).run
    two = prepare(request(tmp_path, cluster="local:2", workload=WORKLOAD), dry_run=True).run
    assert one.executor == "inline" and two.executor == "ray"
    p1, p2 = one.program, two.program
    assert choose_executor("auto", p1, local=False) == "ray"  # joining a cluster: its workers are elsewhere
    assert choose_executor("ray", p1, local=True) == "ray"
    assert choose_executor("inline", p1, local=True) == "inline"
    gpu = dataclasses.replace(p1, target=p1.target.model_copy(update={"kind": "gpu"}))
    assert choose_executor("auto", gpu, local=True) == "ray"  # inline on a GPU only when asked for
    with pytest.raises(SpecError, match="has 2 workers") as e:
        choose_executor("inline", p2, local=True)
    assert "local:1" in e.value.fix
    with pytest.raises(SpecError, match="joins a Ray cluster"):
        choose_executor("inline", p1, local=False)
    cfg = RunConfig(executor="ray", steps=3, eval_every=0, checkpoint_every=0)
    assert prepare(request(tmp_path, cluster="local:1", workload=WORKLOAD, config=cfg), dry_run=True).run.executor == "ray"


@pytest.mark.slow
def test_inline_and_ray_compute_the_same_run(ray_cluster, tmp_path):
    """The same plan, seed and data on both executors: the same rewards, losses, lengths and
    trained weights, to the bit (one process with the same threads runs the same kernels)."""
    outs = {}
    for executor in ("ray", "inline"):
        cfg = RunConfig(steps=3, eval_every=3, eval_size=16, checkpoint_every=0, seed=7, executor=executor)
        req = request(tmp_path / executor, cluster="local:1", workload=WORKLOAD, config=cfg, out=str(tmp_path / executor))
        outs[executor] = run(req, progress=False)
    placement = {k: json.loads((o / "placement.json").read_text()) for k, o in outs.items()}
    (inline_rank,) = next(iter(placement["inline"].values()))
    assert inline_rank["executor"] == "inline" and "executor" not in next(iter(placement["ray"].values()))[0]
    ray_rows, inline_rows = _rows(outs["ray"]), _rows(outs["inline"])
    keys = ["reward", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "response_length/mean"]
    keys += ["gen_tokens", "eval/accuracy"]
    for a, b in zip(ray_rows, inline_rows, strict=True):
        assert {k: a.get(k) for k in keys} == {k: b.get(k) for k in keys}
    wa, wb = _weights(outs["ray"]), _weights(outs["inline"])
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_an_inline_controller_syncs_its_rollout_engine_and_names_failures(tmp_path):
    """No Ray at all: the engines live in this process, the rollout engine holds the trained
    weights after each sync, and a failing call is a WorkerError naming the group and the call."""
    cfg = RunConfig(steps=2, eval_every=0, checkpoint_every=0, executor="inline")
    spec = prepare(request(tmp_path, cluster="local:1", workload=WORKLOAD, config=cfg)).run
    ctl = Controller(spec)
    try:
        ctl.start()
        (group,) = ctl.groups.values()
        assert isinstance(group, InlineGroup)
        m = ctl.run_step(0)
        assert m["reward"] >= 0 and m["perf/controller_fraction"] < 1
        assert ctl.sync_error("actor") < 1e-5
        assert m["actor/sync_probe_diff"] == 0.0  # every sync is checked: here the engine runs the trainer's storage
        # one process, one dtype, lock-step: the HF engine runs the trainer's parameters themselves (nothing copied)
        rollout = group.worker.engines[EngineKey("actor", EngineKind.ROLLOUT)].b
        trainer = group.worker.engines[EngineKey("actor", EngineKind.TRAIN)].b
        mine = dict(trainer.model.named_parameters())
        assert rollout.lent and all(p.data_ptr() == mine[n].data_ptr() for n, p in rollout.model.named_parameters())
        assert m["actor/sync_bytes_per_device"] == 0
        # and gives them back when asked (a re-plan to staleness > 0): its own copy, the same values
        assert not group.worker.engines[EngineKey("actor", EngineKind.ROLLOUT)].alias(None) and not rollout.lent
        for n, p in rollout.model.named_parameters():
            assert p.data_ptr() != mine[n].data_ptr() and torch.equal(p, mine[n])
        # every run reports how far the engine's sampling log-probabilities are from the trainer's (fp32: rounding)
        assert 0 <= m["actor/mismatch_kl"] < 1e-6 and m["actor/mismatch_abs"] < 1e-4
        with pytest.raises(WorkerError, match=r"rollout_logprobs\(critic/rollout\) failed on worker group .*KeyError"):
            group.get(group.call("rollout_logprobs", EngineKey("critic", EngineKind.ROLLOUT), {}), "probe")
    finally:
        ctl.shutdown()


def test_a_sync_the_engine_did_not_take_fails_the_run(tmp_path):
    """A rollout engine whose loader drops the weights (the most reported silent async bug) keeps
    generating from its old weights: the sync's probe check fails the run, naming the step."""
    cfg = RunConfig(steps=4, eval_every=0, checkpoint_every=0, executor="inline")
    spec = prepare(request(tmp_path, cluster="local:1", workload=WORKLOAD, config=cfg)).run
    ctl = Controller(spec)
    try:
        ctl.start()
        (group,) = ctl.groups.values()
        engine = group.worker.engines[EngineKey("actor", EngineKind.ROLLOUT)]
        engine.alias = lambda params: False  # its own copy of the weights (as a vLLM engine, or a sharded or bf16 trainer, has)
        ctl.run_step(0)
        engine.load = lambda weights: 0.0  # a broken loader: nothing arrives
        with pytest.raises(
            RuntimeFailure, match=r"actor: after the weight sync of step \d the generation engine does not run"
        ) as e:
            for step in range(1, 4):
                ctl.run_step(step)
        assert "it kept its old weights" in e.value.what and "sync_check" in e.value.fix
    finally:
        ctl.shutdown()


def test_a_call_past_its_deadline_ends_the_process_loudly():
    code = (
        "import time\nfrom flowc.runtime.inline import deadline\n"
        "with deadline(0.5, 'run(actor.train, update) on worker group g (actor.train)'):\n    time.sleep(30)\n"
    )
    t0 = time.time()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == TIMEOUT_EXIT and time.time() - t0 < 20
    assert "run(actor.train, update) on worker group g (actor.train) did not finish within 0.5 s" in r.stderr
    assert "raise timeout_s" in r.stderr and 'File "<string>", line 4' in r.stderr  # every thread's stack


def test_a_one_worker_cli_run_starts_no_ray(tmp_path):
    out = tmp_path / "run"
    args = ["run", str(EXAMPLES / "grpo.py"), "--cluster", "local:1", "--rollout", "hf", "--steps", "2"]
    args += ["--workload", WORKLOAD, "--out", str(out), "-q", "--set", "eval_every=0"]
    r = subprocess.run(flowc_cmd(*args), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Ray" not in r.stderr, r.stderr[-3000:]
    (ranks,) = json.loads((out / "placement.json").read_text()).values()
    assert [w["executor"] for w in ranks] == ["inline"]
    rows = _rows(out)
    assert [m["step"] for m in rows] == [1, 2]
    assert rows[-1]["response_length/p50"] <= rows[-1]["response_length/p90"] <= rows[-1]["response_length/max"]

    # the next run plans with the lengths this one measured, and records the mean, not the folder
    again = tmp_path / "again"
    words = f"{WORKLOAD},lengths_from={out}"
    args = ["run", str(EXAMPLES / "grpo.py"), "--cluster", "local:1", "--rollout", "hf", "--steps", "1"]
    args += ["--workload", words, "--out", str(again), "-q", "--set", "eval_every=0"]
    r = subprocess.run(flowc_cmd(*args), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    measured = sorted(m["response_length/mean"] for m in rows)
    planned = json.loads((again / "plan.json").read_text())["workload"]["mean_response_len"]
    assert planned == pytest.approx(sum(measured) / 2, rel=1e-3) and f"measured by {out}" in r.stderr
    recorded = json.loads((again / "run.json").read_text())["workload"]
    assert "lengths_from" not in recorded and "mean_response_len=" in recorded


# ---------------------------------------------------------------- rewards in plain child processes
def pid_and_index(prompts, responses, **columns):
    print("a reward that prints does not disturb its answers")
    return [{"score": 0.0, "index": float(i)} for i in columns["i"]]


def verl_match(data_source, solution_str, ground_truth):
    return float(solution_str == ground_truth)


def raises(prompts, responses, **columns):
    raise ValueError("judge offline")


def exits(prompts, responses, **columns):
    import os

    os._exit(3)


def hangs(prompts, responses, **columns):
    import os

    sandbox = subprocess.Popen(["sleep", "3600"])  # what a code-execution reward starts
    with open(os.environ["FLOWC_TEST_SANDBOX_PID"], "w") as f:
        f.write(str(sandbox.pid))
    time.sleep(3600)


def reads_stdin(prompts, responses, **columns):
    import sys

    return [float(len(sys.stdin.read()))] * len(responses)  # fd 0 is not the protocol's: nothing to read


def test_local_reward_processes_score_share_and_fail_loudly(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWC_TEST_SANDBOX_PID", str(tmp_path / "sandbox.pid"))
    fns = {"a": pid_and_index, "r": exact_match, "v": adapt(verl_match), "bad": raises, "exit": exits, "hang": hangs}
    fns["stdin"] = reads_stdin
    pool = Rewards(fns, {}, timeout_s=3, workers=2, processes="local")
    try:
        scores, extras = pool.score_with_metrics("a", ["p"] * 5, ["r"] * 5, {"i": list(range(5))}, where="test")
        assert scores.tolist() == [0.0] * 5 and extras == {"index": pytest.approx(2.0)}  # the batch's mean over both shares
        got = pool.score("r", ["1+1=", "2+2="], ["2", "5"], {"answer": ["2", "4"]}, where="test")
        assert got.dtype == torch.float32 and got.tolist() == [1.0, 0.0]
        verl_cols = {"data_source": ["d"] * 2, "reward_model": [{"ground_truth": "1"}] * 2}
        assert pool.score("v", ["p"] * 2, ["1", "2"], verl_cols, where="test").tolist() == [1.0, 0.0]
        procs = pool._actors()
        assert len({w.call("pid") for w in procs}) == 2 and not any(w.call("imported", "torch") for w in procs)
        with pytest.raises(DataError, match=r"at step 3: reward function bad raised ValueError: judge offline"):
            pool.score("bad", ["p"] * 4, ["r"] * 4, {}, where="step 3")
        assert pool._actors() == procs  # a raising function leaves its processes serving
        t0 = time.time()
        with pytest.raises(DataError, match=r"did not return within 3 s at step 4; its process was killed"):
            pool.score("hang", ["p"] * 2, ["r"] * 2, {}, where="step 4")
        assert time.time() - t0 < 10 and all(w.proc.poll() is not None for w in procs)
        assert _gone(int((tmp_path / "sandbox.pid").read_text()), 5)  # the reward's own child died with its group
        assert pool.score("stdin", ["p"], ["r"], {}, where="test").tolist() == [0.0]
        with pytest.raises(RuntimeFailure, match=r"killed its process at step 5 \(it exited or crashed: exit code 3\)"):
            pool.score("exit", ["p"] * 2, ["r"] * 2, {}, where="step 5")
        assert pool.score("r", ["1+1="], ["2"], {"answer": ["2"]}, where="after").tolist() == [1.0]  # fresh processes
    finally:
        pool.stop()


def test_a_killed_run_leaves_no_reward_process_behind(tmp_path):
    """The child dies with its parent (PR_SET_PDEATHSIG), even while it runs the user's code."""
    import os
    import signal

    code = (
        "import sys, time\n"
        "from flowc.runtime.rewards import Rewards\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "from hang import hangs\n"
        "pool = Rewards({'h': hangs}, {}, timeout_s=600, processes='local')\n"
        "(w,) = pool._actors()\n"
        "print(w.pid, flush=True)\n"
        "pool.score('h', ['p'], ['r'], {}, where='test')\n"
    )
    marker = tmp_path / "inside"
    (tmp_path / "hang.py").write_text(
        "import pathlib, time\n\ndef hangs(prompts, responses, **c):\n"
        f"    pathlib.Path({str(marker)!r}).write_text('1')\n    time.sleep(3600)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(p.stdout.readline())
        deadline = time.time() + 30
        while not marker.exists():  # the child is inside the user's function
            assert time.time() < deadline and p.poll() is None
            time.sleep(0.05)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=30)
        assert _gone(child, 10), "the reward process outlived its killed parent"
    finally:
        if p.poll() is None:
            p.kill()


def _gone(pid: int, within: float) -> bool:
    """Whether ``pid`` ends (or is left a zombie) within ``within`` seconds."""
    import psutil

    deadline = time.time() + within
    while time.time() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_reward_processes_that_cannot_load_or_are_interrupted_serve_nothing_stale(monkeypatch):
    import types

    ghost = types.ModuleType("flowc_test_ghost")  # importable here, not in the reward process
    exec("def score(prompts, responses, **c):\n    return [1.0] * len(responses)\n", ghost.__dict__)
    monkeypatch.setitem(sys.modules, "flowc_test_ghost", ghost)
    pool = Rewards({"g": ghost.score}, {}, timeout_s=30, processes="local")
    with pytest.raises(DataError, match=r"could not be loaded in their process: .*flowc_test_ghost") as e:
        pool.score("g", ["p"], ["r"], {}, where="test")
    assert "importable" in e.value.fix and not pool._pool

    pool = Rewards({"r": exact_match}, {}, timeout_s=30, processes="local")
    try:
        (w,) = pool._actors()

        def interrupted(deadline):
            raise KeyboardInterrupt

        monkeypatch.setattr(w, "receive", interrupted)
        with pytest.raises(KeyboardInterrupt):
            pool.score("r", ["1+1="], ["2"], {"answer": ["2"]}, where="test")
        assert not pool._pool and _gone(w.pid, 5)  # its answer was never read: the process is gone with it
        assert pool.score("r", ["1+1="], ["3"], {"answer": ["2"]}, where="after").tolist() == [0.0]
    finally:
        pool.stop()


CORRECTED = """
import flowc as fc

@fc.flow
def corrected(prompts: fc.Prompts, actor: fc.Policy, reward: fc.Reward, *, n: int = 4):
    rollout = actor.generate(prompts, n=n)
    old = actor.logprobs(rollout)
    adv = fc.ops.group_normalize(reward(rollout), group_size=n)
    actor.update(rollout, advantages=adv, old_logprobs=old, loss=fc.losses.decoupled_ppo(0.2, cap=2.0))
"""


def test_a_corrected_loss_weighs_the_engines_samples(tmp_path):
    """Decoupled PPO end to end: the update weighs each token by the trainer's over the engine's
    probability; with the engine in step with the trainer (staleness 0, fp32) every weight is 1."""
    from flowc.loader import load_flow

    path = tmp_path / "corrected.py"
    path.write_text(CORRECTED)
    cfg = RunConfig(steps=2, eval_every=0, checkpoint_every=0, executor="inline")
    req = request(tmp_path, flow=load_flow(str(path)), cluster="local:1", workload=WORKLOAD, config=cfg, steps=2)
    out = run(req, progress=False)
    rows = _rows(out)
    assert len(rows) == 2
    for m in rows:
        assert m["actor/is_weight"] == pytest.approx(1.0, abs=1e-4) and m["actor/is_cut_frac"] == 0.0
        assert m["actor/mismatch_kl"] < 1e-6


def test_a_run_leaves_out_idle_rows_and_trains_the_same_weights(tmp_path):
    """Dr. GRPO (no KL, no entropy bonus) on the tiny model, whose groups are often all right:
    with ``skip_idle_rows`` the update leaves out the rows whose advantages are all zero, reports
    their share, and trains what computing every row trains — the same rewards, losses and
    weights to float rounding, with the same seed."""
    outs = {}
    for skip in (True, False):
        cfg = RunConfig(steps=3, eval_every=0, checkpoint_every=0, seed=7, executor="inline", skip_idle_rows=skip)
        out = tmp_path / str(skip)
        outs[skip] = run(
            request(tmp_path, flow="drgrpo", cluster="local:1", workload=WORKLOAD, config=cfg, out=str(out)), progress=False
        )
    lean, full = _rows(outs[True]), _rows(outs[False])
    idle = [r["actor/idle_rows"] for r in lean]
    assert all(0.0 <= x < 1.0 for x in idle) and max(idle) > 0.0, idle  # some group was all right (or all wrong)
    assert all("actor/idle_rows" not in r for r in full)
    for a, b in zip(lean, full, strict=True):
        assert a["reward"] == b["reward"] and a["response_length/mean"] == b["response_length/mean"]
        assert a["actor/pg_loss"] == pytest.approx(b["actor/pg_loss"], rel=1e-4, abs=1e-7)
    wa, wb = _weights(outs[True]), _weights(outs[False])
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-5
