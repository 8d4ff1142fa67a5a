"""Does ``torch.compile`` pay for flowc's CPU update and HF rollout? Eager against compiled, side by side.

    python bench/compile_update.py [--sizes tiny,mid] [--iters 20]

The update is what a flowc worker runs for a GRPO step (bench/grpo_vs_trl's shape: 64 rows of
an 8-token prompt and a response): teacher-forced log-probabilities and entropy of the
response (runtime.modeling.response_logprobs), a policy-gradient loss, backward, Adam. Each
mode runs in a fresh process: a warm-up (for ``compiled``, the compilation: its time is
reported), then ``--iters`` updates whose response width cycles through 24, 16 and 8 tokens as
flowc's trimmed batches do (each new width can make the compiler specialise again), then the
same count at one fixed width. The generation side is one decode step of the HF model with its
KV cache after the 8-token prompt (runtime.sampling's inner loop), 64 rows.

Reports per size: seconds to compile, milliseconds per update (varying and fixed width) and
per decode step, and the number of updates after which compiling has paid for itself.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from fresh import in_fresh_process  # bench/fresh.py

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "grpo_vs_trl"))
ROWS, PROMPT = 64, 8
WIDTHS = (24, 16, 8)


def measure(model: str, mode: str, iters: int) -> dict:
    """(In a fresh process) one mode's compile time and per-update and per-decode-step times."""
    import torch

    from flowc.runtime.modeling import load_causal_lm, response_logprobs

    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    m = load_causal_lm(model, dtype=torch.float32)
    vocab = int(m.config.vocab_size)
    opt = torch.optim.Adam(m.parameters(), lr=1e-5)
    net = torch.compile(m) if mode == "compiled" else m

    def batch(width: int):
        p = torch.randint(0, vocab, (ROWS, PROMPT))
        r = torch.randint(0, vocab, (ROWS, width))
        return p, torch.ones_like(p, dtype=torch.bool), r, torch.ones_like(r, dtype=torch.bool)

    def update(width: int) -> None:
        p, pm, r, rm = batch(width)
        lp, ent = response_logprobs(net, p, pm, r, rm, with_entropy=True)
        loss = -(lp * torch.randn(ROWS, 1)).mean() - 0.001 * ent.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    t0 = time.perf_counter()
    for w in WIDTHS:  # the first update of each width compiles (or warms up) that shape
        update(w)
    warm = time.perf_counter() - t0
    out: dict[str, float] = {"warmup_s": warm}
    for name, widths in (("varying", [WIDTHS[i % len(WIDTHS)] for i in range(iters)]), ("fixed", [WIDTHS[0]] * iters)):
        times = []
        for w in widths:
            t = time.perf_counter()
            update(w)
            times.append(time.perf_counter() - t)
        out[f"update_{name}_ms"] = statistics.median(times) * 1e3
    # one decode step with a KV cache: 64 rows after an 8-token prompt (cropped back every step)
    with torch.no_grad():
        p, pm, _, _ = batch(0)
        cache = net(input_ids=p, attention_mask=pm, use_cache=True).past_key_values
        ids = torch.randint(0, vocab, (ROWS, 1))
        mask = torch.ones(ROWS, PROMPT + 1, dtype=torch.bool)
        times = []
        for i in range(iters + 3):
            t = time.perf_counter()
            net(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            if i >= 3:
                times.append(time.perf_counter() - t)
            cache.crop(PROMPT)  # the same context length every step
        out["decode_ms"] = statistics.median(times) * 1e3
    return out


def main() -> None:
    from run import model_dir  # bench/grpo_vs_trl: the shipped tiny model and the 34M one

    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="tiny,mid")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    cache = ROOT / "bench" / ".cache"
    cache.mkdir(exist_ok=True)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; {args.iters} updates each")
    print()
    print(
        "| size | mode | warm-up (s) | update, varying width (ms) | update, fixed width (ms) | decode step (ms) | compiled/eager (varying) | break-even updates |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for size in args.sizes.split(","):
        model = model_dir(size, cache)
        got = {mode: in_fresh_process("compile_update", "measure", model, mode, args.iters) for mode in ("eager", "compiled")}
        e, c = got["eager"], got["compiled"]
        saved = e["update_varying_ms"] - c["update_varying_ms"]
        extra = c["warmup_s"] - e["warmup_s"]
        even = f"{extra * 1e3 / saved:.0f}" if saved > 0 else "never"
        for mode, x in got.items():
            ratio = f"{x['update_varying_ms'] / e['update_varying_ms']:.2f}×" if mode == "compiled" else ""
            print(
                f"| {size} | {mode} | {x['warmup_s']:.1f} | {x['update_varying_ms']:.1f} | {x['update_fixed_ms']:.1f} | "
                f"{x['decode_ms']:.2f} | {ratio} | {even if mode == 'compiled' else ''} |"
            )


if __name__ == "__main__":
    main()
