"""The environments of agent rollouts: a pool of child processes running the user's class.

A rollout engine that runs ``generate(..., env=...)`` starts ``workers`` processes
(:mod:`flowc.runtime.env_process`) the first time, keeps them for the run, and sends each
trajectory's requests to one of them (its instance lives there). Requests are asynchronous:
:meth:`EnvPool.submit` queues one, :meth:`EnvPool.poll` returns those answered, so the engine
generates while environments think. Every request has a deadline (``timeout_s``); a process past
it is killed and a fresh one started, and every trajectory whose instance lived there ends with
an error (the answer ``("timeout", …)`` or ``("lost", …)``) — never the run.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from flowc.errors import SpecError
from flowc.runtime.reward_process import Crashed, RewardProcess, Timeout

MODULE = "flowc.runtime.env_process"
HARNESS_MODULE = "flowc.runtime.harness_process"


@dataclass(frozen=True)
class EnvBinding:
    """An environment role as a run binds it (what a rollout engine needs to run it).

    Attributes:
        role: the flow's ``fc.Environment`` parameter.
        name: ``module:Class`` as the user gave it (errors and metrics name it).
        payload: the class and its keyword arguments, cloudpickled (unpickled in the env processes).
        stop: strings that end a policy turn besides EOS (the class's ``stop``; each one token).
        max_turns: the class's ``max_turns`` (a flow's ``generate(max_turns=…)`` wins).
        workers: processes in each rollout engine's pool.
        timeout_s: the longest one ``reset`` or ``step`` may take.
        error_reward: the reward of a trajectory whose environment raised or timed out.
    """

    role: str
    name: str
    payload: bytes
    stop: tuple[str, ...] = ()
    max_turns: int = 1
    workers: int = 2
    timeout_s: float = 30.0
    error_reward: float = 0.0
    harness: bool = False  # the class drives the trajectory itself: run(record, base_url) (server mode)


def bind_class(
    role: str, cls: Any, name: str, *, workers: int, timeout_s: float, error_reward: float, **kwargs: Any
) -> EnvBinding:
    """Check ``cls`` against the protocol — ``reset``, ``step``, ``stop``, ``max_turns``; or, for an
    agent harness (server mode), ``run`` — and bind it."""
    harness = isinstance(cls, type) and callable(getattr(cls, "run", None)) and not callable(getattr(cls, "step", None))
    missing = [] if harness else [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if not isinstance(cls, type) or missing:
        raise SpecError(
            f"environment {role} ({name}) is not an environment class"
            + (f": it has no {' or '.join(missing)} method" if isinstance(cls, type) else ""),
            fix="give a class with reset(record) -> str and step(action) -> (observation, reward, done[, info]), or an "
            "agent harness with run(record, base_url) -> reward (docs/agents.md)",
        )
    stop = getattr(cls, "stop", ())
    if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
        raise SpecError(f"environment {role} ({name}): stop must be a tuple of non-empty strings, got {stop!r}")
    from flowc.runtime.rewards import by_value

    by_value(cls)  # a class of the user's own module travels by value to the env processes
    turns = getattr(cls, "max_turns", 1)
    if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
        raise SpecError(f"environment {role} ({name}): max_turns must be a positive integer, got {turns!r}")
    return EnvBinding(
        role,
        name,
        cloudpickle.dumps((cls, kwargs, name)),
        tuple(stop),
        turns,
        workers=max(1, int(workers)),
        timeout_s=float(timeout_s),
        error_reward=float(error_reward),
        harness=harness,
    )


@dataclass
class _Worker:
    proc: RewardProcess
    queue: collections.deque = field(default_factory=collections.deque)  # (tid, msg) waiting
    busy: tuple[int, tuple] | None = None  # (tid, msg) in flight
    live: set[int] = field(default_factory=set)  # trajectories whose instance lives here
    lost: set[int] = field(default_factory=set)  # trajectories whose instance died with the last process
    deadline: float = 0.0
    started: float = 0.0
    seconds: float = 0.0  # time spent answering (the environments' share of a rollout)


class EnvPool:
    """``binding.workers`` environment processes; trajectory ``tid`` lives on worker ``tid % workers``."""

    def __init__(self, binding: EnvBinding) -> None:
        self.b = binding
        self.workers: list[_Worker] = []
        try:
            for _ in range(binding.workers):
                self.workers.append(self._start())
        except BaseException:
            self.close()  # the ones started before the one that failed
            raise
        self.restarts = 0
        self._answered: list[tuple[int, str, str, Any]] = []  # answers known without asking (lost instances)

    def _start(self) -> _Worker:
        proc = RewardProcess(self.b.payload, module=MODULE)
        try:
            kind, value = proc.receive(time.monotonic() + max(60.0, self.b.timeout_s))
        except (Timeout, Crashed):
            proc.kill()
            raise SpecError(
                f"environment {self.b.role} ({self.b.name}) did not start in its process",
                fix="the class must be importable there: define it in a module on the path (or the flow's file)",
            ) from None
        if kind != "ok":
            proc.kill()
            raise SpecError(f"environment {self.b.role} ({self.b.name}) could not be loaded in its process: {value}")
        # (the "ready" answer comes from the server loop itself, without a time)
        return _Worker(proc)

    def _of(self, tid: int) -> _Worker:
        return self.workers[tid % len(self.workers)]

    def submit(self, tid: int, *msg: Any) -> None:
        """Queue ``("reset", record)``, ``("step", action)`` or ``("close",)`` for trajectory ``tid``."""
        w = self._of(tid)
        if msg[0] == "reset":
            w.lost.discard(tid)
            w.live.add(tid)
        elif tid in w.lost:  # its instance died with an earlier process of this worker
            if msg[0] == "close":
                w.lost.discard(tid)
            else:
                self._answered.append((tid, msg[0], "lost", "its environment process was restarted"))
            return
        if msg[0] == "close":
            w.live.discard(tid)
        w.queue.append((tid, (msg[0], tid, *msg[1:])))
        self._next(w)

    def _next(self, w: _Worker) -> None:
        if w.busy is not None or not w.queue:
            return
        tid, msg = w.queue.popleft()
        try:
            w.proc.send(*msg)
        except Crashed:
            w.busy, w.deadline = (tid, msg), 0.0  # answered "lost" by the next poll
            return
        w.busy, w.started = (tid, msg), time.monotonic()
        w.deadline = w.started + self.b.timeout_s

    def pending(self) -> int:
        return len(self._answered) + sum(len(w.queue) + (w.busy is not None) for w in self.workers)

    def poll(self, wait_s: float = 0.0) -> list[tuple[int, str, str, Any]]:
        """Answers as ``(tid, op, kind, value)``: kind ``ok`` (value: the answer), ``error`` (the
        environment raised: its message), ``timeout`` or ``lost`` (its process was killed or died).
        Waits up to ``wait_s`` for the first answer when none is ready."""
        end = time.monotonic() + wait_s
        while True:
            out = self._collect()
            if out or self.pending() == 0 or time.monotonic() >= end:
                return out
            time.sleep(0.001)

    def _collect(self) -> list[tuple[int, str, str, Any]]:
        out, self._answered = self._answered, []
        now = time.monotonic()
        for i, w in enumerate(self.workers):
            while w.busy is not None:
                tid, msg = w.busy
                if w.proc.answered():
                    try:
                        kind, value = w.proc.receive(time.monotonic() + 5.0)
                    except (Timeout, Crashed):
                        out += self._restart(i, "lost", "its process died")
                        w = self.workers[i]
                        continue
                    w.busy = None
                    value, took = value
                    w.seconds += took  # the environment's own time, however late the loop collects the answer
                    if msg[0] != "close":
                        out.append((tid, msg[0], kind, value))
                    self._next(w)
                elif now >= w.deadline:
                    out += self._restart(i, "timeout", f"no answer within {self.b.timeout_s:g} s")
                    w = self.workers[i]
                else:
                    break
        return out

    def _restart(self, i: int, kind: str, why: str) -> list[tuple[int, str, str, Any]]:
        """Kill worker ``i`` and start a fresh one: its in-flight request ends as ``kind``, and every
        other trajectory it held (queued or live) as ``lost``; a close of a lost one is dropped."""
        w = self.workers[i]
        w.proc.kill()
        self.restarts += 1
        tid, msg = w.busy  # type: ignore[misc]
        out = [] if msg[0] == "close" else [(tid, msg[0], kind, why)]
        waiting = {t: m[0] for t, m in w.queue if m[0] != "close"}
        out += [
            (t, op, "lost", f"its environment process was restarted ({why} for another trajectory)") for t, op in waiting.items()
        ]
        fresh = self._start()
        fresh.seconds = w.seconds + (time.monotonic() - w.started)  # the request it gave up on kept it busy
        fresh.lost = (w.live | w.lost) - {tid} - set(waiting)
        self.workers[i] = fresh
        return out

    def seconds(self) -> float:
        """The time the pool's processes spent answering, summed over workers."""
        return sum(w.seconds for w in self.workers)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers]

    def close(self) -> None:
        for w in self.workers:
            w.proc.kill()
        self.workers = []


class HarnessPool:
    """``binding.workers`` processes running agent harnesses (:mod:`flowc.runtime.harness_process`),
    each many at once; trajectory ``tid`` runs in process ``tid % workers``. A harness past its
    deadline (``timeout_s`` per turn: ``timeout_s × max_turns``) ends as ``timeout`` (its thread is
    left to finish; its requests are refused from then on); a process that dies ends its harnesses
    as ``lost`` and a fresh one takes its place."""

    def __init__(self, binding: EnvBinding) -> None:
        self.b = binding
        self.deadline_s = binding.timeout_s * max(1, binding.max_turns)
        self.procs: list[RewardProcess] = []
        try:
            for _ in range(binding.workers):
                self.procs.append(self._start())
        except BaseException:
            self.close()
            raise
        self.running: dict[int, float] = {}  # tid → its deadline (time.monotonic)

    def _start(self) -> RewardProcess:
        proc = RewardProcess(self.b.payload, module=HARNESS_MODULE)
        try:
            kind, value = proc.receive(time.monotonic() + 60.0)
        except (Timeout, Crashed):
            proc.kill()
            raise SpecError(f"harness {self.b.role} ({self.b.name}) did not start in its process") from None
        if kind != "ok":
            proc.kill()
            raise SpecError(f"harness {self.b.role} ({self.b.name}) could not be loaded in its process: {value}")
        return proc

    def submit(self, tid: int, record: dict[str, Any], base_url: str) -> None:
        self.running[tid] = time.monotonic() + self.deadline_s
        try:
            self.procs[tid % len(self.procs)].send("run", tid, record, base_url)
        except Crashed:
            pass  # answered "lost" by the next poll

    def pending(self) -> int:
        return len(self.running)

    def poll(self) -> list[tuple[int, str, Any]]:
        """Finished harnesses as ``(tid, kind, value)``: ``ok`` (value: (reward, info)), ``error``
        (its message), ``timeout`` or ``lost``."""
        out: list[tuple[int, str, Any]] = []
        for i, proc in enumerate(self.procs):
            while proc.answered():
                try:
                    kind, (tid, value, _) = proc.receive(time.monotonic() + 5.0)
                except (Timeout, Crashed):
                    proc.kill()
                    mine = [t for t in self.running if t % len(self.procs) == i]
                    out += [(t, "lost", "its harness process died") for t in mine]
                    for t in mine:
                        del self.running[t]
                    self.procs[i] = proc = self._start()
                    continue
                if self.running.pop(tid, None) is not None:  # (a harness past its deadline was answered already)
                    out.append((tid, kind, value))
        now = time.monotonic()
        for tid, end in list(self.running.items()):
            if now > end:
                del self.running[tid]
                out.append((tid, "timeout", f"the harness did not return within {self.deadline_s:g} s"))
        return out

    def seconds(self) -> float:
        """Not measured: a harness's time is mostly its waits on the engine (0)."""
        return 0.0

    def close(self) -> None:
        for p in self.procs:
            p.kill()
        self.procs = []
