"""Lowering: a Plan becomes a Program.

A Program lists, for each worker group (a pool of the plan), the engines its
workers host and the ordered instructions they run in one iteration, plus the
controller's own instructions (compute, reward, input) in graph order. The
controller walks ``steps`` in order; instructions of one group run one after
another (Ray actors execute their calls in order), instructions of different
groups overlap.

:func:`lower` takes the plan and nothing else — the plan holds its graph and
its target — verifies it, checks that this runtime executes every decision
in it (each phase's backend and layout, each weight sync's method), and
follows every one: nothing is re-decided here or later. The Program is plain
data with a deterministic text form: saving a plan, reloading it and lowering
again gives the same program (a test checks it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flowc.errors import PlanError, SpecError
from flowc.ir.graph import FlowGraph
from flowc.ir.lora import LoraConfig, check_lora_backend
from flowc.ir.ops import MODEL_OPS, PHASE_OF_OP, TRAINABLE_KINDS, Op, RoleKind, _Name
from flowc.ir.plan import Layout, PhasePlan, Plan, ReshardPlan, Target
from flowc.ir.plan_verify import device_ids, verify_plan
from flowc.ir.workload import WorkloadSpec
from flowc.runtime.backends import SYNC_TRANSPORTS, backend


class EngineKind(_Name):
    """What an engine does for its role: trains it (and runs its forward ops),
    runs a frozen role's forward ops, or generates."""

    TRAIN = "train"
    FORWARD = "forward"
    ROLLOUT = "rollout"

    @classmethod
    def of(cls, role_kind: str, phase: str) -> EngineKind:
        if phase == "generate":
            return cls.ROLLOUT
        return cls.TRAIN if role_kind in TRAINABLE_KINDS else cls.FORWARD


@dataclass(frozen=True)
class EngineKey:
    """Names one engine of a run: a role's train, forward or rollout engine."""

    role: str
    kind: EngineKind

    def __str__(self) -> str:
        return f"{self.role}/{self.kind}"


@dataclass(frozen=True)
class EngineSpec:
    """One engine a worker group hosts: a role's model in one layout."""

    key: EngineKey
    role_kind: RoleKind
    layout: Layout
    model: str
    memory_fraction: float = 0.0  # of each device, what the plan gives a rollout engine (0: not planned)
    lora: LoraConfig | None = None  # a training engine's LoRA adapters, as the plan priced them
    kv_cache_gb: float = 0.0  # per device, the KV cache the plan gives a rollout engine (0: not planned)
    max_num_seqs: int = 0  # the most sequences a continuously batching rollout engine runs at once, as priced (0: its default)

    @property
    def role(self) -> str:
        return self.key.role

    def __str__(self) -> str:
        return f"{self.key}[{self.layout.backend} {self.layout.short()} {self.layout.micro_label}]"


@dataclass(frozen=True)
class Step:
    """One instruction. ``group`` and ``engine`` are None for the controller."""

    index: int
    op: Op
    node: str
    group: str | None
    engine: EngineKey | None
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

    def hosts(self, kind: EngineKind) -> bool:
        return any(e.key.kind == kind for e in self.engines)


@dataclass(frozen=True)
class Program:
    """Everything the controller executes: the groups, the steps of one iteration,
    the graph they come from, the target and the workload they were planned for."""

    flow: str
    groups: tuple[GroupSpec, ...]
    steps: tuple[Step, ...]
    graph: FlowGraph
    target: Target
    workload: WorkloadSpec
    staleness: int = 0  # weight versions the rollouts may lag the trainer (the plan's)

    def group(self, name: str) -> GroupSpec:
        for g in self.groups:
            if g.name == name:
                return g
        raise PlanError(f"program has no worker group {name!r}")

    def engine(self, key: EngineKey) -> tuple[GroupSpec, EngineSpec]:
        for g in self.groups:
            for e in g.engines:
                if e.key == key:
                    return g, e
        raise PlanError(f"program has no engine {key}")

    def steps_of(self, op: Op) -> list[Step]:
        return [s for s in self.steps if s.op == op]

    def __str__(self) -> str:
        t = self.target
        lines = [
            f"program {self.flow}",
            f"  target {t.kind} {t.dtype} {t.collective}, {t.cpus_per_worker:g} CPU(s) per worker, calls time out after {t.timeout_s:g} s",
        ]
        for g in self.groups:
            lines.append(f"  group {g.name}: {g.size} workers on devices {list(g.devices)} (nodes {list(g.nodes)})")
            for e in g.engines:
                lines.append(f"    engine {e} model={e.model}" + (f" lora={e.lora.short()}" if e.lora is not None else ""))
        lines.append("  steps")
        lines += [f"    {s}" for s in self.steps]
        return "\n".join(lines) + "\n"


def check_executable(plan: Plan, *, here: bool = True) -> None:
    """Raise a PlanError naming the first decision of ``plan`` this runtime cannot execute
    (``here``: its workers run on this machine, so its backends must be installed here;
    on a remote cluster the workers' own imports say so)."""
    kind = plan.target.kind
    for role, rp in plan.roles.items():
        for phase, pp in rp.phases.items():
            info = backend(pp.layout.backend)
            want = "rollout" if phase == "generate" else "trainer"
            if info.role != want:
                raise PlanError(
                    f"{role}.{phase} runs on {info.name}, a {info.role} backend; a {phase} phase needs a {want} backend"
                )
            info.check(kind, pp.layout, f"{role}.{phase}", here=here)
            if pp.sleeps_colocated:
                raise PlanError(
                    f"{role}.generate is planned with the co-located training state asleep in host memory, "
                    "which this runtime does not do (it keeps that state on the device)",
                    fix="re-plan within what the runtime executes (flowc plan … --for-run)",
                )
        if rp.lora is not None and "train" in rp.phases:
            try:
                check_lora_backend(role, rp.lora, rp.phases["train"].layout.backend)
            except SpecError as e:
                raise PlanError(e.what, fix=e.fix) from None
        if "forward" in rp.phases and "train" in rp.phases:
            fw, tr = rp.phases["forward"], rp.phases["train"]
            if (fw.pool, fw.layout) != (tr.pool, tr.layout):
                raise PlanError(
                    f"{role}.forward is planned on {fw.pool} with {fw.layout.short()}, but a trained role's forward ops "
                    f"run on its training engine ({tr.pool}, {tr.layout.short()})",
                    fix="re-plan the flow (the planner gives a trained role's forward phase its training layout)",
                )
    for r in plan.reshards:
        if r.dst_phase == "generate" and r is plan.generation_sync(r.role):
            _check_sync(plan, r)


def _check_sync(plan: Plan, r: ReshardPlan) -> None:
    transport = SYNC_TRANSPORTS.get(r.method)
    if transport is None:
        raise PlanError(
            f"{r.role}'s weight sync is planned as {r.method}, which this runtime does not implement "
            f"(it syncs by {', '.join(SYNC_TRANSPORTS)})",
            fix=f"re-plan within what the runtime executes (flowc plan … --for-run), or pin reshard.{r.role}=broadcast",
        )
    shared = plan.phase(r.role, "train").pool == plan.phase(r.role, "generate").pool
    if shared != (transport == "local"):
        where = "shares its training devices" if shared else "has devices of its own"
        raise PlanError(f"{r.role}'s generation {where}, but its sync is planned as {r.method}", fix="re-plan the flow")


def lower(plan: Plan, *, here: bool = True) -> Program:
    """The Program that runs ``plan``: verified, checked against what this runtime executes
    (``here``: on this machine's workers)."""
    verify_plan(plan)
    check_executable(plan, here=here)
    g = plan.flow_graph()
    node_size = int(plan.cluster["devices_per_node"])
    engines: dict[str, list[EngineSpec]] = {p.name: [] for p in plan.pools}
    for role, rp in plan.roles.items():
        for phase, pp in rp.phases.items():
            key = EngineKey(role, EngineKind.of(rp.kind, phase))
            if phase == "forward" and key.kind == EngineKind.TRAIN:
                continue  # a trained role's forward ops run on its training engine, in its training layout
            lora = rp.lora if key.kind == EngineKind.TRAIN else None
            kv = pp.memory.kv_cache if phase == "generate" else 0.0
            seqs = pp.max_num_seqs if phase == "generate" else 0
            spec = EngineSpec(key, RoleKind(rp.kind), pp.layout, rp.model, _memory_fraction(pp, phase), lora, kv, seqs)
            engines[pp.pool].append(spec)
    groups = tuple(
        GroupSpec(
            p.name, tuple(sorted(device_ids(p.devices))), node_size, tuple(sorted(engines[p.name], key=lambda e: str(e.key)))
        )
        for p in plan.pools
    )
    predicted = {e.op: e.end_s - e.start_s for e in plan.schedule}
    order = [x.id for x in g.nodes]
    steps: list[Step] = []
    for n in g.nodes:
        ins = tuple(sorted({e.src for e in g.inputs(n.id)}, key=order.index))
        group, engine, args = _placement(plan, g, n)
        steps.append(Step(len(steps), n.op, n.id, group, engine, ins, args, round(predicted.get(n.id, 0.0), 6)))
    return Program(plan.flow, groups, tuple(steps), g, plan.target, _workload(plan), plan.staleness)


def _memory_fraction(pp: PhasePlan, phase: str) -> float:
    """The share of each device a generate phase's engine may take: the plan's
    ``gpu_memory_utilization`` (planned or pinned); for a plan saved before it had one,
    what it gives the engine's weights, KV cache and buffers (not the co-located roles' state)."""
    if phase != "generate" or pp.capacity_gb <= 0:
        return 0.0
    if pp.gpu_memory_utilization > 0:
        return pp.gpu_memory_utilization
    own = pp.memory.total - pp.memory.other_roles
    return round(min(0.95, max(0.05, own / pp.capacity_gb)), 3)


def _placement(plan: Plan, g: FlowGraph, n) -> tuple[str | None, EngineKey | None, dict[str, object]]:
    """(group, engine, args) of a node: model ops on their phase's pool and engine, a
    weight sync on the training pool with its method, the rest on the controller."""
    if n.op in MODEL_OPS:
        phase = PHASE_OF_OP[n.op]
        role_kind = g.roles[n.role].kind
        pp = plan.phase(n.role, "train" if (phase == "forward" and role_kind in TRAINABLE_KINDS) else phase)
        if n.id not in plan.phase(n.role, phase).ops:
            raise PlanError(f"the plan does not place op {n.id}", fix="re-plan this flow")
        key = EngineKey(n.role, EngineKind.of(role_kind, phase))
        if n.op == Op.GENERATE:
            args: dict[str, object] = {k: v for k, v in n.kwargs.items() if not hasattr(v, "node")}
            if plan.phase(n.role, phase).env_workers:  # the environment pool the plan sized
                args["env_workers"] = plan.phase(n.role, phase).env_workers
        else:
            # a trained role's forward runs on its training engine (its layout) at the forward op's own priced fixed cost
            args = micro_args(pp.layout, plan.phase(n.role, phase).micro_overhead_tokens)
        return pp.pool, key, args
    if n.op == Op.WEIGHT_SYNC:
        r = plan.generation_sync(n.role)
        transport = SYNC_TRANSPORTS[r.method]
        args = {
            "method": r.method,
            "transport": transport,
            "to": EngineKey(n.role, EngineKind.ROLLOUT),
            "bytes_predicted": r.bytes_per_device,
        }
        if transport == "object_store":
            args["bucket_bytes"] = plan.target.sync_bucket_bytes
        return plan.phase(n.role, "train").pool, EngineKey(n.role, EngineKind.TRAIN), args
    return None, None, {}


def _workload(plan: Plan) -> WorkloadSpec:
    return WorkloadSpec(**plan.workload)


MICRO_ARGS = ("micro", "micro_tokens", "micro_overhead", "share_prompts", "pack_sequences")


def micro_args(layout: Layout, overhead_tokens: float = 0.0) -> dict[str, float]:
    """How a forward or update op cuts its rows into micro-batches: ``micro`` rows, or with
    ``micro_tokens`` a token budget (rows binned by length; see ``backends.training``), split
    further where that saves more padding than a micro-batch's fixed cost
    (``micro_overhead`` tokens; 0: fill each micro-batch up to the budget), computing each
    distinct prompt once where the layout ``share_prompts`` and that saves more than a pass, and
    packing a micro-batch's rows without their padding where the layout ``pack_sequences``."""
    # the plan prices budgets and fixed costs per device; a replica's rows are whole (cp ranks split each row)
    cp = layout.cp
    return {
        "micro": layout.micro_batch,
        "micro_tokens": layout.micro_tokens * cp,
        "micro_overhead": overhead_tokens * cp,
        "share_prompts": layout.share_prompts,
        "pack_sequences": layout.pack_sequences,
    }
