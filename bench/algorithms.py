"""Every algorithm flow on the built-in task: does it learn, and how fast is a step?

    python bench/algorithms.py [--steps 200] [--flows grpo,ppo_rlvr,...] [--out runs/algorithms] [--rollout hf]

Runs ``flowc run examples/FLOW.py --steps N`` for each flow, one after the
other on the same machine (the embedded default: local Ray on this machine's
CPUs, the shipped tiny model, the arithmetic task, held-out accuracy on 1,000
problems every 20 steps), draws each run's curves with ``flowc report`` and
one figure of held-out accuracy against step for all of them, and prints a
markdown table. Figures go to docs/algorithms/.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLOWS = ["grpo", "drgrpo", "dapo", "gspo", "rloo", "reinforce_pp", "remax", "ppo_rlvr", "dpo"]
# Flows that sample once per prompt get 256 prompts per step instead of the default 64: with 64
# samples a step, PPO's young critic and ReMax's one-sample baseline make the advantages mostly noise
# (measured: PPO -0.7 and ReMax -10.5 points in 200 steps).
WORKLOADS = {f: "prompts=256,prompt_len=8,response_len=6" for f in ("ppo_rlvr", "remax")}


def rows_of(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--flows", default=",".join(FLOWS))
    ap.add_argument("--out", default="runs/algorithms")
    ap.add_argument("--figures", default="docs/algorithms")
    ap.add_argument("--rollout", default="hf", help="generation backend (the table in docs/algorithms.md: hf)")
    args = ap.parse_args()
    out, figs = ROOT / args.out, ROOT / args.figures
    figs.mkdir(parents=True, exist_ok=True)
    summary = out / "summary.json"  # runs of other flows from earlier invocations are kept
    results = json.loads(summary.read_text()) if summary.exists() else {}
    for flow in args.flows.split(","):
        run = out / flow
        shutil.rmtree(run, ignore_errors=True)
        t = time.perf_counter()
        cmd = [
            sys.executable,
            "-m",
            "flowc.cli",
            "run",
            f"examples/{flow}.py",
            "--steps",
            str(args.steps),
            "--out",
            str(run),
            "-q",
            "--rollout",
            args.rollout,
        ]
        if flow in WORKLOADS:
            cmd += ["--workload", WORKLOADS[flow]]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - t
        if r.returncode != 0:
            print(f"{flow}: failed\n{r.stderr[-2000:]}", file=sys.stderr)
            continue
        subprocess.run([sys.executable, "-m", "flowc.cli", "report", str(run)], cwd=ROOT, check=True, capture_output=True)
        shutil.copy(run / "report.png", figs / f"{flow}.png")
        rows = rows_of(run)
        key = "eval/dpo_accuracy" if flow == "dpo" else "eval/accuracy"  # DPO: held-out pairs preferred rightly
        evals = [(r["step"], r[key]) for r in rows if key in r]
        steps = [r["step_s"] for r in rows if "step_s" in r]
        results[flow] = {"evals": evals, "wall": wall, "step_s": statistics.median(steps)}
        print(f"{flow}: {evals[0][1]:.3f} -> {evals[-1][1]:.3f} in {wall:.0f} s", file=sys.stderr, flush=True)
        summary.write_text(json.dumps(results, indent=1))
    results = {f: results[f] for f in FLOWS if f in results}
    draw(results, figs / "accuracy.png")
    print(f"machine: {platform.machine()}, Python {platform.python_version()}, {args.steps} steps per flow\n")
    print("(dpo: the fraction of held-out pairs whose chosen answer the policy prefers, against the reference)\n")
    print("| flow | held-out accuracy, step 0 | mean of the last 3 evaluations | gain | median step | wall time |")
    print("|---|---:|---:|---:|---:|---:|")
    for flow, r in results.items():
        first = r["evals"][0][1]
        last = statistics.mean(a for _, a in r["evals"][-3:])
        print(
            f"| {flow} | {first * 100:.1f} % | {last * 100:.1f} % | {(last - first) * 100:+.1f} | {r['step_s']:.2f} s | {r['wall'] / 60:.1f} min |"
        )


def draw(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for flow, r in results.items():
        xs, ys = zip(*r["evals"], strict=True)
        ax.plot(xs, [y * 100 for y in ys], marker=".", label=flow)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out accuracy (%; dpo: pairs preferred rightly)")
    ax.set_title("Built-in arithmetic task, tiny Qwen2-shaped policy, 2 CPU cores")
    ax.grid(alpha=0.3)
    ax.legend(ncol=2, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
