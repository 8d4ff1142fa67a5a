"""The two rollout backends side by side: vLLM's CPU build against HF generate.

    python bench/rollout_backends.py [--rounds 3] [--sizes tiny,mid] [--steps 12]

Two measurements, each alternating the backends (hf, vllm, hf, vllm, …) so that
machine noise hits both, each backend in a fresh process:

1. **Rollout tokens/s** of the engine alone (the ``hf`` and ``vllm``
   backends' engines, built by the backend registry): 64 arithmetic prompts × 8 samples, temperature 1,
   up to 24 new tokens, fp32; one warm-up batch, then the median of 3 batches.
2. **End-to-end GRPO step time**: ``flowc run`` of the TRL comparison's flow
   (GRPO without a reference, 8 prompts × 8 samples, 24-token limit) with
   ``--rollout hf`` and ``--rollout vllm``; median s/step after two warm-up steps.

Sizes as in bench/grpo_vs_trl: ``tiny`` (the shipped 0.5M model), ``mid``
(34M, hidden 512, 8 layers, random init). Prints a markdown table with
vllm/hf ratios.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from fresh import in_fresh_process  # bench/fresh.py

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "grpo_vs_trl"))

PROMPTS, N, MAX_TOKENS, BATCHES = 64, 8, 24, 3


def engine_rate(backend: str, model: str) -> dict:
    """(In a fresh process) generated tokens/s of one backend's engine."""
    import torch
    from transformers import AutoTokenizer

    from flowc.ir.sampling import SamplingParams
    from flowc.runtime.data import tokenize_prompts
    from flowc.tasks import arithmetic as arith

    torch.set_num_threads(os.cpu_count() or 1)
    tok = AutoTokenizer.from_pretrained(model)
    train, _ = arith.split()
    prompts = tokenize_prompts(tok, [r["prompt"] for r in arith.records(train[:PROMPTS])], 8)
    from flowc.ir.plan import Layout
    from flowc.runtime.backends import EngineInit
    from flowc.runtime.worker import make_engine

    t0 = time.perf_counter()
    init = EngineInit(
        role="actor",
        kind="policy",
        source=model,
        layout=Layout(backend=backend),
        dtype="float32",
        seed=0,
        tokenizer=model,
        max_model_len=8 + MAX_TOKENS,
    )
    eng = make_engine(init)  # the registry's engine for the backend, as a worker builds it
    start_s = time.perf_counter() - t0
    sp = SamplingParams()
    rates = []
    for step in range(BATCHES + 1):
        t = time.perf_counter()
        r, _ = eng.generate(prompts, n=N, sp=sp, max_tokens=MAX_TOKENS, step=step, round_=0, row_offset=0)
        dt = time.perf_counter() - t
        if step:  # the first batch is warm-up
            rates.append(float(r.response_mask.sum()) / dt)
    return {
        "tokens_per_s": statistics.median(rates),
        "start_s": start_s,
        "mean_len": float(r.response_mask.sum()) / (PROMPTS * N),
    }


def measure_engine(backend: str, model: str) -> dict:
    return in_fresh_process("rollout_backends", "engine_rate", backend, model, timeout=900)


def main() -> None:
    from run import model_dir, run_flowc  # bench/grpo_vs_trl/run.py

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--sizes", default="tiny,mid")
    args = ap.parse_args()
    cache = ROOT / "bench" / ".cache"
    cache.mkdir(exist_ok=True)
    backends = ("hf", "vllm")
    eng: dict[str, dict[str, list[dict]]] = {}
    e2e: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory() as d:
        for size in args.sizes.split(","):
            model = model_dir(size, cache)
            eng[size] = {b: [] for b in backends}
            e2e[size] = {b: [] for b in backends}
            for r in range(args.rounds):
                for b in backends:
                    eng[size][b].append(measure_engine(b, model))
                    e2e[size][b].append(run_flowc(model, args.steps, 1e-4, Path(d), rollout=b))
                print(
                    f"{size} round {r + 1}: engine {[(b, round(eng[size][b][-1]['tokens_per_s'])) for b in backends]}"
                    f"  step {[(b, round(e2e[size][b][-1]['step_s'], 3)) for b in backends]}",
                    flush=True,
                )
    print()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"{args.rounds} alternating rounds, medians"
    )
    print()
    print(
        "| size | backend | engine start | rollout tokens/s | mean response | GRPO s/step | vllm/hf tokens/s | hf/vllm s/step |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for size in eng:
        med = {b: {k: statistics.median(x[k] for x in eng[size][b]) for k in eng[size][b][0]} for b in backends}
        step = {b: statistics.median(x["step_s"] for x in e2e[size][b]) for b in backends}
        for b in backends:
            ratio = (
                (f"{med['vllm']['tokens_per_s'] / med['hf']['tokens_per_s']:.2f}×", f"{step['hf'] / step['vllm']:.2f}×")
                if b == "vllm"
                else ("", "")
            )
            print(
                f"| {size} | {b} | {med[b]['start_s']:.1f} s | {med[b]['tokens_per_s']:.0f} | {med[b]['mean_len']:.1f} | "
                f"{step[b]:.3f} | {ratio[0]} | {ratio[1]} |"
            )


if __name__ == "__main__":
    main()
