"""`flowc plan` wall time of two checkouts side by side (a planner change against the commit
before it), alternating per row, and whether they print the same plan.

    git worktree add /tmp/before <commit>        # with its own environment (see docs/benchmarks.md)
    python bench/plan_compare.py /tmp/before . [--repeats R]

Each row runs `flowc plan FLOW --model actor=llama-3.1-70b --cluster Nx8xH100 --json` in a fresh
process of each checkout (its own .venv), CLI start-up included; median of R repeats.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path

FLOWS = {"grpo": "examples/grpo.py", "ppo": "examples/ppo.py"}
NODES = [1, 2, 4, 8, 16, 32, 64, 128]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args()
    roots = {"before": str(Path(args.before).resolve()), "after": str(Path(args.after).resolve())}
    table(roots, args.repeats)


def table(roots: dict[str, str], repeats: int) -> None:
    print("| flow | GPUs | before (s) | after (s) | after/before | same plan |")
    print("|---|---:|---:|---:|---:|---|")
    for f, path in FLOWS.items():
        for n in NODES:
            walls: dict[str, list[float]] = {k: [] for k in roots}
            outs: dict[str, str] = {}
            for _ in range(repeats):
                for k, root in roots.items():
                    cmd = [f"{root}/.venv/bin/python", "-m", "flowc.cli", "plan", path, "--model", "actor=llama-3.1-70b"]
                    cmd += ["--cluster", f"{n}x8xH100", "--json"]
                    t = time.perf_counter()
                    r = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
                    walls[k].append(time.perf_counter() - t)
                    outs[k] = r.stdout if r.returncode == 0 else "error: " + r.stderr.strip().splitlines()[-1][:80]
            b, a = statistics.median(walls["before"]), statistics.median(walls["after"])
            same = "yes" if outs["before"] == outs["after"] else "no"
            print(f"| {f} | {n * 8} | {b:.2f} | {a:.2f} | {a / b:.2f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
