"""The pass manager: runs a flat, named list of passes over a typed context.

One signature: ``pass(graph, ctx) -> graph``. Every pass declares the fields
of :class:`PlanContext` it ``reads`` and the ones it ``writes``; analyses
write their results there (and ``node.meta``), decisions record theirs, and
a pass may return a rewritten graph. The manager checks the declarations
before anything runs (every read is an input or written by an earlier pass,
every field is written by one pass only), checks at run time that each pass
found what it reads and left what it writes, times every pass, wraps an
unexpected failure with the passes that ran, and — with ``verify_each`` —
re-verifies the graph (and the plan, once there is one) after every pass.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from flowc.errors import FlowcError, PlanError
from flowc.ir.cluster import ClusterSpec
from flowc.ir.graph import FlowGraph
from flowc.ir.models import ModelSpec
from flowc.ir.plan import Plan, ReshardPlan, Target
from flowc.ir.plan_verify import verify_plan
from flowc.ir.verify import verify
from flowc.ir.workload import WorkloadSpec
from flowc.passes.pins import Pins

if TYPE_CHECKING:
    from flowc.passes.build import Placement
    from flowc.passes.costs import Hw
    from flowc.passes.flops import Demand
    from flowc.passes.options import OptionTable
    from flowc.passes.pools import PoolTable
    from flowc.passes.schedule import OpSpec
    from flowc.passes.search import SearchResult
    from flowc.passes.units import Unit


@dataclass
class PlanContext:
    """What the passes read and write.

    The inputs (``models`` … ``target``) are set by :func:`make_plan`; every
    other field starts as None and is written by exactly one pass, named in
    its comment.
    """

    # inputs
    models: dict[str, ModelSpec]
    cluster: ClusterSpec
    workload: WorkloadSpec
    pins: Pins
    target: Target
    # analyses
    env: dict[str, int] | None = None  # annotate_bytes: the workload's symbols (B, P, R, n, …)
    demands: dict[str, Demand] | None = None  # annotate_flops: the work of every model op
    units: list[Unit] | None = None  # placement_units
    unit_of_op: dict[str, str] | None = None  # placement_units
    hw: Hw | None = None  # cost_tables: the achieved rates of one device
    options: OptionTable | None = None  # cost_tables: layouts of every unit at every size
    pools: PoolTable | None = None  # cost_tables: the best options of every set of units at every size
    ops: list[OpSpec] | None = None  # cost_tables: the nodes as the scheduler sees them
    # decisions
    search: SearchResult | None = None  # search: the ranked co-locations and splits
    placement: Placement | None = None  # place: the winner's devices
    reshards: list[ReshardPlan] | None = None  # plan_reshards: one per weight edge
    planned: FlowGraph | None = None  # insert_weight_sync: the graph with its weight_sync nodes
    plan: Plan | None = None  # assemble_plan
    # bookkeeping
    timings: dict[str, float] = field(default_factory=dict)
    verify_each: bool = False


INPUTS: frozenset[str] = frozenset({"models", "cluster", "workload", "pins", "target"})
_WRITABLE: frozenset[str] = frozenset(f.name for f in dataclasses.fields(PlanContext)) - INPUTS - {"timings", "verify_each"}

Stage = Literal["traced", "planned"]


@dataclass(frozen=True)
class Pass:
    """A named pass and its contract: the context fields it reads and writes, and
    the stage of the graph it returns (``planned`` once ``weight_sync`` nodes exist)."""

    name: str
    run: Callable[[FlowGraph, PlanContext], FlowGraph]
    reads: tuple[str, ...] = ()
    writes: tuple[str, ...] = ()
    stage: Stage = "traced"


def default_verify_each() -> bool:
    """Verify after every pass when ``FLOWC_VERIFY_EACH=1`` (the test suite sets it)."""
    return os.environ.get("FLOWC_VERIFY_EACH", "") == "1"


class PassManager:
    """Runs passes in order, holding each to its declared reads and writes."""

    def __init__(self, passes: list[Pass]) -> None:
        self.passes = passes
        written: dict[str, str] = {}
        for p in passes:
            for r in p.reads:
                if r not in INPUTS and r not in written:
                    makers = [q.name for q in passes if r in q.writes]
                    after = f" (written by {', '.join(makers)}, which runs later)" if makers else ""
                    raise PlanError(f"pass {p.name!r} reads ctx.{r}, which no earlier pass writes{after}")
            for w in p.writes:
                if w not in _WRITABLE:
                    raise PlanError(f"pass {p.name!r} writes ctx.{w}, which is not a field the passes write")
                if w in written:
                    raise PlanError(f"passes {written[w]!r} and {p.name!r} both write ctx.{w}")
                written[w] = p.name

    def run(self, g: FlowGraph, ctx: PlanContext) -> FlowGraph:
        history: list[str] = []
        for p in self.passes:
            missing = [r for r in p.reads if getattr(ctx, r) is None]
            if missing:
                raise PlanError(f"pass {p.name!r} needs ctx.{', ctx.'.join(missing)}, which is not set (after: {_ran(history)})")
            t0 = time.perf_counter()
            try:
                g = p.run(g, ctx)
            except FlowcError:
                raise
            except Exception as e:
                raise PlanError(f"pass {p.name!r} failed: {type(e).__name__}: {e} (after: {_ran(history)})") from e
            ctx.timings[p.name] = time.perf_counter() - t0
            history.append(p.name)
            unset = [w for w in p.writes if getattr(ctx, w) is None]
            if unset:
                raise PlanError(f"pass {p.name!r} did not write ctx.{', ctx.'.join(unset)}, which it declares")
            if ctx.verify_each:
                verify(g, p.stage)
                if ctx.plan is not None:
                    verify_plan(ctx.plan)
        return g


def _ran(history: list[str]) -> str:
    return " → ".join(history) or "(none)"
