"""How long `flowc plan` takes, CLI start-up included, against cluster size and role count.

    python bench/plan_scaling.py [--repeats 3]      # prints a markdown table

Each cell runs the real command line in a fresh process
(`flowc plan FLOW --model actor=llama-3.1-70b --cluster Nx8xH100 --json`) and
reports the median wall time of the repeats. The same run measures the start-up
alone (`flowc graph FLOW`: Python, torch, tracing; no planning) so the table
also gives the search's own time, which is steadier than the wall time when a
shared machine is busy. Goals (issue "Planner"): PPO with
four 70B roles in under 5 s on 128 GPUs and under 30 s on 1024 GPUs.
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

ROOT = Path(__file__).resolve().parents[1]
FLOWS = {"grpo (policy + reference)": "examples/grpo.py", "ppo (policy, critic, reference, reward model)": "examples/ppo.py"}
NODES = [1, 2, 4, 8, 16, 32, 64, 128]


def run(flow: str, nodes: int) -> tuple[float, dict]:
    cmd = [
        sys.executable,
        "-m",
        "flowc.cli",
        "plan",
        flow,
        "--model",
        "actor=llama-3.1-70b",
        "--cluster",
        f"{nodes}x8xH100",
        "--json",
    ]
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode != 0:
        return wall, {"error": r.stderr.strip().splitlines()[0]}
    return wall, json.loads(r.stdout)


def startup(flow: str, repeats: int) -> float:
    walls = []
    for _ in range(repeats):
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "flowc.cli", "graph", flow], cwd=ROOT, capture_output=True, check=True)
        walls.append(time.perf_counter() - t)
    return statistics.median(walls)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(
        f"machine: {platform.processor() or platform.machine()}, {platform.python_version()}, repeats {args.repeats}, median wall time"
    )
    print()
    print("| flow | GPUs | wall time | planning (wall − start-up) | strategy | device splits scored | predicted step |")
    print("|---|---:|---:|---:|---|---:|---:|")
    for name, flow in FLOWS.items():
        base = startup(flow, args.repeats)
        print(f"| {name} | start-up only | {base:.2f} s | — | — | — | — |")
        for n in NODES:
            walls, plan = [], {}
            for _ in range(args.repeats):
                w, plan = run(flow, n)
                walls.append(w)
            if "error" in plan:
                wall = statistics.median(walls)
                print(f"| {name} | {n * 8} | {wall:.2f} s | {wall - base:.2f} s | infeasible | — | {plan['error'][:60]} |")
                continue
            s = plan["search"]
            wall = statistics.median(walls)
            print(
                f"| {name} | {n * 8} | {wall:.2f} s | {wall - base:.2f} s | {s['strategy']} | {s['device_splits']} "
                f"| {plan['predicted']['step_time_s']:.1f} s |"
            )


if __name__ == "__main__":
    main()
