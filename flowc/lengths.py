"""Response lengths a run measured, for planning the next one: ``--workload lengths_from=RUN_DIR``.

The cost model prices generation (and the padding of training micro-batches) from the
workload's ``mean_response_len``; left out, every response is priced at the limit, which
overstates both whenever responses stop early. ``lengths_from=RUN_DIR`` takes the mean from
what a run measured: the median of its last :data:`LAST_STEPS` steps' ``response_length/mean``
(the lengths drift as a policy trains; the last steps are what a continuation sees). The run
must have sampled under the same response limit, or its mean says nothing about this one.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from flowc.errors import SpecError
from flowc.ir.workload import WorkloadSpec

LAST_STEPS = 10
KEY = "lengths_from"


def measured_mean(run_dir: Path) -> tuple[float, int, str]:
    """(mean response length, the response limit it was measured under, a note saying so)."""
    metrics, plan = run_dir / "metrics.jsonl", run_dir / "plan.json"
    if not metrics.is_file() or not plan.is_file():
        raise SpecError(
            f"{KEY}={run_dir}: not a run directory (no metrics.jsonl and plan.json)",
            fix="give the folder `flowc run --out` wrote",
        )
    limit = int(json.loads(plan.read_text())["workload"]["response_len"])
    rows = []
    for line in metrics.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if "response_length/mean" in row and "step_s" in row:
            rows.append(row)
    if not rows:
        raise SpecError(
            f"{KEY}={run_dir}: its metrics hold no sampled response lengths",
            fix="use a run that sampled responses (a flow with a non-greedy generate)",
        )
    last = rows[-LAST_STEPS:]
    mean = statistics.median(float(r["response_length/mean"]) for r in last)
    steps = f"step {last[0]['step']}" if len(last) == 1 else f"steps {last[0]['step']}-{last[-1]['step']}"
    p90 = [float(r["response_length/p90"]) for r in last if "response_length/p90" in r]
    tail = f", p90 {statistics.median(p90):.0f}" if p90 else ""
    note = f"mean_response_len={mean:.1f}: measured by {run_dir} (median of {steps}{tail}; limit {limit})"
    return min(max(mean, 1.0), float(limit)), limit, note


def expand(text: str | None) -> tuple[str | None, list[str]]:
    """``--workload`` words with ``lengths_from=RUN_DIR`` replaced by the ``mean_response_len`` it
    measured; and the note that says so (none when the words have no ``lengths_from``)."""
    if not text or f"{KEY}=" not in text:
        return text, []
    words = [w for w in text.replace(" ", ",").split(",") if w]
    given = dict(w.split("=", 1) for w in words if "=" in w)
    if "mean_response_len" in given:
        raise SpecError(
            f"--workload gives both mean_response_len and {KEY}",
            fix="give one: the mean, or the run that measured it",
        )
    mean, limit, note = measured_mean(Path(given[KEY]))
    want = int(given.get("response_len", WorkloadSpec.model_fields["response_len"].default))
    if want != limit:
        raise SpecError(
            f"{KEY}={given[KEY]}: that run sampled under response_len={limit}, this workload's is {want}; "
            "its mean says nothing about another limit",
            fix=f"plan with response_len={limit}, or give mean_response_len=… yourself",
        )
    kept = [w for w in words if not w.startswith(f"{KEY}=")]
    return ",".join([*kept, f"mean_response_len={mean:.4g}"]), [note]


__all__ = ["LAST_STEPS", "expand", "measured_mean"]
