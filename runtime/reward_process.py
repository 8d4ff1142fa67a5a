"""Reward functions in a plain child process (the inline executor's rewards; no Ray).

The same guarantees as the Ray reward actors (:mod:`flowc.runtime.reward_worker`): the user's
function runs in a process of its own that holds no torch, each call has a deadline after
which the process is killed (a fresh one serves the next call), and a function that raises,
returns garbage or kills its interpreter fails the run with an error naming the reward, the
step and the rows. The child is ``python -m flowc.runtime.reward_process``; requests and
answers are length-prefixed cloudpickle frames on private copies of its stdin and stdout
(fd 0 then reads /dev/null and fd 1 writes to stderr, so neither the user's prints nor a
sandbox the reward starts can touch the protocol). It answers "ready" once the functions are
loaded (a function that cannot be unpickled there is an error naming it). It leads a process
group of its own, killed whole (a reward's sandboxes with it), and on Linux it dies with its
parent (``PR_SET_PDEATHSIG``), so a SIGKILLed run leaves none behind.
"""

from __future__ import annotations

import os
import select
import signal
import struct
import subprocess
import sys
import time
from typing import Any, BinaryIO

import cloudpickle

from flowc.errors import DataError
from flowc.runtime.reward_calls import score_reward

_HEADER = struct.Struct(">Q")


class Timeout(Exception):
    """No answer before the deadline."""


class Crashed(Exception):
    """The process ended without answering."""


def _write(f: BinaryIO, obj: Any) -> None:
    blob = cloudpickle.dumps(obj)
    f.write(_HEADER.pack(len(blob)) + blob)
    f.flush()


def _read_blocking(f: BinaryIO) -> Any:
    head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    (n,) = _HEADER.unpack(head)
    return cloudpickle.loads(f.read(n))


def _read_exact(fd: int, n: int, deadline: float) -> bytes:
    buf = bytearray()
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0 or not poller.poll(left * 1000):
            raise Timeout
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise Crashed
        buf += chunk
    return bytes(buf)


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when its parent dies (and now, if it died already)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


class RewardProcess:
    """One child process holding the run's reward functions (or, with ``module``, another
    server speaking this protocol: the environments of :mod:`flowc.runtime.env_process`);
    one call at a time."""

    def __init__(self, payload: bytes, module: str = "flowc.runtime.reward_process") -> None:
        """Start the process and send it the functions; :meth:`receive` then gets its "ready"."""
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            start_new_session=True,  # a Ctrl-C at the terminal is the run's to handle, not the reward's
        )
        try:
            self.proc.stdin.write(_HEADER.pack(len(payload)) + payload)  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        except OSError:
            raise Crashed from None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, *msg: Any) -> None:
        try:
            _write(self.proc.stdin, msg)  # type: ignore[arg-type]
        except (BrokenPipeError, OSError):
            raise Crashed from None

    def receive(self, deadline: float) -> tuple[str, Any]:
        """The answer to the last request; :class:`Timeout` past ``deadline`` (``time.monotonic``),
        :class:`Crashed` when the process ended instead."""
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        (n,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
        return cloudpickle.loads(_read_exact(fd, n, deadline))

    def answered(self) -> bool:
        """Whether an answer (or the process's end) is waiting to be read, without blocking."""
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        poller = select.poll()
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        return bool(poller.poll(0))

    def call(self, *msg: Any, timeout_s: float = 60.0) -> Any:
        """A request and its answer (tests: ``imported``, ``pid``)."""
        self.send(*msg)
        kind, value = self.receive(time.monotonic() + timeout_s)
        if kind != "ok":
            raise RuntimeError(value)
        return value

    def exit_code(self) -> int | None:
        """The exit code of a process that ended (None if it still runs after a moment)."""
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """Kill the process and its group (what the reward started)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()  # type: ignore[union-attr]
            except OSError:
                pass


def pickled_functions(fns: dict[str, Any], names: dict[str, str]) -> bytes:
    return cloudpickle.dumps((fns, names))


def _answer(fns: dict[str, Any], names: dict[str, str], msg: tuple) -> tuple[str, Any]:
    op, *args = msg
    if op == "score":
        role, prompts, responses, columns, offset = args
        try:
            return "ok", score_reward(fns[role], names.get(role, role), prompts, responses, columns, offset=offset)
        except DataError as e:
            return "data_error", (e.what, e.fix)
        except Exception as e:  # the user's code: what it raises is the answer (an exit ends the process)
            return "error", f"{type(e).__name__}: {e}"
    if op == "imported":
        return "ok", args[0] in sys.modules
    if op == "pid":
        return "ok", os.getpid()
    return "error", f"unknown request {op!r}"


def channels() -> tuple[BinaryIO, BinaryIO, Any]:
    """A child's setup: it dies with its parent; private copies of stdin and stdout carry the
    requests and answers (fd 0 then reads nothing, fd 1 — print — goes to stderr); the payload,
    read and acknowledged ("ready"). Returns (requests, answers, payload)."""
    _die_with_parent(int(sys.argv[1]))
    src = os.fdopen(os.dup(0), "rb")  # the requests' channel; fd 0 now reads nothing
    out = os.fdopen(os.dup(1), "wb")  # the answers' channel; fd 1 (print) now goes to stderr
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    try:
        payload = _read_blocking(src)
    except Exception as e:  # user code that cannot be unpickled here (its module is not importable)
        _write(out, ("error", f"{type(e).__name__}: {e}"))
        sys.exit(1)
    _write(out, ("ok", "ready"))
    return src, out, payload


def serve(answer: Any) -> None:
    """A child's main loop: :func:`channels`, then ``answer(payload, request)`` for each request
    until the parent closes the pipe."""
    src, out, payload = channels()
    while (msg := _read_blocking(src)) is not None:  # None: the parent closed the pipe (it is gone)
        _write(out, answer(payload, msg))


def main() -> None:
    serve(lambda payload, msg: _answer(*payload, msg))


if __name__ == "__main__":
    main()
