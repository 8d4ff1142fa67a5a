"""flowc.runtime.checkpoint_io: pickle-free state files, manifests, and the weights-only legacy reader."""

from __future__ import annotations

import json
import math
import socket
from collections import OrderedDict
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch import nn

from flowc.errors import DataError
from flowc.runtime.checkpoint_io import (
    load_legacy_pt,
    load_state,
    save_state,
    sha256_file,
    verify_manifest,
    write_manifest,
)


def _assert_same(a, b, path="state"):
    """Structural equality that also checks container types, tensor dtypes and NaN floats."""
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), f"{path}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())), path
        if a.is_floating_point():
            assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            assert type(k) is type(next(kk for kk in b if kk == k)), f"{path}: key {k!r}"
            _assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b, path


def test_round_trip_nested(tmp_path):
    state = {
        "weights": {
            "f32": torch.randn(3, 4),
            "bf16": torch.randn(5).to(torch.bfloat16),
            "i64": torch.arange(6, dtype=torch.int64).reshape(2, 3),
            "bool": torch.tensor([True, False, True]),
            "scalar": torch.tensor(2.5),
            "empty": torch.zeros(0, 3),
            "strided": torch.arange(12.0).reshape(3, 4).t(),  # non-contiguous view
        },
        "by_int": {0: "zero", 1: [1, 2], 10: {"x": None}},
        "mixed_keys": {1: "a", "b": 2, 2.5: True, False: 0},
        "tuple": (1, "two", (3.0, None)),
        "size": torch.Size([2, 3, 4]),
        "dtype": torch.bfloat16,
        "dtypes": [torch.float32, torch.int64, torch.bool],
        "none": None,
        "floats": [float("nan"), float("inf"), float("-inf"), -0.0, 1.0, 1e-300],
        "ints": [0, -1, 2**70, True, False],
        "str": "héllo ✓",
        "marker_lookalike": {"__tensor__": "not a tensor"},
        "empty_dict": {},
        "empty_list": [],
    }
    paths = save_state(state, str(tmp_path / "rank0"))
    assert paths == [str(tmp_path / "rank0.safetensors"), str(tmp_path / "rank0.json")]
    assert all(Path(p).is_file() for p in paths)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp files left
    back = load_state(str(tmp_path / "rank0"))
    _assert_same(state, back)
    assert type(back["size"]) is torch.Size and type(back["tuple"]) is tuple and type(back["tuple"][2]) is tuple
    assert back["dtype"] is torch.bfloat16
    assert type(back["ints"][3]) is bool and type(back["ints"][0]) is int
    assert math.copysign(1.0, back["floats"][3]) == -1.0
    assert back["marker_lookalike"] == {"__tensor__": "not a tensor"}
    # the structure file is plain JSON, the tensors carry a reference
    doc = json.loads((tmp_path / "rank0.json").read_text())
    assert doc["state"]["weights"]["f32"] == {"__tensor__": "weights.f32"}


def test_views_of_one_storage_and_one_object_twice(tmp_path):
    base = torch.arange(10.0)
    t = torch.randn(4, 4)
    state = {"a": t, "b": t, "view1": base[:5], "view2": base[3:], "whole": base}
    save_state(state, str(tmp_path / "s"))
    back = load_state(str(tmp_path / "s"))
    _assert_same(state, back)
    assert back["a"] is back["b"]  # the same object twice is stored once and comes back as one


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 2))


def test_adamw_state_round_trip_gives_identical_next_steps(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 2)

    def step(m: nn.Module, o: torch.optim.Optimizer) -> None:
        o.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
        o.step()

    step(model, opt)
    save_state({"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}, str(tmp_path / "rank0"))
    loaded = load_state(str(tmp_path / "rank0"))
    assert loaded["step"] == 1
    assert all(type(k) is int for k in loaded["optim"]["state"])
    assert type(loaded["optim"]["param_groups"][0]["betas"]) is tuple

    model2 = _model()
    with torch.no_grad():
        for p in model2.parameters():
            p.add_(1.0)  # make sure the load, not the seed, sets them
    model2.load_state_dict(loaded["model"])
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1.0)
    opt2.load_state_dict(loaded["optim"])
    _assert_same(opt.state_dict(), opt2.state_dict())
    for _ in range(3):
        step(model, opt)
        step(model2, opt2)
    for (n, p), (_, p2) in zip(model.named_parameters(), model2.named_parameters(), strict=True):
        assert torch.equal(p, p2), n


def test_model_state_dict_keeps_metadata(tmp_path):
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    model(torch.randn(4, 3))
    sd = model.state_dict()
    save_state(sd, str(tmp_path / "m"))
    back = load_state(str(tmp_path / "m"))
    _assert_same(dict(sd), dict(back))
    assert isinstance(back, OrderedDict) and back._metadata == sd._metadata
    fresh = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    fresh.load_state_dict(back)
    _assert_same(dict(fresh.state_dict()), dict(sd))


def test_tied_weights(tmp_path):
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

    m = Tied()
    sd = m.state_dict()
    assert sd["emb.weight"].data_ptr() == sd["head.weight"].data_ptr()  # shared storage: plain safetensors refuses it
    save_state({"model": sd, "same_twice": [m.emb.weight, m.emb.weight]}, str(tmp_path / "t"))
    back = load_state(str(tmp_path / "t"))
    fresh = Tied()
    fresh.load_state_dict(back["model"])
    assert torch.equal(fresh.emb.weight, m.emb.weight) and fresh.head.weight is fresh.emb.weight
    assert torch.equal(back["same_twice"][0], m.emb.weight.detach())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def cpu_mesh():
    try:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        if dist.is_initialized():
            pytest.skip("a process group is already initialised in this process")
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1, timeout=timedelta(seconds=30)
        )
    except Exception as e:  # no distributed build, no gloo, no loopback
        pytest.skip(f"cannot start a 1-process gloo group: {e}")
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_dtensor_round_trip(tmp_path, cpu_mesh):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    full = torch.randn(6, 4)
    state = {
        "sharded": distribute_tensor(full, cpu_mesh, [Shard(0)]),
        "sharded1": distribute_tensor(full, cpu_mesh, [Shard(1)]),
        "replicated": distribute_tensor(full.to(torch.bfloat16), cpu_mesh, [Replicate()]),
        "plain": full,
    }
    save_state(state, str(tmp_path / "d"))
    back = load_state(str(tmp_path / "d"), mesh=cpu_mesh)
    for k in ("sharded", "sharded1", "replicated"):
        assert isinstance(back[k], DTensor), k
        assert back[k].placements == state[k].placements, k
        assert back[k].shape == state[k].shape and back[k].stride() == state[k].stride(), k
        assert torch.equal(back[k].full_tensor(), state[k].full_tensor()), k
    assert torch.equal(back["plain"], full)

    with pytest.raises(DataError, match="no device mesh"):
        load_state(str(tmp_path / "d"))

    partial = DTensor.from_local(torch.ones(2), cpu_mesh, [Partial()])
    with pytest.raises(DataError, match=r"grads\[0\].*Partial"):
        save_state({"grads": [partial]}, str(tmp_path / "p"))


class _Opaque:
    pass


@pytest.mark.parametrize(
    ("state", "where", "typename"),
    [
        ({"optim": {"param_groups": [{"lr": 1.0, "foo": _Opaque()}]}}, "optim.param_groups[0].foo", "_Opaque"),
        ({"rng": {3: {1, 2}}}, "rng[3]", "set"),
        ([1, 2, object()], "[2]", "object"),
        ({"x": b"bytes"}, "x", "bytes"),
        (_Opaque(), "<the state itself>", "_Opaque"),
    ],
)
def test_unsupported_type_names_its_path(tmp_path, state, where, typename):
    with pytest.raises(DataError) as err:
        save_state(state, str(tmp_path / "bad"))
    msg = str(err.value)
    assert where in msg and typename in msg and "fix:" in msg
    assert not (tmp_path / "bad.json").exists()


def test_bad_keys_and_cycles(tmp_path):
    with pytest.raises(DataError, match=r"key \(1, 2\).*tuple"):
        save_state({"d": {(1, 2): 3}}, str(tmp_path / "k"))
    cyc: list = [1]
    cyc.append({"back": cyc})
    with pytest.raises(DataError, match="contains itself"):
        save_state(cyc, str(tmp_path / "c"))


def test_damaged_state_files(tmp_path):
    stem = str(tmp_path / "r")
    save_state({"w": torch.ones(3), "n": 1}, stem)

    (tmp_path / "r.json").write_text("{not json")
    with pytest.raises(DataError, match=r"r\.json is damaged.*not valid JSON"):
        load_state(stem)

    doc = {"format": "flowc-state", "version": 1, "tensors": "r.safetensors", "state": {"w": {"__tensor__": "nope"}}}
    (tmp_path / "r.json").write_text(json.dumps(doc))
    with pytest.raises(DataError, match=r"r\.safetensors is damaged.*'nope'"):
        load_state(stem)

    (tmp_path / "r.safetensors").write_bytes(b"\x00" * 5)
    with pytest.raises(DataError, match=r"r\.safetensors is damaged"):
        load_state(stem)

    (tmp_path / "r.safetensors").unlink()
    with pytest.raises(DataError, match=r"r\.safetensors is damaged: the file is missing"):
        load_state(stem)
    with pytest.raises(DataError, match=r"missing"):
        load_state(str(tmp_path / "absent"))


def test_manifest_verifies_and_catches_tampering(tmp_path):
    ckpt = tmp_path / "step-3"
    ckpt.mkdir()
    files = save_state({"w": torch.randn(64, 64)}, str(ckpt / "rank0"))
    (ckpt / "sub").mkdir()
    (ckpt / "sub" / "extra.txt").write_text("x")
    out = write_manifest(ckpt, [*files, "sub/extra.txt"])
    assert out == ckpt / "manifest.json"
    doc = json.loads(out.read_text())
    assert doc["format"] == 1
    assert set(doc["files"]) == {"rank0.safetensors", "rank0.json", "sub/extra.txt"}
    st = ckpt / "rank0.safetensors"
    assert doc["files"]["rank0.safetensors"] == {"sha256": sha256_file(st), "bytes": st.stat().st_size}
    verify_manifest(ckpt)

    data = bytearray(st.read_bytes())
    data[-1] ^= 0x01  # one flipped bit in the tensor bytes, same size
    st.write_bytes(bytes(data))
    with pytest.raises(DataError) as err:
        verify_manifest(ckpt)
    msg = str(err.value)
    assert "checksum mismatch: rank0.safetensors" in msg and "previous step-*" in msg

    (ckpt / "sub" / "extra.txt").unlink()
    with pytest.raises(DataError, match=r"missing: sub/extra\.txt"):
        verify_manifest(ckpt)


def test_missing_manifest(tmp_path):
    save_state({"w": torch.ones(1)}, str(tmp_path / "rank0"))
    with pytest.raises(DataError, match=r"no manifest\.json.*not written completely.*older flowc"):
        verify_manifest(tmp_path)


def test_manifest_refuses_paths_outside(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 1, "files": {"../x": {"sha256": "0", "bytes": 1}}}))
    with pytest.raises(DataError, match="not a path inside"):
        verify_manifest(tmp_path)


class _Payload:
    """Unpickling this calls ``open(marker, "w")``: a stand-in for arbitrary code in a crafted checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_legacy_pt_plain_tensors_load(tmp_path):
    path = tmp_path / "old.pt"
    torch.save({"w": torch.arange(3), "step": 7, "groups": [{"lr": 0.1}]}, path)
    back = load_legacy_pt(path)
    assert torch.equal(back["w"], torch.arange(3)) and back["step"] == 7


def test_legacy_pt_refuses_code(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "old.pt"
    torch.save({"w": torch.ones(2), "evil": _Payload(marker)}, path)
    assert not marker.exists()
    with pytest.raises(DataError) as err:
        load_legacy_pt(path)
    msg = str(err.value)
    assert "will not unpickle" in msg and "flowc version that wrote it" in msg
    assert not marker.exists()

    # the payload is live: an unrestricted load would have run it
    torch.load(path, weights_only=False)
    assert marker.exists()

    with pytest.raises(DataError, match="does not exist"):
        load_legacy_pt(tmp_path / "absent.pt")
