"""The best way to run a set of co-located units on one pool of devices.

Units that share a pool share device memory: every unit's resident state
(weights, gradients and optimizer states not offloaded) stays while the
others run, and each phase's transient memory (activations, the KV cache)
comes on top. Generation takes what is left for its KV cache, and runs in
waves when that is too little. A co-located policy's weights move from the
training to the generation layout on the pool's own links.

For a set of units and a device count, :class:`PoolTable` picks one option per
unit (from each unit's Pareto front) and one generation layout and reshard
method per generating unit, minimising the pool's busy time subject to memory.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from functools import cache

import numpy as np

from flowc.ir.models import ModelSpec
from flowc.ir.plan import Layout
from flowc.passes.costs import GB, PhaseCost
from flowc.passes.degrees import tp_refusal
from flowc.passes.fronts import UnitOption
from flowc.passes.generation_costs import generate_cost, generation_weights_gb, takes_device_share
from flowc.passes.options import OptionTable
from flowc.passes.reshard import ReshardCost, sync_cost

MAX_COMBOS_KEPT = 12


#: the range a planned ``gpu_memory_utilization`` is kept in (vLLM takes a share in (0, 1] and
#: needs some of the device for itself: an engine is never planned more than the upper bound)
MIN_UTILIZATION, MAX_UTILIZATION = 0.05, 0.95


@dataclass(frozen=True)
class GenChoice:
    unit: str
    layout: Layout
    op_costs: dict[str, PhaseCost]
    reshard: ReshardCost | None  # when the policy trains on the same pool
    weights_gb: float  # generation weights held beyond the training state
    free_gb: float
    swapped: bool = False  # co-located resident state moved to host memory while generating
    swap_s: float = 0.0  # time of that round trip (inside the first generate op)
    shard_gb: float = 0.0  # the engine's whole weight shard (what it reads, held or shared)
    pinned_utilization: float | None = None  # the pinned share of each device the engine may take


@dataclass(frozen=True)
class PoolChoice:
    """The chosen options of one set of units on ``devices`` devices."""

    units: tuple[str, ...]
    devices: int
    options: dict[str, UnitOption]
    gens: dict[str, GenChoice]
    op_times: dict[str, float]
    sync_time: float
    busy: float
    resident_gb: float
    feasible: bool = True
    reason: str = ""
    alternatives: list[tuple[str, float]] = field(default_factory=list)  # (description, busy) of runners-up


class PoolTable:
    """Memoised :class:`PoolChoice` per (units, devices)."""

    def __init__(self, table: OptionTable) -> None:
        self.t = table
        self.cap = table.capacity_gb
        self._generated: dict[tuple[str, Layout, float], PhaseCost | None] = {}

    @cache  # noqa: B019 - lives for one planning run
    def choice(self, units: tuple[str, ...], d: int) -> PoolChoice:
        t = self.t
        plain = [u for u in units if not t.units[u].generates]
        gens = [u for u in units if t.units[u].generates]
        fronts: list[list[UnitOption]] = []
        for u in plain:
            opts = t.options(u, d)
            if not opts.front:
                if opts.oom:
                    why = _oom_text(opts.oom, self.cap, t.hw.host_per_device_gb)
                else:
                    role = t.units[u].role
                    pinned = {**t.pins.phase(role, "train").layout_fields(), **t.pins.phase(role, "forward").layout_fields()}
                    why = (
                        f"no layout with {', '.join(f'{k}={v}' for k, v in pinned.items())} on {d} devices"
                        if pinned
                        else "no layout"
                    )
                    if "tp" in pinned and (bad := tp_refusal(t.models[role], d, int(pinned["tp"]), t.hw)):
                        why += f": {bad}"
                return _infeasible(units, d, f"{u} does not fit on {d} devices: {why}")
            fronts.append(opts.front)
        gen_layouts = {g: t.generation_layouts(t.units[g], d) for g in gens}
        for g, lays in gen_layouts.items():
            if not lays:
                role = t.units[g].role
                gpin = t.pins.phase(role, "generate")
                pinned = gpin.layout_fields()
                if gpin.gpu_memory_utilization is not None:
                    pinned["gpu_memory_utilization"] = gpin.gpu_memory_utilization
                if pinned:
                    shown = ", ".join(f"{k}={v}" for k, v in pinned.items())
                    why = f"{g}: no generation layout with {shown} on {d} devices: {t.generation_refusal(t.units[g], d)}"
                    return _infeasible(units, d, why)
                m = t.models[role]
                if t.multi_turn(t.units[g]):
                    need = generation_weights_gb(m, Layout(tp=1, backend="vllm"))
                    why = (
                        f"{g}: a multi-turn generate runs on single-device replicas (each rank of a wider replica would run "
                        f"environments of its own), and {m.name}'s weights need {need:.1f} GB of a device's {self.cap:.1f} GB"
                    )
                    return _infeasible(units, d, why)
                need = generation_weights_gb(m, Layout(tp=min(d, t.hw.node), backend="vllm"))
                why = (
                    f"{g}: the weights need {need:.1f} GB per device even at the widest tensor parallelism, of {self.cap:.1f} GB"
                )
                return _infeasible(units, d, why)
        # vectorised product of the fronts: resident sums, busy sums, transient checks
        sizes = [len(f) for f in fronts]
        combos = list(itertools.product(*[range(s) for s in sizes])) if fronts else [()]
        idx_arr = np.array(combos, dtype=int).reshape(len(combos), len(fronts))

        def column(attr: str) -> np.ndarray:
            if not fronts:
                return np.zeros((1, 0))
            return np.stack([np.array([getattr(o, attr) for o in f])[idx_arr[:, i]] for i, f in enumerate(fronts)], axis=1)

        res, tim, tra, host = column("resident_gb"), column("time"), column("transient_gb"), column("host_gb")
        res_sum = res.sum(1)
        ok = np.all(res_sum[:, None] + tra <= self.cap, axis=1) if fronts else np.ones(1, bool)
        ok &= host.sum(1) <= t.hw.host_per_device_gb + 1e-9  # offloaded states share the node's host memory
        if not ok.any():
            dev_need = (res_sum[:, None] + tra).max(1)
            host_need = host.sum(1)
            host_cap = t.hw.host_per_device_gb
            over = np.maximum(dev_need - self.cap, host_need - host_cap)
            k = int(np.argmin(over))
            names = " + ".join(plain)
            if dev_need[k] > self.cap:
                why = f"needs {dev_need[k]:.1f} GB of {self.cap:.1f} GB per device"
            else:
                why = f"their offloaded states need {host_need[k]:.1f} GB of host memory per device, of {host_cap:.1f} GB"
            return _infeasible(units, d, f"{names} do not fit together on {d} devices: {why}")
        idx = np.nonzero(ok)[0]
        # only combos on the (busy, resident) Pareto front can win once generation needs memory
        order = idx[np.lexsort((res_sum[idx], tim[idx].sum(1)))]
        kept: list[int] = []
        best_res = np.inf
        for i in order:
            if res_sum[i] < best_res - 1e-9:
                kept.append(int(i))
                best_res = res_sum[i]
            if len(kept) >= MAX_COMBOS_KEPT:
                break
        results: list[PoolChoice] = []
        for ci in kept:
            chosen = {plain[i]: fronts[i][combos[ci][i]] for i in range(len(plain))}
            pc = self._with_generation(units, d, chosen, gens, gen_layouts, float(res_sum[ci]))
            if pc is not None:
                results.extend(pc)
        if not results:
            why = f"no memory left for the KV cache of {', '.join(gens)} on {d} devices"
            for g in gens:
                util = t.pins.phase(t.units[g].role, "generate").gpu_memory_utilization
                if util is not None:
                    why += (
                        f" ({g}: the pinned gpu_memory_utilization={util:g} gives its engine {util * self.cap:.1f} GB"
                        f" of {self.cap:.1f} GB per device, for its weights, buffers and at least one sequence's cache,"
                        " beside the co-located state unless that sleeps in host memory)"
                    )
            return _infeasible(units, d, why)
        results.sort(key=lambda p: (p.busy, p.resident_gb))
        top = results[0]
        alts = [(_describe(p), p.busy) for p in results[1:6]]
        return PoolChoice(
            top.units, d, top.options, top.gens, top.op_times, top.sync_time, top.busy, top.resident_gb, True, "", alts
        )

    def _generate_cost(self, op: str, m: ModelSpec, lay: Layout, free_gb: float) -> PhaseCost | None:
        """:func:`generate_cost` of ``op``, memoised: the co-location combinations a pool tries
        leave the same device memory free again and again (at 128 GPUs, 42k calls held 5.6k
        distinct ones)."""
        key = (op, lay, free_gb)
        if key not in self._generated:
            self._generated[key] = generate_cost(m, lay, self.t.demand[op], self.t.hw, free_gb=free_gb)
        return self._generated[key]

    def _with_generation(self, units, d, chosen, gens, gen_layouts, resident) -> list[PoolChoice] | None:
        t = self.t
        op_times = {op: c.time for o in chosen.values() for op, c in o.op_costs.items()}
        if not gens:
            return [PoolChoice(units, d, chosen, {}, op_times, 0.0, sum(op_times.values()), resident)]
        out: list[PoolChoice] = []
        per_gen: list[list[GenChoice]] = []
        for g in gens:
            u = t.units[g]
            m = t.models[u.role]
            train_unit = next((o for o in chosen.values() if t.units[o.unit].role == u.role and "train" in o.layouts), None)
            pinned = t.pins.reshard.get(u.role)
            options: list[GenChoice] = []
            for lay in gen_layouts[g]:
                if train_unit is not None:
                    rs = sync_cost(
                        m,
                        train_unit.layouts["train"],
                        lay,
                        t.hw,
                        colocated=True,
                        whole_tensor=t.pins.whole_tensor_sync,
                        method=pinned,
                    )
                    if rs is None:
                        continue
                    extra = rs.extra_memory_gb
                else:
                    rs = None
                    extra = generation_weights_gb(m, lay)
                host_used = sum(o.host_gb for o in chosen.values())
                util = t.pins.phase(u.role, "generate").gpu_memory_utilization
                swap_ok = t.pins.sleep_colocated and resident > 0 and host_used + resident <= t.hw.host_per_device_gb + 1e-9
                shard = generation_weights_gb(m, lay)
                for swapped in (False, True) if swap_ok else (False,):
                    # with room in host memory, the co-located state can sleep there while the engine generates;
                    # a sleeping state cannot lend the engine its weights: the engine keeps a copy of its whole
                    # shard on the device (taken before the state sleeps)
                    held = max(shard, extra) if swapped else extra
                    free = self.cap - held - (0.0 if swapped else resident)
                    share = util if util is not None else MAX_UTILIZATION if takes_device_share(lay.backend, t.hw.kind) else None
                    if share is not None:  # the engine's weights, cache and buffers within its share of the device
                        free = min(free, share * self.cap - shard)
                    if util is not None and not swapped and util * self.cap > self.cap - resident - (held - shard) + 1e-9:
                        continue  # vLLM takes its whole pinned share: it must fit beside the state that stays
                    copy_s = (held - extra) * GB / t.hw.hbm if swapped else 0.0
                    swap_s = 2.0 * resident * GB / t.hw.host + copy_s if swapped else 0.0
                    costs: dict[str, PhaseCost] = {}
                    for i, op in enumerate(u.ops):
                        c = self._generate_cost(op, m, lay, free)
                        if c is None:
                            break
                        if i == 0 and swapped:
                            c = replace(c, time=c.time + swap_s, detail={**c.detail, "swap": swap_s})
                        costs[op] = c
                    if len(costs) == len(u.ops):
                        options.append(GenChoice(g, lay, costs, rs, held, free, swapped, swap_s, shard, util))
            if not options:
                return None
            options.sort(key=lambda c: sum(x.time for x in c.op_costs.values()) + (c.reshard.time if c.reshard else 0.0))
            per_gen.append(options[:4])
        for combo in itertools.product(*per_gen):
            times = dict(op_times)
            for c in combo:
                times.update({op: x.time for op, x in c.op_costs.items()})
            sync = sum(c.reshard.time for c in combo if c.reshard is not None)
            gmap = {c.unit: c for c in combo}
            # the engines' extra weights exist only while generating (they sleep through the other phases)
            out.append(PoolChoice(units, d, chosen, gmap, times, sync, sum(times.values()) + sync, resident))
        return out


def _infeasible(units: tuple[str, ...], d: int, reason: str) -> PoolChoice:
    return PoolChoice(units, d, {}, {}, {}, 0.0, float("inf"), 0.0, False, reason)


def _oom_text(o: UnitOption, cap: float, host_cap: float) -> str:
    lay = o.layouts.get("train") or o.layouts.get("forward")
    shown = f"{lay.short()} {lay.micro_label}" if lay else "?"
    if o.need_gb > cap:
        return f"needs {o.need_gb:.1f} GB of {cap:.1f} GB per device with its leanest layout ({shown})"
    return f"its leanest layout ({shown}) offloads {o.host_gb:.1f} GB per device to host memory, of {host_cap:.1f} GB"


def _describe(p: PoolChoice) -> str:
    parts = []
    for u, o in p.options.items():
        lay = o.layouts.get("train") or o.layouts.get("forward")
        parts.append(f"{u} {lay.short()}")
    for u, g in p.gens.items():
        rs = f", {g.reshard.method}" if g.reshard else ""
        parts.append(f"{u} {g.layout.short()}{rs}")
    return "; ".join(parts)
