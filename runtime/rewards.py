"""Reward functions run in their own process, each call with a deadline.

A user's reward is arbitrary Python: it may hang (a judge that never answers), spin,
crash its interpreter or leak memory. :class:`Rewards` calls it in processes of
its own — Ray actors, or plain child processes when the run's workers run inline
(:mod:`flowc.runtime.reward_process`) — (``reward_workers`` of them, each scoring a contiguous share of a call's
responses: a slow judge or a sandbox round trip per sample runs N at a time), waits at most ``reward_timeout_s`` for an answer, and on a timeout kills
that process (a fresh one serves the next call), so the run fails with an error
that names the reward, the step and the rows instead of hanging. Functions from a
user's own files travel to that process by value, so it needs no import path.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Literal

import ray
import torch

from flowc.errors import DataError, RuntimeFailure
from flowc.runtime import reward_process
from flowc.runtime.reward_calls import RewardFn
from flowc.runtime.reward_worker import RewardWorker


class Rewards:
    """The run's reward functions behind a process boundary and a per-call timeout, in a pool
    of ``workers`` processes that share each call's responses."""

    def __init__(
        self,
        fns: dict[str, RewardFn],
        names: dict[str, str],
        timeout_s: float,
        workers: int = 1,
        *,
        processes: Literal["ray", "local"] = "ray",
    ) -> None:
        self.fns, self.names, self.timeout_s = fns, names, timeout_s
        self.workers = max(1, workers)
        self.processes = processes
        self._pool: list[Any] = []
        for fn in fns.values():
            by_value(fn)

    def __bool__(self) -> bool:
        return bool(self.fns)

    def __iter__(self):
        return iter(self.fns)

    def _actors(self) -> list[Any]:
        if not self._pool:
            if self.processes == "local":
                self._pool = self._start_local()
            else:
                self._pool = [RewardWorker.remote(self.fns, self.names) for _ in range(self.workers)]
        return self._pool

    def _start_local(self) -> list[reward_process.RewardProcess]:
        """The child processes, each answering "ready" within the reward timeout."""
        payload = reward_process.pickled_functions(self.fns, self.names)
        procs: list[reward_process.RewardProcess] = []
        deadline = time.monotonic() + self.timeout_s
        try:
            for _ in range(self.workers):
                procs.append(reward_process.RewardProcess(payload))
            answers = [w.receive(deadline) for w in procs]
        except reward_process.Timeout:
            _kill(procs)
            raise DataError(
                f"the reward processes did not load the reward functions within {self.timeout_s:g} s",
                fix="look for slow imports in the reward's module, or raise reward_timeout_s in the run config",
            ) from None
        except reward_process.Crashed:
            _kill(procs)
            raise RuntimeFailure(
                "a reward process exited while it loaded the reward functions", fix="see its log above"
            ) from None
        except BaseException:
            _kill(procs)
            raise
        bad = [value for kind, value in answers if kind != "ok"]
        if bad:
            _kill(procs)
            raise DataError(
                f"the reward functions could not be loaded in their process: {bad[0]}",
                fix="a reward function's module must be importable there (installed, or a file given by path)",
            )
        return procs

    def score(
        self, role: str, prompts: list[str], responses: list[str], columns: dict[str, list[Any]], *, where: str
    ) -> torch.Tensor:
        """``role``'s scores of the responses; ``where`` (e.g. "step 7, rows 0-63") names the call in errors."""
        return self.score_with_metrics(role, prompts, responses, columns, where=where)[0]

    def score_with_metrics(
        self, role: str, prompts: list[str], responses: list[str], columns: dict[str, list[Any]], *, where: str
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """:meth:`score`, and the batch means of the extra numbers its dict results carried."""
        shares = _shares(len(responses), self.workers)
        calls = [(role, prompts[a:b], responses[a:b], {k: v[a:b] for k, v in columns.items()}, a) for a, b in shares]
        score = self._score_local if self.processes == "local" else self._score_ray
        got = score(role, calls, where)
        scores = torch.tensor([x for s, _ in got for x in s], dtype=torch.float32)
        metrics: dict[str, tuple[float, int]] = {}  # key → (weighted sum, rows) over the shares that carry it
        for (_, extra), (a, b) in zip(got, shares, strict=True):
            for k, v in extra.items():
                total, rows = metrics.get(k, (0.0, 0))
                metrics[k] = (total + v * (b - a), rows + (b - a))
        return scores, {k: total / rows for k, (total, rows) in metrics.items()}

    def _timed_out(self, role: str, where: str) -> DataError:
        self.stop()  # kill the stuck processes; the next call starts fresh ones
        return DataError(
            f"reward {role} ({self.names.get(role, role)}) did not return within {self.timeout_s:g} s at {where}; "
            "its process was killed",
            fix="make it return sooner (a hung network call?), or raise reward_timeout_s in the run config",
        )

    def _crashed(self, role: str, where: str, how: str) -> RuntimeFailure:
        self.stop()
        return RuntimeFailure(
            f"reward {role} ({self.names.get(role, role)}) killed its process at {where} (it exited or crashed: {how})",
            fix="a reward function must return its scores, not exit; see the log above",
        )

    def _score_local(self, role: str, calls: list[tuple], where: str) -> list[Any]:
        """The shares on the child processes, answered within one deadline."""
        procs = self._actors()
        deadline = time.monotonic() + self.timeout_s
        w = procs[0]
        try:
            for w, c in zip(procs, calls, strict=False):
                w.send("score", *c)
            answers = []
            for w in procs[: len(calls)]:
                answers.append(w.receive(deadline))
        except reward_process.Timeout:
            raise self._timed_out(role, where) from None
        except reward_process.Crashed:
            raise self._crashed(role, where, f"exit code {w.exit_code()}") from None
        except BaseException:  # interrupted between a request and its answer: no stale answer may serve a later call
            self.stop()
            raise
        for kind, value in answers:
            if kind == "data_error":
                what, fix = value
                raise DataError(f"at {where}: {what}", fix=fix)
            if kind != "ok":
                raise DataError(f"reward {role} ({self.names.get(role, role)}) failed at {where}: {value}")
        return [value for _, value in answers]

    def _score_ray(self, role: str, calls: list[tuple], where: str) -> list[Any]:
        name = self.names.get(role, role)
        refs = [w.score.remote(*c) for w, c in zip(self._actors(), calls, strict=False)]
        try:
            got = ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise self._timed_out(role, where) from None
        except ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, DataError):
                raise DataError(f"at {where}: {cause.what}", fix=cause.fix) from None
            raise DataError(f"reward {role} ({name}) failed at {where}: {cause or e}") from None
        except ray.exceptions.RayActorError as e:
            raise self._crashed(role, where, type(e).__name__) from None
        return got

    def stop(self) -> None:
        for w in self._pool:
            if isinstance(w, reward_process.RewardProcess):
                w.kill()
            elif ray.is_initialized():
                ray.kill(w, no_restart=True)
        self._pool = []


def _kill(procs: list[reward_process.RewardProcess]) -> None:
    for w in procs:
        w.kill()


def _shares(n: int, workers: int) -> list[tuple[int, int]]:
    """Contiguous, near-equal ``[start, stop)`` shares of ``n`` responses (none empty; one when n is 0)."""
    k = max(1, min(workers, n))
    return [(i * n // k, (i + 1) * n // k) for i in range(k)]


def by_value(fn: Any) -> None:
    """Ship a function (or an environment class) from the user's own module by value (one loaded from a file path is not
    in ``sys.modules`` and travels by value anyway; flowc's and installed packages' import anywhere)."""
    fn = getattr(fn, "fn", fn)  # an adapter of verl's or TRL's convention (flowc.rewards): the user's function
    name = getattr(fn, "__module__", "") or ""
    module = sys.modules.get(name)
    file = getattr(module, "__file__", None)
    if module is None or file is None or name == "flowc" or name.startswith("flowc."):
        return
    if any(part in ("site-packages", "dist-packages") for part in Path(file).parts):
        return
    import cloudpickle as plain_cloudpickle  # the local reward processes' pickler (runtime.reward_process)
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(module)
    plain_cloudpickle.register_pickle_by_value(module)
