"""Cleans up the local Ray cluster of a flowc driver when the driver exits, however it exits.

Ray's own clean-up runs in the driver (``ray.shutdown`` at exit). When the driver is SIGKILLed, or
dies of a segfault or of the OOM killer, nothing runs there. On Linux the GCS server and the raylet
die with the driver (Ray sets their parent-death signal) and the workers follow within seconds, but
the dashboard agent and the runtime-env agent linger for about a minute, and the session folder
stays for good. The reaper is a small process that outlives the driver. :func:`start` launches
``python -m flowc.runtime.reaper TEMP_DIR`` in a new session, so a Ctrl-C or a hang-up sent to the
driver's terminal does not reach it. Its stdin is a pipe whose only writer is the driver. The
kernel closes that pipe when the driver exits for any reason, the reaper reads end-of-file, and then
it

1. sends SIGTERM to every process of this user that belongs to the session, waits up to
   :data:`TERM_GRACE_S` seconds, and SIGKILLs the ones still alive. It spares itself and the driver
   that started it, which matters when :func:`stop` asks for the clean-up of a live driver;
2. removes ``TEMP_DIR``.

A process belongs to the session when its command line names ``TEMP_DIR`` (the GCS server, the
raylet, the monitor, the dashboard and the log monitor: their flags name the session folder under
it), or when one of its open files lies under ``TEMP_DIR``. The second test is needed because Ray
renames its workers and agents (``ray::IDLE``, ``ray::MyActor``, ``ray::DashboardAgent``,
``ray::RuntimeEnvAgent``). Their command line no longer names the folder, but their stdout and
stderr are log files inside it.

Processes are found with ``psutil`` when it is importable, else by reading ``/proc`` (Linux). With
neither, only the folder is removed. A child that the driver forked without exec (``os.fork``, a
``fork`` multiprocessing pool) inherits the pipe's write end, and the reaper then also waits for
that child to exit.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

try:
    import psutil
except ImportError:  # pragma: no cover - not a declared dependency (Ray vendors its own copy); /proc serves on Linux
    psutil = None

TERM_GRACE_S = 2.0  # seconds between SIGTERM and SIGKILL
KILL_WAIT_S = 2.0  # seconds to wait for SIGKILLed processes to go
ROUNDS = 3  # scans for processes that appeared while the previous ones were stopped
STOP_TIMEOUT_S = 15.0  # how long stop() waits for the reaper


def start(temp_dir: str) -> subprocess.Popen[bytes]:
    """Start the reaper of the Ray cluster whose temp folder is temp_dir; call it before ``ray.init``.

    Keep the returned handle for :func:`stop`: its stdin is the pipe whose end-of-file starts the
    clean-up, and dropping the handle closes it.
    """
    folder = _checked(temp_dir)
    return subprocess.Popen(
        [sys.executable, "-m", "flowc.runtime.reaper", folder],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


def stop(proc: subprocess.Popen[bytes], timeout: float = STOP_TIMEOUT_S) -> int | None:
    """Close the reaper's stdin (a normal exit: it cleans up as after a crash) and wait up to timeout s.

    Call it after ``ray.shutdown()``; returns the reaper's exit status, or None when it did not end in
    time (it is then left to finish on its own).
    """
    if proc.stdin is not None and not proc.stdin.closed:
        try:
            proc.stdin.close()
        except OSError:
            pass
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def reap(temp_dir: str, spare: Iterable[int] = ()) -> list[int]:
    """Stop every process of this user that belongs to temp_dir's session, then remove temp_dir.

    Processes in spare and the calling process are left alone. Returns the pids it signalled.
    """
    folder = _checked(temp_dir)
    keep = {os.getpid(), *spare}
    signalled: list[int] = []
    for _ in range(ROUNDS):
        pids = [pid for pid in session_pids(folder) if pid not in keep]
        if not pids:
            break
        signalled += pids
        _signal(pids, signal.SIGTERM)
        alive = _wait_gone(pids, TERM_GRACE_S)
        if alive:
            _signal(alive, signal.SIGKILL)
            _wait_gone(alive, KILL_WAIT_S)
    shutil.rmtree(folder, ignore_errors=True)
    return signalled


def main(argv: list[str] | None = None) -> int:
    """``python -m flowc.runtime.reaper TEMP_DIR``: wait for end-of-file on stdin, then :func:`reap`."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m flowc.runtime.reaper TEMP_DIR (stdin: a pipe from the driver)", file=sys.stderr)
        return 2
    try:
        folder = _checked(args[0])
    except ValueError as e:
        print(f"flowc.runtime.reaper: {e}", file=sys.stderr)
        return 2
    driver = os.getppid()  # the driver that started us; spared when it is still alive (stop())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    stdin = sys.stdin.buffer
    while True:
        try:
            if not stdin.read(65536):
                break
        except InterruptedError:
            continue
        except OSError:
            break
    reap(folder, spare=(driver,))
    return 0


# ------------------------------------------------------------------ helpers


def _checked(temp_dir: str) -> str:
    """temp_dir, absolute and normalised; refuses a folder whose clean-up would reach far beyond one session."""
    if not temp_dir or not os.path.isabs(temp_dir):
        raise ValueError(f"the reaper needs an absolute temp folder, not {temp_dir!r}")
    folder = os.path.normpath(temp_dir)
    roots = {os.path.normpath(p) for p in ("/", "/tmp", "/var/tmp", "/dev/shm", tempfile.gettempdir(), str(Path.home()))}
    if folder in roots or len(Path(folder).parts) < 3:
        raise ValueError(f"the reaper will not clean up {folder!r}: it is not a folder of its own")
    return folder


def _mentions(folder: str) -> re.Pattern[str]:
    """Matches folder itself or a path under it (not /tmp/x-12 for /tmp/x-1)."""
    return re.compile(re.escape(folder) + r"(?![\w.-])")


def session_pids(folder: str) -> list[int]:
    """This user's processes whose command line names folder or that hold a file open under it."""
    names = _mentions(folder)
    return sorted(_scan_psutil(folder, names) if psutil is not None else _scan_proc(folder, names))


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder + os.sep)


def _scan_psutil(folder: str, names: re.Pattern[str]) -> Iterator[int]:
    uid = os.getuid() if hasattr(os, "getuid") else None
    for p in psutil.process_iter(["pid", "uids", "cmdline"]):
        try:
            if uid is not None and p.info["uids"] is not None and uid not in (p.info["uids"].real, p.info["uids"].effective):
                continue
            if names.search(" ".join(p.info["cmdline"] or ())) or any(_under(f.path, folder) for f in p.open_files()):
                yield p.info["pid"]
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue


def _scan_proc(folder: str, names: re.Pattern[str]) -> Iterator[int]:
    uid = os.getuid()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return
    for entry in entries:
        if not entry.isdigit():
            continue
        base = f"/proc/{entry}"
        try:
            if os.stat(base).st_uid != uid:
                continue
            with open(f"{base}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            if names.search(cmdline):
                yield int(entry)
                continue
            for fd in os.listdir(f"{base}/fd"):
                try:
                    if _under(os.readlink(f"{base}/fd/{fd}"), folder):
                        yield int(entry)
                        break
                except OSError:
                    continue
        except OSError:
            continue


def _signal(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _gone(pid: int) -> bool:
    """The process has exited (a zombie whose parent has not reaped it yet counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        if psutil is None:
            return False
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
        except psutil.Error:
            return False


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait up to timeout s for pids to exit; returns those still alive."""
    deadline = time.monotonic() + timeout
    alive = [p for p in pids if not _gone(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if not _gone(p)]
    return alive


if __name__ == "__main__":
    sys.exit(main())
