"""One iteration's timeline: list scheduling of the ops over the pools.

Ops of one pool run one after another in graph order; ops on different pools
overlap whenever the data allows. Controller ops (``compute``, ``reward``,
``input``) take no device time; data crossing pools pays its transfer time.
After the last update of a policy its weights move to the generation layout
(``weight_sync``): on the pool itself when co-located, on both pools' links
when not. The step time is when everything, the sync included, is done — the
next iteration's ``generate`` needs the new weights — unless the rollouts may lag the
trainer (staleness K ≥ 1): then it is the pipelined loop's period (:func:`period`).

:func:`simulate` works on numpy arrays so the search can evaluate many device
splits at once: every time is an array over candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flowc.ir.graph import FlowGraph
from flowc.ir.ops import MODEL_OPS, Op, weight_sync_id
from flowc.ir.types import nbytes


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
) -> tuple[np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]], list[np.ndarray]]:
    """Finish time of the step for every candidate (and, with ``record``,
    start/end of every op and sync). ``times`` holds per-op durations;
    ``pool_sizes[i]`` the device count of pool i per candidate. With ``staleness`` K ≥ 1 the
    step time is the pipelined loop's period (:func:`period`), the spans one iteration's."""
    n = len(next(iter(pool_sizes))) if pool_sizes else 1
    free = [np.zeros(n) for _ in pool_sizes]
    busy = [np.zeros(n) for _ in pool_sizes]
    rollouts = np.zeros(n)  # when the iteration's generates are done
    finish: dict[str, np.ndarray] = {}
    spans: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    pool_of = {o.id: o.pool for o in ops}
    for o in ops:
        start = np.zeros(n)
        for src, b in o.deps:
            ready = finish[src]
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
        finish[o.id] = end
        if o.ahead:
            rollouts = np.maximum(rollouts, end)
        if record:
            spans[o.id] = (start, end)
    step = np.max(np.stack(list(finish.values())), axis=0) if finish else np.zeros(n)
    for s in syncs:
        start = finish[s.after]
        for p in s.pools:
            start = np.maximum(start, free[p])
        end = start + sync_times[s.id]
        for p in s.pools:
            free[p] = end
            busy[p] = busy[p] + sync_times[s.id]
        step = np.maximum(step, end)
        if record:
            spans[s.id] = (start, end)
    return period(step, busy, staleness, rollouts), spans, busy


def period(iteration: np.ndarray, busy: list[np.ndarray], staleness: int, rollouts: np.ndarray | float = 0.0) -> np.ndarray:
    """The steady-state time per step of a loop whose rollouts may lag the trainer by ``staleness``
    (K ≥ 1) weight versions, as the runtime runs it: during step s the rollout engine generates a
    later step's rollouts while the rest of step s — everything after its rollouts are ready, at
    ``rollouts`` into the iteration — runs, and the step ends when both are done (the controller
    waits for step s's weight sync, which the engine runs after the generates issued before it).
    So a step takes the longer of the rest of the iteration (``iteration − rollouts``) and the
    busiest pool's ops and syncs of one step. That holds for every K ≥ 1: one later generate
    overlaps each step, a larger K only makes the samples older (and absorbs step-to-step
    variance, which this model does not price). Lock-step (K = 0) is the iteration itself;
    co-located on one pool, the busiest pool is the whole iteration: no gain."""
    if staleness <= 0:
        return iteration
    out = iteration - rollouts
    for b in busy:
        out = np.maximum(out, b)
    return out
