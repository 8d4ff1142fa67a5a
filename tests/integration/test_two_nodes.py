"""A Ray cluster of two nodes on this machine: the plan's pool spans both and the run completes.

The nodes are started with `ray start` (a head and a second node joining it)
in a private temp dir, so stopping them touches nothing else."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import EXAMPLES, ROOT, flowc_cmd


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _ray(*args: str, env: dict) -> None:
    ray_bin = Path(sys.executable).parent / "ray"
    subprocess.run([str(ray_bin), *args], check=True, capture_output=True, text=True, env=env, timeout=180)


def _stop(temp_dir: str) -> None:
    """Every process of the two nodes (named by the folder or holding files in it), then the folder."""
    from flowc.runtime.reaper import reap

    reap(temp_dir)


@pytest.mark.slow
@pytest.mark.parametrize("flow", ["grpo", "grpo_tool"])  # grpo_tool: each node's replica runs its own environments
def test_pools_land_on_both_nodes(tmp_path, flow):
    temp_dir = f"/tmp/flowc-2n-{os.getpid()}"
    port = _free_port()
    env = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_AUTH_MODE": "disabled"}
    try:
        _ray(
            "start",
            "--head",
            f"--port={port}",
            "--num-cpus=1",
            f"--temp-dir={temp_dir}",
            "--include-dashboard=false",
            '--resources={"flowc_node_a": 1}',
            env=env,
        )
        _ray("start", f"--address=127.0.0.1:{port}", "--num-cpus=1", '--resources={"flowc_node_b": 1}', env=env)
        time.sleep(2)
        out = tmp_path / "run"
        r = subprocess.run(
            flowc_cmd(
                "run",
                str(EXAMPLES / f"{flow}.py"),
                *("--cluster", f"127.0.0.1:{port}", "--steps", "2", "--out", str(out), "-q"),
                *("--workload", "prompts=8,prompt_len=8,response_len=" + ("20" if flow == "grpo_tool" else "6")),
            ),
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        plan = json.loads((out / "plan.json").read_text())
        assert plan["cluster"]["nodes"] == 2
        placement = json.loads((out / "placement.json").read_text())
        nodes = {w["node_id"] for workers in placement.values() for w in workers}
        assert len(nodes) == 2, placement
        for pool in plan["pools"]:  # each pool's workers sit on as many nodes as the plan gave it
            assert len({w["node_id"] for w in placement[pool["name"]]}) == pool["nodes"], (pool, placement)
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert rows[-1]["step"] == 2
        if flow == "grpo_tool":
            assert rows[-1]["agent/trajectories"] == 64 and rows[-1]["agent/env_errors"] == 0 and rows[-1]["agent/turns"] >= 1
    finally:
        _stop(temp_dir)
