"""The planner's passes — one flat, named list — and :func:`make_plan`.

    verify → annotate_bytes → annotate_flops → placement_units → cost_tables → search
           → place → plan_reshards → insert_weight_sync → assemble_plan

Every pass has the signature ``(graph, ctx) -> graph`` and declares the
context fields it reads and writes (see :mod:`flowc.passes.manager`).
"""

from __future__ import annotations

import difflib
from dataclasses import replace

from flowc.errors import SpecError
from flowc.ir.cluster import ClusterSpec
from flowc.ir.graph import FlowGraph, Node, ValueRef
from flowc.ir.models import ModelSpec
from flowc.ir.ops import Op, weight_sync_id
from flowc.ir.plan import Plan, Target
from flowc.ir.serialize import to_dict
from flowc.ir.types import WeightsType
from flowc.ir.verify import check_staleness, verify
from flowc.ir.workload import WorkloadSpec
from flowc.passes import build
from flowc.passes.analysis import annotate_bytes, annotate_flops
from flowc.passes.costs import Hw
from flowc.passes.diagnose import diagnose, searcher
from flowc.passes.explain import alternatives, dynamic_sampling_notes, why
from flowc.passes.manager import Pass, PassManager, PlanContext, default_verify_each
from flowc.passes.options import OptionTable
from flowc.passes.pins import Pins
from flowc.passes.pools import PoolTable
from flowc.passes.schedule import op_specs
from flowc.passes.units import units_of


def verify_traced(g: FlowGraph, ctx: PlanContext) -> FlowGraph:
    verify(g, "traced")
    return g


def placement_units(g: FlowGraph, ctx: PlanContext) -> FlowGraph:
    ctx.units = units_of(g)
    ctx.unit_of_op = {op: u.name for u in ctx.units for op in u.ops}
    _check_pins(g, ctx)
    check_staleness(g, ctx.pins.staleness or 0)
    return g


def cost_tables(g: FlowGraph, ctx: PlanContext) -> FlowGraph:
    ctx.hw = Hw.of(ctx.cluster, ctx.target.dtype)
    ctx.options = OptionTable(ctx.units, ctx.models, ctx.demands, ctx.workload, ctx.hw, ctx.pins, ctx.target.rollout_backends)
    ctx.pools = PoolTable(ctx.options)
    ctx.ops = op_specs(g, ctx.unit_of_op, {u.name: 0 for u in ctx.units}, ctx.env)
    return g


def search(g: FlowGraph, ctx: PlanContext) -> FlowGraph:
    result = searcher(g, ctx, ctx.cluster, ctx.workload).run()
    if not result.ranked:
        raise diagnose(g, ctx, result)
    ctx.search = result
    return g


def place(g: FlowGraph, ctx: PlanContext) -> FlowGraph:
    ctx.placement = build.place(ctx.search.ranked[0], ctx.cluster.devices_per_node)
    return g


def plan_reshards(g: FlowGraph, ctx: PlanContext) -> FlowGraph:
    ctx.reshards = build.reshards(g, ctx, ctx.placement)
    return g


def insert_weight_sync(g: FlowGraph, ctx: PlanContext) -> FlowGraph:
    """Replace the loop-carried weight edges into generation by costed
    ``weight_sync`` nodes (the weight edges then start at the sync)."""
    syncs: list[Node] = []
    for r in ctx.reshards:
        if r.dst_phase != "generate" or any(s.role == r.role for s in syncs):
            continue
        to = [x.dst for x in ctx.reshards if x.role == r.role and x.dst_phase == "generate"]
        syncs.append(
            Node(
                id=weight_sync_id(r.role),
                op=Op.WEIGHT_SYNC,
                role=r.role,
                type=WeightsType(role=r.role),
                args=(ValueRef(r.src),),
                kwargs={"method": r.method, "to": to, "bytes_per_device": r.bytes_per_device, "time_s": r.time_s},
            )
        )
    ctx.planned = g.with_nodes([replace(n) for n in g.nodes] + syncs)
    return ctx.planned


def assemble_plan(g: FlowGraph, ctx: PlanContext) -> FlowGraph:
    result, pl = ctx.search, ctx.placement
    roles, pools = build.phases(ctx, pl)
    step, iteration, schedule, pools, steady = build.timeline(g, ctx, pl, ctx.reshards, pools)
    k = ctx.pins.staleness or 0
    body = {
        "predicted": build.predicted(
            g, ctx, step, iteration if k else None, max((e.end_s for e in steady), default=step) if k else None
        ),
        "roles": build.role_plans(g, ctx, roles),
        "pools": pools,
        "reshards": ctx.reshards,
        "schedule": schedule,
        "steady_state": steady,
    }
    ctx.plan = Plan(
        flow=g.name,
        hyperparams={k: v for k, v in g.hyperparams.items() if isinstance(v, (int, float, str, bool)) or v is None},
        cluster={
            **ctx.cluster.model_dump(exclude={"efficiency"} if ctx.cluster.efficiency is None else set()),
            "world_size": ctx.cluster.world_size,
        },
        workload=ctx.workload.model_dump(),
        target=ctx.target,
        graph=to_dict(ctx.planned),
        alternatives=alternatives(ctx, result),
        why=why(ctx, result, body, g.max_staleness) + dynamic_sampling_notes(g),
        pins=ctx.pins.summary(),
        staleness=k,
        search={
            "strategy": result.strategy,
            "device_splits": result.evaluated,
            "co_locations": len(result.per_partition) + len(result.infeasible),
        },
        **body,
    )
    return g


PIPELINE: list[Pass] = [
    Pass("verify", verify_traced),
    Pass("annotate_bytes", annotate_bytes, reads=("workload",), writes=("env",)),
    Pass("annotate_flops", annotate_flops, reads=("workload", "models"), writes=("demands",)),
    Pass("placement_units", placement_units, reads=("pins",), writes=("units", "unit_of_op")),
    Pass(
        "cost_tables",
        cost_tables,
        reads=("cluster", "models", "demands", "workload", "pins", "target", "units", "unit_of_op", "env"),
        writes=("hw", "options", "pools", "ops"),
    ),
    Pass(
        "search",
        search,  # and when nothing fits, the diagnosis re-prices the units on other clusters and workloads
        reads=("hw", "pools", "ops", "units", "unit_of_op", "pins", "cluster", "workload", "models", "options", "target"),
        writes=("search",),
    ),
    Pass("place", place, reads=("search", "cluster"), writes=("placement",)),
    Pass("plan_reshards", plan_reshards, reads=("placement", "units", "models", "options"), writes=("reshards",)),
    Pass("insert_weight_sync", insert_weight_sync, reads=("reshards",), writes=("planned",), stage="planned"),
    Pass(
        "assemble_plan",
        assemble_plan,
        reads=(
            "search",
            "placement",
            "reshards",
            "planned",
            "options",
            "demands",
            "hw",
            "ops",
            "units",
            "unit_of_op",
            "models",
            "cluster",
            "workload",
            "pins",
            "target",
        ),
        writes=("plan",),
        stage="planned",
    ),
]


def make_plan(
    g: FlowGraph,
    models: dict[str, ModelSpec],
    cluster: ClusterSpec,
    workload: WorkloadSpec,
    pins: Pins | None = None,
    *,
    target: Target | None = None,
    verify_each: bool | None = None,
) -> tuple[Plan, FlowGraph, PlanContext]:
    """Plan one flow: returns the plan, the planned graph and the context
    (timings, cost tables) for inspection. ``target`` defaults to the cluster's
    (:meth:`Target.of`); ``verify_each`` to ``FLOWC_VERIFY_EACH=1``. A ``staleness`` pin of
    ``"auto"``: the planner chooses it (:func:`choose_staleness`)."""
    pins = pins or Pins()
    bound = g.max_staleness
    if isinstance(pins.staleness, int) and bound is not None and pins.staleness > bound:
        raise SpecError(
            f"staleness={pins.staleness}, but flow {g.name} declares @fc.flow(max_staleness={bound}): its rollouts may lag"
            f" the trainer by at most {bound} weight version(s)",
            fix=f"ask for staleness 0 … {bound} (or auto, which chooses within it), or raise the flow's max_staleness",
        )
    if pins.staleness == "auto" or (pins.staleness is None and bound):
        return choose_staleness(g, models, cluster, workload, pins, target=target, verify_each=verify_each)
    plan, planned, ctx = _plan_once(g, models, cluster, workload, pins, target, verify_each)
    if pins.staleness is None:  # lock-step by default: say so, and whether the flow could run ahead
        return plan.model_copy(update={"why": [_default_staleness_line(g), *plan.why]}), planned, ctx
    return plan, planned, ctx


def _reason(e: SpecError) -> str:
    """``check_staleness``'s refusal without its ``staleness=K:`` prefix."""
    return e.what.split(": ", 1)[1] if e.what.startswith("staleness=") else e.what


def _default_staleness_line(g: FlowGraph) -> str:
    if g.max_staleness == 0:
        return "Staleness: 0, lock-step — the flow declares @fc.flow(max_staleness=0)."
    try:
        check_staleness(g, 1)
    except SpecError as e:
        return f"Staleness: 0, lock-step (the default) — this flow cannot run ahead: {_reason(e)}."
    return (
        "Staleness: 0, lock-step (the default) — the flow's loss corrects for off-policy samples, so it could run ahead:"
        " --staleness auto (or @fc.flow(max_staleness=2)) lets the planner price it (K = 1 or 2) with the placement."
    )


def _plan_once(
    g: FlowGraph,
    models: dict[str, ModelSpec],
    cluster: ClusterSpec,
    workload: WorkloadSpec,
    pins: Pins,
    target: Target | None,
    verify_each: bool | None,
) -> tuple[Plan, FlowGraph, PlanContext]:
    ctx = PlanContext(
        models=models,
        cluster=cluster,
        workload=workload,
        pins=pins,
        target=target or Target.of(cluster),
        verify_each=default_verify_each() if verify_each is None else verify_each,
    )
    planned = PassManager(PIPELINE).run(g, ctx)
    return ctx.plan, planned, ctx


# the staleness bounds the planner chooses among: K = 1 overlaps one later generate with each step;
# K = 2 also absorbs a slow generate in the rollouts issued further ahead (steady_period), which
# larger K add little to (a 16-point spread of the longest response: two slow steps in a row are rare)
AUTO_STALENESS = (0, 1, 2)
AUTO_TOLERANCE = 0.02  # a larger K must be this much faster: older samples cost learning


def staleness_choices(g: FlowGraph) -> tuple[tuple[int, ...], str | None]:
    """The staleness values ``auto`` chooses among for ``g`` (:data:`AUTO_STALENESS` within the
    flow's ``max_staleness``), and, when that is lock-step alone, why."""
    bound = g.max_staleness
    ks = tuple(k for k in AUTO_STALENESS if bound is None or k <= bound)
    if ks == (0,):
        return ks, f"the flow declares @fc.flow(max_staleness={bound})"
    try:
        check_staleness(g, 1)
    except SpecError as e:
        return (0,), f"this flow cannot run ahead: {_reason(e)}"
    return ks, None


def smallest_within(step_s: dict[int, float]) -> int:
    """The smallest staleness whose step time is within :data:`AUTO_TOLERANCE` of the fastest:
    a larger K must pay for its older samples."""
    fastest = min(step_s.values())
    return min(k for k, t in step_s.items() if t <= fastest * (1 + AUTO_TOLERANCE))


def choose_staleness(
    g: FlowGraph,
    models: dict[str, ModelSpec],
    cluster: ClusterSpec,
    workload: WorkloadSpec,
    pins: Pins,
    *,
    target: Target | None = None,
    verify_each: bool | None = None,
) -> tuple[Plan, FlowGraph, PlanContext]:
    """Plan the flow at each staleness of :data:`AUTO_STALENESS` its loss allows (placement and
    staleness together) and keep the smallest K whose step is within :data:`AUTO_TOLERANCE` of the
    fastest; lock-step only when the flow cannot run ahead (``check_staleness``: why says so)."""
    bound = g.max_staleness
    ks, reason = staleness_choices(g)
    tried = {k: _plan_once(g, models, cluster, workload, pins.merged(Pins(staleness=k)), target, verify_each) for k in ks}
    k = smallest_within({k: r[0].predicted.step_time_s for k, r in tried.items()})
    best = tried[k]
    if reason is not None:
        line = f"Staleness (auto): 0, lock-step — {reason}."
    else:
        fastest = min(r[0].predicted.step_time_s for r in tried.values())

        def over(t: float) -> str:
            return f" (+{t / fastest - 1:.1%})" if t > fastest * (1 + 5e-4) else ""

        each = ", ".join(f"{k} → {r[0].predicted.step_time_s:,.2f} s{over(r[0].predicted.step_time_s)}" for k, r in tried.items())
        within = f", within the flow's max_staleness={bound}" if bound is not None else ""
        line = (
            f"Staleness (auto{within}): {k} — step time by staleness: {each}; the smallest within"
            f" {AUTO_TOLERANCE:.0%} of the fastest (a larger K only makes the samples older)."
        )
    plan, planned, ctx = best
    return plan.model_copy(update={"why": [line, *plan.why]}), planned, ctx


# ------------------------------------------------------------------- checks
def _check_pins(g: FlowGraph, ctx: PlanContext) -> None:
    for role, phases in ctx.pins.roles.items():
        if role not in g.roles:
            close = difflib.get_close_matches(role, list(g.roles), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise SpecError(
                f"pin names role {role!r}, which flow {g.name!r} does not have{hint}", fix=f"roles: {', '.join(g.roles)}"
            )
        have = {ph for u in ctx.units if u.role == role for ph in u.phases}
        for ph in phases:
            if ph not in have:
                raise SpecError(f"pin {role}.{ph}: role {role!r} has no {ph} phase", fix=f"its phases: {', '.join(sorted(have))}")
    names = {u.name for u in ctx.units} | {u.role for u in ctx.units}
    for group in ctx.pins.colocate or []:
        for item in group:
            if item not in names:
                raise SpecError(
                    f"colocate pin names {item!r}, which is not a unit of this flow",
                    fix=f"units: {', '.join(u.name for u in ctx.units)}",
                )
    for role in ctx.pins.reshard:
        if role not in g.roles:
            raise SpecError(f"reshard pin names role {role!r}, which flow {g.name!r} does not have")
