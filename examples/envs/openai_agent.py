"""An agent harness for server mode: agent code written for any OpenAI client drives each
trajectory through the rollout engine's endpoint, and flowc trains on exactly the tokens it served.

    flowc run examples/grpo_tool.py --env calc=examples/envs/openai_agent.py:CalculatorAgent

A harness is an environment class with ``run(record, base_url)`` instead of ``reset``/``step``: it
gets the prompt's data row and a base URL of its own (``http://127.0.0.1:PORT/t/ID/v1``), talks to
the policy with ``chat.completions`` (or ``completions``, with token ids for exact control), runs
its tools, and returns the trajectory's reward (or ``(reward, info)``). This one plays the
built-in calculator task: a reply ending in ``)`` is a tool call, answered in the next message.
"""

from __future__ import annotations

from typing import Any, ClassVar

from flowc.tasks.calculator import Calculator

_SHARED: dict[str, Any] = {}  # one HTTP client for every harness of the process (a new OpenAI client costs ~30 ms)


def client(base_url: str) -> Any:
    """An OpenAI client for ``base_url`` on the process's shared HTTP connection pool."""
    import httpx
    from openai import OpenAI

    if "http" not in _SHARED:  # (two threads may both build one: harmless)
        _SHARED["http"] = httpx.Client(timeout=600.0, limits=httpx.Limits(max_connections=1024))
    return OpenAI(base_url=base_url, api_key="flowc", max_retries=0, http_client=_SHARED["http"])


class CalculatorAgent:
    stop: ClassVar[tuple[str, ...]] = (")",)  # a turn also ends at the tool call's closing parenthesis
    max_turns: ClassVar[int] = 3

    def run(self, record: dict, base_url: str) -> tuple[float, dict[str, float]]:
        policy = client(base_url)
        tool = Calculator()
        tool.reset(record)
        messages = [{"role": "user", "content": record["prompt"]}]
        calls = 0.0
        for _ in range(self.max_turns):
            reply = policy.chat.completions.create(model="policy", messages=messages).choices[0].message.content
            observation, reward, done, _ = tool.step(reply)
            if done:
                return reward, {"tool_calls": calls, "correct": reward}
            calls += 1
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": observation}]
        return 0.0, {"tool_calls": calls, "correct": 0.0}
