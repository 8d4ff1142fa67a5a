"""A code-execution tool for agent flows: the policy writes Python, the environment runs it in
flowc's sandbox (a subprocess with CPU-time, memory and wall-clock limits and no network) and
answers with its output. The pattern for real code tasks; the built-in tiny model cannot write
Python, so run it with a chat model whose tokenizer has the tool-call tokens, e.g.:

    flowc run examples/grpo_tool.py --env calc=examples/envs/python_tool.py:PythonTool \\
        --data problems.jsonl --model actor=Qwen/Qwen2.5-1.5B-Instruct \\
        --workload prompts=64,prompt_len=512,response_len=2048,turns=3,obs_len=64,env_latency_s=0.2

The format is Qwen2.5's tool calling: the policy's turn ends with ``</tool_call>`` (one token of
Qwen2.5's tokenizer, so a valid stop string) around ``{"name": "python", "arguments": {"code":
"…"}}``; the observation closes the assistant's message, wraps the output in a ``user`` message's
``<tool_response>`` as Qwen's chat template does, and opens the next assistant message. A turn with
no tool call is the final answer, scored against the data's ``answer`` column. The prompts (a
system message) should describe the tool: ``python`` takes ``code`` and returns what it prints
(flowc does not yet pass a tool schema to the chat template).
"""

from __future__ import annotations

import json
from typing import ClassVar

import flowc as fc
from flowc.sandbox import run_python


class PythonTool(fc.envs.Env):
    stop = ("</tool_call>",)
    max_turns = 4
    limits: ClassVar[dict[str, float]] = {"cpu_s": 2.0, "memory_mb": 512, "wall_s": 5.0}

    def reset(self, record):
        self.answer = str(record.get("answer", "")).strip()
        return ""

    def step(self, action):
        if action.rstrip().endswith("</tool_call>") and "<tool_call>" in action:
            call = action.rsplit("<tool_call>", 1)[1].rsplit("</tool_call>", 1)[0]
            try:
                req = json.loads(call)
                code = req["arguments"]["code"] if req.get("name") == "python" else None
            except (ValueError, KeyError, TypeError):
                code = None
            if code is None:
                out, ok = 'error: expected {"name": "python", "arguments": {"code": "..."}}', 0.0
            else:
                r = run_python(code, **self.limits)
                out = r.stdout if r.ok else f"{r.stdout}\n[{r.why}] {r.stderr[-500:]}"
                ok = float(r.ok)
            obs = f"<|im_end|>\n<|im_start|>user\n<tool_response>\n{out[-2000:]}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
            return obs, 0.0, False, {"tool_calls": 1.0, "tool_ok": ok}
        correct = float(_last_number(action) == self.answer) if self.answer else 0.0
        return "", correct, True, {"correct": correct}


def _last_number(text: str) -> str:
    """The last whitespace-separated word of the answer, stripped of punctuation (e.g. "… is 42.")."""
    words = text.replace("<|im_end|>", " ").split()
    return words[-1].strip(".,;:!*$") if words else ""
