"""The inline executor: a plan of one local worker runs in the controller's own process.

A plan whose only pool is one worker on this machine gains nothing from Ray: every op is a
round trip to a second process that holds a second copy of torch, transformers and the
models' code, beside Ray's own processes (the GCS, the raylet and its agents). On the
2-core machine this project is developed on, they are about 10 ms of a 75 ms step and about
0.7 GB of a 1.3 GB run (docs/benchmarks.md). :class:`InlineGroup` has the interface of a
:class:`~flowc.runtime.worker.WorkerGroup` (``call`` returns references, ``get`` waits for
them), but holds one :class:`~flowc.runtime.worker.Worker` in this process and runs each call
at once; its results are :class:`~flowc.runtime.batches.Inline` values, so no value ever goes
through an object store.

What Ray gave the one-worker plan, the inline executor keeps:

- **errors that name the group, the roles and the call** (:class:`WorkerError`; a flowc error
  raised by an engine passes unchanged);
- **the plan's timeout**: a call that overruns ``timeout_s`` cannot be interrupted inside
  torch's kernels, so a watchdog thread prints which call overran and every thread's stack,
  and ends the process with exit code :data:`TIMEOUT_EXIT` (a Ray worker that hangs is
  abandoned the same way, with the run failing); the last checkpoint resumes;
- **rewards in a process of their own** with their deadline (:mod:`flowc.runtime.reward_process`).

A crash inside the worker (a segfault in a kernel) ends the whole run instead of one worker:
runs that must survive that pin ``executor: ray``. :func:`choose_executor` decides.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any, Literal

from flowc.errors import RuntimeFailure, SpecError, WorkerError
from flowc.runtime.batches import Inline
from flowc.runtime.program import Program
from flowc.runtime.ray_session import WORKER_ENV
from flowc.runtime.worker import Worker

Executor = Literal["ray", "inline"]
TIMEOUT_EXIT = 124  # what `timeout` exits with: the run overran its deadline


def choose_executor(asked: str, program: Program, *, local: bool) -> Executor:
    """``ray`` or ``inline`` for a run that ``asked`` for ``auto``, ``ray`` or ``inline``.

    ``auto`` runs inline when the run starts its own cluster on this machine (``local``), the
    plan has one pool of one worker, and the target is the CPU (an inline GPU run works the
    same way but has not been measured against Ray's yet, so it is only taken when asked for).
    ``inline`` is refused, with the reason, for a plan it cannot run."""
    one = len(program.groups) == 1 and program.groups[0].size == 1
    if asked == "ray":
        return "ray"
    if asked == "inline":
        if not local or not one:
            why = "joins a Ray cluster" if not local else f"has {sum(g.size for g in program.groups)} workers"
            raise SpecError(
                f"executor: inline runs a plan of one worker on this machine, but this run {why}",
                fix="use executor: auto (or ray), or plan for one local worker (--cluster local:1)",
            )
        return "inline"
    if asked != "auto":
        raise SpecError(f"executor: {asked!r} is not one of auto, ray, inline")
    return "inline" if local and one and program.target.kind == "cpu" else "ray"


@contextlib.contextmanager
def deadline(seconds: float, what: str) -> Iterator[None]:
    """Ends the process, loudly, when the block runs longer than ``seconds``."""
    done = threading.Event()

    def watch() -> None:
        if done.wait(seconds):
            return
        try:  # straight to fd 2: sys.stderr may be captured or replaced (pytest, notebooks)
            os.write(
                2,
                (
                    f"\nflowc: {what} did not finish within {seconds:g} s (the run's timeout_s); the run is stopped.\n"
                    "  fix: raise timeout_s in the run config, or look for what hangs in the stacks below; "
                    "the last checkpoint resumes with `flowc run --resume RUN_DIR`\n"
                ).encode(),
            )
            faulthandler.dump_traceback(file=2, all_threads=True)
        finally:
            os._exit(TIMEOUT_EXIT)

    threading.Thread(target=watch, name="flowc-deadline", daemon=True).start()
    try:
        yield
    finally:
        done.set()


def _unwrap(x: Any) -> Any:
    return x.value if isinstance(x, Inline) else x


class InlineGroup:
    """A pool of one worker, run in this process: the interface of a ``WorkerGroup``."""

    def __init__(self, name: str, size: int, *, cpus_per_worker: float, timeout_s: float, roles: str) -> None:
        if size != 1:
            raise RuntimeFailure(f"the inline executor runs a pool of one worker; pool {name} has {size}")
        self.name, self.size, self.timeout, self.roles = name, size, timeout_s, roles
        os.environ.update(WORKER_ENV)  # the environment a Ray worker gets (vLLM reads OMP_NUM_THREADS)
        self.worker = Worker(name, 0, 1, max(1, int(cpus_per_worker)), timeout_s)

    def join(self, collective: str) -> list[dict[str, Any]]:
        """A world of one rank needs no process group; where it runs: this process."""
        return [{"node_id": "inline", "ip": "127.0.0.1", "pid": os.getpid(), "executor": "inline"}]

    def call(self, method: str, *args: Any, per_rank: list[tuple] | None = None, num_returns: int = 1) -> list[Any]:
        """Run ``method`` now; returns its result(s) as :class:`Inline` references."""
        out: list[Any] = []
        for i in range(self.size):
            a = per_rank[i] if per_rank is not None else args
            what = f"{method}({', '.join(str(x) for x in a[:2] if isinstance(x, (str, int)) or hasattr(x, 'role'))})"
            with deadline(self.timeout, f"{what} on worker group {self.name} ({self.roles})"):
                try:
                    got = getattr(self.worker, method)(*a)
                except RuntimeFailure:
                    raise
                except Exception as e:
                    raise WorkerError(
                        f"{what} failed on worker group {self.name} ({self.roles}), run inline: {type(e).__name__}: {e}"
                    ) from e
            out.append([Inline(x) for x in got] if num_returns != 1 else Inline(got))
        return out

    def get(self, refs: Any, what: str) -> Any:
        """The values of references :meth:`call` returned (they are ready: calls run at once)."""
        if isinstance(refs, list):
            return [[_unwrap(y) for y in r] if isinstance(r, list) else _unwrap(r) for r in refs]
        return _unwrap(refs)

    def shutdown(self) -> None:
        """Close the engines; a failure to close is logged, never raised over the run's own error."""
        try:
            self.worker.shutdown()
        except Exception as e:
            print(f"flowc: closing worker group {self.name}'s engines failed: {type(e).__name__}: {e}", file=sys.stderr)


__all__ = ["TIMEOUT_EXIT", "Executor", "InlineGroup", "choose_executor", "deadline"]
