"""Agent harnesses in a plain child process: the server side of :class:`flowc.runtime.envs.HarnessPool`.

A harness is the user's agent code written for any OpenAI client (an environment class with
``run(record, base_url)`` instead of ``reset``/``step``): it drives a whole trajectory by calling
the rollout engine's OpenAI-compatible endpoint (:mod:`flowc.runtime.serve`) and returns the
trajectory's reward. Harnesses wait on HTTP most of the time, so one process runs many at once,
each in a thread of its own: a request ``("run", tid, record, base_url)`` starts one, and its
answer — ``("ok", (tid, (reward, info), seconds))`` or ``("error", (tid, "Type: message", seconds))``
— comes when it returns, in whatever order they finish. The framing is the reward processes'
(:mod:`flowc.runtime.reward_process`).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from flowc.runtime.env_process import _number


def run_result(value: Any, where: str) -> tuple[float, dict[str, float]]:
    """``run``'s answer as ``(reward, info)``: a number, or ``(reward, info)``."""
    if isinstance(value, tuple | list) and len(value) == 2:
        reward, info = value
    else:
        reward, info = value, {}
    if not _number(reward):
        raise TypeError(f"{where}.run() returned {value!r}, expected the trajectory's reward (a number) or (reward, info)")
    if not isinstance(info, dict) or not all(isinstance(k, str) and _number(v) for k, v in info.items()):
        raise TypeError(f"{where}.run() returned info {info!r}, expected a dict of str to numbers")
    return float(reward), {k: float(v) for k, v in info.items()}


def main() -> None:
    from flowc.runtime.reward_process import _read_blocking, _write, channels

    src, out, (cls, kwargs, name) = channels()
    lock = threading.Lock()

    def one(tid: int, record: dict[str, Any], base_url: str) -> None:
        t0 = time.perf_counter()
        try:
            kind, value = "ok", run_result(cls(**kwargs).run(record, base_url), name)
        except Exception as e:  # the user's code: what it raises ends the trajectory, not the run
            kind, value = "error", f"{type(e).__name__}: {e}"
        with lock:
            _write(out, (kind, (tid, value, time.perf_counter() - t0)))

    while (msg := _read_blocking(src)) is not None:
        op, *args = msg
        if op == "run":
            threading.Thread(target=one, args=tuple(args), daemon=True).start()
        else:
            with lock:
                _write(out, ("error", (args[0] if args else -1, f"unknown request {op!r}", 0.0)))


if __name__ == "__main__":
    main()
