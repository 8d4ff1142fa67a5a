"""The steady state of a plan over consecutive steps, as the runtime runs it: what the plan's
text and diagrams draw for a pipelined loop (staleness K ≥ 1), where one step's generates
overlap the previous step's training."""

from __future__ import annotations

from dataclasses import dataclass

from flowc.errors import SpecError
from flowc.ir.plan import Plan, ScheduleEntry


@dataclass(frozen=True)
class Span:
    """One bar of the placement diagram: ``entry`` of the plan's schedule run by ``step`` (0: the
    first drawn step; a generate run ahead belongs to a later step) from ``start_s`` to ``end_s``."""

    entry: ScheduleEntry
    step: int
    start_s: float
    end_s: float


def drawn_period(plan: Plan) -> float:
    """The period the steady state is drawn with: a pipelined plan's step at the mean lengths
    (``predicted.steady_step_s``; its mean period adds what the variation of generation costs),
    else the predicted step."""
    p = plan.predicted
    return p.steady_step_s if plan.staleness and p.steady_step_s is not None else p.step_time_s


def pipelined_spans(plan: Plan, windows: int = 2) -> list[Span]:
    """``windows`` consecutive steps of ``plan`` as the runtime runs them: step ``j`` starts at
    ``j ×`` :func:`drawn_period`. A pipelined plan (staleness K) repeats its steady-state step
    (``plan.steady_state``: the planner's simulation of one step, from the search's own
    scheduler), whose generates sample step ``j + K``'s rollouts while step ``j`` trains; a
    lock-step plan its one-iteration schedule."""
    period = drawn_period(plan)
    steady = plan.staleness > 0
    if steady and not plan.steady_state:
        raise SpecError(
            f"this plan runs {plan.staleness} weight version(s) ahead but records no steady state (an earlier flowc made it)",
            fix="plan the flow again with this flowc",
        )
    entries = [e for e in (plan.steady_state if steady else plan.schedule) if e.end_s > e.start_s or e.pool]
    return [
        Span(e, j + (plan.staleness if steady and e.phase == "generate" else 0), j * period + e.start_s, j * period + e.end_s)
        for j in range(windows)
        for e in entries
    ]


__all__ = ["Span", "drawn_period", "pipelined_spans"]
