"""What one iteration's Ray round trips cost, and what other lowerings of the same iteration would save.

    python bench/ray_round_trips.py [--steps 300] [--rounds 3]

A GRPO iteration on one worker makes four actor calls: generate on the worker; the reward on
the reward actor (its texts read back by the controller first); the update on the worker (with
the advantages the controller computed); the weight sync on the worker. Here each method does
no work, only takes and returns payloads of the tiny run's sizes (64 prompts of 8 token ids, 64
short texts, 64 advantages), so the time per iteration is the transport alone — the ceiling of
what a leaner lowering can save from a flowc step. Three lowerings, alternating in each round:

* ``calls``: as flowc lowers it today: the controller waits for each result it needs
  (generate's texts, the scores) and submits the next call;
* ``refs``: the same calls chained by object references (the reward takes generate's output
  reference, the update the reward's), the controller waiting only at the end — data stays
  with the actors, the controller never reads it;
* ``compiled``: the chain as one Ray compiled graph (``ray.dag`` with ``experimental_compile``):
  shared-memory channels between the actors, no per-call scheduling.

Prints the median microseconds per iteration of each and their ratios against ``calls``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import ray

PROMPTS, SAMPLES = 8, 8


@ray.remote(num_cpus=0)
class Trainer:
    """Stands in for a flowc worker (generate, update, sync)."""

    def generate(self, prompts: list[list[int]]) -> dict:
        return {"ids": [[*p, 1, 2, 3] for p in prompts for _ in range(SAMPLES)], "texts": ["12"] * (len(prompts) * SAMPLES)}

    def update(self, rollout: dict, advantages: list[float]) -> dict:
        return {"loss": 0.0, "rows": len(advantages)}

    def update_from(self, scored: dict) -> dict:
        return {"loss": 0.0, "rows": len(scored["advantages"])}

    def sync(self, stats: dict) -> dict:
        return {"bytes": 0, **stats}


@ray.remote(num_cpus=0)
class Scorer:
    """Stands in for the reward process (and, for the chained lowerings, the advantage op)."""

    def score(self, texts: list[str]) -> list[float]:
        return [float(t == "12") for t in texts]

    def score_rollout(self, rollout: dict) -> dict:
        scores = [float(t == "12") for t in rollout["texts"]]
        mean = sum(scores) / len(scores)
        return {"rollout": rollout, "advantages": [s - mean for s in scores]}


def calls(t, s, prompts) -> dict:
    out = ray.get(t.generate.remote(prompts))
    scores = ray.get(s.score.remote(out["texts"]))
    mean = sum(scores) / len(scores)
    upd = t.update.remote(out, [x - mean for x in scores])
    return ray.get(t.sync.remote(upd))


def refs(t, s, prompts) -> dict:
    return ray.get(t.sync.remote(t.update_from.remote(s.score_rollout.remote(t.generate.remote(prompts)))))


def main() -> None:
    from flowc.runtime.ray_session import init_ray, shutdown_ray

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    init_ray(None)
    t, s = Trainer.remote(), Scorer.remote()
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12]] * PROMPTS
    ray.get([t.sync.remote({}), s.score.remote([])])
    from ray.dag import InputNode

    timings: dict[str, list[float]] = {"calls": [], "refs": [], "compiled": []}
    try:
        for _ in range(args.rounds):
            for name, fn in (("calls", calls), ("refs", refs)):
                for _ in range(20):
                    fn(t, s, prompts)
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    fn(t, s, prompts)
                timings[name].append((time.perf_counter() - t0) / args.steps * 1e6)
            with InputNode() as inp:  # a DAG compiles once: a new one each round
                dag = t.sync.bind(t.update_from.bind(s.score_rollout.bind(t.generate.bind(inp))))
            compiled = dag.experimental_compile()
            try:
                for _ in range(20):
                    ray.get(compiled.execute(prompts))
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    ray.get(compiled.execute(prompts))
                timings["compiled"].append((time.perf_counter() - t0) / args.steps * 1e6)
            finally:
                compiled.teardown()
    finally:
        shutdown_ray()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Ray {ray.__version__}; {args.rounds} rounds of {args.steps} iterations"
    )
    print()
    print("| lowering | µs per iteration (median of rounds) | rounds | vs calls |")
    print("|---|---:|---|---:|")
    base = statistics.median(timings["calls"])
    for name, xs in timings.items():
        med = statistics.median(xs)
        print(f"| {name} | {med:.0f} | {', '.join(f'{x:.0f}' for x in xs)} | {med / base:.2f}× |")


if __name__ == "__main__":
    main()
