"""Assemble the Plan from the search's winner: devices, phases, reshards, schedule."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from flowc.ir.graph import FlowGraph
from flowc.ir.ops import MODEL_OPS
from flowc.ir.plan import (
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
from flowc.passes.flops import forward_flops, useful_train_flops
from flowc.passes.manager import PlanContext
from flowc.passes.pools import PoolChoice
from flowc.passes.reshard import best, colocated_options, lower_bound_bytes, separate_options, whole_tensor_options
from flowc.passes.schedule import OpSpec, SyncSpec, simulate
from flowc.passes.search import Candidate


def pool_name(units: tuple[str, ...]) -> str:
    return "+".join(units)


def assign_devices(sizes: tuple[int, ...], node: int) -> list[list[int]]:
    """Global device ids per pool: whole-node pools first (largest first), then
    sub-node pools packed first-fit decreasing into the remaining nodes."""
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    out: list[list[int]] = [[] for _ in sizes]
    nxt = 0
    for i in order:
        if sizes[i] >= node:
            out[i] = list(range(nxt, nxt + sizes[i]))
            nxt += sizes[i]
    fill: list[tuple[int, int]] = []  # (start, free) per leftover node
    for i in order:
        if sizes[i] < node:
            for j, (start, free) in enumerate(fill):
                if free >= sizes[i]:
                    used = node - free
                    out[i] = list(range(start + used, start + used + sizes[i]))
                    fill[j] = (start, free - sizes[i])
                    break
            else:
                out[i] = list(range(nxt, nxt + sizes[i]))
                fill.append((nxt, node - sizes[i]))
                nxt += node
    return out


def ranges(ids: list[int]) -> str:
    """``[0,1,2,3,8,9]`` → ``"0-3,8-9"``."""
    if not ids:
        return ""
    parts, start, prev = [], ids[0], ids[0]
    for x in ids[1:]:
        if x == prev + 1:
            prev = x
            continue
        parts.append(f"{start}-{prev}" if prev > start else str(start))
        start = prev = x
    parts.append(f"{start}-{prev}" if prev > start else str(start))
    return ",".join(parts)


def _plan_mem(m: MemoryGB, other: float) -> Memory:
    """The plan's memory record of a phase: its own categories plus what the roles it shares devices with hold."""
    return replace(m, other_roles=other).to_plan()


def build(g: FlowGraph, ctx: PlanContext, cand: Candidate) -> dict:
    """The plan's body (everything but alternatives and why) as keyword
    arguments of :class:`~flowc.ir.plan.Plan`."""
    hw: Hw = ctx.state["hw"]
    table = ctx.state["options"]
    units = table.units
    node = ctx.cluster.devices_per_node
    devices = assign_devices(cand.sizes, node)
    cap = table.capacity_gb
    roles: dict[str, dict[str, PhasePlan]] = {}
    pools: list[PoolPlan] = []
    unit_pool: dict[str, int] = {}
    for i, block in enumerate(cand.partition):
        for u in block:
            unit_pool[u] = i
    # --------------------------------------------------------------- phases
    for i, (block, choice) in enumerate(zip(cand.partition, cand.choices, strict=True)):
        name = pool_name(block)
        devs = ranges(devices[i])
        for u in block:
            unit = units[u]
            own_res = 0.0
            if u in choice.options:
                opt = choice.options[u]
                own_res = opt.resident_gb
                other = choice.resident_gb - own_res
                by_phase: dict[str, list[tuple[str, PhaseCost]]] = {}
                for op, kind in zip(unit.ops, unit.kinds, strict=True):
                    by_phase.setdefault("train" if kind == "update" else "forward", []).append((op, opt.op_costs[op]))
                for phase, items in by_phase.items():
                    lay = opt.layouts[phase]
                    mem = max((c.memory for _, c in items), key=lambda m: m.total)
                    if phase == "forward" and unit.trainable:  # the training state stays while it runs forward
                        tr = opt.op_costs[unit.update_op].memory
                        mem = replace(mem, weights=tr.weights, gradients=tr.gradients, optimizer=tr.optimizer)
                    plan_mem = _plan_mem(mem, other)
                    mfu = max((c.mfu for _, c in items), default=0.0)
                    roles.setdefault(unit.role, {})[phase] = _phase(name, choice.devices, devs, lay, plan_mem, cap, items, 1, mfu)
            if u in choice.gens:
                gc = choice.gens[u]
                items = list(gc.op_costs.items())
                mem = max((c.memory for _, c in items), key=lambda m: m.total)
                if gc.reshard is not None:  # co-located: the training state stays, the engine adds its weights
                    mem = replace(mem, weights=gc.weights_gb)
                plan_mem = _plan_mem(mem, 0.0 if gc.swapped else choice.resident_gb)
                waves = max(c.waves for _, c in items)
                roles.setdefault(unit.role, {})["generate"] = _phase(
                    name, choice.devices, devs, gc.layout, plan_mem, cap, items, waves, 0.0
                )
        pools.append(
            PoolPlan(
                name=name,
                device_count=choice.devices,
                devices=devs,
                nodes=len({d // node for d in devices[i]}),
                roles=sorted({units[u].role for u in block}),
                units=list(block),
                busy_s=0.0,
                idle_fraction=0.0,
            )
        )
    # ------------------------------------------------------------- reshards
    reshards = _reshards(g, ctx, cand, unit_pool, devices, hw)
    # ------------------------------------------------------------- schedule
    ops = [
        OpSpec(o.id, unit_pool[ctx.state["unit_of_op"][o.id]] if o.pool is not None else None, o.deps) for o in ctx.state["ops"]
    ]
    times = {op: np.array([t]) for c in cand.choices for op, t in c.op_times.items()}
    syncs, sync_times = [], {}
    for r in reshards:
        if r.dst_phase == "generate":
            sid = f"{r.role}.weight_sync"
            tr = unit_pool[next(u for u in units if units[u].role == r.role and units[u].trainable)]
            ge = unit_pool[f"{r.role}.gen"]
            syncs.append(SyncSpec(sid, r.src, (tr,) if tr == ge else (tr, ge)))
            sync_times[sid] = np.array([r.time_s])
    sizes = [np.array([float(s)]) for s in cand.sizes]
    step, spans, busy = simulate(
        ops, syncs, times, sync_times, sizes, ctx.state["inter_bw"], ctx.state["controller_bw"], record=True
    )
    step_s = float(step[0])
    schedule = []
    for oid, (s, e) in sorted(spans.items(), key=lambda kv: (float(kv[1][0][0]), float(kv[1][1][0]), kv[0])):
        n = g[oid] if oid in g else None
        role = n.role if n is not None else oid.split(".")[0]
        phase = _phase_of(n) if n is not None else "sync"
        pool = (
            pools[unit_pool[ctx.state["unit_of_op"][oid]]].name
            if (n is not None and n.op in MODEL_OPS)
            else (None if n is not None else pools[unit_pool[f"{role}.gen"]].name)
        )
        schedule.append(
            ScheduleEntry(op=oid, role=role, phase=phase, pool=pool, start_s=round(float(s[0]), 6), end_s=round(float(e[0]), 6))
        )
    pools = [
        p.model_copy(
            update={
                "busy_s": round(float(busy[i][0]), 6),
                "idle_fraction": round(1 - float(busy[i][0]) / step_s, 4) if step_s > 0 else 0.0,
            }
        )
        for i, p in enumerate(pools)
    ]
    # ------------------------------------------------------------ predicted
    dem = ctx.state["demands"]
    tokens = sum(
        d.sequences * d.seq_len for nid, d in dem.items() if g[nid].op == "update" and g.roles[g[nid].role].kind == "policy"
    )
    flops = 0.0
    for nid, d in dem.items():
        m = ctx.models[g[nid].role]
        flops += (
            useful_train_flops(m, d.tokens, d.seq_len)
            if g[nid].op == "update"
            else float(g[nid].meta.get("flops", forward_flops(m, d.tokens, d.seq_len)))
        )
    world = ctx.cluster.world_size
    predicted = Predicted(
        step_time_s=round(step_s, 6),
        tokens_per_s=round(tokens / step_s, 3) if step_s else 0.0,
        tokens_per_s_per_device=round(tokens / step_s / world, 4) if step_s else 0.0,
        tokens_per_step=float(tokens),
        mfu=round(flops / (step_s * world * hw.peak), 4) if step_s else 0.0,
    )
    role_plans = {}
    for r in (r for r in g.roles if r in roles):  # the flow's own role order, whatever the pools' order
        phases = roles[r]
        m = ctx.models[r]
        order = {"train": 0, "forward": 1, "generate": 2}
        role_plans[r] = RolePlan(
            kind=g.roles[r].kind,
            model=m.name,
            params_b=float(f"{m.params_total / 1e9:.6g}"),
            active_params_b=float(f"{m.params_active / 1e9:.6g}"),
            phases=dict(sorted(phases.items(), key=lambda kv: order[kv[0]])),
        )
    return {"predicted": predicted, "roles": role_plans, "pools": pools, "reshards": reshards, "schedule": schedule}


def _phase_of(n) -> str | None:
    return {"update": "train", "generate": "generate", "logprobs": "forward", "values": "forward", "score": "forward"}.get(n.op)


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
    )


def _reshards(g: FlowGraph, ctx: PlanContext, cand: Candidate, unit_pool, devices, hw: Hw) -> list[ReshardPlan]:
    table = ctx.state["options"]
    units = table.units
    out: list[ReshardPlan] = []
    choice_of = {u: c for b, c in zip(cand.partition, cand.choices, strict=True) for u in b}
    seen_gen: set[str] = set()
    for e in g.edges("weights"):
        src, dst = g[e.src], g[e.dst]
        role = src.role
        m = ctx.models[role]
        train_u = next(u for u in units if units[u].role == role and units[u].trainable)
        tc: PoolChoice = choice_of[train_u]
        train_lay = tc.options[train_u].layouts["train"]
        if dst.op != "generate":
            out.append(_no_move(role, src.id, dst.id, "forward"))
            continue
        gen_u = f"{role}.gen"
        gc = choice_of[gen_u].gens[gen_u]
        colocated = unit_pool[gen_u] == unit_pool[train_u]
        lb = lower_bound_bytes(m, train_lay, gc.layout, colocated)
        if role in seen_gen:  # one engine: the first generate's sync serves the others
            out.append(_no_move(role, src.id, dst.id, "generate"))
            continue
        seen_gen.add(role)
        if colocated:
            rc = gc.reshard
        else:
            a, b = devices[unit_pool[train_u]], devices[unit_pool[gen_u]]
            node = ctx.cluster.devices_per_node
            same_node = len({d // node for d in a + b}) == 1
            opts = separate_options(m, train_lay, gc.layout, hw, same_node=same_node)
            if ctx.pins.whole_tensor_sync:
                opts = whole_tensor_options(opts, gc.layout)
            rc = best(opts, ctx.pins.reshard.get(role))
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


def colocated_method_table(ctx: PlanContext, role: str, train: Layout, gen: Layout):
    """All co-located reshard options (for the explanation)."""
    return colocated_options(ctx.models[role], train, gen, ctx.state["hw"])
