"""The default run's console: Ray's token-authentication notice and vLLM's tcmalloc/iomp/NUMA
warnings do not reach the user (they are dropped at their source, not by hiding stderr: a
worker's own print still shows), and the run's trackers write their files."""

from __future__ import annotations

import subprocess

import pytest

from flowc.runtime.backends import BACKENDS
from tests.helpers import EXAMPLES, ROOT, flowc_cmd

NOISE = ("Token authentication is enabled", "LD_PRELOAD", "NUMA binding", "Reset SSM cache type")


@pytest.mark.skipif(not BACKENDS["vllm"].installed(), reason="the vLLM warnings come from its CPU build")
def test_default_run_console_has_no_ray_or_vllm_noise(tmp_path):
    out = tmp_path / "run"
    args = ["run", str(EXAMPLES / "grpo.py"), "--steps", "1", "--set", "eval_every=0", "--out", str(out), "-q"]
    r = subprocess.run(flowc_cmd(*args), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    for needle in NOISE:
        assert needle not in r.stderr, f"{needle!r} reached the console:\n{r.stderr[-3000:]}"
    assert f"run written to {out}" in r.stderr  # stderr itself is not swallowed
    assert (out / "tensorboard").is_dir() and (out / "samples.jsonl").read_text().count("\n") >= 1
