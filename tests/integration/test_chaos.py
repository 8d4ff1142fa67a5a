"""Chaos: a run whose driver is SIGTERMed and SIGKILLed and whose workers are killed and stopped
at random steps, resumed each time with nothing but ``--resume``, ends bit-identical to a run that was
never interrupted, and leaves no Ray process or temp folder behind."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import EXAMPLES, ROOT, flowc_cmd

STEPS = 30


def _steps_done(out: Path) -> int:
    path = out / "metrics.jsonl"
    if not path.exists():
        return 0
    done = 0
    for line in path.read_text().splitlines():
        try:
            m = json.loads(line)
        except json.JSONDecodeError:
            continue  # the line being written
        if "step_s" in m:
            done = max(done, int(m["step"]))
    return done


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen(flowc_cmd(*args), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_step(p: subprocess.Popen, out: Path, step: int, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while _steps_done(out) < step:
        if p.poll() is not None:
            raise AssertionError(f"the run ended (rc {p.returncode}) before step {step}:\n{p.stderr.read()[-3000:]}")
        if time.time() > deadline:
            p.kill()
            raise AssertionError(f"no step {step} within {timeout} s")
        time.sleep(0.2)


def _finish(p: subprocess.Popen, timeout: float = 300) -> tuple[int, str]:
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGUSR1)
        time.sleep(2)
        p.kill()
        _, err = p.communicate()
        raise AssertionError(f"the run did not end within {timeout} s:\n{err[-3000:]}") from None
    assert "Traceback" not in err, err[-3000:]
    return p.returncode, err


def _worker_pids(out: Path) -> list[int]:
    placement = json.loads((out / "placement.json").read_text())
    return [int(w["pid"]) for ranks in placement.values() for w in ranks]


def _leftovers(driver_pids: list[int]) -> tuple[list[int], list[str]]:
    """Processes and temp folders of the Ray clusters these drivers started."""
    from flowc.runtime.ray_session import local_temp_dir
    from flowc.runtime.reaper import session_pids

    dirs = [local_temp_dir(pid) for pid in driver_pids]
    return [pid for d in dirs for pid in session_pids(d)], [d for d in dirs if os.path.exists(d)]


def _weights(out: Path) -> dict:
    from safetensors.torch import load_file

    files = sorted((out / "final").glob("*.safetensors"))
    assert files, f"no exported weights in {out / 'final'}"
    return {k: v for f in files for k, v in load_file(str(f)).items()}


@pytest.mark.slow
def test_killed_stopped_and_terminated_runs_resume_bit_identical(tmp_path):
    import torch

    cfg = tmp_path / "cfg.yaml"
    # executor: ray — the test kills and stops worker processes (an inline run has none of its own)
    cfg.write_text("checkpoint_every: 1\neval_every: 0\nseed: 5\ntimeout_s: 25\nkeep_checkpoints: 2\nexecutor: ray\n")
    common = ["--rollout", "hf", "-q", "--config", str(cfg), "--workload", "prompts=16,prompt_len=8,response_len=6"]
    grpo = str(EXAMPLES / "grpo.py")
    drivers: list[int] = []

    whole = tmp_path / "whole"
    p = _start("run", grpo, "--steps", str(STEPS), "--out", str(whole), *common)
    drivers.append(p.pid)
    rc, err = _finish(p)
    assert rc == 0, err[-3000:]

    rng = random.Random(int(os.environ.get("FLOWC_CHAOS_SEED", "18")))
    a = rng.randint(2, 8)
    b = rng.randint(a + 3, a + 9)
    c = rng.randint(b + 3, b + 9)
    out = tmp_path / "chaos"

    # 1. SIGTERM the driver (what timeout, Slurm and Kubernetes send): a checkpoint, exit 143
    p = _start("run", grpo, "--steps", str(STEPS), "--out", str(out), *common)
    drivers.append(p.pid)
    _wait_for_step(p, out, a)
    p.send_signal(signal.SIGTERM)
    rc, err = _finish(p)
    assert rc == 143 and "stopped by SIGTERM" in err and "written" in err, err[-3000:]

    # 2. SIGKILL a worker: a typed error naming the group, exit 1; the last checkpoint resumes
    p = _start("run", "--resume", str(out), "-q")
    drivers.append(p.pid)
    _wait_for_step(p, out, b)
    os.kill(rng.choice(_worker_pids(out)), signal.SIGKILL)
    rc, err = _finish(p)
    assert rc == 1 and "died" in err and "--resume" in err, err[-3000:]

    # 3. SIGSTOP a worker: the call times out naming the rank that did not answer
    p = _start("run", "--resume", str(out), "-q")
    drivers.append(p.pid)
    _wait_for_step(p, out, c)
    stopped = rng.choice(_worker_pids(out))
    os.kill(stopped, signal.SIGSTOP)
    try:
        rc, err = _finish(p)
    finally:
        try:
            os.kill(stopped, signal.SIGCONT)
        except ProcessLookupError:
            pass
    assert rc == 1 and "did not finish within 25 s" in err and "did not answer" in err, err[-3000:]

    # 4. SIGKILL the driver: nothing runs in it, yet its reaper stops its Ray processes and removes the session folder
    p = _start("run", "--resume", str(out), "-q")
    drivers.append(p.pid)
    _wait_for_step(p, out, c + 2)
    p.kill()
    p.communicate()
    deadline = time.time() + 20
    while any(_leftovers([p.pid])) and time.time() < deadline:
        time.sleep(0.5)
    assert not any(_leftovers([p.pid])), _leftovers([p.pid])

    # 5. to the end, with nothing but --resume
    p = _start("run", "--resume", str(out), "-q")
    drivers.append(p.pid)
    rc, err = _finish(p)
    assert rc == 0, err[-3000:]

    want, got = _weights(whole), _weights(out)
    assert sorted(want) == sorted(got)
    assert all(torch.equal(want[k], got[k]) for k in want), [k for k in want if not torch.equal(want[k], got[k])][:5]

    def rewards(d: Path) -> list[tuple[int, float]]:
        rows = map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
        return [(m["step"], m["reward"]) for m in rows if "step_s" in m]

    assert rewards(whole) == rewards(out)
    rec = json.loads((out / "run.json").read_text())
    assert len(rec["resumes"]) == 4

    deadline = time.time() + 15  # the reaper of a killed cluster needs a moment
    while any(_leftovers(drivers)) and time.time() < deadline:
        time.sleep(0.5)
    procs, dirs = _leftovers(drivers)
    assert not procs and not dirs, (procs, dirs)
