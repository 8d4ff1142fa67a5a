"""flowc.sandbox and the code-execution environment built on it (examples/envs/python_tool.py):
limits that hold, no network, and the environment's protocol."""

from __future__ import annotations

import json
import time

import pytest
from helpers import EXAMPLES

from flowc.sandbox import network_fence_available, run_python

pytestmark = pytest.mark.skipif(not network_fence_available(), reason="no unprivileged network namespaces here")


def test_code_runs_in_an_empty_folder_with_a_bare_environment():
    r = run_python("import os; print(6 * 7, os.listdir('.'), sorted(os.environ))")
    assert r.ok and r.stdout == "42 [] ['LANG', 'PATH']\n"


def test_cpu_memory_wall_clock_and_output_are_limited():
    t0 = time.monotonic()
    assert run_python("while True: pass", cpu_s=1, wall_s=20).why in ("cpu", "killed")
    assert run_python("x = bytearray(600 * 1024 * 1024)", memory_mb=256).why == "memory"
    r = run_python("import time; time.sleep(60)", wall_s=1)
    assert r.why == "wall"
    assert run_python("print('x' * 100000)", max_output=1000).why == "output"
    assert time.monotonic() - t0 < 15


def test_the_code_has_no_network():
    r = run_python("import socket; socket.create_connection(('1.1.1.1', 53), timeout=2); print('connected')")
    assert r.why == "error" and "connected" not in r.stdout and ("unreachable" in r.stderr or "OSError" in r.stderr)


def _env():
    import importlib.util

    spec = importlib.util.spec_from_file_location("python_tool", EXAMPLES / "envs" / "python_tool.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.PythonTool()


def _call(code: str) -> str:
    return "Let me compute.\n<tool_call>\n" + json.dumps({"name": "python", "arguments": {"code": code}}) + "\n</tool_call>"


def test_the_python_tool_runs_a_call_and_scores_the_final_answer():
    env = _env()
    assert env.reset({"prompt": "What is 37*48?", "answer": "1776"}) == ""
    obs, reward, done, info = env.step(_call("print(37 * 48)"))
    assert "<tool_response>\n1776\n\n</tool_response>" in obs and obs.startswith("<|im_end|>") and obs.endswith("assistant\n")
    assert (reward, done, info) == (0.0, False, {"tool_calls": 1.0, "tool_ok": 1.0})
    obs, reward, done, info = env.step(_call("while True: pass"))
    assert "[cpu]" in obs or "[killed]" in obs or "[wall]" in obs
    assert info["tool_ok"] == 0.0 and not done
    assert env.step("<tool_call>not json</tool_call>")[0].count("error: expected") == 1
    assert env.step("The answer is 1776.") == ("", 1.0, True, {"correct": 1.0})
