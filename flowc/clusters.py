"""The cluster a run plans for: this machine's CPUs, or a Ray cluster it joins.

Joining a Ray cluster reads its alive nodes. GPU nodes are counted (a
CPU-only head node holds no devices and is left out) and their device type
comes from the accelerator type Ray detected (``accelerator_type:H200``), or
from ``--device``; a GPU cluster whose type is unknown is refused, never
planned as some other GPU.
"""

from __future__ import annotations

from typing import Any

from flowc.errors import SpecError
from flowc.ir.cluster import ClusterSpec
from flowc.ir.hardware import get_profile, profiles

ACCELERATOR = "accelerator_type:"


def gpu_type(nodes: list[dict[str, Any]], device: str | None, address: str) -> str:
    """The hardware profile of the GPU nodes: ``device`` when given, else Ray's accelerator type."""
    if device is not None:
        return get_profile(device).name
    seen = sorted({k[len(ACCELERATOR) :] for n in nodes for k in n["Resources"] if k.startswith(ACCELERATOR)})
    names = ", ".join(sorted(p.name for p in profiles().values() if p.kind == "gpu"))
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
        per = min(int(n["Resources"]["GPU"]) for n in gpu_nodes)
        dev = gpu_type(gpu_nodes, device, address)
        name = f"ray {address} ({len(gpu_nodes)}x{per}x{dev})"
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
            f"no Ray cluster answers at {address} within {wait_s:g} s ({e.strerror or e})",
            fix="start one there (ray start --head --port PORT) or check the address; --cluster local runs on this machine",
        ) from None


def join(address: str, device: str | None = None) -> tuple[ClusterSpec, bool]:
    """Join the Ray cluster at ``address`` and read it."""
    import ray

    from flowc.runtime.ray_session import init_ray

    check_address(address)
    init_ray(address)
    return cluster_of(ray.nodes(), address, device)
