"""Response lengths a run measured, for planning the next one: ``--workload lengths_from=RUN_DIR``.

The cost model prices generation (and the padding of training micro-batches) from the
workload's ``mean_response_len``; left out, every response is priced at the limit, which
overstates both whenever responses stop early. ``lengths_from=RUN_DIR`` takes the mean from
what a run measured: the median of its last :data:`LAST_STEPS` steps' ``response_length/mean``
(the lengths drift as a policy trains; the last steps are what a continuation sees), and the
distribution's shape from the same steps' ``min``, ``p50``, ``p90``, ``p99`` and ``max`` (each
the median over those steps, made ascending) as ``response_percentiles``: generation is priced
over it, its long tail included; and how much the steps' means varied from one step to the next
as ``mean_response_cv`` (from successive differences, so that a drift over the steps is not
counted as variation), which a pipelined loop's period prices; and, where its updates left out rows
whose advantages were all zero, their median share as ``idle_rows``. The run must have sampled under
the same response limit, or its lengths say nothing about this one.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from pathlib import Path
from typing import NamedTuple

from flowc.errors import SpecError
from flowc.ir.workload import WorkloadSpec

LAST_STEPS = 10
KEY = "lengths_from"
#: the statistics of a step's response lengths that make the distribution's shape
SHAPE = ("min", "p50", "p90", "p99", "max")


class Measured(NamedTuple):
    """What a run measured of its response lengths."""

    mean: float  # the median of its last steps' means
    percentiles: tuple[float, ...] | None  # min/p50/p90/p99/max (each a median over those steps), when recorded
    limit: int  # the response limit they were sampled under
    note: str  # what the planner says about where they came from
    cv: float | None = None  # how much the steps' means vary, over the mean (at least 3 steps)
    idle: float | None = None  # the share of an update's rows left out with zero advantages, where recorded


def measured(run_dir: Path) -> Measured:
    """The response lengths ``run_dir`` measured (:class:`Measured`)."""
    metrics, plan = run_dir / "metrics.jsonl", run_dir / "plan.json"
    if not metrics.is_file() or not plan.is_file():
        raise SpecError(
            f"{KEY}={run_dir}: not a run directory (no metrics.jsonl and plan.json)",
            fix="give the folder `flowc run --out` wrote",
        )
    try:
        limit = int(json.loads(plan.read_text())["workload"]["response_len"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise SpecError(
            f"{KEY}={run_dir}: its plan.json holds no workload.response_len ({type(e).__name__}: {e})",
            fix="give the folder `flowc run --out` wrote, with its plan.json as the run wrote it",
        ) from None
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if "response_length/mean" in row and "step_s" in row and _finite(row["response_length/mean"]):
            rows.append(row)
    if not rows:
        raise SpecError(
            f"{KEY}={run_dir}: its metrics hold no sampled response lengths",
            fix="use a run that sampled responses (a flow with a non-greedy generate)",
        )
    last = rows[-LAST_STEPS:]
    mean = statistics.median(float(r["response_length/mean"]) for r in last)
    if mean < 1.0:
        raise SpecError(
            f"{KEY}={run_dir}: its last steps' responses averaged {mean:g} tokens — less than one; the run sampled"
            " (almost) nothing to plan lengths from",
            fix="use a run whose responses have tokens (check its sampling settings and stop strings)",
        )
    steps = f"step {last[0]['step']}" if len(last) == 1 else f"steps {last[0]['step']}-{last[-1]['step']}"
    mean = min(max(mean, 1.0), float(limit))
    pct = _percentiles(last, float(limit))
    if pct is not None:
        mean = min(max(mean, pct[0]), pct[-1])
        shape = f", min/p50/p90/p99/max {'/'.join(f'{x:g}' for x in pct)}"
    else:
        p90 = [float(r["response_length/p90"]) for r in last if "response_length/p90" in r]
        shape = f", p90 {statistics.median(p90):.0f}" if p90 else ""
    cv = step_cv([float(r["response_length/mean"]) for r in last])
    varies = ""
    if cv is not None:
        varies = f", step means ±{cv:.1%}" + (" (priced as ±100%, the most the workload takes)" if cv > 1.0 else "")
        cv = min(cv, 1.0)
    idle = _idle_rows(last)
    if idle is not None:
        varies += f", {idle:.0%} of update rows with zero advantages"
    note = f"mean_response_len={mean:.1f}: measured by {run_dir} (median of {steps}{shape}{varies}; limit {limit})"
    return Measured(mean, pct, limit, note, cv, idle)


def _idle_rows(rows: list[dict]) -> float | None:
    """The median over ``rows`` of the share of an update's rows left out with zero advantages
    (``ROLE/idle_rows``: the most of any role a step reports); None where no step recorded it (a
    run that computed every row)."""
    got = []
    for r in rows:
        shares = [float(v) for k, v in r.items() if k.endswith("/idle_rows") and _finite(v)]
        if shares:
            got.append(max(shares))
    if not got:
        return None
    return statistics.median(got)


def _finite(v: object) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def step_cv(means: list[float]) -> float | None:
    """How much a step's mean differs from the last one's beyond the run's drift, as a share of
    the mean: the standard deviation of the successive differences about their mean (the drift:
    a policy learning to answer longer), over √2 — for independent steps that is their standard
    deviation, and a steady drift adds nothing to it. Uncapped (the workload takes at most 1).
    None for fewer than 3 steps."""
    if len(means) < 3:
        return None
    diffs = [b - a for a, b in itertools.pairwise(means)]
    sd = statistics.stdev(diffs) / math.sqrt(2.0)
    avg = statistics.fmean(means)
    return sd / avg if avg > 0 else None


def _percentiles(rows: list[dict], limit: float) -> tuple[float, ...] | None:
    """The median over ``rows`` of each of min/p50/p90/p99/max (rows that recorded all five),
    made ascending and kept within 1..limit; None when no row recorded them."""
    full = [r for r in rows if all(f"response_length/{k}" in r for k in SHAPE)]
    if not full:
        return None
    out, floor = [], 1.0
    for k in SHAPE:
        floor = min(max(floor, statistics.median(float(r[f"response_length/{k}"]) for r in full)), limit)
        out.append(round(floor, 1))
    return tuple(out)


def expand(text: str | None) -> tuple[str | None, list[str]]:
    """``--workload`` words with ``lengths_from=RUN_DIR`` replaced by the ``mean_response_len`` it
    measured; and the note that says so (none when the words have no ``lengths_from``)."""
    if not text or f"{KEY}=" not in text:
        return text, []
    words = [w for w in text.replace(" ", ",").split(",") if w]
    given = dict(w.split("=", 1) for w in words if "=" in w)
    for own in ("mean_response_len", "response_percentiles", "mean_response_cv", "idle_rows"):
        if own in given:
            raise SpecError(
                f"--workload gives both {own} and {KEY}",
                fix="give one: the lengths, or the run that measured them",
            )
    got = measured(Path(given[KEY]))
    want = int(given.get("response_len", WorkloadSpec.model_fields["response_len"].default))
    if want != got.limit:
        raise SpecError(
            f"{KEY}={given[KEY]}: that run sampled under response_len={got.limit}, this workload's is {want}; "
            "its mean says nothing about another limit",
            fix=f"plan with response_len={got.limit}, or give mean_response_len=… yourself",
        )
    kept = [w for w in words if not w.startswith(f"{KEY}=")]
    kept.append(f"mean_response_len={got.mean:.6g}")
    if got.percentiles is not None:
        kept.append("response_percentiles=" + "/".join(f"{x:g}" for x in got.percentiles))
    if got.cv is not None:
        kept.append(f"mean_response_cv={got.cv:.3g}")
    if got.idle is not None:
        kept.append(f"idle_rows={got.idle:.3g}")
    return ",".join(kept), [got.note]


__all__ = ["LAST_STEPS", "SHAPE", "Measured", "expand", "measured", "step_cv"]
