"""Does deferring the weight-sync wait pay? This checkout against a baseline checkout, side by side.

    python bench/deferred_sync.py /path/to/baseline-checkout [--sizes tiny,mid] [--rounds 2] [--steps 30]

Runs examples/grpo_async.py with generation in a pool of its own (one core each on this machine)
at staleness 1 and 2, from each checkout with its own ``.venv``, alternating checkout and K in
every round so the machine's load hits all of them alike. Reports the median step (first 3 steps
dropped), the trainer pool's idle share and each checkout's ratio to the baseline in the same round.
At K = 1 the two must match (the wait is the same); at K = 2 the deferred wait lets the trainer go
on while the engine generates two steps ahead, which pays where generation times vary from step
to step (on this task the mid size's responses: 36 % stop at the length limit).
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
WORKLOADS = {"tiny": None, "mid": "prompts=8,prompt_len=8,response_len=24"}
DROP = 3


def flowc_run(checkout: Path, model: str, size: str, k: int, steps: int, out: Path) -> list[dict]:
    python = checkout / ".venv" / "bin" / "python"
    cmd = [str(python), "-m", "flowc.cli", "run", "examples/grpo_async.py", "--steps", str(steps), "--out", str(out)]
    cmd += ["--model", f"actor={model}", "--model", f"ref={model}", "--rollout", "hf", "-q", *SPLIT]
    cmd += ["--staleness", str(k), "--set", "eval_every=0", "--set", "checkpoint_every=0", "--report-to", "none"]
    if WORKLOADS[size]:
        cmd += ["--workload", WORKLOADS[size]]
    r = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"step_s"' in x][DROP:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("baseline", type=Path, help="a checkout of the code to compare against, with its own .venv")
    ap.add_argument("--sizes", default="tiny,mid")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30, help="steps a tiny run (a mid run: a third, at least 8)")
    ap.add_argument("--out", default="runs/deferred_sync")
    args = ap.parse_args()
    work = ROOT / args.out
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    checkouts = {"baseline": args.baseline.resolve(), "this": ROOT}
    got: dict[tuple[str, int, str], list[tuple[float, float]]] = {}
    for size in args.sizes.split(","):
        model = str(model_dir(size, HERE / ".cache"))
        steps = args.steps if size == "tiny" else max(8, args.steps // 3)
        for rnd in range(args.rounds):
            for k in (1, 2):
                for name, checkout in checkouts.items() if rnd % 2 == 0 else reversed(checkouts.items()):
                    rows = flowc_run(checkout, model, size, k, steps, work / f"{size}-{rnd}-k{k}-{name}")
                    step = statistics.median(r["step_s"] for r in rows)
                    idle = statistics.mean(r["pool/actor.train_ref/idle_fraction"] for r in rows)
                    got.setdefault((size, k, name), []).append((step, idle))
                    print(f"{size} round {rnd} K={k} {name}: {step:.3f} s/step, trainer idle {idle:.0%}", file=sys.stderr)
    print(f"machine: {platform.machine()}, Python {platform.python_version()}, {(time.time() - t0) / 60:.0f} min in all\n")
    print("| size | K | baseline s/step | this s/step | this / baseline (per round) | trainer idle: baseline | this |")
    print("|---|---:|---:|---:|---|---:|---:|")
    for size in args.sizes.split(","):
        for k in (1, 2):
            b, t = got[(size, k, "baseline")], got[(size, k, "this")]
            ratios = ", ".join(f"{x[0] / y[0]:.2f}" for x, y in zip(t, b, strict=True))
            print(
                f"| {size} | {k} | {statistics.median(x[0] for x in b):.3f} | {statistics.median(x[0] for x in t):.3f} | {ratios} |"
                f" {statistics.mean(x[1] for x in b):.0%} | {statistics.mean(x[1] for x in t):.0%} |"
            )


if __name__ == "__main__":
    main()
