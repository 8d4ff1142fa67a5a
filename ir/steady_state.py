"""The steady state of a plan over consecutive steps, as the runtime runs it: what the plan's
text and diagrams draw for a pipelined loop (staleness K ≥ 1), where one step's generates
overlap the previous step's training."""

from __future__ import annotations

from dataclasses import dataclass

from flowc.ir.plan import Plan, ScheduleEntry


@dataclass(frozen=True)
class Span:
    """One bar of the placement diagram: ``entry`` of the plan's schedule run by ``step`` (0: the
    first drawn step; a generate run ahead belongs to a later step) from ``start_s`` to ``end_s``."""

    entry: ScheduleEntry
    step: int
    start_s: float
    end_s: float


def pipelined_spans(plan: Plan, windows: int = 2) -> list[Span]:
    """The steady state of a pipelined plan (staleness K ≥ 1) over ``windows`` consecutive steps,
    as the runtime runs it and the period prices it: step ``j`` starts at ``j × period``; its
    generate ops belong to step ``j + 1`` (issued ahead, first on their pool) and the rest of step
    ``j`` — every op after its rollouts, and the weight syncs — keeps its place in the lock-step
    schedule relative to the rollouts being ready, pushed back on a pool the generate still holds.
    Each window fits in its period (the period is at least each pool's busy time and the rest of
    the iteration). A lock-step plan: its schedule, one step per window, one after the other."""
    period = plan.predicted.step_time_s
    entries = [e for e in plan.schedule if e.end_s > e.start_s or e.pool]
    if not plan.staleness:
        return [Span(e, j, j * period + e.start_s, j * period + e.end_s) for j in range(windows) for e in entries]
    ahead = [e for e in entries if e.phase == "generate"]
    ready = max((e.end_s for e in ahead), default=0.0)
    rest = sorted((e for e in entries if e not in ahead), key=lambda e: e.start_s)
    out: list[Span] = []
    for j in range(windows):
        t0 = j * period
        free: dict[str | None, float] = {}
        for e in ahead:
            out.append(Span(e, j + 1, t0 + e.start_s, t0 + e.end_s))
            free[e.pool] = max(free.get(e.pool, t0), t0 + e.end_s)
        for e in rest:
            start = t0 + max(e.start_s - ready, 0.0)
            if e.pool is not None:
                start = max(start, free.get(e.pool, t0))
            end = start + (e.end_s - e.start_s)
            if e.pool is not None:
                free[e.pool] = end
            out.append(Span(e, j, start, end))
    return out


__all__ = ["Span", "pipelined_spans"]
