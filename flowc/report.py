"""`flowc report RUN_DIR`: a run's curves as one PNG.

Panels: reward (mean ± spread) and training accuracy; held-out accuracy;
KL to the reference and the policy loss; and, per op, the time the planner
predicted beside the time measured at every step (so the cost model's error
is always in view).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from flowc.errors import DataError


def load_metrics(run_dir: str | Path) -> list[dict]:
    p = Path(run_dir) / "metrics.jsonl"
    if not p.exists():
        raise DataError(f"{run_dir} has no metrics.jsonl", fix="give a directory written by flowc run")
    return read_metrics(p)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The lines of a metrics.jsonl; a torn last line (the run was killed while writing it)
    is dropped with a warning, a damaged line elsewhere is an error naming it."""
    lines = path.read_text(errors="replace").splitlines()
    out = []
    for i, ln in enumerate(lines, 1):
        if not ln.strip():
            continue
        try:
            out.append(json.loads(ln))
        except json.JSONDecodeError as e:
            if i == len(lines):
                print(f"warning: {path}:{i}: dropped a torn last line (the run stopped while writing it)", file=sys.stderr)
                continue
            raise DataError(f"{path}:{i}: not a JSON line: {e}", fix="repair or delete that line") from None
    return out


def draw(run_dir: str | Path, output: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = load_metrics(run_dir)
    steps = [r for r in rows if "reward" in r]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0][0]
    if steps:
        x = [r["step"] for r in steps]
        mean = [r["reward"] for r in steps]
        std = [r.get("reward_std", 0.0) for r in steps]
        ax.plot(x, mean, label="reward (mean)")
        ax.fill_between(
            x, [m - s for m, s in zip(mean, std, strict=True)], [m + s for m, s in zip(mean, std, strict=True)], alpha=0.15
        )
        if any("accuracy" in r for r in steps):
            ax.plot(x, [r.get("accuracy") for r in steps], label="training accuracy", alpha=0.7)
    ax.set_title("reward")
    ax.set_xlabel("step")
    ax.legend()
    ax = axes[0][1]
    ev = [r for r in rows if "eval/accuracy" in r]
    if ev:
        ax.plot([r["step"] for r in ev], [r["eval/accuracy"] for r in ev], marker="o")
    ax.set_title("held-out accuracy")
    ax.set_xlabel("step")
    ax = axes[1][0]
    kl = [(r["step"], v) for r in steps for k, v in r.items() if k.endswith(("/kl_loss", "/kl"))]  # /kl: runs before verl's names
    if kl:
        ax.plot([s for s, _ in kl], [v for _, v in kl], label="KL to reference")
    loss = [(r["step"], v) for r in steps for k, v in r.items() if k.endswith("/pg_loss")]
    if loss:
        ax2 = ax.twinx()
        ax2.plot([s for s, _ in loss], [v for _, v in loss], color="tab:orange", alpha=0.6, label="policy loss")
        ax2.set_ylabel("policy loss")
    ax.set_title("KL and loss")
    ax.set_xlabel("step")
    ax.legend(loc="upper left")
    ax = axes[1][1]
    timed = [r for r in steps if r.get("measured_s")]
    if timed:
        ops = sorted(timed[-1]["measured_s"])
        for i, op in enumerate(ops):
            color = f"C{i % 10}"
            ax.plot([r["step"] for r in timed], [r["measured_s"].get(op) for r in timed], color=color, label=f"{op} measured")
            pred = timed[-1].get("predicted_s", {}).get(op)
            if pred is not None:
                ax.axhline(pred, color=color, linestyle="--", alpha=0.7)
        ax.set_yscale("log")
    ax.set_title("seconds per op: measured (lines) vs predicted (dashed)")
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
    fig.suptitle(f"flowc run {Path(run_dir).name}")
    fig.tight_layout()
    out = Path(output) if output else Path(run_dir) / "report.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
