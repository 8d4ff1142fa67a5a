"""The JSON form of a FlowGraph; it round-trips exactly.

Constants in node arguments are encoded with tags so that decoding restores
the same Python values: ``{"$ref": id, "path": [...]}`` (a ValueRef),
``{"$tuple": [...]}``, ``{"$dict": {...}}``, ``{"$slice": [a, b, c]}``,
``{"$ellipsis": true}``, ``{"$dtype": "float32"}``, ``{"$loss": {...}}``
(a loss spec) and ``{"$tensor": [...], "dtype": ...}`` (a small constant).
Lists, strings, numbers, booleans and null are themselves.

The document (:class:`GraphDoc`) lists nodes and, for readers, edges; on load
the edges are recomputed from the nodes and must equal the listed ones.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from flowc.errors import IRError
from flowc.ir.graph import FlowGraph, Node, RoleInfo, ValueRef
from flowc.ir.losses import LOSS_ADAPTER, LOSS_TYPES
from flowc.ir.types import ValueType

FORMAT = "flowc.graph"
VERSION = 1


def encode(x: Any) -> Any:
    """A JSON-able form of a node argument, hyperparameter or meta value."""
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, ValueRef):
        return {"$ref": x.node, "path": list(x.path)}
    if isinstance(x, tuple):
        return {"$tuple": [encode(y) for y in x]}
    if isinstance(x, list):
        return [encode(y) for y in x]
    if isinstance(x, dict):
        return {"$dict": {str(k): encode(v) for k, v in x.items()}}
    if isinstance(x, slice):
        return {"$slice": [encode(x.start), encode(x.stop), encode(x.step)]}
    if x is Ellipsis:
        return {"$ellipsis": True}
    if isinstance(x, torch.dtype):
        return {"$dtype": str(x).removeprefix("torch.")}
    if isinstance(x, LOSS_TYPES):
        return {"$loss": x.model_dump(mode="json")}
    if isinstance(x, torch.Tensor):
        if x.numel() > 4096:
            raise IRError(f"a constant tensor of {x.numel()} elements is too large to store in the graph")
        return {"$tensor": x.tolist(), "dtype": str(x.dtype).removeprefix("torch.")}
    raise IRError(f"cannot store a value of type {type(x).__name__} in the IR: {x!r}")


def decode(x: Any) -> Any:
    """Inverse of :func:`encode`."""
    if isinstance(x, list):
        return [decode(y) for y in x]
    if not isinstance(x, dict):
        return x
    if "$ref" in x:
        return ValueRef(x["$ref"], tuple(x.get("path", ())))
    if "$tuple" in x:
        return tuple(decode(y) for y in x["$tuple"])
    if "$dict" in x:
        return {k: decode(v) for k, v in x["$dict"].items()}
    if "$slice" in x:
        return slice(*(decode(y) for y in x["$slice"]))
    if "$ellipsis" in x:
        return Ellipsis
    if "$dtype" in x:
        return getattr(torch, x["$dtype"])
    if "$loss" in x:
        return LOSS_ADAPTER.validate_python(x["$loss"])
    if "$tensor" in x:
        return torch.tensor(x["$tensor"], dtype=getattr(torch, x["dtype"]))
    raise IRError(f"unknown tagged value in graph document: {sorted(x)}")


class NodeDoc(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    op: str
    role: str | None
    target: str | None = None
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    type: ValueType
    line: int | None = None
    meta: dict[str, Any] = {}


class EdgeDoc(BaseModel):
    model_config = ConfigDict(extra="forbid")
    src: str
    dst: str
    arg: str
    what: str
    kind: Literal["data", "weights"]
    type: str


class GraphDoc(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: Literal["flowc.graph"] = FORMAT
    version: int = VERSION
    name: str
    source: str | None = None
    roles: dict[str, str]
    hyperparams: dict[str, Any]
    symbols: dict[str, int]
    max_staleness: int | None = None
    nodes: list[NodeDoc]
    edges: list[EdgeDoc]


def _edge_docs(g: FlowGraph) -> list[dict[str, Any]]:
    return [{"src": e.src, "dst": e.dst, "arg": e.arg, "what": e.what, "kind": e.kind, "type": str(e.type)} for e in g.edges()]


def to_dict(g: FlowGraph) -> dict[str, Any]:
    """The graph as a JSON-able dict (the document's Python form)."""
    return {
        "format": FORMAT,
        "version": VERSION,
        "name": g.name,
        "source": g.source,
        "roles": {r.name: str(r.kind) for r in g.roles.values()},
        "hyperparams": {k: encode(v) for k, v in g.hyperparams.items()},
        "symbols": dict(g.symbols),
        **({"max_staleness": g.max_staleness} if g.max_staleness is not None else {}),
        "nodes": [
            {
                "id": n.id,
                "op": str(n.op),
                "role": n.role,
                "target": n.target,
                "args": [encode(a) for a in n.args],
                "kwargs": {k: encode(v) for k, v in n.kwargs.items()},
                "type": n.type.model_dump(mode="json"),
                "line": n.line,
                "meta": {k: encode(v) for k, v in n.meta.items()},
            }
            for n in g.nodes
        ],
        "edges": _edge_docs(g),
    }


def to_json(g: FlowGraph, *, indent: int | None = 2) -> str:
    """The graph's JSON text (deterministic)."""
    return json.dumps(to_dict(g), indent=indent)


def from_dict(d: dict[str, Any]) -> FlowGraph:
    """Rebuild a graph from :func:`to_dict`'s output; validates the document."""
    try:
        doc = GraphDoc.model_validate(d)
    except ValidationError as e:
        raise IRError(f"not a valid flowc graph document: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}") from e
    if doc.version != VERSION:
        raise IRError(f"graph document version {doc.version} is not supported (this flowc reads {VERSION})")
    g = FlowGraph(
        doc.name,
        roles={k: RoleInfo(k, v) for k, v in doc.roles.items()},
        hyperparams={k: decode(v) for k, v in doc.hyperparams.items()},
        symbols=doc.symbols,
        source=doc.source,
        max_staleness=doc.max_staleness,
    )
    for nd in doc.nodes:
        g.add(
            Node(
                id=nd.id,
                op=nd.op,
                role=nd.role,
                type=nd.type,
                args=tuple(decode(a) for a in nd.args),
                kwargs={k: decode(v) for k, v in nd.kwargs.items()},
                target=nd.target,
                line=nd.line,
                meta={k: decode(v) for k, v in nd.meta.items()},
            )
        )
    g.add_weight_edges()
    listed = [e.model_dump() for e in doc.edges]
    if listed != _edge_docs(g):
        raise IRError("the document's edges do not match its nodes' arguments", fix="regenerate the document with flowc")
    return g


def from_json(text: str) -> FlowGraph:
    """Parse a graph from :func:`to_json`'s text."""
    try:
        return from_dict(json.loads(text))
    except json.JSONDecodeError as e:
        raise IRError(f"graph document is not JSON: {e}") from e
