"""Lowering: a Plan and its graph become a Program.

A Program lists, for each worker group (a pool of the plan), the engines its
workers host and the ordered instructions they run in one iteration, plus the
controller's own instructions (compute, reward, input) in graph order. The
controller walks ``steps`` in order; instructions of one group run one after
another (Ray actors execute their calls in order), instructions of different
groups overlap.

The Program is plain data with a deterministic text form: saving a plan,
reloading it and lowering again gives the same program (a test checks it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flowc.errors import PlanError
from flowc.ir.graph import FlowGraph
from flowc.ir.ops import MODEL_OPS
from flowc.ir.plan import Layout, Plan
from flowc.ir.plan_verify import _ids

ENGINE_OF_PHASE = {"train": "train", "forward": "train", "generate": "rollout"}


@dataclass(frozen=True)
class EngineSpec:
    """One engine a worker group hosts: a role's model in one layout."""

    role: str
    kind: str  # role kind: policy, critic, reference, reward_model
    engine: str  # "train" (trainable: update + forward), "forward" (frozen), "rollout" (generation)
    backend: str
    layout: Layout
    model: str

    def __str__(self) -> str:
        return f"{self.role}/{self.engine}[{self.backend} {self.layout.short()}]"


@dataclass(frozen=True)
class Step:
    """One instruction. ``group`` is None for the controller."""

    index: int
    op: str  # input | generate | logprobs | values | score | update | weight_sync | reward | compute
    node: str
    group: str | None
    engine: str | None  # "role/engine" for device ops
    inputs: tuple[str, ...]
    args: dict[str, object] = field(default_factory=dict)
    predicted_s: float = 0.0

    def __str__(self) -> str:
        where = f"[{self.group}] {self.engine}" if self.group else "[controller]"
        extra = "".join(f" {k}={v}" for k, v in sorted(self.args.items()))
        ins = ", ".join(self.inputs)
        return f"{self.index:3d} {self.op:<11} {self.node:<20} {where} <- ({ins}){extra}  ~{self.predicted_s:.3g}s"


@dataclass(frozen=True)
class GroupSpec:
    """A worker group: one Ray actor per device of a pool."""

    name: str
    devices: tuple[int, ...]
    devices_per_node: int
    engines: tuple[EngineSpec, ...]

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def nodes(self) -> tuple[int, ...]:
        return tuple(sorted({d // self.devices_per_node for d in self.devices}))


@dataclass(frozen=True)
class Program:
    flow: str
    groups: tuple[GroupSpec, ...]
    steps: tuple[Step, ...]

    def group(self, name: str) -> GroupSpec:
        for g in self.groups:
            if g.name == name:
                return g
        raise PlanError(f"program has no worker group {name!r}")

    def engine(self, role: str, engine: str) -> tuple[GroupSpec, EngineSpec]:
        for g in self.groups:
            for e in g.engines:
                if e.role == role and e.engine == engine:
                    return g, e
        raise PlanError(f"program has no {engine} engine for role {role!r}")

    def __str__(self) -> str:
        lines = [f"program {self.flow}"]
        for g in self.groups:
            lines.append(f"  group {g.name}: {g.size} workers on devices {list(g.devices)} (nodes {list(g.nodes)})")
            for e in g.engines:
                lines.append(f"    engine {e} model={e.model}")
        lines.append("  steps")
        lines += [f"    {s}" for s in self.steps]
        return "\n".join(lines) + "\n"


def lower(plan: Plan, g: FlowGraph) -> Program:
    """The Program that runs ``plan`` for graph ``g``."""
    if plan.flow != g.name:
        raise PlanError(f"plan is for flow {plan.flow!r}, graph is {g.name!r}")
    node_size = int(plan.cluster["devices_per_node"])
    engines: dict[str, list[EngineSpec]] = {p.name: [] for p in plan.pools}
    seen: set[tuple[str, str]] = set()
    for role, rp in plan.roles.items():
        for phase, pp in rp.phases.items():
            kind = rp.kind
            engine = "rollout" if phase == "generate" else ("train" if kind in ("policy", "critic") else "forward")
            if (role, engine) in seen:
                continue
            seen.add((role, engine))
            engines[pp.pool].append(EngineSpec(role, kind, engine, pp.layout.backend, pp.layout, rp.model))
    groups = tuple(
        GroupSpec(
            p.name, tuple(sorted(_ids(p.devices))), node_size, tuple(sorted(engines[p.name], key=lambda e: (e.role, e.engine)))
        )
        for p in plan.pools
    )
    predicted = {e.op: e.end_s - e.start_s for e in plan.schedule}
    pool_of: dict[str, str] = {}
    for rp in plan.roles.values():
        for pp in rp.phases.values():
            for op in pp.ops:
                pool_of[op] = pp.pool
    steps: list[Step] = []
    for n in g.nodes:
        ins = tuple(sorted({e.src for e in g.inputs(n.id)}, key=[x.id for x in g.nodes].index))
        if n.op in MODEL_OPS:
            role_kind = g.roles[n.role].kind
            engine = "rollout" if n.op == "generate" else ("train" if role_kind in ("policy", "critic") else "forward")
            if n.id not in pool_of:
                raise PlanError(f"the plan does not place op {n.id}", fix="re-plan this flow")
            args: dict[str, object] = {}
            if n.op == "generate":
                args = {k: v for k, v in n.kwargs.items() if not hasattr(v, "node")}
            steps.append(
                Step(len(steps), n.op, n.id, pool_of[n.id], f"{n.role}/{engine}", ins, args, round(predicted.get(n.id, 0.0), 6))
            )
        elif n.op == "weight_sync":
            r = next(x for x in plan.reshards if x.role == n.role and x.dst_phase == "generate")
            steps.append(
                Step(
                    len(steps),
                    "weight_sync",
                    n.id,
                    pool_of.get(r.src),
                    f"{n.role}/train",
                    ins,
                    {"method": r.method, "to": f"{n.role}/rollout"},
                    round(r.time_s, 6),
                )
            )
        else:
            steps.append(Step(len(steps), n.op, n.id, None, None, ins))
    if any(r.dst_phase == "generate" for r in plan.reshards) and not any(s.op == "weight_sync" for s in steps):
        raise PlanError("lower the planned graph (with its weight_sync nodes), not the traced one")
    return Program(plan.flow, groups, tuple(steps))
