"""The Ray cluster of one flowc process: join one, or start one on this machine that listens only on
loopback and leaves nothing behind when the process ends, however it ends.

A local cluster (``address=None``) gets

- a session folder of its own, ``$TMPDIR/flowc-ray-<pid>``;
- Ray's node address ``127.0.0.1``: every socket of the session (GCS, raylet, object manager, the
  workers' gRPC servers, the agents) is bound to loopback (SECURITY.md lists them);
- ``GLOO_SOCKET_IFNAME=lo`` for the workers, so gloo's collectives stay on loopback too (the
  rendezvous store of a worker group binds to the master's address, see ``Worker.port``);
- a reaper (:mod:`flowc.runtime.reaper`) that stops the session's processes and removes the folder
  when this process exits, also when it is SIGKILLed;
- only the processes a run uses (:func:`_lean_head`): the GCS, the raylet and its agents, the log
  monitor and the run's own workers. No autoscaler monitor (a local cluster has a fixed size),
  no dashboard API server (``include_dashboard=False`` still starts one for usage statistics),
  no idle workers started ahead of need. Together they held about 0.45 GB resident on a 2-core
  machine (docs/benchmarks.md); ``FLOWC_RAY_FULL_HEAD=1`` starts them as Ray would.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import ray

from flowc.errors import RuntimeFailure
from flowc.runtime import reaper

LOOPBACK = "127.0.0.1"
# TORCH_CPP_LOG_LEVEL: torch's C++ warnings (vLLM's CPU build logs its NUMA memory binding through
# them on every engine start) stay out of the user's console; set it to WARNING to see them.
WORKER_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
    "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
}
LOCAL_WORKER_ENV = {**WORKER_ENV, "GLOO_SOCKET_IFNAME": "lo"}
_SINGLE_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray uses loopback as the node's address

_reaper: subprocess.Popen[bytes] | None = None  # held for the process's life: its stdin pipe is the reaper's signal
_temp_dir: str | None = None
_CLUSTERS_ENABLED = ray._private.ray_constants.ENABLE_RAY_CLUSTER  # as Ray read it at import


class _TokenAuthNotice(logging.Filter):
    """Drops Ray's notice that a new local cluster uses token authentication (its default, which
    flowc keeps); the warning that authentication is *disabled* still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Token authentication is enabled for this Ray cluster" not in record.getMessage()


def _quiet_token_notice() -> None:
    logger = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _TokenAuthNotice) for f in logger.filters):
        logger.addFilter(_TokenAuthNotice())


# Ray's own switches for workers started ahead of demand: none (each run starts the actors it needs)
LEAN_SYSTEM_CONFIG = {"enable_worker_prestart": False, "prestart_worker_first_driver": False}


def lean() -> bool:
    """Whether a local head starts lean (the default; ``FLOWC_RAY_FULL_HEAD=1``: as Ray would)."""
    return os.environ.get("FLOWC_RAY_FULL_HEAD") != "1"


@contextlib.contextmanager
def _lean_head() -> Iterator[None]:
    """While a local head starts: no autoscaler monitor and no dashboard API server.

    ``ray.init`` has no switch for either (``ray start --no-monitor`` has one for the monitor
    only), so the head node's two start methods are no-ops for the duration of the call. A Ray
    whose node lacks them starts everything, as before (checked by a test of the process set)."""
    node = getattr(getattr(ray, "_private", None), "node", None)
    node_cls = getattr(node, "Node", None)
    names = ("start_monitor", "start_api_server")
    if not lean() or node_cls is None or not all(n in vars(node_cls) for n in names):
        yield
        return
    saved = {n: node_cls.__dict__[n] for n in names}
    node_cls.start_monitor = lambda self: None
    node_cls.start_api_server = lambda self, **_: setattr(self, "_webui_url", None)
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(node_cls, n, fn)


def local_temp_dir(pid: int | None = None) -> str:
    """The session folder of the local cluster that process pid (default: this one) starts."""
    return str(Path(tempfile.gettempdir()) / f"flowc-ray-{pid or os.getpid()}")


def running_temp_dir() -> str | None:
    """The session folder of the local cluster this process started, or None."""
    return _temp_dir if ray.is_initialized() else None


def init_ray(address: str | None, *, temp_dir: str | None = None) -> bool:
    """Connect to (address) or start (None: this machine, loopback only) a Ray cluster; True when
    this call did either, False when Ray was already initialised in this process."""
    global _reaper, _temp_dir
    if ray.is_initialized():
        return False
    _quiet_token_notice()
    if address:
        ray.init(address=address, runtime_env={"env_vars": dict(WORKER_ENV)}, log_to_driver=True)
        return True
    tmp = temp_dir or local_temp_dir()
    # a local cluster is one node: its address is loopback, and Ray checks that it is not multi-node.
    # The variable reaches Ray's own processes, which start now (the raylet passes it on to the
    # workers); it is not left in this process's environment, where every later subprocess (a
    # `ray start` of another cluster) would inherit it. The driver read it at import, hence the constant.
    before = os.environ.get(_SINGLE_NODE_ENV)
    os.environ[_SINGLE_NODE_ENV] = "0"
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False
    _reaper = _reaper or reaper.start(tmp)
    try:
        with _lean_head():
            ray.init(
                num_cpus=max(8, 2 * (os.cpu_count() or 1)),
                include_dashboard=False,
                _system_config=dict(LEAN_SYSTEM_CONFIG) if lean() else None,
                _temp_dir=tmp,
                _node_ip_address=LOOPBACK,
                runtime_env={"env_vars": dict(LOCAL_WORKER_ENV)},
                log_to_driver=True,
            )
    finally:
        if before is None:
            os.environ.pop(_SINGLE_NODE_ENV, None)
        else:
            os.environ[_SINGLE_NODE_ENV] = before
    _temp_dir = tmp
    if (ip := ray.util.get_node_ip_address()) != LOOPBACK:
        shutdown_ray()
        raise RuntimeFailure(
            f"the local Ray cluster came up on {ip}, not {LOOPBACK}",
            fix="report this with `ray --version`; until then run on a machine without other users",
        )
    return True


def shutdown_ray() -> None:
    """Stop Ray; for a local cluster, also its leftover processes and its session folder."""
    global _reaper, _temp_dir
    ray.shutdown()
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = _CLUSTERS_ENABLED
    if _reaper is not None:
        reaper.stop(_reaper)
        _reaper = None
    _temp_dir = None


__all__ = ["LOOPBACK", "init_ray", "local_temp_dir", "running_temp_dir", "shutdown_ray"]
