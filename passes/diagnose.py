"""Why nothing fits: which role and phase, by how much, and what would fit.

Called by the ``search`` pass when no co-location fits; it re-runs the
option tables and the search on bigger clusters, shorter responses or
devices with more memory to turn the failure into a fix.
"""

from __future__ import annotations

import time

from flowc.errors import InfeasibleError
from flowc.ir.cluster import ClusterSpec
from flowc.ir.graph import FlowGraph
from flowc.ir.hardware import profiles
from flowc.ir.workload import WorkloadSpec
from flowc.passes.costs import Hw
from flowc.passes.manager import PlanContext
from flowc.passes.options import OptionTable
from flowc.passes.pools import PoolTable
from flowc.passes.schedule import op_specs
from flowc.passes.search import Searcher, SearchResult
from flowc.passes.units import demands

BUDGET_S = 5.0  # the fix-it probes stop after this long and say what they tried


class _Budget:
    """A deadline shared by the fix-it probes, and a record of what they tried."""

    def __init__(self, seconds: float | None = None) -> None:
        seconds = BUDGET_S if seconds is None else seconds
        self.end = time.monotonic() + seconds
        self.seconds = seconds
        self.tried: list[str] = []
        self.out = False

    def left(self) -> bool:
        if time.monotonic() > self.end:
            self.out = True
        return not self.out

    def note(self) -> str | None:
        if not self.out:
            return None
        return f"stopped looking for a fix after {self.seconds:g} s (tried {', '.join(self.tried) or 'nothing'})"


def tables(g: FlowGraph, ctx: PlanContext, cluster: ClusterSpec, workload: WorkloadSpec) -> tuple[Hw, OptionTable, PoolTable]:
    """The cost tables of the context's units for ``cluster`` and ``workload``."""
    hw = Hw.of(cluster, ctx.target.dtype)
    dem = demands(g, workload)
    table = OptionTable(ctx.units, ctx.models, dem, workload, hw, ctx.pins, ctx.target.rollout_backends)
    return hw, table, PoolTable(table)


def searcher(g: FlowGraph, ctx: PlanContext, cluster: ClusterSpec, workload: WorkloadSpec) -> Searcher:
    """A searcher for ``cluster`` and ``workload`` (the context's own tables when they are the context's)."""
    if cluster is ctx.cluster and workload is ctx.workload:
        hw, pools, ops = ctx.hw, ctx.pools, ctx.ops
    else:
        hw, _, pools = tables(g, ctx, cluster, workload)
        ops = op_specs(g, ctx.unit_of_op, {u.name: 0 for u in ctx.units}, workload.env(g.symbols))
    return Searcher(pools, ops, ctx.unit_of_op, cluster.world_size, hw, ctx.pins)


def diagnose(g: FlowGraph, ctx: PlanContext, result: SearchResult) -> InfeasibleError:
    """Why nothing fits: which role and phase, by how much, and what would fit."""
    pt, table = ctx.pools, ctx.options
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
        budget = _Budget()
        hints = _what_would_fit(g, ctx, [u for u, _ in failing], budget)
        if not ctx.pins.is_empty():
            hints.insert(0, "change or drop the pins named above")
        if budget.note():
            hints.append(budget.note())
        return InfeasibleError(what, fix="; or ".join(hints))
    reasons = "; ".join(f"{' | '.join('+'.join(b) for b in p)}: {r}" for p, r in list(result.infeasible.items())[:3])
    hints = []
    budget = _Budget()
    node = ctx.cluster.devices_per_node
    for k in (2, 4, 8):
        if not budget.left():
            break
        bigger = ClusterSpec(device=ctx.cluster.device, nodes=ctx.cluster.nodes * k, devices_per_node=node)
        budget.tried.append(f"{bigger.world_size} devices")
        if searcher(g, ctx, bigger, ctx.workload).run().ranked:
            hints.append(f"it plans on {bigger.world_size} devices (--cluster {bigger.nodes}x{node}x{ctx.cluster.device})")
            break
    r = ctx.workload.response_len
    for div in (2, 4, 8):
        if not budget.left():
            break
        w = ctx.workload.model_copy(update={"response_len": max(r // div, 1), "mean_response_len": None})
        budget.tried.append(f"response_len={w.response_len}")
        if searcher(g, ctx, ctx.cluster, w).run().ranked:
            hints.append(f"with response_len={w.response_len} (--workload response_len={w.response_len})")
            break
    if not ctx.pins.is_empty():
        hints.append("drop or change the pins")
    if budget.note():
        hints.append(budget.note())
    return InfeasibleError(
        f"every role fits on its own, but no co-location fits on {world} devices{pinned}: {reasons}",
        fix="; or ".join(hints) or "add devices, allow offload, or shorten response_len",
    )


def _what_would_fit(g: FlowGraph, ctx: PlanContext, units: list[str], budget: _Budget) -> list[str]:
    hints: list[str] = []
    table = ctx.options
    single = [u for u in units if u in table.units and table.units[u].generates and table.multi_turn(table.units[u])]
    if single:  # more devices cannot help a replica that must fit one device
        return [
            f"{', '.join(single)}: a policy whose weights fit one device, or a device type with more memory "
            "(multi-turn generation runs on single-device replicas)"
        ]
    node = ctx.cluster.devices_per_node
    # more devices of the same type: the smallest multiple of the cluster that fits each failing unit
    largest = 0
    for k in (2, 4, 8, 16, 32, 64):
        if not budget.left():
            break
        bigger = ClusterSpec(device=ctx.cluster.device, nodes=ctx.cluster.nodes * k, devices_per_node=node)
        largest = bigger.world_size
        if all(_fits_alone(g, ctx, u, bigger, ctx.workload) for u in units):
            hints.append(f"each fits alone on {bigger.world_size} devices (--cluster {bigger.nodes}x{node}x{ctx.cluster.device})")
            break
    else:
        hints.append(f"no cluster up to {largest} {ctx.cluster.device} devices fits them")
    if largest:
        budget.tried.append(f"clusters up to {largest} devices")
    # a shorter response
    lo, hi, found = 1, ctx.workload.response_len - 1, None
    while lo <= hi and budget.left():
        mid = (lo + hi) // 2
        w = ctx.workload.model_copy(update={"response_len": mid, "mean_response_len": None})
        if all(_fits_alone(g, ctx, u, ctx.cluster, w) for u in units):
            found, lo = mid, mid + 1
        else:
            hi = mid - 1
    budget.tried.append("shorter responses")
    if found:
        hints.append(f"they fit with response_len <= {found} (--workload response_len={found})")
    # a device with more memory
    bigger_dev = [p for p in profiles().values() if p.kind == "gpu" and p.memory_gb > ctx.cluster.profile.memory_gb]
    for p in sorted(bigger_dev, key=lambda p: p.memory_gb):
        if not budget.left():
            break
        budget.tried.append(p.name)
        other = ClusterSpec(device=p.name, nodes=ctx.cluster.nodes, devices_per_node=node)
        if all(_fits_alone(g, ctx, u, other, ctx.workload) for u in units):
            hints.append(f"they fit on the same number of {p.name} ({p.memory_gb:.0f} GB)")
            break
    # offload, when pins forbade it
    roles = {u.name: u.role for u in ctx.units}
    for u in units:
        for ph in ("train", "forward"):
            pin = ctx.pins.phase(roles[u], ph)
            if pin.offload_optimizer is False or pin.offload_params is False:
                hints.append(f"allow offload for {roles[u]}.{ph} (drop the offload pins)")
    return hints


def _fits_alone(g: FlowGraph, ctx: PlanContext, unit: str, cluster: ClusterSpec, w: WorkloadSpec) -> bool:
    _, _, pools = tables(g, ctx, cluster, w)
    return pools.choice((unit,), cluster.world_size).feasible
