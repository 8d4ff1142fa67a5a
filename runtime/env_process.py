"""Environments in a plain child process (no Ray, no torch): the server side of
:class:`flowc.runtime.envs.EnvPool`.

The child is ``python -m flowc.runtime.env_process`` and speaks the reward processes' protocol
(:mod:`flowc.runtime.reward_process`: length-prefixed cloudpickle frames on private copies of
stdin and stdout, "ready" once the environment class is unpickled, dies with its parent). It
holds one instance of the user's environment class per live trajectory; requests are

* ``("reset", tid, record)`` → the first observation (a new instance for ``tid``);
* ``("step", tid, action)`` → ``(observation, reward, done, info)``, checked;
* ``("close", tid)`` → drops the instance;

and the answer to one that raises is ``("error", "Type: message")`` — the trajectory's end,
never the run's. Each answer's value comes with the seconds the environment took for it.
"""

from __future__ import annotations

import math
import numbers
import os
import time
from typing import Any

_LIVE: dict[int, Any] = {}


def reset_result(value: Any, where: str) -> str:
    """The first observation ``reset`` returned (None: nothing to append)."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise TypeError(f"{where}.reset() returned {type(value).__name__}, expected the first observation (a str, or None)")
    return value


def step_result(value: Any, where: str) -> tuple[str, float, bool, dict[str, float]]:
    """``step``'s answer as ``(observation, reward, done, info)``; what the protocol does not allow
    is a ``TypeError`` naming the field."""
    if not isinstance(value, tuple | list) or len(value) not in (3, 4):
        raise TypeError(
            f"{where}.step() returned {type(value).__name__}, expected (observation: str, reward: float, done: bool[, info: dict])"
        )
    obs, reward, done, *rest = value
    if obs is None:
        obs = ""
    if not isinstance(obs, str):
        raise TypeError(f"{where}.step() returned an observation of type {type(obs).__name__}, expected str")
    if not _number(reward) or not math.isfinite(float(reward)):
        raise TypeError(f"{where}.step() returned reward {reward!r} ({type(reward).__name__}), expected a finite number")
    if not (isinstance(done, bool) or getattr(getattr(done, "dtype", None), "kind", "") == "b"):
        raise TypeError(f"{where}.step() returned done {done!r} ({type(done).__name__}), expected a bool")
    info = rest[0] if rest else {}
    if info is None:
        info = {}
    if not isinstance(info, dict) or not all(isinstance(k, str) and _number(v) for k, v in info.items()):
        raise TypeError(f"{where}.step() returned info {info!r}, expected a dict of str to numbers (averaged into metrics)")
    return obs, float(reward), bool(done), {k: float(v) for k, v in info.items()}


def _number(x: Any) -> bool:
    """A real number, Python's or NumPy's (``np.float32``, ``np.int64``), not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and getattr(getattr(x, "dtype", None), "kind", "") != "b"


def answer(payload: tuple[Any, dict[str, Any], str], msg: tuple) -> tuple[str, Any]:
    """``(kind, (value, seconds))``: the answer to ``msg`` and the time the environment took for it."""
    t0 = time.perf_counter()
    kind, value = _answer(payload, msg)
    return kind, (value, time.perf_counter() - t0)


def _answer(payload: tuple[Any, dict[str, Any], str], msg: tuple) -> tuple[str, Any]:
    cls, kwargs, name = payload
    op, *args = msg
    try:
        if op == "reset":
            tid, record = args
            env = _LIVE[tid] = cls(**kwargs)
            return "ok", reset_result(env.reset(record), name)
        if op == "step":
            tid, action = args
            return "ok", step_result(_LIVE[tid].step(action), name)
        if op == "close":
            env = _LIVE.pop(args[0], None)
            close = getattr(env, "close", None)
            if callable(close):
                close()
            return "ok", None
        if op == "pid":
            return "ok", os.getpid()
    except Exception as e:  # the user's code: what it raises ends the trajectory, not the run
        return "error", f"{type(e).__name__}: {e}"
    return "error", f"unknown request {op!r}"


def main() -> None:
    from flowc.runtime.reward_process import serve

    serve(answer)


if __name__ == "__main__":
    main()
