"""Joining a Ray cluster (`--cluster auto|ADDR`): the GPU type and count read from Ray's node
table (pure logic over fake `ray.nodes()` records), and an address without a Ray cluster
refused at once with the fix, never Ray's minutes of retries."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from flowc.clusters import cluster_of, join, node_gpu_type
from flowc.errors import SpecError


def _node(gpus: int = 0, *kinds: str, cpus: int = 16, alive: bool = True) -> dict:
    res = {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **{f"accelerator_type:{k}": 1 for k in kinds}}
    return {"Alive": alive, "Resources": res, "NodeManagerAddress": "10.0.0.1"}


def test_a_cpu_only_head_holds_no_gpus_and_uneven_nodes_are_said():
    head = _node(cpus=8)
    c, gpus = cluster_of([head, _node(8, "H100"), _node(4, "H100"), _node(4, "H100")], "10.0.0.1:6379")
    assert gpus and (c.device, c.nodes, c.devices_per_node) == ("H100-80GB", 3, 4)
    assert "nodes have 4, 8 GPUs, 4 used on each" in c.name
    c, _ = cluster_of([head, _node(8, "H200"), _node(8, "H200")], "x")
    assert (c.nodes, c.devices_per_node) == (2, 8) and "nodes have" not in c.name


def test_gpu_types_are_read_per_node_never_assumed():
    # Ray's own "A100" beside a hand-added "A100-80G" on one node is one type, the specific one
    assert node_gpu_type(_node(8, "A100", "A100-80G")) == "A100-80G"
    assert node_gpu_type(_node(8)) is None
    c, _ = cluster_of([_node(8, "A100", "A100-80G"), _node(8, "A100-80G")], "x")
    assert c.device == "A100-80GB"
    # two names of one profile are not a mix
    assert cluster_of([_node(8, "H100"), _node(8, "H100-80G")], "x")[0].device == "H100-80GB"
    # a GPU node that reports no type beside typed ones is not planned as their type
    with pytest.raises(SpecError, match=r"1 of the 2 GPU nodes .* report no accelerator type \(the others: H200\)") as e:
        cluster_of([_node(8, "H200"), _node(8)], "x")
    assert "--device" in e.value.fix
    assert cluster_of([_node(8, "H200"), _node(8)], "x", device="H200")[0].device == "H200"
    with pytest.raises(SpecError, match="mixes GPU types"):
        cluster_of([_node(8, "H100"), _node(8, "A100")], "x")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when this returns


def test_joining_a_closed_port_fails_at_once_with_the_fix():
    import ray

    was = ray.is_initialized()  # a long test session may have started Ray in this process already
    port = _closed_port()
    t0 = time.perf_counter()
    with pytest.raises(SpecError, match=rf"no Ray cluster answers at 127\.0\.0\.1:{port}") as e:
        join(f"127.0.0.1:{port}", wait_s=2)
    assert time.perf_counter() - t0 < 5
    assert "ray start --head" in e.value.fix and "--cluster local" in e.value.fix
    assert ray.is_initialized() == was  # a failed join leaves Ray as it was


def test_a_port_that_is_not_a_ray_head_fails_within_the_bound():
    import ray

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    held: list[socket.socket] = []

    def accept() -> None:  # a listener that never speaks: what Ray retries against for minutes
        try:
            while True:
                held.append(srv.accept()[0])
        except OSError:  # closed at the end of the test
            pass

    threading.Thread(target=accept, daemon=True).start()
    was = ray.is_initialized()
    try:
        t0 = time.perf_counter()
        with pytest.raises(SpecError, match=rf"127\.0\.0\.1:{port} accepts connections but no Ray cluster answers there"):
            join(f"127.0.0.1:{port}", wait_s=1)
        assert time.perf_counter() - t0 < 8
        assert ray.is_initialized() == was
    finally:
        srv.close()
        for c in held:
            c.close()


def test_auto_without_a_cluster_says_so(monkeypatch):
    import ray._private.services as services

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: [])
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: None)
    with pytest.raises(SpecError, match="--cluster auto found no Ray cluster") as e:
        join("auto", wait_s=1)
    assert "--cluster HOST:PORT" in e.value.fix
    port = _closed_port()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    with pytest.raises(SpecError, match=rf"--cluster auto resolved to 127\.0\.0\.1:{port} .* no Ray cluster answers"):
        join("auto", wait_s=1)
