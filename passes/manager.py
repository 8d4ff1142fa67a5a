"""The pass manager: runs a flat, named list of passes over a context.

One signature: ``pass(graph, ctx) -> graph``. Analyses write ``node.meta``
and ``ctx.state``; decisions record their results in ``ctx.state`` (the plan
is assembled from it) and may return a rewritten graph. The manager times
every pass and wraps an unexpected failure with the list of passes that ran.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flowc.errors import FlowcError, PlanError
from flowc.ir.cluster import ClusterSpec
from flowc.ir.graph import FlowGraph
from flowc.ir.models import ModelSpec
from flowc.ir.verify import verify
from flowc.ir.workload import WorkloadSpec
from flowc.passes.pins import Pins


@dataclass
class PlanContext:
    """What the passes read (the inputs) and write (``state``)."""

    models: dict[str, ModelSpec]
    cluster: ClusterSpec
    workload: WorkloadSpec
    pins: Pins = field(default_factory=Pins)
    state: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    verify_each: bool = False


Pass = Callable[[FlowGraph, PlanContext], FlowGraph]


class PassManager:
    """Runs passes in order; ``verify_each`` re-checks the IR after each."""

    def __init__(self, passes: list[tuple[str, Pass]]) -> None:
        self.passes = passes

    def run(self, g: FlowGraph, ctx: PlanContext) -> FlowGraph:
        history: list[str] = []
        for name, fn in self.passes:
            t0 = time.perf_counter()
            try:
                g = fn(g, ctx)
            except FlowcError:
                raise
            except Exception as e:
                ran = " → ".join(history) or "(none)"
                raise PlanError(f"pass {name!r} failed: {type(e).__name__}: {e} (after: {ran})") from e
            ctx.timings[name] = time.perf_counter() - t0
            history.append(name)
            if ctx.verify_each:
                verify(g, "planned" if ctx.state.get("planned") else "traced")
        return g
