"""The cluster a run plans for: this machine's CPUs, or a Ray cluster it joins.

Joining a Ray cluster reads its alive nodes. GPU nodes are counted (a
CPU-only head node holds no devices and is left out) and their device type
comes from the accelerator type Ray detected (``accelerator_type:H200``), or
from ``--device``; a GPU cluster whose type is unknown, mixed or undetected on
some nodes is refused, never planned as some other GPU. Nodes with different
GPU counts are planned with the smallest count per node, and the cluster's name
says so.

Before Ray is asked, the address is resolved (``auto``: ``RAY_ADDRESS`` or the
cluster ``ray start`` left on this machine) and probed within a few seconds — its
port, then its GCS — so a wrong address fails at once with the fix instead of
Ray's minutes of retries.
"""

from __future__ import annotations

import threading
from typing import Any

from flowc.errors import SpecError
from flowc.ir.cluster import ClusterSpec
from flowc.ir.hardware import get_profile, profiles

ACCELERATOR = "accelerator_type:"
NO_CLUSTER_FIX = "start one there (ray start --head --port PORT) or check the address; --cluster local runs on this machine"


def _profile_name(label: str) -> str | None:
    try:
        return get_profile(label).name
    except SpecError:
        return None


def node_gpu_type(node: dict[str, Any]) -> str | None:
    """A node's accelerator type as Ray labels it (None: none detected). A node labelled twice
    (Ray's ``A100`` beside a hand-added ``A100-80G``) is the more specific label flowc knows."""
    labels = [k[len(ACCELERATOR) :] for k in node["Resources"] if k.startswith(ACCELERATOR)]
    return max(labels, key=lambda x: (_profile_name(x) is not None, len(x), x), default=None)


def gpu_type(nodes: list[dict[str, Any]], device: str | None, address: str) -> str:
    """The hardware profile of the GPU nodes: ``device`` when given, else Ray's accelerator type."""
    if device is not None:
        return get_profile(device).name
    names = ", ".join(sorted(p.name for p in profiles().values() if p.kind == "gpu"))
    types = [node_gpu_type(n) for n in nodes]
    if None in types and any(types):
        raise SpecError(
            f"{types.count(None)} of the {len(types)} GPU nodes of the Ray cluster at {address} report no accelerator type "
            f"(the others: {', '.join(sorted({t for t in types if t}))})",
            fix=f"name the type to plan for: --device TYPE (one of {names})",
        )
    seen = sorted({_profile_name(t) or t for t in types if t})
    if not seen:
        raise SpecError(
            f"the Ray cluster at {address} has GPUs of a type Ray did not detect",
            fix=f"name it: --device TYPE (one of {names})",
        )
    if len(seen) > 1:
        raise SpecError(
            f"the Ray cluster at {address} mixes GPU types ({', '.join(seen)}); flowc plans for one type",
            fix="run on nodes of one type, or name the type to plan for with --device",
        )
    try:
        return get_profile(seen[0]).name
    except SpecError:
        raise SpecError(
            f"Ray reports {seen[0]} GPUs at {address}, which flowc has no hardware profile for",
            fix=f"name the closest profile with --device TYPE (one of {names}), or add a profile (docs/planner.md)",
        ) from None


def cluster_of(nodes: list[dict[str, Any]], address: str, device: str | None = None) -> tuple[ClusterSpec, bool]:
    """(the cluster to plan for, GPUs?) from Ray's node table (``ray.nodes()``)."""
    alive = [n for n in nodes if n.get("Alive")]
    if not alive:
        raise SpecError(f"the Ray cluster at {address} has no live nodes", fix="start its nodes (ray start) and try again")
    gpu_nodes = [n for n in alive if n["Resources"].get("GPU", 0) >= 1]
    if gpu_nodes:
        counts = sorted({int(n["Resources"]["GPU"]) for n in gpu_nodes})
        per = counts[0]
        dev = gpu_type(gpu_nodes, device, address)
        # a plan's nodes are alike: with different counts, each node lends the smallest (said in the name)
        uneven = f"; nodes have {', '.join(map(str, counts))} GPUs, {per} used on each" if len(counts) > 1 else ""
        name = f"ray {address} ({len(gpu_nodes)}x{per}x{dev}{uneven})"
        return ClusterSpec(device=dev, nodes=len(gpu_nodes), devices_per_node=per, name=name), True
    if device is not None and get_profile(device).kind == "gpu":
        raise SpecError(
            f"--device {device}, but the Ray cluster at {address} has no GPUs", fix="drop --device, or join a GPU cluster"
        )
    cpus = min(int(n["Resources"].get("CPU", 1)) for n in alive)
    name = f"ray {address} ({len(alive)} nodes x {cpus} CPUs)"
    return ClusterSpec(device="cpu", nodes=len(alive), devices_per_node=max(cpus, 1), name=name), False


def check_address(address: str, *, wait_s: float = 5.0) -> None:
    """``address`` is a Ray address (``HOST:PORT``, ``ray://HOST:PORT`` or ``auto``) that
    answers within ``wait_s`` (a TCP connect to its port), or a SpecError says which part fails."""
    if address == "auto":
        return
    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SpecError(
            f"--cluster {address!r} is neither local, local:N nor a Ray address",
            fix="give local (this machine), local:N (N workers here), HOST:PORT of a Ray head (e.g. 10.0.0.1:6379) or auto",
        )
    import socket

    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=wait_s):
            pass
    except OSError as e:
        raise SpecError(
            f"no Ray cluster answers at {address} within {wait_s:g} s ({e.strerror or e})", fix=NO_CLUSTER_FIX
        ) from None


def resolve_address(address: str) -> str:
    """``auto`` as Ray resolves it (``RAY_ADDRESS``, else the cluster ``ray start`` left on this
    machine), refused with the fix when there is none; any other address unchanged."""
    if address != "auto":
        return address
    try:
        from ray._private.services import get_ray_address_from_environment
    except ImportError:  # another Ray: ray.init resolves it
        return address
    try:
        found = get_ray_address_from_environment("auto", None)
    except ConnectionError:
        found = None
    if not found or found == "auto":
        raise SpecError(
            "--cluster auto found no Ray cluster: RAY_ADDRESS is not set and no `ray start` cluster runs on this machine",
            fix="give its address (--cluster HOST:PORT of the head), set RAY_ADDRESS, or start one (ray start --head); "
            "--cluster local runs on this machine",
        )
    return found


def check_gcs(address: str, *, wait_s: float = 10.0) -> None:
    """The process at ``HOST:PORT`` is a Ray head (its GCS answers) within ``wait_s``, or a
    SpecError says so (Ray itself retries for minutes against a port that is something else)."""
    try:
        from ray._raylet import GcsClient
    except ImportError:
        return
    box: dict[str, Any] = {}

    def probe() -> None:
        try:
            box["id"] = GcsClient(address=address).cluster_id
        except Exception as e:  # reported below, whatever Ray raised
            box["error"] = e

    t = threading.Thread(target=probe, name="flowc-gcs-probe", daemon=True)  # left behind if it hangs
    t.start()
    t.join(wait_s)
    if "id" in box:
        return
    why = f"its GCS did not answer within {wait_s:g} s" if "error" not in box else f"{box['error']}"
    raise SpecError(
        f"{address} accepts connections but no Ray cluster answers there ({why})",
        fix="give the address of the Ray head's GCS (ray start --head prints it; default port 6379), or start one there; "
        "--cluster local runs on this machine",
    )


def join(address: str, device: str | None = None, *, wait_s: float = 5.0) -> tuple[ClusterSpec, bool]:
    """Join the Ray cluster at ``address`` and read it. Within about ``3 * wait_s`` a wrong
    address is a SpecError naming it and the fix; Ray's own failure to join is one too."""
    import ray

    from flowc.runtime.ray_session import init_ray

    target = resolve_address(address)
    try:
        check_address(target, wait_s=wait_s)
        if not target.startswith("ray://"):  # a Ray Client server is not a GCS
            check_gcs(target, wait_s=2 * wait_s)
    except SpecError as e:
        if target == address:
            raise
        raise SpecError(
            f"--cluster {address} resolved to {target} (RAY_ADDRESS or `ray start`), but {e.what}", fix=e.fix
        ) from None
    try:
        init_ray(target)
    except (ConnectionError, TimeoutError, RuntimeError) as e:
        where = address if target == address else f"{address} ({target})"
        raise SpecError(f"cannot join the Ray cluster at {where}: {e}", fix=NO_CLUSTER_FIX) from e
    return cluster_of(ray.nodes(), address, device)
