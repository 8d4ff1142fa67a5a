"""One iteration's timeline: list scheduling of the ops over the pools.

Ops of one pool run one after another in graph order; ops on different pools
overlap whenever the data allows. Controller ops (``compute``, ``reward``,
``input``) take no device time; data crossing pools pays its transfer time.
After the last update of a policy its weights move to the generation layout
(``weight_sync``): on the pool itself when co-located, on both pools' links
when not. The step time is when everything, the sync included, is done — the
next iteration's ``generate`` needs the new weights — unless the rollouts may lag the
trainer (staleness K ≥ 1): then it is the pipelined loop's period, one steady-state step
(:func:`steady_order`).

:func:`simulate` works on numpy arrays so the search can evaluate many device
splits at once: every time is an array over candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flowc.ir.graph import FlowGraph
from flowc.ir.ops import MODEL_OPS, Op, weight_sync_id
from flowc.ir.types import nbytes
from flowc.passes.steady_period import SPREAD_POINTS, Variation, varied_period


@dataclass(frozen=True)
class OpSpec:
    """A node as the scheduler sees it."""

    id: str
    pool: int | None  # None: runs on the controller
    deps: tuple[tuple[str, float], ...]  # (producer, bytes moved)
    ahead: bool = False  # a generate: with staleness ≥ 1 issued during an earlier step


@dataclass(frozen=True)
class SyncSpec:
    """``role``'s weight sync after ``after`` (its update), occupying ``pools``."""

    role: str
    after: str
    pools: tuple[int, ...]

    @property
    def id(self) -> str:
        return weight_sync_id(self.role)


def op_specs(g: FlowGraph, unit_of_op: dict[str, str], pool_of_unit: dict[str, int], env: dict[str, int]) -> list[OpSpec]:
    out = []
    for n in g.nodes:
        pool = pool_of_unit[unit_of_op[n.id]] if n.op in MODEL_OPS else None
        deps: dict[str, float] = {}
        for e in g.inputs(n.id):
            deps[e.src] = deps.get(e.src, 0.0) + float(nbytes(e.type, env))
        out.append(OpSpec(n.id, pool, tuple(sorted(deps.items())), n.op == Op.GENERATE))
    return out


def simulate(
    ops: list[OpSpec],
    syncs: list[SyncSpec],
    times: dict[str, np.ndarray],
    sync_times: dict[str, np.ndarray],
    pool_sizes: list[np.ndarray],
    per_device_bw: float,
    controller_bw: float,
    *,
    record: bool = False,
    staleness: int = 0,
    window: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
    variation: Variation | None = None,
) -> tuple[np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]], list[np.ndarray]]:
    """Finish time of the step for every candidate (and, with ``record``,
    start/end of every op and sync of one iteration). ``times`` holds per-op durations;
    ``pool_sizes[i]`` the device count of pool i per candidate. With ``staleness`` K ≥ 1 the
    step time is the pipelined loop's mean period: where one steady-state step ends
    (:func:`steady_order`; ``window``, when given, receives its spans), plus what the step-to-step
    ``variation`` of the generates and of the steps' lengths costs the loop at that K
    (:func:`flowc.passes.steady_period.varied_period`).
    The spans and the pools' busy times are one lock-step iteration's."""
    durations, bw = (times, sync_times), (per_device_bw, controller_bw)
    step, spans, busy = _list_schedule(ops, syncs, durations, pool_sizes, bw, record)
    if staleness <= 0:
        return step, spans, busy
    order, done = steady_order(ops)
    per, win, _ = _list_schedule(order, syncs, durations, pool_sizes, bw, window is not None, done)
    if window is not None:
        window.update(win)
    ahead = [o.id for o in order if o.ahead]
    if variation and ahead:
        mean_gen = sum(times[a] for a in ahead)
        deviation = sum((variation.spread[a] for a in ahead if a in variation.spread), np.zeros((SPREAD_POINTS, len(per))))

        def at(x: float, with_syncs: bool) -> np.ndarray:
            scaled = {**times, **{a: times[a] * x for a in ahead}}
            st = sync_times if with_syncs else {k: v * 0.0 for k, v in sync_times.items()}
            return _list_schedule(order, syncs, (scaled, st), pool_sizes, bw, False, done)[0]

        per = varied_period(at, mean_gen, deviation, variation.cv, staleness, per)
    return per, spans, busy


def steady_order(ops: list[OpSpec]) -> tuple[list[OpSpec], set[str]]:
    """One step of the pipelined loop (staleness K ≥ 1) as the runtime issues it: what the
    generates read (the prompts: ``check_staleness``), then a later step's generates (their pools
    start on them at once), then this step's other ops, whose rollouts were generated during the
    previous step — so the generates are ``done`` for them, ready at the start less their transfer —
    then the weight syncs, on the generation pool after the generate issued before them. The step
    ends when all of it is done (the controller waits for its syncs): the loop's period, at least
    every pool's busy time and at most one lock-step iteration (an op on a pool the generate holds
    waits for it, and so does everything that reads that op)."""
    ahead = [o for o in ops if o.ahead]
    needed: set[str] = set()
    todo = [d for o in ahead for d, _ in o.deps]
    while todo:
        d = todo.pop()
        if d not in needed:
            needed.add(d)
            todo += [x for o in ops if o.id == d for x, _ in o.deps]
    first = [o for o in ops if o.id in needed and not o.ahead]
    return first + ahead + [o for o in ops if not o.ahead and o.id not in needed], {o.id for o in ahead}


def _list_schedule(
    ops: list[OpSpec],
    syncs: list[SyncSpec],
    durations: tuple[dict[str, np.ndarray], dict[str, np.ndarray]],
    pool_sizes: list[np.ndarray],
    bw: tuple[float, float],
    record: bool,
    done: set[str] | None = None,
) -> tuple[np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]], list[np.ndarray]]:
    """List-schedule ``ops`` in the order the controller issues them, then ``syncs``
    (``durations``: the ops' and the syncs' seconds; ``bw``: per-device and controller bytes/s);
    the outputs of ``done`` (ops whose earlier instance produced them) are ready at 0 for their
    consumers, less the transfer. A device op is issued without waiting for it; a controller op
    (``pool`` None: compute, reward) runs in the controller, which issues nothing after it until
    it is done — so it holds back every later op, on any pool (the issue clock)."""
    (times, sync_times), (per_device_bw, controller_bw) = durations, bw
    n = len(next(iter(pool_sizes))) if pool_sizes else 1
    done = done or set()
    free = [np.zeros(n) for _ in pool_sizes]
    busy = [np.zeros(n) for _ in pool_sizes]
    finish: dict[str, np.ndarray] = {}
    spans: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    pool_of = {o.id: o.pool for o in ops}
    issue = np.zeros(n)  # when the controller is free to issue the next op
    for o in ops:
        start = issue
        for src, b in o.deps:
            ready = np.zeros(n) if src in done else finish[src]
            sp, dp = pool_of[src], o.pool
            if b > 0 and sp != dp:
                if sp is None or dp is None:
                    ready = ready + b / controller_bw
                else:
                    ready = ready + b / (np.minimum(pool_sizes[sp], pool_sizes[dp]) * per_device_bw)
            start = np.maximum(start, ready)
        dur = times.get(o.id)
        if o.pool is not None:
            start = np.maximum(start, free[o.pool])
            end = start + dur
            free[o.pool] = end
            busy[o.pool] = busy[o.pool] + dur
        else:
            end = start + (dur if dur is not None else 0.0)
            issue = end
        finish[o.id] = end
        if record:
            spans[o.id] = (start, end)
    step = np.max(np.stack(list(finish.values())), axis=0) if finish else np.zeros(n)
    for s in syncs:
        start = np.maximum(finish[s.after], issue)
        for p in s.pools:
            start = np.maximum(start, free[p])
        end = start + sync_times[s.id]
        for p in s.pools:
            free[p] = end
            busy[p] = busy[p] + sync_times[s.id]
        step = np.maximum(step, end)
        if record:
            spans[s.id] = (start, end)
    return step, spans, busy
