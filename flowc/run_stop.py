"""Stopping a run cleanly: SIGINT and SIGTERM stop it at the next step boundary, after a
checkpoint; a second signal aborts at once (after a checkpoint being written is whole).
What a stopped run says about its checkpoints, and how to go on, is here too."""

from __future__ import annotations

import faulthandler
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class Abort(KeyboardInterrupt):
    """A second signal: leave now (nothing on the way catches a KeyboardInterrupt). While the main
    thread waits in ``ray.get``, Ray runs the signal handler and turns what it raises into a fresh
    KeyboardInterrupt only when it is one (anything else it swallows, and the wait goes on), so
    the run tells an abort by :attr:`Stop.aborted`, not by this type."""


class Stop:
    """SIGINT and SIGTERM while a run is in the main thread: the first asks for a stop at the
    next step boundary, the second aborts (after a checkpoint being written is whole)."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._count = 0
        self._defer = False
        self._pending = False
        self.aborted = False

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "a signal"

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._count += 1
        if self._count == 1:
            self.signum = signum
            print(
                f"\n{signal.Signals(signum).name}: stopping after the current step, with a checkpoint "
                "(send it again to abort now)",
                file=sys.stderr,
                flush=True,
            )
            return
        if self._defer:
            self._pending = True
            return
        self.aborted = True
        raise Abort

    @contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        prev = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints where a stuck run is
        try:
            yield
        finally:
            for s, h in prev.items():
                signal.signal(s, h)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        """A second signal inside waits for the block to finish."""
        self._defer = True
        try:
            yield
        finally:
            self._defer = False
            if self._pending:
                self.aborted = True
                raise Abort


def checkpoint_status(out: Path) -> str:
    from flowc.runtime.checkpoints import CheckpointDir

    latest = CheckpointDir(out).latest()
    return f"the last checkpoint, {latest}, is intact" if latest is not None else "no checkpoint was written"


def resume_fix(out: Path, resume: str) -> str:
    from flowc.runtime.checkpoints import CheckpointDir

    if CheckpointDir(out).latest() is not None:
        return f"continue from the last checkpoint with: {resume}"
    return "start the run again (no checkpoint to resume from)"
