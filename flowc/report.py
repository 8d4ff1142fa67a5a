"""`flowc report RUN_DIR`: a run's curves as one PNG.

Panels: reward (mean ± spread) and training accuracy; held-out accuracy;
KL to the reference and the policy loss; and, per op, the time the planner
predicted beside the time measured at every step (so the cost model's error
is always in view). A run whose rollouts may lag the trainer (staleness K, or a run that was
switched to it: its metrics report ``rollout/staleness``) gets a third row: the
staleness histogram with the importance-ratio statistics, and each pool's busy time per step,
measured against predicted, with its idle share; :func:`pipeline_summary` says the same in text.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from flowc.errors import DataError

IS_KEYS = ("/is_weight", "/is_cut_frac", "/mismatch_kl")


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
    timed_steps = [r for r in rows if "step_s" in r]
    pipeline = _has_pipeline(timed_steps)
    agent = _has_agents(rows)
    n_rows = 2 + pipeline + agent
    fig, axes = plt.subplots(n_rows, 2, figsize=(12, 4 * n_rows))
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
    _legend(ax)
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
    _legend(ax, loc="upper left")
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
    _legend(ax, fontsize=7)
    if pipeline:
        _draw_pipeline(axes[2], timed_steps)
    if agent:
        _draw_agents(axes[n_rows - 1], rows)
    fig.suptitle(f"flowc run {Path(run_dir).name}")
    fig.tight_layout()
    out = Path(output) if output else Path(run_dir) / "report.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# --------------------------------------------------------------- the pipeline's figures
def _has_pipeline(rows: list[dict[str, Any]]) -> bool:
    """A run whose rollouts may lag the trainer (it reports their lag); lock-step runs do not."""
    return any("rollout/staleness" in r for r in rows)


def staleness_histogram(rows: list[dict[str, Any]]) -> dict[int, int]:
    """How many steps trained on rollouts 0, 1, … weight versions behind the trainer (a lock-step
    run's steps are all 0)."""
    out: dict[int, int] = {}
    for r in rows:
        if "step_s" in r:
            lag = int(r.get("rollout/staleness", 0))
            out[lag] = out.get(lag, 0) + 1
    return dict(sorted(out.items()))


def pool_figures(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per pool: mean measured and predicted busy seconds per step and the mean idle share."""
    out: dict[str, dict[str, float]] = {}
    for k, v in _means(rows, lambda k: k.startswith("pool/")).items():
        pool, what = k[len("pool/") :].rsplit("/", 1)
        out.setdefault(pool, {})[what] = v
    return out


def _means(rows: list[dict[str, Any]], keep: Any) -> dict[str, float]:
    """The mean over ``rows`` of every numeric metric whose name ``keep`` accepts (over the rows that have it)."""
    acc: dict[str, list[float]] = {}
    for r in rows:
        for k, v in r.items():
            if keep(k) and isinstance(v, (int, float)) and not isinstance(v, bool):
                acc.setdefault(k, []).append(float(v))
    return {k: sum(v) / len(v) for k, v in sorted(acc.items())}


def idle_summary(run_dir: str | Path) -> str:
    """How many of each update's rows the run left out, their advantages all zero (``ROLE/idle_rows``,
    ``RunConfig.skip_idle_rows``); empty for a run that left none out."""
    means = _means([r for r in load_metrics(run_dir) if "step_s" in r], lambda k: k.endswith("/idle_rows"))
    if not any(means.values()):
        return ""
    lines = ["update rows left out, their advantages all zero (mean over steps; the same gradient, not computed):"]
    lines += [f"  {k.rsplit('/', 1)[0]}: {v:.0%} of its rows" for k, v in means.items()]
    return "\n".join(lines)


def pipeline_summary(run_dir: str | Path) -> str:
    """The pipeline's figures of a run in text: the staleness histogram over its steps, the
    importance-ratio statistics of its corrections and the rollout/trainer mismatch, and each
    pool's measured busy time against the plan's with its idle share. Empty for a run without
    them (a lock-step run)."""
    rows = [r for r in load_metrics(run_dir) if "step_s" in r]
    if not _has_pipeline(rows):
        return ""
    hist = staleness_histogram(rows)
    lines = ["staleness (steps by how many weight versions their rollouts lagged the trainer):"]
    lines += [f"  {lag} behind: {n} step(s)" for lag, n in hist.items()]
    buffered = [int(r["rollout/buffered"]) for r in rows if "rollout/buffered" in r]
    if buffered:
        lines.append(f"  rollout buffer: at most {max(buffered)} step(s) issued ahead of the trainer")
    stats = _means(rows, lambda k: k.endswith(IS_KEYS))
    if stats:
        lines.append("off-policy statistics (mean over steps):")
        lines += [f"  {k}: {v:.4g}" for k, v in stats.items()]
    pools = pool_figures(rows)
    if pools:
        lines.append("pools (mean per step): busy measured / predicted, idle share")
        for pool, f in pools.items():
            busy, pred, idle = f.get("busy_s"), f.get("busy_predicted_s"), f.get("idle_fraction")
            ratio = f" ({busy / pred:.2f}×)" if busy is not None and pred else ""
            lines.append(f"  {pool}: {_num(busy, '.3g')} s / {_num(pred, '.3g')} s{ratio}, idle {_num(idle, '.0%')}")
    return "\n".join(lines)


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def _draw_pipeline(axes: Any, rows: list[dict[str, Any]]) -> None:
    ax = axes[0]
    hist = staleness_histogram(rows)
    ax.bar([str(k) for k in hist], list(hist.values()), color="tab:purple", alpha=0.7)
    stats = _means(rows, lambda k: k.endswith(IS_KEYS))
    means = " · ".join(f"{k.rsplit('/', 1)[1]} {v:.3g}" for k, v in stats.items())
    ax.set_xlabel("weight versions behind the trainer" + (f"\nmean {means}" if means else ""))
    ax.set_ylabel("steps")
    ax.set_title("rollout staleness over the steps")
    ax = axes[1]
    pools = sorted({k[len("pool/") :].rsplit("/", 1)[0] for r in rows for k in r if k.startswith("pool/")})
    for i, pool in enumerate(pools):
        pts = [(r["step"], r.get(f"pool/{pool}/busy_s"), r.get(f"pool/{pool}/busy_predicted_s")) for r in rows]
        ax.plot(
            [s for s, b, _ in pts if b is not None], [b for _, b, _ in pts if b is not None], color=f"C{i}", label=f"{pool} busy"
        )
        pred = [p for *_, p in pts if p is not None]
        if pred:
            ax.axhline(pred[-1], color=f"C{i}", linestyle="--", alpha=0.7)
    ax.plot([r["step"] for r in rows], [r["step_s"] for r in rows], color="black", alpha=0.5, label="step")
    ax.set_title("pool busy s/step: measured (lines) vs predicted (dashed)")
    ax.set_xlabel("step")
    _legend(ax, fontsize=7)


# --------------------------------------------------------------- agent rollouts
def _has_agents(rows: list[dict[str, Any]]) -> bool:
    """A run of a multi-turn flow (its steps report ``agent/…``)."""
    return any("agent/turns" in r for r in rows)


def _draw_agents(axes: Any, rows: list[dict[str, Any]]) -> None:
    """Turns and what the environment's ``info`` reported, in training and held out; and how
    trajectories ended early (errors, timeouts, lost, truncated)."""
    train = [r for r in rows if "agent/turns" in r]
    ev = [r for r in rows if "eval/agent/turns" in r]
    ax = axes[0]
    ax.plot([r["step"] for r in train], [r["agent/turns"] for r in train], label="turns per trajectory", color="black")
    infos = sorted({k for r in train for k in r if k.startswith("agent/info/")})
    for i, k in enumerate(infos):
        ax.plot([r["step"] for r in train], [r.get(k) for r in train], color=f"C{i}", label=k.removeprefix("agent/"))
        if any("eval/" + k in r for r in ev):
            ax.plot(
                [r["step"] for r in ev],
                [r.get("eval/" + k) for r in ev],
                color=f"C{i}",
                marker="o",
                linestyle="--",
                label=f"held out {k.removeprefix('agent/info/')}",
            )
    ax.set_title("agent: turns and the environment's info (mean per trajectory)")
    ax.set_xlabel("step")
    _legend(ax, fontsize=7)
    ax = axes[1]
    for i, (k, label) in enumerate(
        (("agent/env_errors", "errors"), ("agent/env_timeouts", "timeouts"), ("agent/env_lost", "lost"))
    ):
        ax.plot([r["step"] for r in train], [r.get(k, 0.0) for r in train], color=f"C{i + 3}", label=f"{label} (trajectories)")
    ax2 = ax.twinx()
    ax2.plot(
        [r["step"] for r in train],
        [r.get("agent/truncated", 0.0) for r in train],
        color="gray",
        alpha=0.6,
        label="truncated (share)",
    )
    ax2.set_ylabel("truncated share")
    ax.set_title("agent: trajectories the environment or the budget ended")
    ax.set_xlabel("step")
    _legend(ax, loc="upper left", fontsize=7)
    _legend(ax2, loc="upper right", fontsize=7)


def agent_summary(run_dir: str | Path) -> str:
    """A multi-turn run's figures in text: turns and the environment's info at its first and last
    step (and held out), trajectories ended by errors, timeouts or a lost process, and the
    environments' share of the rollout's time. Empty for a run without an environment."""
    rows = load_metrics(run_dir)
    if not _has_agents(rows):
        return ""
    train = [r for r in rows if "agent/turns" in r]
    first, last = train[0], train[-1]
    lines = [f"agent (step {first['step']} → {last['step']}):"]
    keys = ["agent/turns", *sorted(k for k in last if k.startswith("agent/info/"))]
    lines += [f"  {k.removeprefix('agent/')}: {first.get(k, 0.0):.3g} → {last.get(k, 0.0):.3g}" for k in keys]
    ev = [r for r in rows if "eval/agent/turns" in r]
    if ev:
        lines.append(
            f"  held out ({ev[0]['step']} → {ev[-1]['step']}): accuracy {ev[0].get('eval/accuracy', 0):.3g} → {ev[-1].get('eval/accuracy', 0):.3g}"
        )
    ended = {k: sum(r.get(f"agent/{k}", 0.0) for r in train) for k in ("env_errors", "env_timeouts", "env_lost")}
    total = sum(r.get("agent/trajectories", 0.0) for r in train)
    lines.append(
        f"  trajectories ended by their environment: {int(ended['env_errors'])} errors, {int(ended['env_timeouts'])} timeouts, "
        f"{int(ended['env_lost'])} lost of {int(total)}"
    )
    env_s = sum(r.get("agent/env_seconds", 0.0) for r in train)
    roll_s = sum(r.get("agent/seconds", 0.0) for r in train)
    if roll_s > 0:
        lines.append(f"  environments busy {env_s:.3g} s (summed over processes) in {roll_s:.3g} s of rollouts")
    return "\n".join(lines)


def _legend(ax: Any, **kw: Any) -> None:
    """A legend, when the axes hold something labelled (matplotlib warns otherwise)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kw)
