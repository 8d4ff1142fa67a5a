"""`flowc calibrate`: fit the hardware profile's efficiency factors to measured runs.

Every run folder holds its plan (``plan.json``: what each op was predicted to
take, and on which phase) and its measurements (``metrics.jsonl``: each step's
measured seconds per op beside the prediction). Each op's time is dominated by
one efficiency factor of the profile:

=====================  ===============================================
op                     factor
=====================  ===============================================
``generate``           ``decode_bw`` (the decode loop reads weights and KV cache)
forward ops            ``forward`` (log-probs, values, scores)
``update``             ``train``
weight sync            ``intra_node`` (``inter_node`` when it crossed nodes)
=====================  ===============================================

Each run is first *re-planned* with its own decisions pinned and the profile's current factors
(:func:`repredict`), so the fit starts from what this version of the cost model predicts, not from
the figures an older version recorded. A factor's new value is then the old one times the
time-weighted geometric mean of ``predicted/measured`` over its ops (steps after the first, which
pays warm-up, are used; the median per op). Because an op's time is not all bound by its factor
(an engine's per-request cost, a fixed latency), one such step overshoots; the fit re-plans with
the new factors and repeats until the factors settle (a few rounds), so the residuals it reports
are the planner's, not the fit's assumption.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from flowc.errors import SpecError
from flowc.ir.cluster import ClusterSpec
from flowc.ir.hardware import Efficiency
from flowc.ir.plan import Plan

FACTORS = ("decode_bw", "forward", "train", "intra_node", "inter_node")


@dataclass
class OpTime:
    """One op of one run: its factor, the plan's prediction and the median measurement."""

    run: str
    op: str
    factor: str
    predicted_s: float
    measured_s: float


@dataclass
class Fit:
    """What a calibration found: the cluster with fitted factors and each factor's multiplier."""

    cluster: ClusterSpec
    scale: dict[str, float]  # new factor / old factor
    ops: list[OpTime]


def factor_of(plan: Plan, op: str) -> str | None:
    """The efficiency factor that bounds ``op`` of ``plan`` (None: a controller op)."""
    for r in plan.reshards:
        if op == f"{r.role}.weight_sync" and r.dst_phase == "generate":
            return "inter_node" if r.link == "inter-node" else "intra_node"
    entry = next((e for e in plan.schedule if e.op == op), None)
    if entry is None or entry.phase is None:
        return None
    return {"generate": "decode_bw", "forward": "forward", "train": "train"}.get(entry.phase)


def read_run(run_dir: Path) -> tuple[Plan, list[OpTime]]:
    """A run's plan and the median measured seconds of each of its device ops."""
    from flowc.planning import read_plan
    from flowc.report import read_metrics

    plan_path, metrics_path = run_dir / "plan.json", run_dir / "metrics.jsonl"
    for p in (plan_path, metrics_path):
        if not p.is_file():
            raise SpecError(f"{run_dir} has no {p.name}", fix="give run folders written by flowc run")
    plan = read_plan(plan_path)
    rows = [m for m in read_metrics(metrics_path) if m.get("measured_s")]
    if len(rows) > 1:
        rows = rows[1:]  # the first step pays warm-up (compilation, allocator, caches)
    if not rows:
        raise SpecError(f"{run_dir}/metrics.jsonl has no measured steps", fix="calibrate on runs that took steps")
    out = []
    for op in rows[-1]["measured_s"]:
        factor = factor_of(plan, op)
        measured = [m["measured_s"][op] for m in rows if op in m["measured_s"]]
        predicted = rows[-1].get("predicted_s", {}).get(op)
        if factor is None or not predicted or not measured or statistics.median(measured) <= 0:
            continue
        out.append(OpTime(str(run_dir), op, factor, float(predicted), float(statistics.median(measured))))
    return plan, out


def fit(run_dirs: list[Path], rounds: int = 4) -> Fit:
    """Fitted factors from ``run_dirs`` (all planned for the same device type), re-planning
    at most ``rounds`` times."""
    if not run_dirs:
        raise SpecError("flowc calibrate needs at least one run folder", fix="flowc calibrate RUN_DIR…")
    plans, ops = [], []
    for d in run_dirs:
        plan, times = read_run(Path(d))
        plans.append(plan)
        ops.extend(times)
    devices = {p.cluster_spec().device for p in plans}
    if len(devices) > 1:
        raise SpecError(
            f"the runs were planned for different devices ({', '.join(sorted(devices))})",
            fix="calibrate one device type at a time",
        )
    base = plans[0].cluster_spec()
    old = base.profile.efficiency
    ops = [replace(o, predicted_s=p) for o, p in _predicted(ops, old)]
    eff, pred = old, [o.predicted_s for o in ops]
    for _ in range(rounds):
        step: dict[str, float] = {}
        for f in FACTORS:
            mine = [(p, o.measured_s) for p, o in zip(pred, ops, strict=True) if o.factor == f]
            weight = sum(m for _, m in mine)
            if weight > 0:
                step[f] = math.exp(sum(m * math.log(p / m) for p, m in mine) / weight)
        eff = Efficiency.model_validate(eff.model_dump() | {f: min(max(getattr(eff, f) * k, 1e-4), 1.0) for f, k in step.items()})
        if all(abs(math.log(k)) < 0.01 for k in step.values()):
            break
        pred = [p for _, p in _predicted(ops, eff)]
    scale = {f: getattr(eff, f) / getattr(old, f) for f in FACTORS if any(o.factor == f for o in ops)}
    return Fit(base.model_copy(update={"efficiency": eff}), scale, ops)


def _predicted(ops: list[OpTime], efficiency: Efficiency) -> list[tuple[OpTime, float]]:
    """Each op with its re-planned prediction under ``efficiency`` (the recorded one where the
    re-plan has no such op)."""
    again = {run: repredict(Path(run), efficiency) for run in dict.fromkeys(o.run for o in ops)}
    return [(o, again[o.run].get(o.op, o.predicted_s)) for o in ops]


def repredict(run_dir: Path, efficiency: Efficiency) -> dict[str, float]:
    """Each op's predicted seconds when ``run_dir``'s own decisions are planned again on its own
    cluster with the ``efficiency`` factors."""
    from flowc.ir.models import ModelSpec
    from flowc.ir.workload import WorkloadSpec
    from flowc.loader import load_flow
    from flowc.passes.pins import pins_from_plan
    from flowc.passes.pipeline import make_plan
    from flowc.planning import read_plan
    from flowc.run_record import RunRecord

    plan = read_plan(run_dir / "plan.json")
    rec = RunRecord.read(run_dir)
    g = load_flow(rec.flow).trace(**rec.overrides)
    models = {r: ModelSpec.resolve(rp.model) for r, rp in plan.roles.items()}
    wl = WorkloadSpec.model_validate(plan.workload)
    cluster = plan.cluster_spec().model_copy(update={"efficiency": efficiency})
    again, _, _ = make_plan(g, models, cluster, wl, pins_from_plan(plan), target=plan.target)
    return {e.op: e.end_s - e.start_s for e in again.schedule}


def error(times: list[tuple[float, float]]) -> float:
    """Mean |log(predicted/measured)|: 0 is perfect, 0.1 is about ±10 %."""
    return sum(abs(math.log(p / m)) for p, m in times) / max(len(times), 1)


def report(result: Fit, held_apart: list[Path] | None = None) -> str:
    """The fit, its residuals per op (re-planned), and the held-apart runs' errors before and after."""
    old = ClusterSpec(**result.cluster.model_dump(exclude={"efficiency", "name"})).profile.efficiency
    new = result.cluster.profile.efficiency
    lines = ["factor       before   after   (x)"]
    for f, k in result.scale.items():
        lines.append(f"{f:<11} {getattr(old, f):7.3f} {getattr(new, f):7.3f}   x{k:.2f}")
    lines.append("")
    lines.append("op (run)                                     measured   predicted before -> after (re-planned)")
    for run in dict.fromkeys(o.run for o in result.ops):
        after = repredict(Path(run), new)
        for o in (x for x in result.ops if x.run == run):
            a = after.get(o.op, float("nan"))
            lines.append(
                f"{o.op:<20} ({Path(run).name[:20]:<20}) {o.measured_s:9.4f} s {o.predicted_s:9.4f} s -> {a:9.4f} s "
                f"({(a / o.measured_s - 1) * 100:+.0f} %)"
            )
    for run in held_apart or []:
        _, times = read_run(run)
        before, after = repredict(run, old), repredict(run, new)
        before_err = error([(before[o.op], o.measured_s) for o in times if o.op in before])
        after_err = error([(after[o.op], o.measured_s) for o in times if o.op in after])
        lines.append(f"held apart {run.name}: mean |log(pred/meas)| {before_err:.3f} -> {after_err:.3f}")
    return "\n".join(lines)


def write_cluster(result: Fit, path: Path) -> None:
    """A cluster file ``--cluster`` reads: the runs' cluster with the fitted factors."""
    import yaml

    data: dict[str, Any] = result.cluster.model_dump(exclude_none=True)
    data["efficiency"] = {k: round(v, 4) for k, v in data["efficiency"].items()}
    head = "# fitted by flowc calibrate from: " + ", ".join(dict.fromkeys(Path(o.run).name for o in result.ops)) + "\n"
    path.write_text(head + yaml.safe_dump(data, sort_keys=False))


def as_json(result: Fit) -> str:
    return json.dumps({"scale": result.scale, "cluster": result.cluster.model_dump(mode="json", exclude_none=True)}, indent=2)
