"""Invariants of a Plan, checked after the passes (in tests, after every
pass) and by the runtime before it lowers one.

* its graph is a valid planned graph of the plan's flow, every model op of
  it runs in exactly one phase of its role, and every ``weight_sync`` node
  carries the method of its role's reshard;
* the target's kind is the cluster's;
* each phase's degrees multiply to its pool's device count and its devices
  are its pool's;
* memory per device is within capacity, and equals the sum of its categories;
* pools have disjoint device sets within the cluster;
* every reshard moves at least its lower bound, and no reshard into
  generation is missing for a trained policy that generates;
* the schedule has every model op once, ops of one pool do not overlap, and
  the predicted step time is the end of the schedule.
"""

from __future__ import annotations

import itertools

from flowc.errors import FlowcError, VerificationError
from flowc.ir.ops import MODEL_OPS, Op
from flowc.ir.plan import Plan, ScheduleEntry


def device_ids(spec: str) -> set[int]:
    """``"0-3,8"`` → ``{0, 1, 2, 3, 8}``."""
    out: set[int] = set()
    for part in spec.split(","):
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-")
            out.update(range(int(a), int(b) + 1))
        else:
            out.add(int(part))
    return out


def verify_plan(plan: Plan, *, tol: float = 1e-6) -> None:
    """Raise VerificationError naming the first broken invariant."""
    _verify_graph(plan)
    try:
        kind = plan.cluster_spec().profile.kind
    except FlowcError as e:
        raise VerificationError(f"plan cluster: {e.what}") from None
    if kind != plan.target.kind:
        raise VerificationError(f"the plan's target is {plan.target.kind} but its cluster's devices are {kind}")
    world = int(plan.cluster["world_size"])
    pools = {p.name: p for p in plan.pools}
    seen: set[int] = set()
    for p in plan.pools:
        ids = device_ids(p.devices)
        if len(ids) != p.device_count:
            raise VerificationError(f"pool {p.name}: {len(ids)} device ids for {p.device_count} devices")
        if ids & seen:
            raise VerificationError(f"pool {p.name} shares devices {sorted(ids & seen)[:4]} with another pool")
        if ids and (min(ids) < 0 or max(ids) >= world):
            raise VerificationError(f"pool {p.name} uses devices outside the cluster of {world}")
        seen |= ids
    for role, rp in plan.roles.items():
        for ph, pp in rp.phases.items():
            where = f"{role}.{ph}"
            if pp.pool not in pools:
                raise VerificationError(f"{where} runs on unknown pool {pp.pool!r}")
            if pp.device_count != pools[pp.pool].device_count or pp.devices != pools[pp.pool].devices:
                raise VerificationError(f"{where}: devices differ from its pool's")
            lay = pp.layout
            if (pp.dp, pp.tp, pp.pp, pp.cp, pp.ep) != (lay.dp, lay.tp, lay.pp, lay.cp, lay.ep):
                raise VerificationError(f"{where}: degrees differ from its layout")
            try:
                lay.check_world(pp.device_count, where)
            except FlowcError as e:
                raise VerificationError(e.what) from None
            if lay.ep > 1 and (lay.dp * lay.cp * lay.tp) % lay.ep:
                raise VerificationError(f"{where}: ep({lay.ep}) does not divide the ranks it is carved from")
            if abs(pp.memory.total - pp.memory_gb_per_device) > 1e-2:
                raise VerificationError(f"{where}: memory categories sum to {pp.memory.total:.3f}, not {pp.memory_gb_per_device}")
            if pp.memory_gb_per_device > pp.capacity_gb + 1e-3:
                raise VerificationError(f"{where}: needs {pp.memory_gb_per_device:.1f} GB of {pp.capacity_gb:.1f} GB per device")
            if pp.gpu_memory_utilization > 0:
                own = pp.memory.total - pp.memory.other_roles  # what the engine itself holds
                if ph != "generate":
                    raise VerificationError(f"{where}: only a generation phase has a gpu_memory_utilization")
                if pp.gpu_memory_utilization_pinned and own > pp.gpu_memory_utilization * pp.capacity_gb + 1e-2:
                    raise VerificationError(
                        f"{where}: its engine holds {own:.1f} GB per device, over its gpu_memory_utilization "
                        f"{pp.gpu_memory_utilization:g} of {pp.capacity_gb:.1f} GB"
                    )
            if pp.time_s < 0:
                raise VerificationError(f"{where}: negative time")
    for r in plan.reshards:
        if r.bytes_per_device + tol < r.lower_bound_bytes:
            raise VerificationError(
                f"reshard {r.src} → {r.dst}: {r.bytes_per_device:.0f} bytes per device, below the lower bound {r.lower_bound_bytes:.0f}"
            )
    for role, rp in plan.roles.items():
        if (
            "generate" in rp.phases
            and "train" in rp.phases
            and not any(r.role == role and r.dst_phase == "generate" for r in plan.reshards)
        ):
            raise VerificationError(f"role {role} trains and generates but has no reshard into generation")
    for e in plan.schedule:
        if e.end_s + tol < e.start_s:
            raise VerificationError(f"schedule: {e.op} ends before it starts")
    _no_overlap(plan.schedule, "schedule")
    ops = [e.op for e in plan.schedule]
    if len(ops) != len(set(ops)):
        raise VerificationError("schedule lists an op twice")
    end = max((e.end_s for e in plan.schedule), default=0.0)
    pred = plan.predicted
    if plan.staleness:  # the schedule is one iteration; the step, the pipelined loop's period
        if pred.iteration_s is None or abs(end - pred.iteration_s) > 1e-3 * max(1.0, end):
            raise VerificationError(f"predicted iteration {pred.iteration_s} s is not the schedule's end {end} s")
        _verify_steady_state(plan, tol)
        busiest = max((p.busy_s for p in plan.pools), default=0.0)
        if pred.step_time_s < busiest * (1 - 1e-3) - 1e-6:  # (it may exceed the iteration: generates issued first)
            raise VerificationError(
                f"predicted step {pred.step_time_s} s of a loop {plan.staleness} version(s) ahead is below the busiest"
                f" pool's {busiest:.6g} s"
            )
    elif abs(end - pred.step_time_s) > 1e-3 * max(1.0, end):
        raise VerificationError(f"predicted step {pred.step_time_s} s is not the schedule's end {end} s")
    elif plan.steady_state:
        raise VerificationError("a lock-step plan has a steady_state (only a pipelined loop has one)")


def _no_overlap(entries: list[ScheduleEntry], what: str) -> None:
    """No two of ``entries`` run at once on one pool."""
    by_pool: dict[str, list[tuple[float, float, str]]] = {}
    for e in entries:
        if e.pool:
            by_pool.setdefault(e.pool, []).append((e.start_s, e.end_s, e.op))
    for pool, spans in by_pool.items():
        spans.sort()
        for (_, e1, a), (s2, _, b) in itertools.pairwise(spans):
            if s2 + 1e-6 < e1:
                raise VerificationError(f"{what}: {a} and {b} overlap on pool {pool}")


def _verify_steady_state(plan: Plan, tol: float) -> None:
    """A pipelined plan's steady-state step: the schedule's ops once each, no two at once on a
    pool, and it ends at the predicted steady step (the period at the mean lengths), which the
    predicted step (the mean period) is not below."""
    steady = plan.steady_state
    if not steady:
        raise VerificationError(
            f"a plan with staleness {plan.staleness} has no steady_state (plans made before flowc recorded it)",
            fix="plan the flow again with this flowc",
        )
    if sorted(e.op for e in steady) != sorted(e.op for e in plan.schedule):
        raise VerificationError("steady_state does not list the schedule's ops once each")
    _no_overlap(steady, "steady_state")
    end = max(e.end_s for e in steady)
    pred = plan.predicted
    at = pred.steady_step_s if pred.steady_step_s is not None else pred.step_time_s
    if abs(end - at) > 1e-3 * max(1.0, end) + tol:
        raise VerificationError(f"steady_state ends at {end} s, not at the predicted steady step {at} s")
    if pred.step_time_s < at * (1 - 1e-3) - tol:
        raise VerificationError(
            f"predicted step {pred.step_time_s} s is below the steady step at the mean lengths, {at} s"
            " (the variation of generation time only adds to a pipelined loop's period)"
        )


def _verify_graph(plan: Plan) -> None:
    """The plan's graph: decodes, is a valid planned graph of its flow, and the
    plan places every model op of it once and syncs every trained policy by its
    reshard's method."""
    from flowc.ir.verify import verify

    try:
        g = plan.flow_graph()
        verify(g, "planned")
    except FlowcError as e:
        raise VerificationError(f"the plan's graph: {e.what}") from None
    if g.name != plan.flow:
        raise VerificationError(f"the plan is for flow {plan.flow!r} but holds the graph of {g.name!r}")
    placed: dict[str, str] = {}
    for role, rp in plan.roles.items():
        for ph, pp in rp.phases.items():
            for op in pp.ops:
                if op not in g or g[op].role != role:
                    raise VerificationError(f"{role}.{ph} runs {op}, which is not an op of role {role!r} in the plan's graph")
                if op in placed:
                    raise VerificationError(f"{op} is placed twice ({placed[op]} and {role}.{ph})")
                placed[op] = f"{role}.{ph}"
    for n in g.nodes:
        if n.op in MODEL_OPS and n.id not in placed:
            raise VerificationError(f"the plan does not place {n.op} {n.id}")
        if n.op == Op.WEIGHT_SYNC:
            r = plan.generation_sync(n.role)
            if r is None or r.method != n.kwargs.get("method"):
                have = r.method if r is not None else "none"
                raise VerificationError(f"{n.id} syncs by {n.kwargs.get('method')} but the plan's reshard of {n.role} is {have}")
    for r in plan.reshards:
        if r.src not in g or r.dst not in g:
            raise VerificationError(f"reshard {r.src} → {r.dst} names ops the plan's graph does not have")
