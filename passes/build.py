"""Assemble the Plan from the search's winner, one seam at a time: its devices
(:func:`place`), the weight movement of every weight edge (:func:`reshards`),
each role's phases and the pools (:func:`phases`), one iteration's timeline
(:func:`timeline`) and the prediction (:func:`predicted`).

Every cost here is the one the search ranked: the pool choices are the
search's own objects, and a sync between pools is priced by the search's own
:func:`~flowc.passes.search.cross_pool_sync` on the same device placement.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from flowc.errors import PlanError
from flowc.ir.graph import FlowGraph
from flowc.ir.ops import MODEL_OPS, PHASE_OF_OP, Op
from flowc.ir.plan import (
    STATIC_BATCH_BACKENDS,
    Layout,
    Memory,
    PhasePlan,
    PoolPlan,
    Predicted,
    ReshardPlan,
    RolePlan,
    ScheduleEntry,
)
from flowc.passes.costs import Hw, MemoryGB, PhaseCost
from flowc.passes.devices import assign_devices, node_count, ranges
from flowc.passes.flops import forward_flops, useful_train_flops
from flowc.passes.generation_costs import takes_device_share
from flowc.passes.manager import PlanContext
from flowc.passes.pools import MAX_UTILIZATION, MIN_UTILIZATION, PoolChoice
from flowc.passes.reshard import lower_bound_bytes
from flowc.passes.schedule import SyncSpec, simulate
from flowc.passes.search import Candidate, cross_pool_sync, generate_spreads
from flowc.passes.steady_period import Variation
from flowc.passes.units import Unit, gen_unit, train_unit

PHASE_ORDER = {"train": 0, "forward": 1, "generate": 2}


def pool_name(units: tuple[str, ...]) -> str:
    return "+".join(units)


@dataclass(frozen=True)
class Placement:
    """The search's winner with its devices: pool ``i`` holds ``cand.partition[i]``
    on global device ids ``devices[i]``."""

    cand: Candidate
    devices: tuple[tuple[int, ...], ...]
    pool_of_unit: dict[str, int]

    @property
    def names(self) -> list[str]:
        return [pool_name(b) for b in self.cand.partition]

    def choice(self, unit: str) -> PoolChoice:
        return self.cand.choices[self.pool_of_unit[unit]]


def place(cand: Candidate, node: int) -> Placement:
    pool_of_unit = {u: i for i, block in enumerate(cand.partition) for u in block}
    return Placement(cand, assign_devices(cand.sizes, node), pool_of_unit)


# ------------------------------------------------------------------ reshards
def reshards(g: FlowGraph, ctx: PlanContext, pl: Placement) -> list[ReshardPlan]:
    """How every weight edge moves its role's weights: into generation by the
    method the pool table (co-located) or :func:`sync_cost` (across pools) chose;
    into a forward op of the training engine, nothing."""
    units = {u.name: u for u in ctx.units}
    out: list[ReshardPlan] = []
    synced: set[str] = set()
    for e in g.edges("weights"):
        src, dst = g[e.src], g[e.dst]
        role = src.role
        if dst.op != Op.GENERATE:
            out.append(_no_move(role, src.id, dst.id, "forward"))
            continue
        if role in synced:  # one engine: the first generate's sync serves the others
            out.append(_no_move(role, src.id, dst.id, "generate"))
            continue
        synced.add(role)
        tu, gu = train_unit(units.values(), role), gen_unit(units.values(), role)
        rc, train_lay, gen_lay, colocated = sync_choice(ctx, pl.cand, tu, gu)
        if rc is None:  # the search keeps only candidates whose syncs it priced: a disagreement is a bug
            raise PlanError(
                f"{role}: no weight-sync method moves {train_lay.short()} to {gen_lay.short()} for the chosen placement",
                fix="report this plan (flowc plan … -o plan.json); pin reshard.ROLE or the layouts to work around it",
            )
        lb = lower_bound_bytes(ctx.models[role], train_lay, gen_lay, colocated)
        out.append(
            ReshardPlan(
                role=role,
                src=src.id,
                dst=dst.id,
                src_phase="train",
                dst_phase="generate",
                method=rc.method,
                bytes_per_device=round(rc.bytes_per_device, 1),
                lower_bound_bytes=round(lb, 1),
                total_bytes=round(rc.total_bytes, 1),
                time_s=round(rc.time, 6),
                link=rc.link,
            )
        )
    return out


def sync_choice(ctx: PlanContext, cand: Candidate, tu: Unit, gu: Unit):
    """(the sync's cost, train layout, generation layout, co-located?) of a candidate:
    the pool table's choice when co-located, else the search's :func:`cross_pool_sync`."""
    pool = {u: i for i, block in enumerate(cand.partition) for u in block}
    ti, gi = pool[tu.name], pool[gu.name]
    tc, gc = cand.choices[ti], cand.choices[gi]
    train_lay, gen = tc.options[tu.name].layouts["train"], gc.gens[gu.name]
    if ti == gi:
        return gen.reshard, train_lay, gen.layout, True
    return cross_pool_sync(ctx.options, tu, gu, tc, gc, cand.sizes, ti, gi), train_lay, gen.layout, False


def _no_move(role: str, src: str, dst: str, dst_phase: str) -> ReshardPlan:
    """A weight edge whose reader already has the weights where it needs them."""
    return ReshardPlan(
        role=role,
        src=src,
        dst=dst,
        src_phase="train",
        dst_phase=dst_phase,
        method="in_place",
        bytes_per_device=0.0,
        lower_bound_bytes=0.0,
        total_bytes=0.0,
        time_s=0.0,
        link="none",
    )


# -------------------------------------------------------------------- phases
def phases(ctx: PlanContext, pl: Placement) -> tuple[dict[str, dict[str, PhasePlan]], list[PoolPlan]]:
    """Every role's phases (layout, memory, time) and the pools, before the timeline."""
    units = {u.name: u for u in ctx.units}
    cap = ctx.options.capacity_gb
    node = ctx.cluster.devices_per_node
    roles: dict[str, dict[str, PhasePlan]] = {}
    pools: list[PoolPlan] = []
    for i, (block, choice) in enumerate(zip(pl.cand.partition, pl.cand.choices, strict=True)):
        name, devs = pool_name(block), ranges(pl.devices[i])
        for u in block:
            unit = units[u]
            if u in choice.options:
                for phase, p in _model_phases(unit, choice, name, devs, cap).items():
                    roles.setdefault(unit.role, {})[phase] = p
            if u in choice.gens:
                roles.setdefault(unit.role, {})["generate"] = _generate_phase(choice, u, name, devs, cap, ctx.options.hw)
        pools.append(
            PoolPlan(
                name=name,
                device_count=choice.devices,
                devices=devs,
                nodes=node_count(pl.devices[i], node),
                roles=sorted({units[u].role for u in block}),
                units=list(block),
                busy_s=0.0,
                idle_fraction=0.0,
            )
        )
    return roles, pools


def _model_phases(unit: Unit, choice: PoolChoice, pool: str, devs: str, cap: float) -> dict[str, PhasePlan]:
    """The train and/or forward phase of a training or frozen unit."""
    opt = choice.options[unit.name]
    other = choice.resident_gb - opt.resident_gb  # what the roles it shares devices with hold
    by_phase: dict[str, list[tuple[str, PhaseCost]]] = {}
    for op, kind in zip(unit.ops, unit.kinds, strict=True):
        by_phase.setdefault("train" if kind == Op.UPDATE else "forward", []).append((op, opt.op_costs[op]))
    out = {}
    for phase, items in by_phase.items():
        mem = max((c.memory for _, c in items), key=lambda m: m.total)
        if phase == "forward" and unit.trainable:  # the training state stays while it runs forward
            tr = opt.op_costs[unit.update_op].memory
            mem = replace(mem, weights=tr.weights, gradients=tr.gradients, optimizer=tr.optimizer)
        mfu = max((c.mfu for _, c in items), default=0.0)
        out[phase] = _phase(pool, choice.devices, devs, opt.layouts[phase], _plan_mem(mem, other), cap, items, 1, mfu)
    return out


def _generate_phase(choice: PoolChoice, u: str, pool: str, devs: str, cap: float, hw: Hw) -> PhasePlan:
    gc = choice.gens[u]
    items = list(gc.op_costs.items())
    mem = max((c.memory for _, c in items), key=lambda m: m.total)
    other = 0.0 if gc.swapped else choice.resident_gb
    if gc.reshard is not None and not gc.swapped:
        # co-located with the training state: the engine reads its whole shard (the weights shown), of
        # which it holds only what the training shards lack; the rest it shares with them, so it leaves
        # the other roles' column (no byte is counted twice)
        other -= max(gc.shard_gb - gc.weights_gb, 0.0)
    plan_mem = _plan_mem(replace(mem, weights=max(gc.shard_gb, gc.weights_gb)), other)
    ph = _phase(pool, choice.devices, devs, gc.layout, plan_mem, cap, items, max(c.waves for _, c in items), 0.0)
    pinned = gc.pinned_utilization
    own = plan_mem.total - plan_mem.other_roles  # what the engine itself holds: its weights, cache and buffers
    paged = takes_device_share(gc.layout.backend, hw.kind)
    # rounded up: the engine is never given less than the plan counts for it
    planned = min(MAX_UTILIZATION, max(MIN_UTILIZATION, math.ceil(own / cap * 1000) / 1000)) if cap > 0 and paged else 0.0
    util = pinned if pinned is not None else planned
    return ph.model_copy(
        update={
            "sleeps_colocated": gc.swapped,
            "gpu_memory_utilization": util,
            "gpu_memory_utilization_pinned": pinned is not None,
            # the batch the cost model played (generation_costs: at most the profile's max_seqs running)
            "max_num_seqs": 0 if gc.layout.backend in STATIC_BATCH_BACKENDS else hw.rollout_cost(gc.layout.backend).max_seqs or 0,
            "env_workers": max((int(c.detail.get("env_workers", 0)) for _, c in items), default=0),
        }
    )


def _plan_mem(m: MemoryGB, other: float) -> Memory:
    """The plan's memory record of a phase: its own categories plus what the roles it shares devices with hold."""
    return replace(m, other_roles=other).to_plan()


def _phase(pool: str, d: int, devs: str, lay: Layout, mem: Memory, cap: float, items, waves: int, mfu: float) -> PhasePlan:
    return PhasePlan(
        pool=pool,
        device_count=d,
        devices=devs,
        dp=lay.dp,
        tp=lay.tp,
        pp=lay.pp,
        cp=lay.cp,
        ep=lay.ep,
        layout=lay,
        memory=mem,
        memory_gb_per_device=round(mem.total, 3),
        capacity_gb=round(cap, 3),
        time_s=round(sum(c.time for _, c in items), 6),
        ops=[op for op, _ in items],
        waves=waves,
        mfu=round(mfu, 4),
        micro_overhead_tokens=round(max((c.micro_overhead_tokens for _, c in items), default=0.0), 1),
    )


# ------------------------------------------------------------------ timeline
def timeline(
    g: FlowGraph, ctx: PlanContext, pl: Placement, rs: list[ReshardPlan], pools: list[PoolPlan]
) -> tuple[float, float, list[ScheduleEntry], list[PoolPlan], list[ScheduleEntry]]:
    """One iteration's list schedule (the search's :func:`simulate`, on the
    winner): the step time (with staleness, the pipelined period), one iteration's
    span, its entries, the pools with their busy time, and (with staleness) one step of the
    steady state's entries (:func:`steady_order`)."""
    units = {u.name: u for u in ctx.units}
    ops = [replace(o, pool=pl.pool_of_unit[ctx.unit_of_op[o.id]] if o.pool is not None else None) for o in ctx.ops]
    times = {op: np.array([t]) for c in pl.cand.choices for op, t in c.op_times.items()}
    syncs, sync_times = [], {}
    for r in rs:
        if r.dst_phase != "generate" or any(s.role == r.role for s in syncs):
            continue  # a role's first generate edge carries its sync; the others read the same engine
        tr = pl.pool_of_unit[train_unit(units.values(), r.role).name]
        ge = pl.pool_of_unit[gen_unit(units.values(), r.role).name]
        s = SyncSpec(r.role, r.src, (tr,) if tr == ge else (tr, ge))
        syncs.append(s)
        sync_times[s.id] = np.array([r.time_s])
    sizes = [np.array([float(s)]) for s in pl.cand.sizes]
    k = ctx.pins.staleness or 0
    window: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    variation = None
    if k:
        spread = generate_spreads(units, pl.cand.partition, [[c] for c in pl.cand.choices])
        variation = Variation(spread, ctx.workload.mean_response_cv)
    step, spans, busy = simulate(
        ops,
        syncs,
        times,
        sync_times,
        sizes,
        ctx.hw.pool_bw,
        ctx.hw.controller_bw,
        record=True,
        staleness=k,
        window=window,
        variation=variation,
    )
    step_s = float(step[0])
    iteration_s = max((float(e[0]) for _, e in spans.values()), default=0.0)
    sync_role = {s.id: s.role for s in syncs}

    def entries_of(recorded: dict[str, tuple[np.ndarray, np.ndarray]]) -> list[ScheduleEntry]:
        out = []
        for oid, (s, e) in sorted(recorded.items(), key=lambda kv: (float(kv[1][0][0]), float(kv[1][1][0]), kv[0])):
            if oid in sync_role:
                role, phase = sync_role[oid], "sync"
                pool = pools[pl.pool_of_unit[gen_unit(units.values(), role).name]].name
            else:
                n = g[oid]
                role, phase = n.role, PHASE_OF_OP.get(n.op)
                pool = pools[pl.pool_of_unit[ctx.unit_of_op[oid]]].name if n.op in MODEL_OPS else None
            out.append(
                ScheduleEntry(
                    op=oid, role=role, phase=phase, pool=pool, start_s=round(float(s[0]), 6), end_s=round(float(e[0]), 6)
                )
            )
        return out

    entries, steady = entries_of(spans), entries_of(window)
    pools = [
        p.model_copy(
            update={
                "busy_s": round(float(busy[i][0]), 6),
                "idle_fraction": round(1 - float(busy[i][0]) / step_s, 4) if step_s > 0 else 0.0,
            }
        )
        for i, p in enumerate(pools)
    ]
    return step_s, iteration_s, entries, pools, steady


# ----------------------------------------------------------------- predicted
def predicted(
    g: FlowGraph, ctx: PlanContext, step_s: float, iteration_s: float | None = None, steady_s: float | None = None
) -> Predicted:
    """Throughput and MFU of the step: the policy's trained tokens (the rows its update leaves
    out as idle included: the batch is trained on), every model op's useful FLOPs computed
    (``iteration_s``: one iteration's span, and ``steady_s`` the period at the mean lengths, given
    when the loop is pipelined)."""
    dem = ctx.demands
    tokens = sum(
        (d.sequences + d.idle) * d.seq_len
        for nid, d in dem.items()
        if g[nid].op == Op.UPDATE and g.roles[g[nid].role].kind == "policy"
    )
    flops = 0.0
    for nid, d in dem.items():
        m = ctx.models[g[nid].role]
        flops += (
            useful_train_flops(m, d.tokens, d.seq_len)
            if g[nid].op == Op.UPDATE
            else float(g[nid].meta.get("flops", forward_flops(m, d.tokens, d.seq_len)))
        )
    world = ctx.cluster.world_size
    return Predicted(
        step_time_s=round(step_s, 6),
        tokens_per_s=round(tokens / step_s, 3) if step_s else 0.0,
        tokens_per_s_per_device=round(tokens / step_s / world, 4) if step_s else 0.0,
        tokens_per_step=float(tokens),
        mfu=round(flops / (step_s * world * ctx.hw.peak), 4) if step_s else 0.0,
        iteration_s=round(iteration_s, 6) if iteration_s is not None else None,
        steady_step_s=round(steady_s, 6) if steady_s is not None else None,
    )


def role_plans(g: FlowGraph, ctx: PlanContext, roles: dict[str, dict[str, PhasePlan]]) -> dict[str, RolePlan]:
    """The roles in the flow's own order (whatever the pools' order), phases train, forward, generate."""
    out = {}
    for r in (r for r in g.roles if r in roles):
        m = ctx.models[r]
        out[r] = RolePlan(
            kind=g.roles[r].kind,
            model=m.name,
            params_b=float(f"{m.params_total / 1e9:.6g}"),
            active_params_b=float(f"{m.params_active / 1e9:.6g}"),
            phases=dict(sorted(roles[r].items(), key=lambda kv: PHASE_ORDER[kv[0]])),
            lora=m.lora if m.lora is not None and m.lora.enabled and "train" in roles[r] else None,
        )
    return out
