"""Run untrusted Python (a policy's code) in a subprocess with limits: the pattern for code tools.

    from flowc.sandbox import run_python
    r = run_python("print(6 * 7)", cpu_s=2, memory_mb=256, wall_s=5)
    r.stdout, r.ok, r.why          # "42\\n", True, ""

Each call is a fresh ``python -I`` (isolated mode: no user site, no PYTHON* variables, the script's
folder not on the path) in an empty temporary folder that is removed afterwards, with

* **CPU time** ``cpu_s`` (``RLIMIT_CPU``: the kernel kills it past that),
* **memory** ``memory_mb`` of address space (``RLIMIT_AS``), files it writes ≤ ``file_mb``
  (``RLIMIT_FSIZE``), no core dumps,
* **wall clock** ``wall_s`` (its process group is killed: a sleeping or blocked program too),
* **no network**: the child enters new user and network namespaces before it runs (only a
  loopback device that is down). Where the kernel refuses unprivileged namespaces the call raises
  :class:`SandboxUnavailable` rather than run with the network — pass ``network=True`` to allow it
  knowingly,
* an environment of ``PATH`` and ``LANG`` only, stdin from ``/dev/null``, output capped at
  ``max_output`` bytes per stream.

Linux only. It is a resource and network fence for a policy's mistakes, not a security boundary
against a determined attacker (the filesystem is readable): run real untrusted code in a
container or VM as well.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from flowc.errors import FlowcError

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000


class SandboxUnavailable(FlowcError):
    """This machine cannot fence the child off the network (no unprivileged namespaces)."""


@dataclass(frozen=True)
class SandboxResult:
    """What a sandboxed run did: its output, exit code and, when it did not finish cleanly, why."""

    stdout: str
    stderr: str
    returncode: int
    why: str  # "" (exited 0), "error" (non-zero exit), "cpu", "memory", "wall", "killed", "output"

    @property
    def ok(self) -> bool:
        return self.why == ""


def _fence(cpu_s: float, memory_mb: int, file_mb: int, network: bool) -> None:
    """In the child, before ``exec``: limits, then (unless ``network``) a network namespace."""
    import ctypes
    import resource

    os.setsid()
    cpu = max(1, int(cpu_s + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    mem = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_mb * 1024 * 1024,) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if not network:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) != 0 and libc.unshare(CLONE_NEWNET) != 0:
            os.write(2, b"flowc-sandbox: no network namespace\n")
            os._exit(125)


def network_fence_available() -> bool:
    """Whether this machine lets an unprivileged child enter a network namespace."""
    r = run_python("pass", cpu_s=2, memory_mb=256, wall_s=10, _probe=True)
    return r.returncode != 125


def run_python(
    code: str,
    *,
    cpu_s: float = 2.0,
    memory_mb: int = 512,
    wall_s: float = 10.0,
    file_mb: int = 16,
    max_output: int = 64 * 1024,
    network: bool = False,
    _probe: bool = False,
) -> SandboxResult:
    """Run ``code`` with ``python -I`` under the limits above; never raises for what the code does."""
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailable("flowc.sandbox runs on Linux only (rlimits and namespaces)")
    with tempfile.TemporaryDirectory(prefix="flowc-sandbox-") as cwd:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", code],
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
            preexec_fn=lambda: _fence(cpu_s, memory_mb, file_mb, network),  # in the child, right before exec
            close_fds=True,
        )
        try:
            out, err = proc.communicate(timeout=wall_s)
            wall = False
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            out, err = proc.communicate()
            wall = True
    if proc.returncode == 125 and b"flowc-sandbox: no network namespace" in err and not _probe:
        raise SandboxUnavailable(
            "this machine does not allow an unprivileged process to enter a network namespace, so the sandbox "
            "cannot keep the code off the network",
            fix="enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1), run in a container "
            "without network, or pass network=True to run with the network knowingly",
        )
    rc = proc.returncode
    why = ""
    if wall:
        why = "wall"
    elif rc == -signal.SIGXCPU:
        why = "cpu"
    elif rc == -signal.SIGKILL:
        why = "killed"  # past the CPU limit's hard value, or by the kernel
    elif rc != 0:
        why = "memory" if b"MemoryError" in err else "error"
    if len(out) > max_output or len(err) > max_output:
        why = why or "output"
    return SandboxResult(out[:max_output].decode("utf-8", "replace"), err[:max_output].decode("utf-8", "replace"), rc, why)
