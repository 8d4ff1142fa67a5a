"""Measure what each rollout backend costs on this machine, for the planner's choice between them.

    python bench/calibrate_rollout.py [--sizes tiny,mid] [--reps 3]

The cost model prices generation the same way for every backend (FLOPs, weight and KV-cache
reads: passes/costs.py, ``generate_cost``) and adds, per backend, what its engine costs on top
(``rollout:`` in the hardware profile, :class:`flowc.ir.hardware.RolloutCost`):

* ``request_ms``: host work per request (vLLM schedules, tokenises and detokenises each);
* ``step_ms`` and ``layer_overhead_us``: host work per decode step and per layer of one;
* ``decode_scale``: the speed of its decode kernels against the profile's calibrated rates.

Each backend's engine is built as a worker builds it (the backend registry), once per model
size, and generates batches of several shapes (requests × token limit), fresh seeds each, after
a warm-up batch; medians of ``--reps``. For every batch the script computes what the shared
model prices from the responses actually generated (the decode steps, the sequences active at
each step: all of them until the longest ends for the HF loop's padded batch, the unfinished
ones for vLLM) and fits the four figures by non-negative least squares to the measured times.
It prints the YAML to paste under ``rollout:`` in ir/hardware/cpu.yaml and each batch's measured
and predicted time.

Sizes: ``tiny`` (the shipped 0.5M model), ``mid`` (34M, random init; bench/grpo_vs_trl).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from fresh import in_fresh_process  # bench/fresh.py

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "grpo_vs_trl"))

SHAPES = ((64, 8, 24), (8, 8, 24), (64, 8, 6), (8, 8, 6), (64, 1, 24))  # prompts, samples each, token limit
PROMPT_LEN = 8


def measure(backend: str, model: str, reps: int) -> dict:
    """(In a fresh process) each shape's median time and what it generated."""
    import torch
    from transformers import AutoTokenizer

    from flowc.ir.plan import Layout
    from flowc.ir.sampling import SamplingParams
    from flowc.runtime.backends import EngineInit
    from flowc.runtime.data import tokenize_prompts
    from flowc.runtime.worker import make_engine
    from flowc.tasks import arithmetic as arith

    torch.set_num_threads(os.cpu_count() or 1)
    tok = AutoTokenizer.from_pretrained(model)
    train, _ = arith.split()
    rows = [r["prompt"] for r in arith.records(train[:64])]
    init = EngineInit(
        role="actor",
        kind="policy",
        source=model,
        layout=Layout(backend=backend),
        dtype="float32",
        seed=0,
        tokenizer=model,
        max_model_len=PROMPT_LEN + max(s[2] for s in SHAPES),
    )
    t0 = time.perf_counter()
    eng = make_engine(init)
    start_s = time.perf_counter() - t0
    sp = SamplingParams()
    out = []
    step = 0
    for prompts, n, limit in SHAPES:
        batch = tokenize_prompts(tok, rows[:prompts], PROMPT_LEN)
        eng.generate(batch, n=n, sp=sp, max_tokens=limit, step=step, round_=0, row_offset=0)  # warm-up
        step += 1
        times, lengths = [], []
        for _ in range(reps):
            t = time.perf_counter()
            r, _ = eng.generate(batch, n=n, sp=sp, max_tokens=limit, step=step, round_=0, row_offset=0)
            times.append(time.perf_counter() - t)
            lengths.append(r.response_mask.sum(-1).tolist())
            step += 1
        k = times.index(statistics.median(times))
        out.append({"prompts": prompts, "n": n, "limit": limit, "time_s": times[k], "lengths": lengths[k]})
    return {"start_s": start_s, "batches": out}


def _in_process(backend: str, model: str, reps: int) -> dict:
    return in_fresh_process("calibrate_rollout", "measure", backend, model, reps)


def features(backend: str, model: str, batch: dict) -> tuple[list[float], float]:
    """The fit's features of one measured batch — (requests, decode steps, steps × layers, the
    shared model's decode time at decode_scale 1) — and the shared model's prefill time."""
    from flowc.ir.cluster import ClusterSpec
    from flowc.ir.models import ModelSpec
    from flowc.ir.plan import STATIC_BATCH_BACKENDS, Layout
    from flowc.passes.costs import Hw
    from flowc.passes.generation_costs import decode_step_device_s, prefill_device_s

    m = ModelSpec.resolve(model).model_copy(update={"dtype": "float32"})
    hw = Hw.of(ClusterSpec.parse("local:1"), "float32")  # measured in fp32 on every core
    lay = Layout(backend=backend)
    lengths = [int(x) for x in batch["lengths"]]
    b, steps = len(lengths), max(lengths)
    decode = 0.0
    for t in range(steps):  # the planner's per-step model, with the sequences this batch really had active
        active = b if backend in STATIC_BATCH_BACKENDS else sum(1 for x in lengths if x > t)
        decode += decode_step_device_s(m, lay, hw, active, PROMPT_LEN + t)
    prefill = prefill_device_s(m, lay, hw, b, PROMPT_LEN)
    return [float(b), float(steps), float(steps * m.num_layers), decode], prefill


def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a handful of features: solve, drop the most negative
    coefficient (fixed at 0), solve again."""
    free = list(range(a.shape[1]))
    while True:
        x = np.zeros(a.shape[1])
        if free:
            x[free] = np.linalg.lstsq(a[:, free], y, rcond=None)[0]
        neg = [j for j in free if x[j] < 0]
        if not neg:
            return x
        free.remove(min(neg, key=lambda j: x[j]))


def main() -> None:
    from run import model_dir  # bench/grpo_vs_trl/run.py

    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="tiny,mid")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--backends", default="hf,vllm")
    ap.add_argument("--measured", type=Path, help="fit these saved measurements (a previous run's JSON) instead of measuring")
    args = ap.parse_args()
    cache = ROOT / "bench" / ".cache"
    cache.mkdir(exist_ok=True)
    models = {s: model_dir(s, cache) for s in args.sizes.split(",")}
    got: dict[str, dict[str, dict]] = {}
    if args.measured:
        got = json.loads(args.measured.read_text())
    else:
        for b in args.backends.split(","):
            for size, model in models.items():
                got.setdefault(b, {})[size] = _in_process(b, model, args.reps)
                print(f"measured {b} {size}: start {got[b][size]['start_s']:.1f} s", flush=True)
        saved = cache / "rollout-measured.json"
        saved.write_text(json.dumps(got))
        print(f"measurements saved to {saved} (refit with --measured {saved})")
    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}\n")
    print("rollout:")
    table = []
    for b, by_size in got.items():
        rows, ys, pre = [], [], []
        for size, res in by_size.items():
            for batch in res["batches"]:
                f, p = features(b, models[size], batch)
                rows.append(f)
                ys.append(batch["time_s"] - p)
                pre.append((size, batch, p))
        a, y = np.array(rows), np.array(ys)
        # relative error matters: weight each batch by 1/time so short batches count as much as long ones
        w = 1.0 / np.maximum(np.array([bt["time_s"] for _, bt, _ in pre]), 1e-3)
        req, step, layer, inv_scale = nnls(a * w[:, None], y * w)
        scale = 1.0 / inv_scale if inv_scale > 0 else 1.0
        start = statistics.median(res["start_s"] for res in by_size.values())
        print(f"  {b}:")
        print(f"    start_s: {start:.2f}")
        print(f"    request_ms: {req * 1e3:.3f}")
        print(f"    step_ms: {step * 1e3:.3f}")
        print(f"    layer_overhead_us: {layer * 1e6:.1f}")
        print(f"    decode_scale: {scale:.3f}")
        pred = a @ np.array([req, step, layer, inv_scale])
        for (size, batch, p), fit in zip(pre, pred, strict=True):
            mean = statistics.mean(batch["lengths"])
            table.append(
                (
                    b,
                    size,
                    f"{batch['prompts']}×{batch['n']}",
                    batch["limit"],
                    mean,
                    max(batch["lengths"]),
                    batch["time_s"],
                    fit + p,
                )
            )
    print("\n| backend | size | requests | limit | mean response | longest | measured s | fitted s | fitted/measured |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for b, size, shape, limit, mean, longest, t, f in table:
        print(f"| {b} | {size} | {shape} | {limit} | {mean:.1f} | {longest} | {t:.3f} | {f:.3f} | {f / t:.2f} |")


if __name__ == "__main__":
    main()
