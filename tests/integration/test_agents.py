"""Agent runs end to end on Ray: the same task through an environment class and through an agent
harness on the OpenAI client (server mode) trains the same policy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import EXAMPLES, request

from flowc.ir.run_config import RunConfig
from flowc.run import run

pytest.importorskip("openai")


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if "step_s" in x]


def test_server_mode_and_an_environment_class_train_the_same_policy(ray_cluster, tmp_path):
    """examples/envs/openai_agent.py plays the calculator task through the engine's OpenAI endpoint;
    with the same seeds every turn samples the same tokens as the built-in Calculator environment's,
    so the two runs' rewards and trained weights are equal: the endpoint served, and flowc trained
    on, exactly the trajectory the environment loop builds."""
    from safetensors.torch import load_file

    cfg = RunConfig(steps=2, eval_every=0, checkpoint_every=0)
    env = run(request(tmp_path, flow="grpo_tool", steps=2, out=str(tmp_path / "env"), config=cfg), progress=False)
    harness = f"{EXAMPLES / 'envs' / 'openai_agent.py'}:CalculatorAgent"
    served = run(
        request(tmp_path, flow="grpo_tool", steps=2, out=str(tmp_path / "served"), config=cfg, envs={"calc": harness}),
        progress=False,
    )
    a, b = _rows(env), _rows(served)
    assert [(r["reward"], r["agent/turns"], r["agent/env_tokens"]) for r in a] == [
        (r["reward"], r["agent/turns"], r["agent/env_tokens"]) for r in b
    ]
    assert all(r["agent/env_errors"] == 0 for r in b)
    wa, wb = load_file(str(env / "final" / "model.safetensors")), load_file(str(served / "final" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
