"""Staleness on this machine: lock-step against rollouts that lag the trainer by 1 and 2 versions.

    python bench/async.py [--sizes tiny,mid] [--rounds 2] [--timing-steps 30] [--learn-steps 400] [--rollout hf]

The flow is examples/grpo_async.py (GRPO with AReaL's decoupled PPO, so every staleness is sound)
on the built-in arithmetic task. Four configurations:

- ``lock-step (planned)``: the planner's own placement (on 2 cores: both workers share every role);
- ``lock-step (split)``: generation in a pool of its own (``--pin colocate=actor.train,ref;actor.gen``);
- ``staleness 1 (split)``, ``staleness 2 (split)``: the same split, the engine sampling ahead.

**Timing**: ``--rounds`` rounds, each running every configuration once for ``--timing-steps``
steps without evaluation, alternating, so the machine's load hits all of them alike; the median
step (first 3 dropped), samples/s, and the planner's prediction of the step (``plan.json``) beside
it. ``tiny`` is the shipped 0.5M-parameter model on the built-in workload (64 prompts × 8 samples,
6 tokens); ``mid`` the 34M-parameter Qwen2 of bench/grpo_vs_trl (8 prompts × 8, 24 tokens).

**Learning** (``tiny`` only, ``--learn-steps`` > 0): one run per configuration with held-out
accuracy on 1,000 problems every 40 steps, against the run's summed step time (evaluation
excluded) — does staleness reach the lock-step accuracy in less time? Prints markdown tables
(docs/async.md keeps them) and writes ``RUNS/summary.json`` and ``docs/async-accuracy.png``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "grpo_vs_trl"))
from run import model_dir  # noqa: E402  (bench/grpo_vs_trl/run.py: the shipped and the 34M model)

SPLIT = ["--pin", "colocate=actor.train,ref;actor.gen"]
CONFIGS = {  # (the flow declares max_staleness=2: without --staleness the planner would choose it)
    "lock-step (planned)": ["--staleness", "0"],
    "lock-step (split)": [*SPLIT, "--staleness", "0"],
    "staleness 1 (split)": [*SPLIT, "--staleness", "1"],
    "staleness 2 (split)": [*SPLIT, "--staleness", "2"],
}
WORKLOADS = {"tiny": None, "mid": "prompts=8,prompt_len=8,response_len=24"}
DROP = 3


def flowc_run(model: str, size: str, extra: list[str], steps: int, out: Path, *, rollout: str, evals: int) -> Path:
    cmd = [sys.executable, "-m", "flowc.cli", "run", "examples/grpo_async.py", "--steps", str(steps), "--out", str(out)]
    cmd += ["--model", f"actor={model}", "--model", f"ref={model}", "--rollout", rollout, "-q", *extra]
    cmd += ["--set", f"eval_every={evals}", "--set", "checkpoint_every=0", "--report-to", "none"]
    if WORKLOADS[size]:
        cmd += ["--workload", WORKLOADS[size]]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return out


def slug(name: str) -> str:
    return name.replace(" (", "-").replace(")", "").replace(" ", "-")


def rows_of(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def timing(out: Path) -> dict:
    rows = [r for r in rows_of(out) if "step_s" in r][DROP:]
    plan = json.loads((out / "plan.json").read_text())
    samples = plan["workload"]["prompts"] * plan["hyperparams"].get("n", 8)
    step = statistics.median(r["step_s"] for r in rows)
    return {
        "step_s": step,
        "samples_per_s": samples / step,
        "predicted_s": plan["predicted"]["step_time_s"],
        "iteration_s": plan["predicted"].get("iteration_s"),
        "staleness": statistics.mean(r.get("rollout/staleness", 0) for r in rows),
        "mismatch_kl": statistics.mean(r.get("actor/mismatch_kl", float("nan")) for r in rows),
        "pools": " | ".join(f"{p['name']} ×{p['device_count']}" for p in plan["pools"]),
    }


def learning(out: Path) -> dict:
    rows = rows_of(out)
    t, curve = 0.0, []
    for r in rows:
        t += r.get("step_s", 0.0)
        if "eval/accuracy" in r:
            curve.append((r["step"], t, r["eval/accuracy"]))
    return {"curve": curve, "step_s": statistics.median(r["step_s"] for r in rows if "step_s" in r)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="tiny,mid")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--timing-steps", type=int, default=30)
    ap.add_argument("--learn-steps", type=int, default=400)
    ap.add_argument("--rollout", default="hf")
    ap.add_argument("--out", default="runs/async")
    ap.add_argument("--figure", default="docs/async-accuracy.png")
    args = ap.parse_args()
    work = ROOT / args.out
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    results: dict = {"timing": {}, "learning": {}}
    for size in args.sizes.split(","):
        model = model_dir(size, work / "models")
        steps = args.timing_steps if size == "tiny" else max(8, args.timing_steps // 3)
        for rnd in range(args.rounds):
            for name, extra in CONFIGS.items():
                out = flowc_run(model, size, extra, steps, work / f"t-{size}-{rnd}-{slug(name)}", rollout=args.rollout, evals=0)
                results["timing"].setdefault(size, {}).setdefault(name, []).append(timing(out))
                print(
                    f"{size} round {rnd} {name}: {results['timing'][size][name][-1]['step_s']:.3f} s/step",
                    file=sys.stderr,
                    flush=True,
                )
    if args.learn_steps:
        model = model_dir("tiny", work / "models")
        for name, extra in CONFIGS.items():
            out = flowc_run(model, "tiny", extra, args.learn_steps, work / f"l-{slug(name)}", rollout=args.rollout, evals=40)
            results["learning"][name] = learning(out)
            print(f"learning {name}: {results['learning'][name]['curve'][-1]}", file=sys.stderr, flush=True)
    (work / "summary.json").write_text(json.dumps(results, indent=1))
    report(results, args, time.time() - t0)
    if results["learning"]:
        draw(results["learning"], ROOT / args.figure)


def report(results: dict, args: argparse.Namespace, wall: float) -> None:
    print(
        f"machine: {platform.machine()}, Python {platform.python_version()}, rollout {args.rollout}, {wall / 60:.0f} min in all\n"
    )
    print(
        "| size | configuration | pools | s/step (median of rounds) | samples/s | × lock-step (planned) | predicted s/step | measured / predicted | mean staleness | mismatch KL |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for size, by in results["timing"].items():
        base = statistics.median(x["step_s"] for x in by["lock-step (planned)"])
        for name, xs in by.items():
            step = statistics.median(x["step_s"] for x in xs)
            pred = xs[0]["predicted_s"]
            print(
                f"| {size} | {name} | {xs[0]['pools']} | {step:.3f} | {statistics.median(x['samples_per_s'] for x in xs):.0f} |"
                f" {base / step:.2f}× | {pred:.3f} | {step / pred:.2f} | {xs[0]['staleness']:.2f} | {xs[0]['mismatch_kl']:.2e} |"
            )
    if not results["learning"]:
        return
    print(
        "\n| configuration | accuracy, step 0 | mean of the last 3 evaluations | median step | training time to the lock-step (planned) run's final accuracy |"
    )
    print("|---|---:|---:|---:|---:|")
    ref = results["learning"]["lock-step (planned)"]["curve"]
    goal = statistics.mean(a for _, _, a in ref[-3:])
    for name, r in results["learning"].items():
        c = r["curve"]
        last = statistics.mean(a for _, _, a in c[-3:])
        reached = next((t for _, t, a in c if a >= goal), None)
        when = f"{reached:.0f} s" if reached is not None else "not reached"
        print(f"| {name} | {c[0][2] * 100:.1f} % | {last * 100:.1f} % | {r['step_s']:.3f} s | {when} |")


def draw(learn: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, r in learn.items():
        steps, times, acc = zip(*r["curve"], strict=True)
        a.plot(steps, [x * 100 for x in acc], marker=".", label=name)
        b.plot(times, [x * 100 for x in acc], marker=".", label=name)
    a.set_xlabel("step")
    b.set_xlabel("training time (s, evaluation excluded)")
    for ax in (a, b):
        ax.set_ylabel("held-out accuracy (%)")
        ax.grid(alpha=0.3)
    b.legend(fontsize=8)
    fig.suptitle("examples/grpo_async.py on the built-in task, 2 CPU cores: lock-step against staleness 1 and 2")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
