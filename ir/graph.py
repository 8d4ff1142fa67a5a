"""The dataflow graph of one training iteration.

A :class:`FlowGraph` holds nodes in a valid execution order (every reference
points to an earlier node) and keeps use-def links itself, in a networkx
``MultiDiGraph`` rebuilt from the nodes' arguments — passes never maintain
edges by hand. Loop-carried weight edges (``update`` of role R at iteration t
→ the ops that read R's weights at t+1) are kept beside the data edges; they
are the only edges that point backwards.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import networkx as nx

from flowc.errors import IRError
from flowc.ir.ops import OPS, TRAINABLE_KINDS, WEIGHT_READERS, Op, RoleKind
from flowc.ir.types import ValueType, WeightsType, project


@dataclass(frozen=True)
class ValueRef:
    """A reference to (part of) an earlier node's output.

    ``path`` projects into bundles and tuples: ``ValueRef("actor.generate",
    ("response_mask",))`` is the rollout's response mask; ``ValueRef("gae",
    (1,))`` the second item of ``gae``'s result.
    """

    node: str
    path: tuple[str | int, ...] = ()

    def __str__(self) -> str:
        return "%" + self.node + "".join(f".{p}" if isinstance(p, str) else f"[{p}]" for p in self.path)


@dataclass(frozen=True)
class RoleInfo:
    """A role bound by the flow's signature."""

    name: str
    kind: RoleKind

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", RoleKind(self.kind))
        except ValueError:
            kinds = ", ".join(RoleKind)
            raise IRError(f"role {self.name!r} has kind {self.kind!r}, which is not one of {kinds}") from None


@dataclass
class Node:
    """One operation. ``meta`` is for analyses; everything else is the op."""

    id: str
    op: Op  # a plain string is accepted and normalised by FlowGraph.add
    role: str | None
    type: ValueType
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    target: str | None = None
    line: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def refs(self) -> Iterator[tuple[str, ValueRef]]:
        """Every ValueRef in args/kwargs with the argument it sits in
        (``"0"``, ``"1"``, … for positions, the keyword otherwise)."""
        for i, a in enumerate(self.args):
            for r in _walk_refs(a):
                yield str(i), r
        for k, a in self.kwargs.items():
            for r in _walk_refs(a):
                yield k, r


def _walk_refs(x: Any) -> Iterator[ValueRef]:
    if isinstance(x, ValueRef):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _walk_refs(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _walk_refs(y)
    elif isinstance(x, slice):
        for y in (x.start, x.stop, x.step):
            yield from _walk_refs(y)


@dataclass(frozen=True)
class Edge:
    """A transfer: data edges carry ``type`` from ``src`` (projected along
    ``path``) into argument ``arg`` of ``dst``; weight edges (``kind ==
    "weights"``) are loop-carried: ``dst`` reads them at the next iteration."""

    src: str
    dst: str
    arg: str
    path: tuple[str | int, ...]
    type: ValueType
    kind: str = "data"

    @property
    def what(self) -> str:
        """A short name of what flows, e.g. ``rollout.response_mask``."""
        if self.kind == "weights":
            return "weights"
        return str(ValueRef(self.src, self.path))[1:]


class FlowGraph:
    """The IR of one flow: nodes in order, roles, hyperparameters, symbols."""

    def __init__(
        self,
        name: str,
        *,
        roles: Mapping[str, RoleInfo] | None = None,
        hyperparams: Mapping[str, Any] | None = None,
        symbols: Mapping[str, int] | None = None,
        source: str | None = None,
        max_staleness: int | None = None,
    ) -> None:
        self.name = name
        # the most weight versions the flow lets its rollouts lag the trainer (``@fc.flow(max_staleness=K)``);
        # None: the flow does not say, the run's staleness decides (0 unless asked)
        self.max_staleness = max_staleness
        self.roles: dict[str, RoleInfo] = dict(roles or {})
        self.hyperparams: dict[str, Any] = dict(hyperparams or {})
        self.symbols: dict[str, int] = dict(symbols or {})
        self.source = source
        self._nodes: dict[str, Node] = {}
        self._g = nx.MultiDiGraph()

    # ----------------------------------------------------------------- build
    def add(self, node: Node) -> Node:
        """Append a node; its references must point to existing nodes."""
        if node.id in self._nodes:
            raise IRError(f"node id {node.id!r} is already used in flow {self.name!r}")
        if node.op not in OPS:
            raise IRError(f"node {node.id!r} has op {node.op!r}, which is not one of {', '.join(OPS)}")
        node.op = Op(node.op)
        for arg, ref in node.refs():
            if ref.node not in self._nodes:
                raise IRError(
                    f"node {node.id!r} uses {ref} in argument {arg!r} before it exists",
                    fix="add nodes in execution order",
                )
            project(self._nodes[ref.node].type, ref.path)  # raises on a bad path
        self._nodes[node.id] = node
        self._g.add_node(node.id)
        for arg, ref in node.refs():
            edge = Edge(ref.node, node.id, arg, ref.path, project(self._nodes[ref.node].type, ref.path))
            self._g.add_edge(ref.node, node.id, edge=edge)
        return node

    def unique_id(self, base: str) -> str:
        """``base`` if free, else ``base_1``, ``base_2``, …"""
        if base not in self._nodes:
            return base
        i = 1
        while f"{base}_{i}" in self._nodes:
            i += 1
        return f"{base}_{i}"

    def add_weight_edges(self) -> None:
        """Add the loop-carried weight edges of every trainable role: from its
        (last) ``update`` — or, once planned, its last ``weight_sync`` — to each
        op that reads its weights."""
        for u, v, k, e in list(self._g.edges(keys=True, data="edge")):
            if e.kind == "weights":
                self._g.remove_edge(u, v, k)
        for role in self.roles.values():
            if role.kind not in TRAINABLE_KINDS:
                continue
            updates = [n for n in self._nodes.values() if n.op == "update" and n.role == role.name]
            if not updates:
                continue
            syncs = [n for n in self._nodes.values() if n.op == "weight_sync" and n.role == role.name]
            src = syncs[-1] if syncs else updates[-1]
            for n in self._nodes.values():
                if n.role == role.name and n.op in WEIGHT_READERS:
                    e = Edge(src.id, n.id, "weights", (), WeightsType(role=role.name), kind="weights")
                    self._g.add_edge(src.id, n.id, edge=e)

    def with_nodes(self, nodes: list[Node]) -> FlowGraph:
        """A new graph with the same header and the given nodes (in order),
        weight edges rebuilt. Passes use this to rewrite graphs."""
        g = FlowGraph(
            self.name,
            roles=self.roles,
            hyperparams=self.hyperparams,
            symbols=self.symbols,
            source=self.source,
            max_staleness=self.max_staleness,
        )
        for n in nodes:
            g.add(replace(n, meta=dict(n.meta)))
        g.add_weight_edges()
        return g

    # ----------------------------------------------------------------- query
    @property
    def nodes(self) -> list[Node]:
        """Nodes in execution order."""
        return list(self._nodes.values())

    def __getitem__(self, node_id: str) -> Node:
        try:
            return self._nodes[node_id]
        except KeyError:
            raise IRError(f"flow {self.name!r} has no node {node_id!r}") from None

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def edges(self, kind: str | None = None) -> list[Edge]:
        """Edges in a deterministic order (by destination, then source order)."""
        order = {nid: i for i, nid in enumerate(self._nodes)}
        es = [e for _, _, e in self._g.edges(data="edge") if kind is None or e.kind == kind]
        return sorted(es, key=lambda e: (e.kind != "data", order[e.dst], order[e.src], e.arg, str(e.path)))

    def inputs(self, node_id: str) -> list[Edge]:
        """Data edges into a node."""
        return [e for e in self.edges("data") if e.dst == node_id]

    def users(self, node_id: str) -> list[Node]:
        """Nodes that read a node's output (data edges only), in order."""
        ids = {v for _, v, e in self._g.out_edges(node_id, data="edge") if e.kind == "data"}
        return [n for n in self._nodes.values() if n.id in ids]

    def predecessors(self, node_id: str) -> list[Node]:
        """Nodes whose output a node reads (data edges only), in order."""
        ids = {u for u, _, e in self._g.in_edges(node_id, data="edge") if e.kind == "data"}
        return [n for n in self._nodes.values() if n.id in ids]

    def data_dag(self) -> nx.DiGraph:
        """The data edges as a simple DiGraph (weight edges left out)."""
        g = nx.DiGraph()
        g.add_nodes_from(self._nodes)
        g.add_edges_from((e.src, e.dst) for e in self.edges("data"))
        return g

    # ------------------------------------------------------------ equality
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FlowGraph):
            return NotImplemented
        from flowc.ir.serialize import to_dict

        return to_dict(self) == to_dict(other)

    def __str__(self) -> str:
        from flowc.ir.text import format_graph

        return format_graph(self)

    def __repr__(self) -> str:
        return f"<FlowGraph {self.name!r}: {len(self._nodes)} nodes>"
