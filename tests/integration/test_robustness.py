"""Nothing lost, nothing silently changed, nothing executed: resumes that reload the run,
checkpoints that cannot run code, user code with a deadline, errors without tracebacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import EXAMPLES, ROOT, flowc_cmd, request

from flowc.errors import DataError, SpecError
from flowc.ir.run_config import RunConfig
from flowc.run import given_options, resume_request, run


def metrics(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def user_inputs(tmp_path: Path) -> tuple[str, str]:
    data = tmp_path / "good.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(32)))
    rw = tmp_path / "rw.py"
    rw.write_text("def half(prompts, responses, answer):\n    return [0.5 + 0.0 * len(a) for a in answer]\n")
    return str(data), f"{rw}:half"


def test_a_resume_reloads_the_run_and_its_checkpoints_are_verified(ray_cluster, tmp_path):
    """The issue's repro: a custom-data, custom-reward, 1-worker run resumed with nothing but
    --resume continues on its own data, reward, backend and plan; its checkpoints hold no pickle,
    and a damaged one is refused by its checksum."""
    data, reward = user_inputs(tmp_path)
    cfg = RunConfig(steps=2, eval_every=0, checkpoint_every=1)
    req = request(
        tmp_path,
        data=data,
        rewards={"reward": reward},
        cluster="local:1",
        workload="prompts=8,prompt_len=8,response_len=6",
        steps=2,
        config=cfg,
    )
    out = run(req, progress=False)
    rec = json.loads((out / "run.json").read_text())
    assert rec["data"] == data and rec["rewards"] == {"reward": reward} and rec["rollout"] == "hf" and rec["steps"] == 2
    plan_before = (out / "plan.json").read_text()
    ckpt = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    names = sorted(p.name for p in ckpt.iterdir())
    assert "manifest.json" in names and any(n.endswith(".safetensors") for n in names)
    assert not any(n.endswith(".pt") for n in names)

    resumed = resume_request(str(out), given_options(steps=3), override=False)
    assert (resumed.data, resumed.rewards, resumed.rollout, resumed.cluster) == (data, {"reward": reward}, "hf", "local:1")
    run(resumed, progress=False)
    rows = [m for m in metrics(out) if "step_s" in m]
    assert [m["step"] for m in rows] == [1, 2, 3] and all(m["reward"] == 0.5 for m in rows)  # its own reward, not 0/1
    assert (out / "plan.json").read_text() == plan_before
    rec = json.loads((out / "run.json").read_text())
    assert rec["steps"] == 3 and len(rec["resumes"]) == 1

    # a contradiction is refused before anything runs, listing it
    with pytest.raises(SpecError, match="--rollout: the run has 'hf', the command gives 'vllm'"):
        resume_request(str(out), given_options(rollout="vllm", steps=4), override=False)

    # one flipped byte in a rank's tensors: the manifest's checksum refuses the checkpoint
    last = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    victim = next(p for p in last.iterdir() if p.suffix == ".safetensors")
    blob = bytearray(victim.read_bytes())
    blob[-1] ^= 0xFF
    victim.write_bytes(bytes(blob))
    with pytest.raises(DataError, match=r"sha256|checksum"):
        run(resume_request(str(out), given_options(steps=4), override=False), progress=False)


def test_a_hanging_reward_is_killed_at_its_deadline_and_names_the_step(ray_cluster, tmp_path):
    rw = tmp_path / "slow.py"
    rw.write_text("import time\n\ndef never(prompts, responses, **c):\n    time.sleep(3600)\n")
    data, _ = user_inputs(tmp_path)
    cfg = RunConfig(steps=2, eval_every=0, checkpoint_every=0, reward_timeout_s=3)
    req = request(
        tmp_path, data=data, rewards={"reward": f"{rw}:never"}, workload="prompts=8,prompt_len=8,response_len=6", config=cfg
    )
    with pytest.raises(DataError) as e:
        run(req, progress=False)
    assert "did not return within 3 s at step 0" in e.value.what and "its process was killed" in e.value.what
    assert "no checkpoint was written" in e.value.fix


def test_a_raising_reward_names_the_step_and_the_last_checkpoint(ray_cluster, tmp_path):
    rw = tmp_path / "bad.py"
    rw.write_text("def boom(prompts, responses, **c):\n    raise ValueError('judge offline')\n")
    data, _ = user_inputs(tmp_path)
    cfg = RunConfig(steps=2, eval_every=0, checkpoint_every=0)
    req = request(
        tmp_path, data=data, rewards={"reward": f"{rw}:boom"}, workload="prompts=8,prompt_len=8,response_len=6", config=cfg
    )
    with pytest.raises(DataError) as e:
        run(req, progress=False)
    assert "at step 0" in e.value.what and "judge offline" in e.value.what
    assert "good.jsonl:" in e.value.what and "and 4 more" in e.value.what  # the batch's data rows
    assert "no checkpoint was written" in e.value.fix and "is intact" not in e.value.fix


@pytest.mark.slow
def test_ctrl_c_during_a_hung_reward_says_so_and_a_second_one_aborts_at_once(tmp_path):
    """The first Ctrl-C is acknowledged even while user code hangs; the second ends the run
    within seconds (not at the reward's deadline), with exit 130 and an honest message."""
    import signal
    import time

    rw = tmp_path / "hang.py"
    rw.write_text("import time\n\ndef never(prompts, responses, **c):\n    time.sleep(3600)\n")
    data, _ = user_inputs(tmp_path)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("reward_timeout_s: 600\neval_every: 0\n")
    out = tmp_path / "run"
    args = ["run", str(EXAMPLES / "grpo.py"), "--rollout", "hf", "--data", data, "--reward", f"reward={rw}:never"]
    args += ["--workload", "prompts=8,prompt_len=8,response_len=6", "--config", str(cfg), "--out", str(out), "-q"]
    p = subprocess.Popen(flowc_cmd(*args), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while not (out / "placement.json").exists():  # the workers are up: step 0 is running into the reward
            assert p.poll() is None and time.time() < deadline, p.stderr.read()[-3000:] if p.poll() is not None else "no start"
            time.sleep(0.2)
        time.sleep(5)
        p.send_signal(signal.SIGINT)
        time.sleep(2)
        assert p.poll() is None  # the first one waits for the step boundary
        t0 = time.time()
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert time.time() - t0 < 30, "the second Ctrl-C waited for the reward's deadline"
    assert p.returncode == 130, err[-3000:]
    assert "stopping after the current step" in err and "aborted by a second SIGINT" in err, err[-3000:]
    assert "no checkpoint was written" in err and "Traceback" not in err, err[-3000:]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(flowc_cmd(*args), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_cli_errors_are_one_message_with_a_fix_and_no_traceback(tmp_path):
    grpo = str(EXAMPLES / "grpo.py")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1+1=", "answer": "2"}\n["1+1=", "2"]\n')
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    cases = [
        (["run", grpo, "--steps", "0"], 2, "Invalid value for '--steps'"),
        (["run", grpo, "--steps", "-1"], 2, "Invalid value for '--steps'"),
        (["run", grpo, "--cluster", "my-cluster"], 1, "neither local, local:N nor a Ray address"),
        (["run", grpo, "--cluster", "127.0.0.1:1"], 1, "no Ray cluster answers at 127.0.0.1:1"),
        (["run", grpo, "--data", str(bad), "--rollout", "hf"], 1, "bad.jsonl:2: a JSON list"),
        (["run", "--resume", str(tmp_path)], 1, "has no run.json"),
        (["run", grpo, "--override"], 1, "there is no --resume"),
    ]
    if os.geteuid() != 0:  # root writes anywhere
        cases.append((["run", grpo, "--out", str(locked / "run")], 1, "cannot write the run folder"))
    for args, rc, message in cases:
        r = _cli(*args)
        assert r.returncode == rc, (args, r.returncode, r.stderr[-2000:])
        assert message in r.stderr, (args, r.stderr[-2000:])
        assert "Traceback" not in r.stderr, (args, r.stderr[-3000:])
    # -v shows the traceback for a bug report
    r = _cli("-v", "run", grpo, "--cluster", "my-cluster")
    assert r.returncode == 1 and "Traceback" in r.stderr


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_local_run_listens_on_loopback_only(ray_cluster):
    """Every TCP socket a process of this session's Ray listens on, including a two-rank gloo
    group's rendezvous store and collectives, is bound to loopback."""
    import psutil
    import ray

    from flowc.runtime.ray_session import running_temp_dir
    from flowc.runtime.reaper import session_pids
    from flowc.runtime.worker import RayWorker

    tmp = running_temp_dir()
    assert tmp, "the test session's Ray was not started by flowc"
    ws = [RayWorker.options(num_cpus=0).remote("loopback", r, 2, 1, 60.0) for r in range(2)]
    try:
        ip = ray.get(ws[0].where.remote())["ip"]
        assert ip == "127.0.0.1"
        port = ray.get(ws[0].port.remote())
        assert ray.get([w.init_dist.remote(ip, port, "gloo") for w in ws]) == [True, True]
        worker_pids = {ray.get(w.where.remote())["pid"] for w in ws}
        pids = set(session_pids(tmp))
        assert worker_pids <= pids, (worker_pids, pids)  # the scan finds renamed workers too
        bound = set()
        for pid in pids | {os.getpid()}:
            try:
                conns = psutil.Process(pid).net_connections(kind="inet")
            except (psutil.AccessDenied, psutil.NoSuchProcess):
                continue
            bound |= {(c.laddr.ip, c.laddr.port, pid) for c in conns if c.status == psutil.CONN_LISTEN}
        assert any(b[2] in worker_pids for b in bound), "the gloo group listens nowhere?"
        exposed = [b for b in bound if b[0] not in ("127.0.0.1", "::1", "::ffff:127.0.0.1")]
        assert not exposed, exposed
    finally:
        for w in ws:
            ray.kill(w)


def test_a_local_cluster_starts_only_the_processes_a_run_uses(ray_cluster):
    """No autoscaler monitor and no dashboard API server on a local cluster (about 0.2 GB resident
    between them, for a cluster whose size is fixed and whose dashboard is off); the GCS and the
    raylet are there."""
    import psutil

    from flowc.runtime.ray_session import running_temp_dir
    from flowc.runtime.reaper import session_pids

    tmp = running_temp_dir()
    assert tmp, "the test session's Ray was not started by flowc"
    cmds = []
    for pid in session_pids(tmp):
        try:
            cmds.append(" ".join(psutil.Process(pid).cmdline()))
        except psutil.Error:
            continue
    assert any("gcs_server" in c for c in cmds) and any("raylet" in c for c in cmds), cmds
    extra = [c for c in cmds if "autoscaler/_private/monitor.py" in c or "dashboard/dashboard.py" in c]
    assert not extra, extra


def test_a_collective_that_gives_up_on_a_silent_peer_names_the_peer(ray_cluster):
    """A stopped rank shows first as a collective error on the survivors (gloo's "Timed out waiting …
    for recv"); the error must name the rank that did not answer, not the survivor's symptom. The process
    group also outlasts the call's deadline, so the deadline fires first on its own."""
    from flowc.errors import WorkerTimeout
    from flowc.runtime.worker import WorkerGroup, collective_timeout

    assert collective_timeout(25) > 25

    @ray_cluster.remote(num_cpus=0)
    def survivor() -> None:
        raise RuntimeError("Timed out waiting 25000ms for recv operation to complete")

    @ray_cluster.remote(num_cpus=0)
    def stopped() -> None:
        import time

        time.sleep(120)

    group = object.__new__(WorkerGroup)
    group.name, group.size, group.timeout, group.roles, group.workers = "g", 2, 2.0, "actor.train", [None, None]
    refs = [survivor.remote(), stopped.remote()]
    ray_cluster.wait(refs[:1], timeout=120)  # the survivor has failed (a busy machine starts tasks slowly)
    try:
        with pytest.raises(WorkerTimeout, match=r"rank 1 of 2 did not answer \(then logprobs failed, rank 0: RuntimeError"):
            group.get(refs, "logprobs")
    finally:
        ray_cluster.cancel(refs[1], force=True)


def test_an_agent_run_resumed_mid_run_ends_where_an_uninterrupted_one_does(ray_cluster, tmp_path):
    """examples/grpo_tool.py on the calculator task, stopped after step 2 and resumed to step 4,
    trains to the same weights and metrics as a run of 4 steps: environments hold nothing across
    steps, and the hf agent loop's batches do not depend on which environment answered first."""
    from safetensors.torch import load_file

    def go(out: Path, steps: int):
        cfg = RunConfig(steps=steps, eval_every=0, checkpoint_every=2)
        return run(request(tmp_path, flow="grpo_tool", steps=steps, out=str(out), config=cfg), progress=False)

    whole = go(tmp_path / "whole", 4)
    part = go(tmp_path / "part", 2)
    run(resume_request(str(part), given_options(steps=4), override=False), progress=False)

    def rows(d: Path) -> list[tuple[int, float, float]]:
        return [(m["step"], m["reward"], m["agent/turns"]) for m in metrics(d) if "step_s" in m]

    assert rows(whole) == rows(part) and [r[0] for r in rows(part)] == [1, 2, 3, 4]
    want, got = load_file(str(whole / "final" / "model.safetensors")), load_file(str(part / "final" / "model.safetensors"))
    assert sorted(want) == sorted(got) and all(torch.equal(want[k], got[k]) for k in want)
