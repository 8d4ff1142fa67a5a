"""flowc vs TRL's GRPOTrainer on one machine, side by side in one invocation.

    bash bench/grpo_vs_trl/setup.sh             # TRL in its own environment (bench/.venv-trl)
    python bench/grpo_vs_trl/run.py [--rounds 3] [--steps 12] [--sizes tiny,mid] [--rollout vllm|hf] [--bf16]
                                    [--executors inline,ray] [--every-row]

Both run GRPO without a reference model on the built-in arithmetic task with
the same model, batch (8 prompts × 8 samples), response limit (24 tokens),
learning rate and steps; they alternate (flowc, TRL, flowc, TRL, …) so that
machine noise hits both. Reported per system: median seconds per step (the
first two steps of each run are warm-up and dropped), generated tokens/s
(response tokens / step time), peak memory of the whole process tree (Ray's
processes included for flowc) both as the sum of resident sets (RSS: shared
library pages counted once per process) and as the proportional set size (PSS:
each shared page split among the processes that map it, so the sum is what the
tree takes from the machine), and the ratio flowc/TRL.

With ``--executors inline,ray`` flowc runs once per executor in each round (a row each: the
inline executor against Ray's on the same plan); the default is the run's own choice (``auto``).

flowc leaves out the update rows whose advantages are all zero (a group whose rewards are all
equal: ``skip_idle_rows``, the same gradient); the *idle rows* column is their median share.
With ``--every-row`` flowc also runs computing every row (a row each), the work TRL does.

With ``--bf16`` each system also runs in mixed precision (fp32 master weights, bf16 matmuls:
flowc's ``dtype: bfloat16``, TRL's ``bf16=True``) as a second row, in the same alternation.

Sizes: ``tiny`` is the shipped 0.5M-parameter model; ``mid`` is a 34M-parameter
Qwen2 (hidden 512, 8 layers) initialised at random from the same tokenizer,
where compute dominates.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TRL_PY = ROOT / "bench" / ".venv-trl" / "bin" / "python"
WARMUP = 2


def model_dir(size: str, cache: Path) -> str:
    from flowc.tasks.arithmetic import asset_dir

    if size == "tiny":
        return str(asset_dir())
    target = cache / "mid-34m"
    if not (target / "config.json").exists():
        from transformers import AutoTokenizer

        from flowc.ir.models import ModelSpec
        from flowc.runtime.modeling import load_causal_lm

        spec = ModelSpec(
            name="mid-34m",
            model_type="qwen2",
            hidden_size=512,
            intermediate_size=2048,
            num_layers=8,
            num_heads=8,
            num_kv_heads=8,
            vocab_size=32,
            tie_word_embeddings=True,
            dtype="float32",
        )
        load_causal_lm(spec, seed=0).save_pretrained(target, safe_serialization=True)
        AutoTokenizer.from_pretrained(str(asset_dir())).save_pretrained(target)
    return str(target)


def watch(proc: subprocess.Popen, peak: list[float]) -> None:
    """Peak summed RSS and summed PSS (GB) of the process and all its descendants."""
    try:
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            rss = pss = 0
            for p in [root, *root.children(recursive=True)]:
                try:
                    m = p.memory_full_info()
                    rss, pss = rss + m.rss, pss + m.pss
                except psutil.Error:
                    pass
            peak[0], peak[1] = max(peak[0], rss / 1e9), max(peak[1], pss / 1e9)
            time.sleep(0.25)
    except psutil.Error:
        pass


def launch(cmd: list[str], env: dict[str, str]) -> tuple[subprocess.CompletedProcess, list[float]]:
    peak = [0.0, 0.0]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    t = threading.Thread(target=watch, args=(p, peak), daemon=True)
    t.start()
    out, err = p.communicate()
    t.join(timeout=1)
    r = subprocess.CompletedProcess(cmd, p.returncode, out, err)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} failed:\n{err[-3000:]}")
    return r, peak


def run_flowc(
    model: str,
    steps: int,
    lr: float,
    work: Path,
    rollout: str | None = None,
    bf16: bool = False,
    executor: str = "auto",
    skip_idle: bool = True,
) -> dict:
    cfg = work / "flowc.yaml"
    dtype = "bfloat16" if bf16 else "float32"
    cfg.write_text(
        f"eval_every: 0\ncheckpoint_every: 0\ndtype: {dtype}\ndefault_optim: {{lr: {lr}}}\nexecutor: {executor}\n"
        f"skip_idle_rows: {str(skip_idle).lower()}\n"
    )
    out = work / f"flowc-{time.time_ns()}"
    cmd = [
        sys.executable,
        "-m",
        "flowc.cli",
        "run",
        str(HERE / "grpo_noref.py"),
        "--model",
        f"actor={model}",
        "--steps",
        str(steps),
        "--workload",
        "prompts=8,prompt_len=8,response_len=24",
        "--config",
        str(cfg),
        "--out",
        str(out),
        "-q",
        *(["--rollout", rollout] if rollout else []),
    ]
    _, peak = launch(cmd, dict(os.environ))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"step_s"' in x][WARMUP:]
    step = statistics.median(r["step_s"] for r in rows)
    tokens = statistics.median(r["gen_tokens"] / r["step_s"] for r in rows)
    controller = statistics.median(r.get("perf/controller_fraction", float("nan")) for r in rows)
    idle = statistics.median(r.get("actor/idle_rows", 0.0) for r in rows)  # update rows left out: advantages all zero
    backend = json.loads((out / "plan.json").read_text())["roles"]["actor"]["phases"]["generate"]["layout"]["backend"]
    ranks = [w for ws in json.loads((out / "placement.json").read_text()).values() for w in ws]
    return {
        "step_s": step,
        "tokens_per_s": tokens,
        "peak_gb": peak[0],
        "pss_gb": peak[1],
        "controller": controller,
        "idle": idle,
        "backend": backend,
        "executor": "inline" if all(w.get("executor") == "inline" for w in ranks) else "ray",
    }


def run_trl(model: str, steps: int, lr: float, work: Path, bf16: bool = False) -> dict:
    out = work / f"trl-{time.time_ns()}.json"
    cmd = [str(TRL_PY), str(HERE / "trl_grpo.py"), "--model", model, "--steps", str(steps), "--lr", str(lr), "--out", str(out)]
    cmd += ["--bf16"] if bf16 else []
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    _, peak = launch(cmd, env)
    d = json.loads(out.read_text())
    times = d["step_s"][WARMUP:]
    lengths = d["mean_length"][WARMUP:]
    per_step_tokens = [ln * d["samples_per_step"] for ln in lengths]
    return {
        "step_s": statistics.median(times),
        "tokens_per_s": statistics.median(t / s for t, s in zip(per_step_tokens, times, strict=False)),
        "peak_gb": peak[0],
        "pss_gb": peak[1],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--sizes", default="tiny,mid")
    ap.add_argument("--rollout", default=None, help="flowc's generation backend (default: the planner's choice)")
    ap.add_argument("--bf16", action="store_true", help="also run each system in bf16 mixed precision (a second row)")
    ap.add_argument(
        "--executors", default="auto", help="flowc's executors, a row each (e.g. inline,ray; default: the run's choice)"
    )
    ap.add_argument(
        "--every-row",
        action="store_true",
        help="also run flowc computing every update row (skip_idle_rows: false), a row each: the same work as TRL's",
    )
    args = ap.parse_args()
    if not TRL_PY.exists():
        sys.exit("TRL's environment is missing: run bash bench/grpo_vs_trl/setup.sh first")
    cache = ROOT / "bench" / ".cache"
    cache.mkdir(exist_ok=True)
    precisions = ("fp32", "bf16") if args.bf16 else ("fp32",)
    executors = args.executors.split(",")
    variants = [(ex, True) for ex in executors] + ([(ex, False) for ex in executors] if args.every_row else [])
    systems = [f"flowc:{ex}" + ("" if skip else ":every") for ex, skip in variants] + ["trl"]
    results: dict[str, dict[tuple[str, str], list[dict]]] = {}
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        for size in args.sizes.split(","):
            model = model_dir(size, cache)
            results[size] = {(s, p): [] for p in precisions for s in systems}
            for r in range(args.rounds):
                for prec in precisions:
                    bf16 = prec == "bf16"
                    for (ex, skip), name in zip(variants, systems, strict=False):
                        got = run_flowc(model, args.steps, args.lr, work, args.rollout, bf16, ex, skip)
                        results[size][name, prec].append(got)
                    results[size]["trl", prec].append(run_trl(model, args.steps, args.lr, work, bf16))
                    print(f"{size} {prec} round {r + 1}: " + "  ".join(f"{s} {results[size][s, prec][-1]}" for s in systems))
    print()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; {args.rounds} alternating rounds of {args.steps} steps (first {WARMUP} dropped), medians"
    )
    print()
    print(
        "| size | precision | system | s/step | samples/s | generated tokens/s | mean response | peak memory (RSS) | peak memory (PSS) | controller share | idle rows | flowc/TRL (samples/s) | flowc/TRL (tokens/s) |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for size, res in results.items():
        med = {
            k: {f: statistics.median(x[f] for x in runs) for f in ("step_s", "tokens_per_s", "peak_gb", "pss_gb")}
            for k, runs in res.items()
        }
        for prec in precisions:
            tr = med["trl", prec]
            for s in systems:
                m = med[s, prec]
                length = m["tokens_per_s"] * m["step_s"] / 64
                ratios = ("", "")
                name, ctl, idle = "TRL 1.16", "", ""
                if s != "trl":
                    ratios = (f"{tr['step_s'] / m['step_s']:.2f}×", f"{m['tokens_per_s'] / tr['tokens_per_s']:.2f}×")
                    backends = "/".join(sorted({x["backend"] for x in res[s, prec]}))
                    ran = "/".join(sorted({x["executor"] for x in res[s, prec]}))
                    name = f"flowc ({backends}, {ran}{', every row' if s.endswith(':every') else ''})"
                    ctl = f"{statistics.median(x['controller'] for x in res[s, prec]):.0%}"
                    idle = f"{statistics.median(x['idle'] for x in res[s, prec]):.0%}" if not s.endswith(":every") else "computed"
                print(
                    f"| {size} | {prec} | {name} | {m['step_s']:.3f} | {64 / m['step_s']:.0f} | {m['tokens_per_s']:.0f} | {length:.1f} | {m['peak_gb']:.2f} GB | {m['pss_gb']:.2f} GB | {ctl} | {idle} | {ratios[0]} | {ratios[1]} |"
                )


if __name__ == "__main__":
    main()
