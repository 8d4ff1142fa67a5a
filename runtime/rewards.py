"""Reward functions run in their own process, each call with a deadline.

A user's reward is arbitrary Python: it may hang (a judge that never answers), spin,
crash its interpreter or leak memory. :class:`Rewards` calls it in a Ray actor of
its own, waits at most ``reward_timeout_s`` for an answer, and on a timeout kills
that process (a fresh one serves the next call), so the run fails with an error
that names the reward, the step and the rows instead of hanging. Functions from a
user's own files travel to that process by value, so it needs no import path.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import ray
import torch

from flowc.errors import DataError, RuntimeFailure
from flowc.runtime.data import RewardFn, call_reward


@ray.remote(num_cpus=0, max_restarts=0)
class RewardWorker:
    """Holds the run's reward functions; one call at a time."""

    def __init__(self, fns: dict[str, RewardFn], names: dict[str, str]) -> None:
        self.fns, self.names = fns, names

    def score(self, role: str, prompts: list[str], responses: list[str], columns: dict[str, list[Any]]) -> torch.Tensor:
        return call_reward(self.fns[role], self.names.get(role, role), prompts, responses, columns)

    def pid(self) -> int:
        return os.getpid()


class Rewards:
    """The run's reward functions behind a process boundary and a per-call timeout."""

    def __init__(self, fns: dict[str, RewardFn], names: dict[str, str], timeout_s: float) -> None:
        self.fns, self.names, self.timeout_s = fns, names, timeout_s
        self._worker: Any = None
        for fn in fns.values():
            _by_value(fn)

    def __bool__(self) -> bool:
        return bool(self.fns)

    def __iter__(self):
        return iter(self.fns)

    def _actor(self) -> Any:
        if self._worker is None:
            self._worker = RewardWorker.remote(self.fns, self.names)
        return self._worker

    def score(
        self, role: str, prompts: list[str], responses: list[str], columns: dict[str, list[Any]], *, where: str
    ) -> torch.Tensor:
        """``role``'s scores of the responses; ``where`` (e.g. "step 7, rows 0-63") names the call in errors."""
        name = self.names.get(role, role)
        ref = self._actor().score.remote(role, prompts, responses, columns)
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            self.stop()  # kill the stuck process; the next call starts a fresh one
            raise DataError(
                f"reward {role} ({name}) did not return within {self.timeout_s:g} s at {where}; its process was killed",
                fix="make it return sooner (a hung network call?), or raise reward_timeout_s in the run config",
            ) from None
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, DataError):
                raise DataError(f"at {where}: {cause.what}", fix=cause.fix) from None
            raise DataError(f"reward {role} ({name}) failed at {where}: {cause or e}") from None
        except ray.exceptions.RayActorError as e:
            self._worker = None
            raise RuntimeFailure(
                f"reward {role} ({name}) killed its process at {where} (it exited or crashed: {type(e).__name__})",
                fix="a reward function must return its scores, not exit; see the log above",
            ) from None

    def stop(self) -> None:
        if self._worker is not None and ray.is_initialized():
            ray.kill(self._worker, no_restart=True)
        self._worker = None


def _by_value(fn: RewardFn) -> None:
    """Ship a function from the user's own module by value (one loaded from a file path is not
    in ``sys.modules`` and travels by value anyway; flowc's and installed packages' import anywhere)."""
    fn = getattr(fn, "fn", fn)  # an adapter of verl's or TRL's convention (flowc.rewards): the user's function
    name = getattr(fn, "__module__", "") or ""
    module = sys.modules.get(name)
    file = getattr(module, "__file__", None)
    if module is None or file is None or name == "flowc" or name.startswith("flowc."):
        return
    if any(part in ("site-packages", "dist-packages") for part in Path(file).parts):
        return
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(module)
