"""The pass manager holds every pass to its declared contract: what it reads of
the context is an input or was written by an earlier pass, what it writes it
writes, no two passes write one field, and with ``verify_each`` (on for the
whole test suite, ``FLOWC_VERIFY_EACH=1``) the graph and the plan are
re-verified after every pass."""

from __future__ import annotations

import dataclasses
import os

import pytest
from helpers import EXAMPLES

from flowc.errors import InfeasibleError, PlanError, VerificationError
from flowc.ir.cluster import ClusterSpec
from flowc.ir.graph import Node, ValueRef
from flowc.ir.models import ModelSpec
from flowc.ir.plan import Target
from flowc.ir.types import WeightsType
from flowc.ir.workload import WorkloadSpec
from flowc.loader import load_flow
from flowc.passes.manager import INPUTS, Pass, PassManager, PlanContext
from flowc.passes.pins import PhasePin, Pins
from flowc.passes.pipeline import PIPELINE, make_plan


def ctx() -> PlanContext:
    cl = ClusterSpec.parse("1x8xH100")
    m = ModelSpec.resolve("qwen2.5-7b")
    return PlanContext(models={"actor": m, "ref": m}, cluster=cl, workload=WorkloadSpec(), pins=Pins(), target=Target.of(cl))


def grpo():
    return load_flow(str(EXAMPLES / "grpo.py")).trace()


def test_the_suite_verifies_after_every_pass():
    assert os.environ.get("FLOWC_VERIFY_EACH") == "1"
    _, _, c = make_plan(grpo(), ctx().models, ctx().cluster, WorkloadSpec())
    assert c.verify_each and list(c.timings) == [p.name for p in PIPELINE]


def test_contracts_are_checked_before_anything_runs():
    noop = lambda g, c: g  # noqa: E731
    with pytest.raises(PlanError, match=r"'b' reads ctx.units, which no earlier pass writes \(written by a, which runs later\)"):
        PassManager([Pass("b", noop, reads=("units",)), Pass("a", noop, writes=("units",))])
    with pytest.raises(PlanError, match=r"both write ctx\.hw"):
        PassManager([Pass("a", noop, writes=("hw",)), Pass("b", noop, writes=("hw",))])
    with pytest.raises(PlanError, match=r"writes ctx\.cluster, which is not a field the passes write"):
        PassManager([Pass("a", noop, writes=("cluster",))])


def test_a_pass_must_write_what_it_declares():
    with pytest.raises(PlanError, match=r"did not write ctx\.units"):
        PassManager([Pass("lazy", lambda g, c: g, writes=("units",))]).run(grpo(), ctx())


def test_verify_each_catches_a_pass_that_breaks_the_ir():
    def premature_sync(g, c):  # a weight_sync before planning breaks the traced stage's invariants
        n = Node(
            "actor.weight_sync",
            "weight_sync",
            "actor",
            WeightsType(role="actor"),
            args=(ValueRef("actor.update"),),
            kwargs={"method": "p2p"},
        )
        return g.with_nodes([*g.nodes, n])

    c = ctx()
    c.verify_each = True
    with pytest.raises(VerificationError, match="weight_sync nodes appear only after planning"):
        PassManager([Pass("premature", premature_sync)]).run(grpo(), c)


class Recording(PlanContext):
    """A context that notes which of its fields each pass touches."""

    current: str | None = None
    touched: dict[str, set[str]] = {}  # noqa: RUF012 - replaced per instance

    def __getattribute__(self, name: str):
        cur = object.__getattribute__(self, "current")
        if cur is not None and name in {f.name for f in dataclasses.fields(PlanContext)}:
            object.__getattribute__(self, "touched").setdefault(cur, set()).add(name)
        return object.__getattribute__(self, name)


@pytest.mark.parametrize(
    "pins,cluster",
    [
        (Pins(), "1x8xH100"),
        (Pins(colocate=[["actor.train", "ref"], ["actor.gen"]], whole_tensor_sync=True), "2x8xH100"),
        (Pins(roles={"actor": {"train": PhasePin(tp=3)}}), "1x8xH100"),  # no layout has tp=3: the diagnosis runs
    ],
    ids=["colocated", "separate-pools", "infeasible"],
)
def test_every_pass_reads_only_what_it_declares(pins, cluster):
    """Run the real pipeline with each pass's context accesses recorded: a pass may touch its
    declared reads and writes (and the bookkeeping), nothing else."""
    base = dataclasses.replace(ctx(), pins=pins, cluster=ClusterSpec.parse(cluster))
    rec = Recording(**{f.name: getattr(base, f.name) for f in dataclasses.fields(PlanContext)})
    rec.touched = {}

    def traced(p: Pass) -> Pass:
        def run(g, c):
            c.current = p.name
            try:
                return p.run(g, c)
            finally:
                c.current = None

        return dataclasses.replace(p, run=run)

    infeasible = any(pin.tp == 3 for phases in pins.roles.values() for pin in phases.values())
    try:
        PassManager([traced(p) for p in PIPELINE]).run(grpo(), rec)
        assert not infeasible
    except InfeasibleError:
        assert infeasible
    for p in PIPELINE:
        extra = rec.touched.get(p.name, set()) - set(p.reads) - set(p.writes) - {"timings", "verify_each"}
        assert not extra, f"pass {p.name} touches ctx.{', ctx.'.join(sorted(extra))} without declaring it"
    assert {r for p in PIPELINE for r in p.reads} & INPUTS == INPUTS  # every input is read by some pass
