"""Agent rollouts on this machine: throughput against environment workers, and learning with and
without the tool.

    python bench/agentic.py [--latency-ms 20] [--rounds 3] [--prompts 32] [--n 4] [--learn-steps 40]

**Throughput.** The built-in calculator task's environment with ``--latency-ms`` of simulated tool
latency per step (a sleep in ``step``: a real tool is a search call or a sandbox run), one rollout
of ``--prompts`` × ``--n`` trajectories (at most 3 turns) per measurement, on the shipped
calc-tiny model, at 1, 2 and 4 environment processes, for each installed rollout backend. The
configurations alternate within each of ``--rounds`` rounds (the median is kept), so the machine's
load hits them alike; turns/s and trajectories/s are reported with their ratio to 1 worker. The
engine runs in this process (no Ray), as a rollout worker runs it.

**Learning** (``--learn-steps`` > 0): examples/grpo_tool.py trained on the calculator task twice —
with the calculator, and with an environment whose calls return nothing (``NoTool``: the policy
must multiply in its head) — with held-out accuracy (500 problems, greedy) every 10 steps.

Prints markdown tables (docs/benchmarks.md#agents keeps them) and writes ``RUNS/agentic.json``.
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
sys.path.insert(0, str(HERE))

from flowc.tasks.calculator import Calculator  # noqa: E402


class SlowCalculator(Calculator):
    """The calculator with a tool latency (set by the bench before it binds the class)."""

    latency_s = 0.02

    def step(self, action):
        time.sleep(self.latency_s)
        return super().step(action)


class NoTool(Calculator):
    """The calculator task with the tool switched off: a call returns no result."""

    def step(self, action):
        if action.endswith(")"):
            return "|", 0.0, False, {"tool_calls": 1.0, "tool_ok": 0.0}
        return super().step(action)


def engine(backend: str):
    from flowc.ir.ops import RoleKind
    from flowc.ir.plan import Layout
    from flowc.runtime.backends import EngineInit
    from flowc.runtime.worker import make_engine
    from flowc.tasks.calculator import asset_dir

    src = str(asset_dir())
    init = EngineInit(
        role="actor",
        kind=RoleKind.POLICY,
        source=src,
        layout=Layout(backend=backend),
        dtype="float32",
        seed=0,
        tokenizer=src,
        max_model_len=64,
    )
    return make_engine(init)


def throughput(args: argparse.Namespace) -> list[dict]:
    from transformers import AutoTokenizer

    from flowc.ir.sampling import SamplingParams
    from flowc.runtime.backends import BACKENDS
    from flowc.runtime.data import tokenize_prompts
    from flowc.runtime.envs import bind_class
    from flowc.tasks import calculator as calc

    SlowCalculator.latency_s = args.latency_ms / 1000.0
    train, _ = calc.split()
    rows = calc.records(train[: args.prompts])
    backends = [b for b in ("hf", "vllm") if BACKENDS[b].installed()]
    out = []
    for backend in backends:
        eng = engine(backend)
        tok = AutoTokenizer.from_pretrained(str(calc.asset_dir()))
        prompts = tokenize_prompts(tok, [r["prompt"] for r in rows], 8)
        times: dict[int, list[float]] = {w: [] for w in args.workers}
        turns: dict[int, list[float]] = {w: [] for w in args.workers}
        for rnd in range(args.rounds + 1):  # round 0 warms the engine and the processes up
            for w in args.workers:
                b = bind_class("calc", SlowCalculator, "bench:SlowCalculator", workers=w, timeout_s=30, error_reward=0.0)
                eng.pools.pop("calc", None)  # a pool of this size (closed below)
                t0 = time.perf_counter()
                res = eng.generate_agent(
                    prompts,
                    rows,
                    n=args.n,
                    sp=SamplingParams(temperature=1.0),
                    turn_tokens=20,
                    budget=20,
                    max_turns=3,
                    binding=b,
                    step=rnd,
                    round_=0,
                    row_offset=0,
                )
                dt = time.perf_counter() - t0
                eng.pools.pop("calc").close()
                if rnd:
                    times[w].append(dt)
                    turns[w].append(float(res.rollout.turns.sum()))
        base = statistics.median(times[args.workers[0]])
        for w in args.workers:
            t = statistics.median(times[w])
            out.append(
                {
                    "backend": backend,
                    "env_workers": w,
                    "rollout_s": t,
                    "turns_per_s": statistics.median(turns[w]) / t,
                    "trajectories_per_s": args.prompts * args.n / t,
                    "speedup": base / t,
                }
            )
        eng.close()
    return out


def learn(args: argparse.Namespace, runs: Path) -> dict[str, list[tuple[int, float, float]]]:
    curves = {}
    for name, env in (("with the calculator", None), ("without the tool", "bench/agentic.py:NoTool")):
        out = runs / name.replace(" ", "_")
        cmd = [sys.executable, "-m", "flowc.cli", "run", "examples/grpo_tool.py", "--steps", str(args.learn_steps)]
        cmd += ["--out", str(out), "--rollout", "hf", "-q", "--set", "eval_every=10", "--set", "checkpoint_every=0"]
        cmd += ["--report-to", "none", *(["--env", f"calc={env}"] if env else [])]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        curves[name] = [
            (m["step"], m["eval/accuracy"], m.get("eval/agent/info/tool_calls", 0.0)) for m in rows if "eval/accuracy" in m
        ]
    return curves


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--latency-ms", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--workers", default="1,2,4")
    ap.add_argument("--learn-steps", type=int, default=40)
    ap.add_argument("--runs", default="runs/bench-agentic")
    args = ap.parse_args()
    args.workers = [int(w) for w in args.workers.split(",")]
    runs = ROOT / args.runs
    runs.mkdir(parents=True, exist_ok=True)
    print(f"machine: {platform.processor() or platform.machine()}, {platform.system()}, python {platform.python_version()}")
    rows = throughput(args)
    print(
        f"\nrollout of {args.prompts}x{args.n} trajectories, tool latency {args.latency_ms:g} ms per step (median of {args.rounds})\n"
    )
    print("| backend | env workers | rollout s | turns/s | trajectories/s | vs 1 worker |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['backend']} | {r['env_workers']} | {r['rollout_s']:.2f} | {r['turns_per_s']:.0f} | "
            f"{r['trajectories_per_s']:.0f} | {r['speedup']:.2f}× |"
        )
    curves = learn(args, runs) if args.learn_steps > 0 else {}
    if curves:
        print("\n| step | " + " | ".join(f"accuracy {k} (tool calls)" for k in curves) + " |")
        print("|---:|" + "---:|" * len(curves))
        for i, (step, *_) in enumerate(next(iter(curves.values()))):
            print(f"| {step} | " + " | ".join(f"{c[i][1]:.3f} ({c[i][2]:.2f})" for c in curves.values()) + " |")
    (runs / "agentic.json").write_text(json.dumps({"throughput": rows, "curves": curves, "args": vars(args)}, indent=1))


if __name__ == "__main__":
    main()
