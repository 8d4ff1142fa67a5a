"""The options of a placement unit at one device count, and their Pareto front.

An option is one way to run a unit (its layouts per phase, their costs, its memory); the front is
what the search combines: the options not beaten on all of time, resident and transient memory,
cut to :data:`FRONT_LIMIT` (:func:`pareto`) so that the product over a pool's units stays small.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from flowc.ir.plan import Layout
from flowc.passes.costs import PhaseCost

FRONT_LIMIT = 8


@dataclass(frozen=True)
class UnitOption:
    """One way to run a unit on ``devices`` devices."""

    unit: str
    devices: int
    layouts: dict[str, Layout]  # phase → layout
    op_costs: dict[str, PhaseCost]  # node id → cost
    resident_gb: float
    transient_gb: float  # peak over the unit's phases, on top of the resident state
    time: float
    fits_alone: bool = True
    need_gb: float = 0.0
    host_gb: float = 0.0  # state offloaded to host memory, per device

    @property
    def op_times(self) -> dict[str, float]:
        return {k: v.time for k, v in self.op_costs.items()}


@dataclass
class UnitOptions:
    front: list[UnitOption]
    oom: UnitOption | None = None  # when nothing fits: the nearest miss


def pareto(options: list[UnitOption], limit: int = FRONT_LIMIT) -> list[UnitOption]:
    """Options not beaten on all of (time, resident, transient), fastest first; at most ``limit``
    of them (:func:`_budget_spread` chooses which)."""
    ordered = sorted(options, key=lambda o: (o.time, o.resident_gb, o.transient_gb))
    front: list[UnitOption] = []
    for o in ordered:
        if all(o.resident_gb < f.resident_gb - 1e-9 or o.transient_gb < f.transient_gb - 1e-9 for f in front):
            front.append(o)
    if len(front) > limit:
        front = _budget_spread(front, limit)
    return front


def _budget_spread(front: list[UnitOption], limit: int) -> list[UnitOption]:
    """``limit`` options of a front (fastest first) for the search to combine: the fastest, the
    leanest in resident and in transient memory, then, in turn, the fastest option within a
    memory budget (budgets spread evenly, geometrically, from the leanest total to the
    fastest's: what a pool that shares its devices can afford is a memory budget) and an option
    of an even spread along the front (the trade-offs between resident and transient memory
    that one total does not see)."""
    n = len(front)
    total = [o.resident_gb + o.transient_gb for o in front]
    keep = {0, min(range(n), key=lambda i: (front[i].resident_gb, front[i].time))}
    keep.add(min(range(n), key=lambda i: (front[i].transient_gb, front[i].time)))
    lo, hi = max(min(total), 1e-9), max(total[0], min(total), 1e-9)
    levels = max((limit - len(keep) + 1) // 2, 1)
    budgets = [lo * (hi / lo) ** (j / (levels + 1)) for j in range(1, levels + 1)]
    by_budget = [next(i for i, t in enumerate(total) if t <= b * (1 + 1e-9)) for b in budgets]
    spread = [round(i * (n - 1) / (limit - 1)) for i in range(1, limit - 1)]
    for i in (x for pair in itertools.zip_longest(by_budget, spread) for x in pair if x is not None):
        if len(keep) >= limit:
            break
        keep.add(i)
    return [front[i] for i in sorted(keep)[:limit]]
