"""Do token-budget micro-batches pay? flowc's update with one padded micro-batch against the
planner's token budget and length-aware cuts, side by side.

    python bench/token_budget.py [--sizes tiny,mid] [--rounds 3] [--iters 6] [--interleave]

The workload is bench/grpo_vs_trl's (64 rows, an 8-token prompt, up to 24 response tokens)
with the response lengths a flowc run of the 34 M random model produced (36 % of responses
stop at the limit, the rest spread over 1-23 tokens; prompts of 5-7 tokens). Each mode runs
the shared training loop (``backends.training.TrainEngine`` on fsdp2, one process, two threads)
in a fresh interpreter: ``rows`` is one micro-batch of all 64 rows (what row micro-batches of
the planned size run: every row padded to the widest), ``cuts`` the planner's budget with its
``micro_overhead_tokens`` (rows sorted by length, cut where padding saved exceeds a
micro-batch's fixed cost), ``fill32`` a budget of 32 rows of the longest length filled
greedily, ``shared`` the planner's cuts with ``share_prompts`` (the rows come in groups of
8 samples of one prompt, as GRPO's: a micro-batch where it pays computes each distinct prompt
once, then the responses on its KV cache), ``packed`` the rows without their padding in packed
lines (``pack_sequences``), and ``packed_shared`` packed lines that hold each prompt once with
its rows' responses after it (both, as the planner now plans the bench's run). Modes
alternate within each round; reported: the
median update time, the micro-batches it ran (and of those, how many shared their prompts),
the tokens it computed (padding included), and the ratio to ``rows``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from fresh import in_fresh_process  # bench/fresh.py

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "grpo_vs_trl"))
ROWS, PROMPT, RESPONSE, N = 64, 8, 24, 8


def lengths(seed: int = 0) -> tuple[list[int], list[int]]:
    """Prompt and response lengths per row; the rows come in groups of ``N`` samples of one prompt."""
    rng = random.Random(seed)
    q = [RESPONSE if rng.random() < 0.36 else rng.randint(1, RESPONSE - 1) for _ in range(ROWS)]
    p = [rng.randint(5, 7) for _ in range(ROWS // N) for _ in range(N)]
    return p, q


def planned(model: str, dtype: str) -> dict:
    """The training layout and micro-batch fixed cost ``flowc plan`` gives the bench's run (as
    ``flowc run`` would plan it: local CPUs, the run config's dtype)."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(f"dtype: {dtype}\n")
    cmd = [
        sys.executable,
        "-m",
        "flowc.cli",
        "plan",
        str(HERE / "grpo_vs_trl" / "grpo_noref.py"),
        "--model",
        f"actor={model}",
        "--workload",
        f"prompts=8,prompt_len={PROMPT},response_len={RESPONSE}",
        "--config",
        f.name,
        "--json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout
    ph = json.loads(out)["roles"]["actor"]["phases"]["train"]
    return {"micro_tokens": ph["layout"]["micro_tokens"], "overhead": ph["micro_overhead_tokens"]}


def batch():
    """The bench's rollout (8 prompts × 8 samples, the lengths of :func:`lengths`), advantages and masks."""
    import torch

    from flowc.ir.functional import Rollout

    p, q = lengths()
    g = torch.Generator().manual_seed(0)
    pmask = torch.zeros(ROWS, PROMPT, dtype=torch.bool)
    rmask = torch.zeros(ROWS, RESPONSE, dtype=torch.bool)
    for i in range(ROWS):
        pmask[i, PROMPT - p[i] :] = True
        rmask[i, : q[i]] = True
    r = Rollout(
        torch.randint(3, 30, (ROWS // N, PROMPT), generator=g).repeat_interleave(N, 0) * pmask,
        pmask,
        torch.randint(3, 30, (ROWS, RESPONSE), generator=g),
        rmask,
        torch.zeros(ROWS, RESPONSE),
    )
    return r, torch.randn(ROWS, generator=g), pmask, rmask


def engine(model: str, dtype: str, pack: bool = False):
    """flowc's shared training loop on fsdp2 in this process (all its cores), as the bench runs it
    (``pack``: built for packed micro-batches, which checks the model packs correctly)."""
    import torch

    from flowc.ir.plan import Layout
    from flowc.ir.run_config import OptimConfig
    from flowc.runtime.backends import EngineInit
    from flowc.runtime.backends.fsdp2 import Fsdp2Trainer
    from flowc.runtime.backends.training import TrainEngine

    torch.set_num_threads(os.cpu_count() or 1)
    layout = Layout(pack_sequences=pack)
    init = EngineInit(role="actor", kind="policy", source=model, layout=layout, dtype=dtype, seed=0, optim=OptimConfig(lr=1e-6))
    return TrainEngine(Fsdp2Trainer(init))


def grpo_update(eng, r, adv, **micro) -> None:
    """One GRPO update of the batch (clipped surrogate, token-mean), micro-batched as ``micro`` says."""
    from flowc.ir.losses import ppo_clip

    eng.update(
        r,
        {"advantages": adv},
        loss=ppo_clip(0.2),
        kl_coef=0.0,
        kl_kind="k1",
        entropy_coef=0.0,
        mini_sizes=[ROWS],
        epochs=1,
        **micro,
    )


def interleaved(model: str, dtype: str, iters: int, budget: int, overhead: float) -> dict:
    """(In a fresh process) the planner's cuts without and with shared prompts, update after
    update in one process (so the machine's drift hits both alike): median ms of each."""
    eng = engine(model, dtype)
    r, adv, _, _ = batch()
    times: dict[bool, list[float]] = {False: [], True: []}
    shared = 0
    for i in range(2 * iters + 2):
        share = bool(i % 2)
        t = time.perf_counter()
        grpo_update(eng, r, adv, micro=ROWS, micro_tokens=budget, micro_overhead=overhead, share_prompts=share)
        if i >= 2:  # the first of each is warm-up
            times[share].append(time.perf_counter() - t)
        shared = max(shared, eng.shared_prompts)
    cuts, with_share = (statistics.median(times[k]) * 1e3 for k in (False, True))
    return {"cuts_ms": cuts, "shared_ms": with_share, "ratio": with_share / cuts, "shared": shared}


def measure(model: str, dtype: str, mode: str, iters: int, budget: int, overhead: float) -> dict:
    """(In a fresh process) ``iters`` updates of the bench's batch under one micro-batching mode."""
    import torch

    from flowc.runtime.backends.micro_batches import shares_prompt, token_bins, trim
    from flowc.runtime.batches import take_rows
    from flowc.runtime.packing import pack

    cut = {"micro": ROWS, "micro_tokens": budget, "micro_overhead": overhead}
    kw = {
        "rows": {"micro": ROWS},
        "cuts": cut,
        "shared": {**cut, "share_prompts": True},
        "fill32": {"micro": ROWS, "micro_tokens": 32 * (PROMPT + RESPONSE)},
        "packed": {**cut, "pack_sequences": True},
        "packed_shared": {**cut, "pack_sequences": True, "share_prompts": True},
    }[mode]
    share, packed = kw.get("share_prompts", False), kw.get("pack_sequences", False)
    eng = engine(model, dtype, pack=packed)
    r, adv, pmask, rmask = batch()
    if packed:  # the micro-batches as the engine cuts them, and what their lines compute
        parts, bins, groups, _ = eng.split(r, ROWS, 1, budget, overhead, share, True)
        ratio = eng.b.attention_ratio
        lines = [
            pack(p.prompt_ids, p.prompt_mask, p.response_ids, p.present, ratio, groups=g)
            for p, g in zip(parts, groups, strict=True)
        ]
        computed = sum(x.ids.numel() for x in lines)
    bins = (
        token_bins(r, kw["micro_tokens"], 1, kw.get("micro_overhead", 0.0), share)
        if "micro_tokens" in kw and not packed
        else (bins if packed else [torch.arange(ROWS)])
    )

    def tokens(b: torch.Tensor) -> int:  # what the micro-batch computes: prompts once per distinct prompt when shared
        wp, wq = int(pmask[b].sum(-1).max()), int(rmask[b].sum(-1).max())
        part = trim(take_rows(r, b))
        prompts = (
            len(b)
            if shares_prompt(part, kw.get("micro_overhead", 0.0)) is None or not share
            else len({tuple(x) for x in r.prompt_ids[b].tolist()})
        )
        return prompts * wp + len(b) * wq

    padded = computed if packed else sum(tokens(b) for b in bins)

    def update() -> None:
        grpo_update(eng, r, adv, **kw)

    update()  # warm-up
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        update()
        times.append(time.perf_counter() - t)
    return {
        "ms": statistics.median(times) * 1e3,
        "micro_batches": eng.micro_batches,
        "padded": padded,
        "shared": eng.shared_prompts,
        "packed": eng.packed,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="tiny,mid")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument(
        "--interleave", action="store_true", help="only cuts against shared prompts, update after update in one process"
    )
    args = ap.parse_args()
    from run import model_dir  # bench/grpo_vs_trl/run.py

    cache = ROOT / "bench" / ".cache"
    cache.mkdir(exist_ok=True)
    modes = ("rows", "cuts", "fill32", "shared", "packed", "packed_shared")
    rows = []
    for size in args.sizes.split(","):
        model = model_dir(size, cache)
        for dtype in args.dtypes.split(","):
            pl = in_fresh_process("token_budget", "planned", model, dtype)
            if args.interleave:
                for _ in range(args.rounds):
                    x = in_fresh_process(
                        "token_budget", "interleaved", model, dtype, args.iters, pl["micro_tokens"], pl["overhead"]
                    )
                    print(
                        f"| {size} | {dtype} | {x['cuts_ms']:.0f} | {x['shared_ms']:.0f} ({x['shared']} shared) | {x['ratio']:.2f}× |"
                    )
                continue
            got: dict[str, list[dict]] = {m: [] for m in modes}
            for _ in range(args.rounds):
                for mode in modes:
                    got[mode].append(
                        in_fresh_process(
                            "token_budget", "measure", model, dtype, mode, args.iters, pl["micro_tokens"], pl["overhead"]
                        )
                    )
            base = statistics.median(x["ms"] for x in got["rows"])
            for mode in modes:
                ms = statistics.median(x["ms"] for x in got[mode])
                rows.append(
                    (
                        size,
                        dtype,
                        mode,
                        ms,
                        f"{got[mode][0]['micro_batches']}"
                        + (f" ({got[mode][0]['shared']} shared)" if got[mode][0]["shared"] else "")
                        + (f" ({got[mode][0]['packed']} packed)" if got[mode][0].get("packed") else ""),
                        got[mode][0]["padded"],
                        ms / base,
                        pl["overhead"],
                        [round(x["ms"]) for x in got[mode]],
                    )
                )
                print(json.dumps(rows[-1]), flush=True)
    if args.interleave:
        return
    real = sum(a + b for a, b in zip(*lengths(), strict=True))
    print()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"{args.rounds} alternating rounds of {args.iters} updates; {real} real tokens in the batch"
    )
    print()
    print(
        "| size | dtype | mode | update (ms) | micro-batches | computed tokens | vs rows | planned fixed cost (tokens) | rounds (ms) |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---|")
    for size, dtype, mode, ms, k, padded, ratio, ov, each in rows:
        print(
            f"| {size} | {dtype} | {mode} | {ms:.1f} | {k} | {padded} | {ratio:.2f}× | {ov:.0f} | {', '.join(map(str, each))} |"
        )


if __name__ == "__main__":
    main()
