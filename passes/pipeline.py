"""The planner's passes — one flat, named list — and :func:`make_plan`.

    verify → annotate_bytes → annotate_flops → placement_units → cost_tables
           → search → assemble_plan → insert_weight_sync

Every pass has the signature ``(graph, ctx) -> graph`` (see
:mod:`flowc.passes.manager`).
"""

from __future__ import annotations

from dataclasses import replace

from flowc.errors import InfeasibleError, SpecError
from flowc.ir.cluster import ClusterSpec
from flowc.ir.graph import FlowGraph, Node, ValueRef
from flowc.ir.models import ModelSpec
from flowc.ir.plan import Plan
from flowc.ir.types import WeightsType
from flowc.ir.verify import verify
from flowc.ir.workload import WorkloadSpec
from flowc.passes.analysis import annotate_bytes, annotate_flops
from flowc.passes.build import build
from flowc.passes.costs import GB, Hw
from flowc.passes.explain import alternatives, dynamic_sampling_notes, why
from flowc.passes.manager import Pass, PassManager, PlanContext
from flowc.passes.options import OptionTable
from flowc.passes.pins import Pins
from flowc.passes.pools import PoolTable
from flowc.passes.schedule import op_specs
from flowc.passes.search import Searcher
from flowc.passes.units import demands, units_of


def verify_traced(g: FlowGraph, ctx: PlanContext) -> FlowGraph:
    verify(g, "traced")
    return g


def placement_units(g: FlowGraph, ctx: PlanContext) -> FlowGraph:
    units = units_of(g)
    ctx.state["units"] = units
    ctx.state["unit_of_op"] = {op: u.name for u in units for op in u.ops}
    _check_pins(g, ctx, units)
    return g


def cost_tables(g: FlowGraph, ctx: PlanContext) -> FlowGraph:
    hw = Hw.of(ctx.cluster)
    ctx.state["hw"] = hw
    table = OptionTable(ctx.state["units"], ctx.models, ctx.state["demands"], ctx.workload, hw, ctx.pins)
    ctx.state["options"] = table
    ctx.state["pools"] = PoolTable(table)
    ctx.state["ops"] = op_specs(g, ctx.state["unit_of_op"], {u.name: 0 for u in ctx.state["units"]}, ctx.state["env"])
    ctx.state["inter_bw"] = hw.inter if ctx.cluster.nodes > 1 else hw.intra
    ctx.state["controller_bw"] = ctx.cluster.profile.inter_node_gb_s * GB * hw.eff.inter_node
    return g


def _searcher(g: FlowGraph, ctx: PlanContext, cluster: ClusterSpec, workload: WorkloadSpec) -> Searcher:
    """A searcher for ``cluster`` and ``workload`` (the context's own, or others when diagnosing)."""
    if cluster is ctx.cluster and workload is ctx.workload:
        pools, hw, ops = ctx.state["pools"], ctx.state["hw"], ctx.state["ops"]
    else:
        hw = Hw.of(cluster)
        pools = PoolTable(OptionTable(ctx.state["units"], ctx.models, demands(g, workload), workload, hw, ctx.pins))
        ops = op_specs(g, ctx.state["unit_of_op"], {u.name: 0 for u in ctx.state["units"]}, workload.env(g.symbols))
    devices_pin: dict[str, int] = {}
    for u in ctx.state["units"]:
        for ph in u.phases:
            d = ctx.pins.phase(u.role, ph).devices
            if d is not None:
                devices_pin[u.name] = d
    inter = hw.inter if cluster.nodes > 1 else hw.intra
    controller = cluster.profile.inter_node_gb_s * GB * hw.eff.inter_node
    return Searcher(
        pools,
        ops,
        ctx.state["unit_of_op"],
        cluster.world_size,
        cluster.devices_per_node,
        inter,
        hw.intra,
        controller,
        ctx.pins.colocate,
        devices_pin,
    )


def search(g: FlowGraph, ctx: PlanContext) -> FlowGraph:
    result = _searcher(g, ctx, ctx.cluster, ctx.workload).run()
    if not result.ranked:
        raise diagnose(g, ctx, result)
    ctx.state["search"] = result
    return g


def assemble_plan(g: FlowGraph, ctx: PlanContext) -> FlowGraph:
    result = ctx.state["search"]
    best = result.ranked[0]
    body = build(g, ctx, best)
    plan = Plan(
        flow=g.name,
        hyperparams={k: v for k, v in g.hyperparams.items() if isinstance(v, (int, float, str, bool)) or v is None},
        cluster={**ctx.cluster.model_dump(), "world_size": ctx.cluster.world_size},
        workload=ctx.workload.model_dump(),
        alternatives=alternatives(ctx, result),
        why=why(ctx, result, body) + dynamic_sampling_notes(g),
        pins=ctx.pins.summary(),
        search={
            "strategy": result.strategy,
            "device_splits": result.evaluated,
            "co_locations": len(result.per_partition) + len(result.infeasible),
        },
        **body,
    )
    ctx.state["plan"] = plan
    return g


def insert_weight_sync(g: FlowGraph, ctx: PlanContext) -> FlowGraph:
    """Replace the loop-carried weight edges into generation by costed
    ``weight_sync`` nodes (the weight edges then start at the sync)."""
    plan: Plan = ctx.state["plan"]
    syncs = []
    for r in plan.reshards:
        if r.dst_phase != "generate" or any(s.role == r.role for s in syncs):
            continue
        to = [x.dst for x in plan.reshards if x.role == r.role and x.dst_phase == "generate"]
        syncs.append(
            Node(
                id=f"{r.role}.weight_sync",
                op="weight_sync",
                role=r.role,
                type=WeightsType(role=r.role),
                args=(ValueRef(r.src),),
                kwargs={"method": r.method, "to": to, "bytes_per_device": r.bytes_per_device, "time_s": r.time_s},
            )
        )
    out = g.with_nodes([replace(n) for n in g.nodes] + syncs)
    ctx.state["planned"] = True
    return out


PIPELINE: list[tuple[str, Pass]] = [
    ("verify", verify_traced),
    ("annotate_bytes", annotate_bytes),
    ("annotate_flops", annotate_flops),
    ("placement_units", placement_units),
    ("cost_tables", cost_tables),
    ("search", search),
    ("assemble_plan", assemble_plan),
    ("insert_weight_sync", insert_weight_sync),
]


def make_plan(
    g: FlowGraph,
    models: dict[str, ModelSpec],
    cluster: ClusterSpec,
    workload: WorkloadSpec,
    pins: Pins | None = None,
    *,
    verify_each: bool = False,
) -> tuple[Plan, FlowGraph, PlanContext]:
    """Plan one flow: returns the plan, the planned graph and the context
    (timings, cost tables) for inspection."""
    ctx = PlanContext(models=models, cluster=cluster, workload=workload, pins=pins or Pins(), verify_each=verify_each)
    planned = PassManager(PIPELINE).run(g, ctx)
    return ctx.state["plan"], planned, ctx


# ------------------------------------------------------------------- checks
def _check_pins(g: FlowGraph, ctx: PlanContext, units) -> None:
    import difflib

    for role, phases in ctx.pins.roles.items():
        if role not in g.roles:
            close = difflib.get_close_matches(role, list(g.roles), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise SpecError(
                f"pin names role {role!r}, which flow {g.name!r} does not have{hint}", fix=f"roles: {', '.join(g.roles)}"
            )
        have = {ph for u in units if u.role == role for ph in u.phases}
        for ph in phases:
            if ph not in have:
                raise SpecError(f"pin {role}.{ph}: role {role!r} has no {ph} phase", fix=f"its phases: {', '.join(sorted(have))}")
    names = {u.name for u in units} | {u.role for u in units}
    for group in ctx.pins.colocate or []:
        for item in group:
            if item not in names:
                raise SpecError(
                    f"colocate pin names {item!r}, which is not a unit of this flow",
                    fix=f"units: {', '.join(u.name for u in units)}",
                )
    for role in ctx.pins.reshard:
        if role not in g.roles:
            raise SpecError(f"reshard pin names role {role!r}, which flow {g.name!r} does not have")


def diagnose(g: FlowGraph, ctx: PlanContext, result) -> InfeasibleError:
    """Why nothing fits: which role and phase, by how much, and what would fit."""
    pt: PoolTable = ctx.state["pools"]
    table: OptionTable = ctx.state["options"]
    world = ctx.cluster.world_size
    failing = [
        (u.name, pt.choice((u.name,), world).reason) for u in table.units.values() if not pt.choice((u.name,), world).feasible
    ]
    pinned = " (with the pins given)" if not ctx.pins.is_empty() else ""
    if failing:
        what = (
            f"{len(failing)} of {len(table.units)} roles/phases do not fit on {world} {ctx.cluster.device} devices{pinned}: "
            + "; ".join(r for _, r in failing)
        )
        hints = _what_would_fit(g, ctx, [u for u, _ in failing])
        return InfeasibleError(what, fix="; or ".join(hints))
    reasons = "; ".join(f"{' | '.join('+'.join(b) for b in p)}: {r}" for p, r in list(result.infeasible.items())[:3])
    hints = []
    node = ctx.cluster.devices_per_node
    for k in (2, 4, 8):
        bigger = ClusterSpec(device=ctx.cluster.device, nodes=ctx.cluster.nodes * k, devices_per_node=node)
        if _searcher(g, ctx, bigger, ctx.workload).run().ranked:
            hints.append(f"it plans on {bigger.world_size} devices (--cluster {bigger.nodes}x{node}x{ctx.cluster.device})")
            break
    r = ctx.workload.response_len
    for div in (2, 4, 8):
        w = ctx.workload.model_copy(update={"response_len": max(r // div, 1), "mean_response_len": None})
        if _searcher(g, ctx, ctx.cluster, w).run().ranked:
            hints.append(f"with response_len={w.response_len} (--workload response_len={w.response_len})")
            break
    if not ctx.pins.is_empty():
        hints.append("drop or change the pins")
    return InfeasibleError(
        f"every role fits on its own, but no co-location fits on {world} devices{pinned}: {reasons}",
        fix="; or ".join(hints) or "add devices, allow offload, or shorten response_len",
    )


def _what_would_fit(g: FlowGraph, ctx: PlanContext, units: list[str]) -> list[str]:
    hints: list[str] = []
    node = ctx.cluster.devices_per_node
    # more devices of the same type: the smallest multiple of the cluster that fits each failing unit
    for k in (2, 4, 8, 16, 32, 64):
        bigger = ClusterSpec(device=ctx.cluster.device, nodes=ctx.cluster.nodes * k, devices_per_node=node)
        if all(_fits_alone(g, ctx, u, bigger, ctx.workload) for u in units):
            hints.append(f"each fits alone on {bigger.world_size} devices (--cluster {bigger.nodes}x{node}x{ctx.cluster.device})")
            break
    else:
        hints.append(f"no cluster up to {ctx.cluster.world_size * 64} {ctx.cluster.device} devices fits them")
    # a shorter response
    lo, hi, found = 1, ctx.workload.response_len - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        w = ctx.workload.model_copy(update={"response_len": mid, "mean_response_len": None})
        if all(_fits_alone(g, ctx, u, ctx.cluster, w) for u in units):
            found, lo = mid, mid + 1
        else:
            hi = mid - 1
    if found:
        hints.append(f"they fit with response_len <= {found} (--workload response_len={found})")
    # a device with more memory
    from flowc.ir.hardware import profiles

    bigger_dev = [p for p in profiles().values() if p.kind == "gpu" and p.memory_gb > ctx.cluster.profile.memory_gb]
    for p in sorted(bigger_dev, key=lambda p: p.memory_gb):
        other = ClusterSpec(device=p.name, nodes=ctx.cluster.nodes, devices_per_node=node)
        if all(_fits_alone(g, ctx, u, other, ctx.workload) for u in units):
            hints.append(f"they fit on the same number of {p.name} ({p.memory_gb:.0f} GB)")
            break
    # offload, when pins forbade it
    for u in units:
        role = u.split(".")[0]
        for ph in ("train", "forward"):
            pin = ctx.pins.phase(role, ph)
            if pin.offload_optimizer is False or pin.offload_params is False:
                hints.append(f"allow offload for {role}.{ph} (drop the offload pins)")
    return hints


def _fits_alone(g: FlowGraph, ctx: PlanContext, unit: str, cluster: ClusterSpec, w: WorkloadSpec) -> bool:
    hw = Hw.of(cluster)
    table = OptionTable(ctx.state["units"], ctx.models, demands(g, w), w, hw, ctx.pins)
    return PoolTable(table).choice((unit,), cluster.world_size).feasible
