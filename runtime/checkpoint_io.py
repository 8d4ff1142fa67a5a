"""Pickle-free checkpoint files for a training rank's state.

A rank's state (model and optimizer ``state_dict``\\ s, counters, RNG tensors) is
a tree of containers and leaves. :func:`save_state` splits it in two files:

* ``<stem>.safetensors``: every tensor leaf, written with ``safetensors`` (a
  flat table of named, typed byte ranges; reading it runs no code);
* ``<stem>.json``: the tree itself, where each tensor leaf is replaced by a
  reference ``{"__tensor__": key}`` and every other leaf is plain JSON.

Neither file is ever unpickled, so a crafted checkpoint cannot execute code
on load. Containers and leaves the JSON cannot hold directly are written as
one-key marker objects::

    {"__tensor__": key}                      a torch.Tensor (key into the .safetensors file)
    {"__tuple__": [...]}                     a tuple
    {"__dict__": [[k, v], ...]}              a dict whose keys are not all str (optimizer state: int keys)
    {"__dict__": [...], "__metadata__": m}   a ``state_dict`` with torch's ``_metadata`` (module versions)
    {"__size__": [...]}                      a torch.Size
    {"__dtype__": "bfloat16"}                a torch.dtype
    {"__dtensor__": {...}}                   a DTensor: its local shard plus placements, global shape, stride

A str-keyed dict whose keys happen to spell a marker is written in the
``__dict__`` form, so no user data is ever mistaken for a marker.

A checkpoint folder also carries ``manifest.json`` (:func:`write_manifest`),
the size and SHA-256 of each file, checked by :func:`verify_manifest` before a
resume. :func:`load_legacy_pt` reads checkpoints of older flowc versions
(``torch.save`` files) with ``weights_only=True`` only.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from flowc.errors import DataError, display_path

STATE_FORMAT = "flowc-state"
STATE_VERSION = 1
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
_CHUNK = 1 << 20  # sha256_file reads 1 MiB at a time

_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_DICT = "__dict__"
_METADATA = "__metadata__"
_SIZE = "__size__"
_DTYPE = "__dtype__"
_DTENSOR = "__dtensor__"
# The exact key sets of marker objects; any other JSON object is a plain str-keyed dict.
_MARKER_KEYSETS = (
    frozenset({_TENSOR}),
    frozenset({_TUPLE}),
    frozenset({_DICT}),
    frozenset({_DICT, _METADATA}),
    frozenset({_SIZE}),
    frozenset({_DTYPE}),
    frozenset({_DTENSOR}),
)

_UNSUPPORTED_FIX = (
    "keep only tensors, None, bool, int, float, str, torch.Size, torch.dtype and lists, tuples and dicts of them "
    "in the state: convert this value (e.g. with .item(), .tolist(), float() or str()) or leave it out"
)
_RESUME_EARLIER_FIX = (
    "resume from an earlier checkpoint: remove this one and point checkpoints/latest at the previous step-* folder"
)


# --------------------------------------------------------------------------- helpers


def _dtensor_types() -> tuple[type, type, type] | None:
    """``(DTensor, Shard, Replicate)``, or None when this torch has no torch.distributed."""
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except Exception:  # torch built without distributed support
        return None
    return DTensor, Shard, Replicate


def _child_path(path: str, key: Any) -> str:
    """The path of ``key`` inside the container at ``path``: ``a.b`` for str keys, ``a[0]`` otherwise."""
    if isinstance(key, str):
        return f"{path}.{key}" if path else key
    return f"{path}[{key!r}]"


def _where(path: str) -> str:
    return path if path else "<the state itself>"


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp)`` on a temporary name beside ``path``, flush it to disk, then rename it onto ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_text_atomic(path: Path, text: str) -> None:
    _atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def _damaged(file: Path | str, detail: str) -> DataError:
    return DataError(
        f"checkpoint file {display_path(str(file))} is damaged: {detail}",
        fix=_RESUME_EARLIER_FIX,
    )


# --------------------------------------------------------------------------- encoding


class _Encoder:
    """Turns a state tree into a JSON skeleton plus a flat ``{key: cpu tensor}`` table."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._by_id: dict[int, tuple[torch.Tensor, str]] = {}  # the same tensor object twice is stored once
        self._open: set[int] = set()  # containers being encoded, to catch a state that contains itself
        self._dt = _dtensor_types()

    def _new_key(self, path: str) -> str:
        base = path or "<root>"
        key, n = base, 1
        while key in self.tensors:
            key = f"{base}#{n}"
            n += 1
        return key

    def _store(self, t: torch.Tensor, path: str) -> str:
        if t.layout != torch.strided:
            raise DataError(
                f"checkpoint state at {_where(path)} is a {t.layout} tensor; only dense (strided) tensors can be saved",
                fix="convert it with .to_dense() before saving, or leave it out of the state",
            )
        try:
            cpu = t.detach().to("cpu", copy=True).contiguous()
        except Exception as e:
            raise DataError(
                f"checkpoint state at {_where(path)}: the tensor on {t.device} cannot be copied to the CPU ({e})",
                fix="keep only materialised tensors (not meta or fake ones) in the state",
            ) from e
        key = self._new_key(path)
        self.tensors[key] = cpu
        return key

    def tensor(self, t: torch.Tensor, path: str) -> dict[str, Any]:
        seen = self._by_id.get(id(t))
        if seen is not None and seen[0] is t:
            return {_TENSOR: seen[1]}
        key = self._store(t, path)
        self._by_id[id(t)] = (t, key)
        return {_TENSOR: key}

    def dtensor(self, dt: Any, path: str) -> dict[str, Any]:
        assert self._dt is not None
        _, shard_t, replicate_t = self._dt
        placements: list[dict[str, Any]] = []
        for i, p in enumerate(dt.placements):
            if type(p) is shard_t:
                placements.append({"shard": int(p.dim)})
            elif type(p) is replicate_t:
                placements.append({"replicate": True})
            else:
                raise DataError(
                    f"checkpoint state at {_where(path)} is a DTensor with placement {p!r} on mesh dimension {i}; "
                    "only Shard(dim) and Replicate() can be saved",
                    fix="redistribute it first (e.g. dtensor.redistribute(mesh, [Replicate()]) for a Partial one)",
                )
        mesh = dt.device_mesh
        return {
            _DTENSOR: {
                "local": self._store(dt.to_local(), path),
                "placements": placements,
                "shape": [int(s) for s in dt.shape],
                "stride": [int(s) for s in dt.stride()],
                "mesh_shape": [int(s) for s in mesh.shape],
            }
        }

    def key(self, k: Any, path: str) -> Any:
        if k is None or type(k) in (bool, int, float, str):
            return k
        raise DataError(
            f"checkpoint state at {_where(path)} has a dict key {k!r} of type {type(k).__qualname__}; "
            "dict keys must be str, int, float, bool or None",
            fix="use str or int keys in the state",
        )

    def encode(self, x: Any, path: str = "") -> Any:
        if x is None or type(x) in (bool, int, str):
            return x
        if type(x) is float:
            return x  # json writes inf/nan as Infinity/NaN and reads them back
        if self._dt is not None and isinstance(x, self._dt[0]):
            return self.dtensor(x, path)
        if isinstance(x, torch.Tensor):
            return self.tensor(x, path)
        if isinstance(x, torch.dtype):
            return {_DTYPE: str(x).removeprefix("torch.")}
        if type(x) is torch.Size:
            return {_SIZE: [int(s) for s in x]}
        if type(x) in (list, tuple) or isinstance(x, dict):
            if id(x) in self._open:
                raise DataError(
                    f"checkpoint state at {_where(path)} contains itself (a reference cycle)",
                    fix="break the cycle: a state must be a tree",
                )
            self._open.add(id(x))
            try:
                if isinstance(x, dict):
                    return self._dict(x, path)
                items = [self.encode(v, _child_path(path, i)) for i, v in enumerate(x)]
                return {_TUPLE: items} if type(x) is tuple else items
            finally:
                self._open.discard(id(x))
        raise DataError(
            f"checkpoint state at {_where(path)} is of type {type(x).__module__}.{type(x).__qualname__}, "
            "which flowc does not save",
            fix=_UNSUPPORTED_FIX,
        )

    def _dict(self, d: dict[Any, Any], path: str) -> Any:
        metadata = getattr(d, "_metadata", None)  # nn.Module.state_dict() keeps module versions here
        all_str = all(type(k) is str for k in d)
        if all_str and metadata is None and frozenset(d) not in _MARKER_KEYSETS:
            return {k: self.encode(v, _child_path(path, k)) for k, v in d.items()}
        pairs = [[self.key(k, path), self.encode(v, _child_path(path, k))] for k, v in d.items()]
        if metadata is None:
            return {_DICT: pairs}
        if not isinstance(metadata, dict):
            raise DataError(
                f"checkpoint state at {_where(path)}: its _metadata attribute is a {type(metadata).__qualname__}, not a dict",
                fix="remove the _metadata attribute or make it a dict",
            )
        return {_DICT: pairs, _METADATA: self.encode(metadata, _child_path(path, "_metadata"))}


# --------------------------------------------------------------------------- decoding


class _Decoder:
    """Rebuilds a state tree from its JSON skeleton and the loaded tensor table."""

    def __init__(self, tensors: dict[str, torch.Tensor], json_file: Path, tensor_file: Path, mesh: Any) -> None:
        self.tensors = tensors
        self.json_file = json_file
        self.tensor_file = tensor_file
        self.mesh = mesh

    def _tensor(self, key: Any) -> torch.Tensor:
        if not isinstance(key, str):
            raise _damaged(self.json_file, f"a tensor reference is {key!r}, not a name")
        t = self.tensors.get(key)
        if t is None:
            raise _damaged(self.tensor_file, f"it has no tensor {key!r}, which {self.json_file.name} refers to")
        return t

    def _list(self, v: Any, what: str) -> list[Any]:
        if not isinstance(v, list):
            raise _damaged(self.json_file, f"{what} is {type(v).__name__}, not a list")
        return v

    def decode(self, x: Any) -> Any:
        if isinstance(x, list):
            return [self.decode(v) for v in x]
        if not isinstance(x, dict):
            return x
        keys = frozenset(x)
        if keys not in _MARKER_KEYSETS:
            return {k: self.decode(v) for k, v in x.items()}
        if _TENSOR in x:
            return self._tensor(x[_TENSOR])
        if _TUPLE in x:
            return tuple(self.decode(v) for v in self._list(x[_TUPLE], "a tuple"))
        if _SIZE in x:
            dims = self._list(x[_SIZE], "a torch.Size")
            if not all(type(d) is int for d in dims):
                raise _damaged(self.json_file, f"torch.Size {dims!r} holds non-integers")
            return torch.Size(dims)
        if _DTYPE in x:
            dtype = getattr(torch, x[_DTYPE], None) if isinstance(x[_DTYPE], str) else None
            if not isinstance(dtype, torch.dtype):
                raise _damaged(self.json_file, f"{x[_DTYPE]!r} is not a torch dtype")
            return dtype
        if _DICT in x:
            return self._dict(x)
        return self._dtensor(x[_DTENSOR])

    def _dict(self, x: dict[str, Any]) -> dict[Any, Any]:
        pairs = self._list(x[_DICT], "a dict")
        out: dict[Any, Any] = OrderedDict() if _METADATA in x else {}
        for pair in pairs:
            if not isinstance(pair, list) or len(pair) != 2 or isinstance(pair[0], (list, dict)):
                raise _damaged(self.json_file, f"a dict entry is {pair!r}, not a [key, value] pair")
            out[pair[0]] = self.decode(pair[1])
        if _METADATA in x:
            out._metadata = self.decode(x[_METADATA])  # type: ignore[attr-defined]
        return out

    def _dtensor(self, d: Any) -> Any:
        if not isinstance(d, dict) or not {"local", "placements", "shape", "stride"} <= set(d):
            raise _damaged(self.json_file, "a DTensor entry lacks local, placements, shape or stride")
        dt = _dtensor_types()
        if dt is None:
            raise DataError(
                f"checkpoint {display_path(str(self.json_file))} holds DTensors, but this torch has no torch.distributed",
                fix="resume with a torch build that includes torch.distributed",
            )
        dtensor_t, shard_t, replicate_t = dt
        if self.mesh is None:
            raise DataError(
                f"checkpoint {display_path(str(self.json_file))} holds DTensors, and load_state was given no device mesh",
                fix="pass the rank's DeviceMesh: load_state(stem, mesh=mesh)",
            )
        placements = []
        for p in self._list(d["placements"], "DTensor placements"):
            if isinstance(p, dict) and set(p) == {"shard"} and type(p["shard"]) is int:
                placements.append(shard_t(p["shard"]))
            elif p == {"replicate": True}:
                placements.append(replicate_t())
            else:
                raise _damaged(self.json_file, f"unknown DTensor placement {p!r}")
        saved_mesh = d.get("mesh_shape")
        mesh_shape = [int(s) for s in self.mesh.shape]
        if len(placements) != len(mesh_shape) or (saved_mesh is not None and list(saved_mesh) != mesh_shape):
            raise DataError(
                f"checkpoint {display_path(str(self.json_file))} was saved on a device mesh of shape "
                f"{saved_mesh if saved_mesh is not None else len(placements)}, but the mesh given has shape {mesh_shape}",
                fix="resume with the same parallel layout (number of ranks and mesh shape) that wrote the checkpoint",
            )
        shape = self._list(d["shape"], "a DTensor shape")
        stride = self._list(d["stride"], "a DTensor stride")
        if not all(type(s) is int for s in [*shape, *stride]):
            raise _damaged(self.json_file, "a DTensor shape or stride holds non-integers")
        local = self._tensor(d["local"])
        return dtensor_t.from_local(local, self.mesh, placements, shape=torch.Size(shape), stride=tuple(stride))


# --------------------------------------------------------------------------- public API


def save_state(state: Any, stem: str) -> list[str]:
    """Write ``state`` as ``stem + ".safetensors"`` (its tensors) and ``stem + ".json"`` (its structure).

    Tensors are copied to contiguous CPU tensors first, so tied or shared
    storages and GPU tensors are fine; the same tensor object appearing twice
    is stored once and comes back as one object. DTensors are stored as their
    local shard plus placements, global shape and stride. Each file is written
    to a temporary name and renamed into place.

    Args:
        state: a tree of dicts (str, int, float or bool keys), lists, tuples and leaves (None, bool, int,
            float, str, torch.Size, torch.dtype, torch.Tensor, DTensor with Shard/Replicate placements).
        stem: the path of both files without their extension.

    Returns:
        The two paths written: ``[stem + ".safetensors", stem + ".json"]``.

    Raises:
        DataError: the state holds a value of an unsupported type; the message names its path in the state.
    """
    from safetensors.torch import save_file

    enc = _Encoder()
    skeleton = enc.encode(state)
    tensor_path = Path(stem + ".safetensors")
    json_path = Path(stem + ".json")
    doc = {"format": STATE_FORMAT, "version": STATE_VERSION, "tensors": tensor_path.name, "state": skeleton}
    text = json.dumps(doc, allow_nan=True, ensure_ascii=False)

    def write_tensors(tmp: Path) -> None:
        try:
            save_file(enc.tensors, str(tmp), metadata={"format": STATE_FORMAT, "version": str(STATE_VERSION)})
        except Exception as e:
            if isinstance(e, OSError):
                raise
            raise DataError(
                f"checkpoint state could not be written to {display_path(str(tensor_path))}: {e}",
                fix="keep only tensors of dtypes safetensors stores (floating, integer and bool) in the state",
            ) from e

    _atomic_write(tensor_path, write_tensors)
    _write_text_atomic(json_path, text)
    return [str(tensor_path), str(json_path)]


def load_state(stem: str, *, mesh: Any = None) -> Any:
    """Read a state written by :func:`save_state`; nothing is unpickled.

    Tensors come back on the CPU. DTensor leaves are rebuilt on ``mesh`` with
    ``DTensor.from_local`` (the local shard moves to the mesh's device).

    Args:
        stem: the path both files share, without their extension.
        mesh: the rank's ``DeviceMesh``; needed only when the state holds DTensors.

    Raises:
        DataError: a file is missing or damaged, or DTensors are present and ``mesh`` is None
            or of another shape than when saved.
    """
    from safetensors.torch import load_file

    json_path = Path(stem + ".json")
    tensor_path = Path(stem + ".safetensors")
    for p in (json_path, tensor_path):
        if not p.is_file():
            raise _damaged(p, "the file is missing")
    try:
        doc = json.loads(json_path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise _damaged(json_path, f"it is not valid JSON ({e})") from e
    if not isinstance(doc, dict) or doc.get("format") != STATE_FORMAT or "state" not in doc:
        raise _damaged(json_path, f"it is not a {STATE_FORMAT} document")
    if doc.get("version") != STATE_VERSION:
        raise DataError(
            f"checkpoint file {display_path(str(json_path))} has format version {doc.get('version')!r}; "
            f"this flowc reads version {STATE_VERSION}",
            fix="resume it with the flowc version that wrote it",
        )
    try:
        tensors = load_file(str(tensor_path), device="cpu")
    except Exception as e:
        raise _damaged(tensor_path, f"safetensors cannot read it ({e})") from e
    try:
        return _Decoder(tensors, json_path, tensor_path, mesh).decode(doc["state"])
    except RecursionError as e:
        raise _damaged(json_path, "its structure is nested too deeply") from e


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The hex SHA-256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _relative_name(root: Path, file: str | os.PathLike[str]) -> str:
    """``file``'s name relative to ``root``; a relative ``file`` may be given from the cwd or from ``root``."""
    p = Path(file)
    candidates = [p.resolve()] + ([] if p.is_absolute() else [(root / p).resolve()])
    for c in candidates:
        try:
            rel = c.relative_to(root)
        except ValueError:
            continue
        if c.is_file():
            return rel.as_posix()
    raise ValueError(f"{file} is not a file inside the checkpoint folder {root}")


def write_manifest(dir: str | os.PathLike[str], files: Iterable[str | os.PathLike[str]]) -> Path:
    """Write ``dir/manifest.json`` listing the size and SHA-256 of each of ``files``; returns its path.

    ``files`` are paths inside ``dir`` (absolute, relative to the cwd, or relative to ``dir``).
    The manifest is written last and atomically, so its presence means the checkpoint is complete.
    """
    root = Path(dir).resolve()
    entries: dict[str, dict[str, Any]] = {}
    for f in files:
        name = _relative_name(root, f)
        if name == MANIFEST_NAME:
            continue
        full = root / name
        entries[name] = {"sha256": sha256_file(full), "bytes": full.stat().st_size}
    doc = {"format": MANIFEST_FORMAT, "files": dict(sorted(entries.items()))}
    out = Path(dir) / MANIFEST_NAME
    _write_text_atomic(out, json.dumps(doc, indent=1) + "\n")
    return out


def verify_manifest(dir: str | os.PathLike[str]) -> None:
    """Check every file ``dir/manifest.json`` lists: present, of the listed size and SHA-256.

    Raises:
        DataError: there is no manifest (the checkpoint is incomplete or from an older flowc), the manifest
            is unreadable, or files are missing or differ; the message lists all of them.
    """
    root = Path(dir)
    shown = display_path(str(root))
    manifest = root / MANIFEST_NAME
    if not manifest.is_file():
        raise DataError(
            f"checkpoint {shown} has no {MANIFEST_NAME}: it was not written completely (the run stopped while saving) "
            "or was written by an older flowc",
            fix=_RESUME_EARLIER_FIX + "; a checkpoint of an older flowc resumes with the flowc version that wrote it",
        )
    try:
        doc = json.loads(manifest.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise _damaged(manifest, f"it is not valid JSON ({e})") from e
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT or not isinstance(doc.get("files"), dict):
        raise _damaged(manifest, f"it is not a format-{MANIFEST_FORMAT} manifest")
    missing: list[str] = []
    mismatched: list[str] = []
    for name, entry in doc["files"].items():
        rel = Path(name)
        if rel.is_absolute() or ".." in rel.parts or not name:
            raise _damaged(manifest, f"it lists {name!r}, which is not a path inside the checkpoint")
        if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and type(entry.get("bytes")) is int):
            raise _damaged(manifest, f"its entry for {name!r} lacks sha256 or bytes")
        path = root / rel
        if not path.is_file():
            missing.append(name)
        elif path.stat().st_size != entry["bytes"]:
            mismatched.append(f"{name} ({path.stat().st_size} bytes, manifest says {entry['bytes']})")
        elif sha256_file(path) != entry["sha256"]:
            mismatched.append(f"{name} (checksum differs)")
    if missing or mismatched:
        lines = [f"checkpoint {shown} is damaged:"]
        if missing:
            lines.append("  missing: " + ", ".join(missing))
        if mismatched:
            lines.append("  checksum mismatch: " + ", ".join(mismatched))
        raise DataError("\n".join(lines), fix=_RESUME_EARLIER_FIX)


def load_legacy_pt(path: str | os.PathLike[str]) -> Any:
    """Read an old-format ``torch.save`` checkpoint with ``weights_only=True`` (tensors and plain containers only).

    Raises:
        DataError: the file is missing, or holds objects outside torch's weights-only allow-list (which flowc
            will not unpickle: unpickling them can run arbitrary code).
    """
    shown = display_path(str(path))
    if not Path(path).is_file():
        raise DataError(f"checkpoint file {shown} does not exist", fix="check the path, or start the run again")
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(
            f"old-format checkpoint {shown} contains objects flowc will not unpickle (loading them could run code), "
            f"or is damaged: {reason}",
            fix="resume it with the flowc version that wrote it, or start the run again",
        ) from e


__all__ = [
    "MANIFEST_NAME",
    "load_legacy_pt",
    "load_state",
    "save_state",
    "sha256_file",
    "verify_manifest",
    "write_manifest",
]
