"""Re-planning when the measured response lengths drift from the plan's (``replan_every``, opt-in).

A plan is priced for the workload's response lengths; RL changes them as it trains (responses
often grow severalfold). Every ``replan_every`` steps the run compares the mean response length it
measured over those steps with the one its plan assumed; when they differ by more than
``replan_drift`` it plans again at the measured length:

* the current placement and staleness, priced at the measured length (what the run will now take);
* the same placement at each staleness the flow allows (``check_staleness``, ``max_staleness``):
  when the run let the planner choose the staleness (``staleness: auto``, or a flow that declares
  ``max_staleness`` and a run that does not set it), a better one is switched to in place, at the
  step boundary — the runtime issues rollouts ahead or stops doing so; nothing else changes;
* the best plan over every placement: when it is faster by more than :data:`REPLACE_GAIN` it is
  written beside the run (``replans/step-NNNNNN.json``) and said, with its predicted gain. A new
  placement is not applied mid-run: checkpoints hold each rank's shard of its own layout, so the
  weights cannot move to another split without a restart (use the plan for the next run).

Every re-plan is one ``{"event": "replan", …}`` line in ``metrics.jsonl`` and a console note.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowc.errors import FlowcError
from flowc.ir.graph import FlowGraph
from flowc.ir.models import ModelSpec
from flowc.ir.plan import Plan
from flowc.ir.workload import WorkloadSpec

if TYPE_CHECKING:
    from flowc.run import Prepared, RunRequest
    from flowc.trackers import MetricsLog

REPLACE_GAIN = 0.05  # a re-placed plan must be this much faster to be worth a restart's mention


def measured_length(rows: list[dict[str, Any]]) -> float | None:
    """The mean response length over ``rows`` (steps' metrics), None when none measured it."""
    vals = [float(r["response_length/mean"]) for r in rows if isinstance(r.get("response_length/mean"), (int, float))]
    return sum(vals) / len(vals) if vals else None


def planned_length(wl: WorkloadSpec) -> float:
    """The mean response length a workload prices: its ``mean_response_len``, else ``response_len``."""
    return float(wl.mean_response_len or wl.response_len)


def at_length(wl: WorkloadSpec, mean: float, cv: float | None = None) -> WorkloadSpec:
    """``wl`` with mean response length ``mean`` (at least 1, at most the response limit) and, when
    given, the steps' measured variation ``cv`` (``mean_response_cv``); the percentiles of the old
    distribution are dropped (they no longer describe it)."""
    mean = min(max(mean, 1.0), float(wl.response_len))
    update: dict[str, Any] = {"mean_response_len": mean, "response_percentiles": None}
    if cv is not None:
        update["mean_response_cv"] = cv
    return wl.model_copy(update=update)


@dataclass
class Replan:
    """One re-plan: what the measured length changes, and what the run does about it."""

    step: int
    planned_len: float
    measured_len: float
    current_s: float  # the run's placement and staleness, priced at the measured length
    by_staleness: dict[int, float]  # the same placement at each staleness the flow allows
    staleness_from: int
    staleness_to: int  # == staleness_from: kept
    switched: bool  # the run changes its staleness in place
    best: Plan  # the best plan over every placement at the measured length
    best_path: Path | None = None  # where it was written (when worth a restart)
    measured_cv: float | None = None  # how much the measured steps' means varied (mean_response_cv), when measured

    @property
    def best_gain(self) -> float:
        """How much faster the best re-placed plan is than the run at the measured length."""
        return self.current_s / self.best.predicted.step_time_s if self.best.predicted.step_time_s > 0 else 1.0

    def event(self) -> dict[str, Any]:
        """The ``metrics.jsonl`` line."""
        kept = self.by_staleness.get(self.staleness_to, self.current_s)
        return {
            "event": "replan",
            "step": self.step,
            "replan/planned_response_len": round(self.planned_len, 3),
            "replan/measured_response_len": round(self.measured_len, 3),
            **({"replan/measured_response_cv": round(self.measured_cv, 4)} if self.measured_cv is not None else {}),
            "replan/predicted_step_s": round(self.current_s, 6),
            "replan/staleness_from": self.staleness_from,
            "replan/staleness_to": self.staleness_to,
            "replan/switched": self.switched,
            "replan/staleness_step_s": {str(k): round(v, 6) for k, v in self.by_staleness.items()},
            "replan/staleness_gain": round(self.current_s / kept, 4) if kept > 0 else 1.0,
            "replan/best_placement": self.best_placement,
            "replan/best_staleness": self.best.staleness,
            "replan/best_step_s": round(self.best.predicted.step_time_s, 6),
            "replan/best_gain": round(self.best_gain, 4),
            "replan/best_plan": str(self.best_path) if self.best_path else None,
        }

    @property
    def best_placement(self) -> str:
        return " | ".join(f"{p.name} ×{p.device_count}" for p in self.best.pools)

    def message(self) -> str:
        head = (
            f"step {self.step}: responses averaged {self.measured_len:.1f} tokens over the last steps against the"
            f" plan's {self.planned_len:.1f}; re-planned at the measured length: this run now predicts"
            f" {self.current_s:.3g} s/step"
        )
        parts = [head]
        if self.switched:
            after = self.by_staleness[self.staleness_to]
            parts.append(
                f"staleness {self.staleness_from} → {self.staleness_to} on the same placement ({self.current_s:.3g} →"
                f" {after:.3g} s/step, {self.current_s / after:.2f}×), from the next step"
            )
        if self.best_path is not None:
            parts.append(
                f"a re-placed plan ({self.best_placement}, staleness {self.best.staleness}) would take"
                f" {self.best.predicted.step_time_s:.3g} s/step ({self.best_gain:.2f}×); it is written to {self.best_path}"
                " — a new placement needs a new run (checkpoints hold each rank's shard of its own layout)"
            )
        return "; ".join(parts) + "."


def replan(
    step: int,
    plan: Plan,
    g: FlowGraph,
    models: dict[str, ModelSpec],
    measured: float,
    *,
    may_switch: bool,
    best_plan: Any,
    out_dir: Path | None = None,
    cv: float | None = None,
) -> Replan:
    """Plan ``plan``'s flow again at the measured mean response length ``measured`` (the caller
    decided it drifted), ``models`` priced as the run prices them (dtype, LoRA:
    ``flowc.compile.role_specs``). ``best_plan(workload) -> Plan`` plans every placement as the run
    was planned (its pins, cluster, rollout backend); ``may_switch``: the run's staleness is the
    planner's to choose, so the staleness the planner would now choose on this placement is
    switched to (a larger one only when more than the tolerance faster, as ``auto`` chooses); ``cv``:
    how much the measured steps' means varied (what a larger staleness absorbs), when measured."""
    from flowc.passes.pins import Pins, pins_from_plan
    from flowc.passes.pipeline import AUTO_TOLERANCE, make_plan, smallest_within, staleness_choices

    wl = at_length(WorkloadSpec.model_validate(plan.workload), measured, cv)
    cluster = plan.cluster_spec()
    fixed = pins_from_plan(plan)

    def priced(k: int) -> float:
        again, _, _ = make_plan(g, models, cluster, wl, fixed.merged(Pins(staleness=k)), target=plan.target)
        return again.predicted.step_time_s

    current = priced(plan.staleness)
    ks = sorted({*staleness_choices(g)[0], plan.staleness})
    by_k = {k: (current if k == plan.staleness else priced(k)) for k in ks}
    chosen = smallest_within(by_k)
    # lower: fresher samples within the tolerance; higher: only when it pays more than the tolerance
    switch = may_switch and (
        chosen < plan.staleness or (chosen > plan.staleness and by_k[chosen] * (1 + AUTO_TOLERANCE) < current)
    )
    best = best_plan(wl)
    r = Replan(
        step=step,
        planned_len=planned_length(WorkloadSpec.model_validate(plan.workload)),
        measured_len=measured,
        current_s=current,
        by_staleness=by_k,
        staleness_from=plan.staleness,
        staleness_to=chosen if switch else plan.staleness,
        switched=switch,
        best=best,
        measured_cv=cv,
    )
    differs = _placement(best) != _placement(plan)
    if differs and r.best_gain > 1 + REPLACE_GAIN and out_dir is not None:
        path = out_dir / "replans" / f"step-{step:06d}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(best.to_json() + "\n")
        r.best_path = path
    return r


def maybe_replan(req: RunRequest, p: Prepared, ctl: Any, current: Plan, step: int, log: MetricsLog) -> Plan:
    """``replan_every``: when the mean response length of the last steps drifted from ``current``'s
    by more than ``replan_drift``, plan again at the measured length (``flowc.replan``), log it,
    switch the staleness in place when the planner chooses it; returns the plan as it now stands.
    A re-plan advises: when it fails, the run says why and goes on with its plan."""
    from flowc.compile import compile_plan, lora_roles, role_specs
    from flowc.lengths import step_cv
    from flowc.passes.pins import parse_pins

    cfg = p.run.config
    rows = [r for r in ctl.history if "step_s" in r][-cfg.replan_every :]
    raw = measured_length(rows)
    wl = WorkloadSpec.model_validate(current.workload)
    if raw is None:
        return current
    measured = min(max(raw, 1.0), float(wl.response_len))  # what the plan can price: 1 … response_len tokens
    cv = step_cv([float(r["response_length/mean"]) for r in rows if isinstance(r.get("response_length/mean"), (int, float))])
    cv = None if cv is None else min(cv, 1.0)  # (the most the workload takes)
    moved = at_length(wl, measured, cv)
    if abs(measured / planned_length(wl) - 1.0) <= cfg.replan_drift:
        return current
    try:
        g = req.flow.trace(**req.overrides)
        # the staleness is the planner's to change only when the run let it choose (auto, or a bounded flow
        # and no request), never on a saved plan (a saved plan runs unchanged)
        asked = cfg.staleness if "staleness" in cfg.model_fields_set else parse_pins(req.pins).staleness
        may_switch = not req.plan_file and (asked == "auto" or (asked is None and bool(g.max_staleness)))
        models = role_specs(p.run.model_sources, lora_roles(g, cfg), current.target.dtype)

        def best_plan(at: WorkloadSpec) -> Plan:
            return compile_plan(
                g,
                p.run.model_sources,
                current.cluster_spec(),
                at,
                cfg,
                pin_words=req.pins,
                rollout=req.rollout,
                split_local=req.cluster == "local",
                here=p.address is None,
            )

        r = replan(step, current, g, models, measured, may_switch=may_switch, best_plan=best_plan, out_dir=p.run.out_dir, cv=cv)
    except Exception as e:  # advisory: nothing it raises stops the run (Ctrl-C is not an Exception)
        what = e.what if isinstance(e, FlowcError) else f"{type(e).__name__}: {e}"
        log.write({"event": "replan", "step": step, "replan/measured_response_len": round(measured, 3), "replan/error": what})
        print(f"note: step {step}: re-planning at the measured response length {measured:.1f} failed: {what};"
              " the run goes on with its plan", file=sys.stderr)  # fmt: skip
        return current.model_copy(update={"workload": moved.model_dump()})
    log.write(r.event())
    print(f"note: {r.message()}", file=sys.stderr)
    if r.switched:
        ctl.set_staleness(r.staleness_to)
    return current.model_copy(update={"workload": moved.model_dump(), "staleness": r.staleness_to})


def _placement(plan: Plan) -> tuple:
    """What a restart would change: the pools (units, devices) and every phase's layout."""
    pools = tuple((tuple(p.units), p.device_count) for p in plan.pools)
    layouts = tuple(sorted((r, ph, pp.layout.model_dump_json()) for r, rp in plan.roles.items() for ph, pp in rp.phases.items()))
    return pools, layouts


__all__ = ["REPLACE_GAIN", "Replan", "at_length", "maybe_replan", "measured_length", "planned_length", "replan"]
