"""LoRA weight sync to vLLM, the two ways, on this machine.

    python bench/lora_sync.py [--sizes tiny,mid] [--rounds 6] [--rank 8]

1. **merged** (what flowc does): the LoRA trainer's weight stream — the adapters merged into
   the base weights, HF names — into the ``vllm`` backend's in-place reload (``VllmRollout.load``:
   one reload, tied head re-tied, prefix cache reset);
2. **adapter**: the adapters alone, written as a peft folder and loaded by vLLM's own LoRA
   support (``LLM(enable_lora=True)``; a ``LoRARequest`` with a new id per sync, added with
   ``add_lora`` so the load is timed; every request then names it).

Each path runs in a fresh process: ``rounds`` times (one update of a LoRA trainer at a large
learning rate, a sync, a rollout of 64 prompts × 8 samples × up to 24 tokens at temperature 1),
then checks that vLLM's teacher-forced log-probabilities equal the trainer's (so both paths run
the updated adapters). Prints the median sync seconds, the rollout tokens/s with the synced
weights, and the end-to-end seconds per round (sync + rollout), skipping the first round.
Sizes as in bench/rollout_backends.py: ``tiny`` (the shipped 0.5M model), ``mid`` (34M).
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

PROMPTS, N, MAX_TOKENS = 64, 8, 24


def measure(path: str, model: str, rounds: int, rank: int) -> dict:
    """(In a fresh process) ``rounds`` of update → sync → rollout on one path."""
    import torch
    from transformers import AutoTokenizer

    from flowc.ir.functional import Rollout
    from flowc.ir.lora import LoraConfig
    from flowc.ir.losses import ppo_clip
    from flowc.ir.plan import Layout
    from flowc.ir.run_config import OptimConfig
    from flowc.runtime.backends import EngineInit
    from flowc.runtime.backends.fsdp2 import Fsdp2Trainer
    from flowc.runtime.backends.training import TrainEngine
    from flowc.runtime.backends.vllm import CPU_ENV, VllmRollout
    from flowc.runtime.data import tokenize_prompts
    from flowc.runtime.lora import save_adapter
    from flowc.tasks import arithmetic as arith

    torch.set_num_threads(os.cpu_count() or 1)
    lora = LoraConfig(rank=rank, alpha=2 * rank)
    tok = AutoTokenizer.from_pretrained(model)
    train, _ = arith.split()
    prompts = tokenize_prompts(tok, [r["prompt"] for r in arith.records(train[:PROMPTS])], 8)
    base = dict(role="actor", kind="policy", source=model, dtype="float32", seed=0)
    trainer = TrainEngine(Fsdp2Trainer(EngineInit(**base, layout=Layout(), optim=OptimConfig(lr=1e-2), lora=lora)))
    init = EngineInit(**base, layout=Layout(backend="vllm"), tokenizer=model, max_model_len=8 + MAX_TOKENS)
    if path == "merged":
        engine = VllmRollout(init)
        llm = engine.llm
    else:
        for k, v in CPU_ENV.items():  # the same environment as the backend's engine
            os.environ.setdefault(k, v)
        from vllm import LLM

        llm = LLM(
            model=model,
            skip_tokenizer_init=True,
            dtype="float32",
            seed=0,
            max_model_len=init.max_model_len,
            enable_prefix_caching=True,
            enforce_eager=True,
            logprobs_mode="processed_logprobs",
            enable_lora=True,
            max_lora_rank=rank,
            max_loras=1,
        )
    from vllm import SamplingParams as VSP
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    toks = [row[m.bool()].tolist() for row, m in zip(prompts.input_ids, prompts.attention_mask, strict=True)]
    reqs = [TokensPrompt(prompt_token_ids=t) for t in toks for _ in range(N)]
    g = torch.Generator().manual_seed(0)
    syncs, rates, rounds_s, errors = [], [], [], []
    with tempfile.TemporaryDirectory() as scratch:
        for k in range(rounds):
            ids = torch.randint(3, 16, (16, 6), generator=g)
            rids = torch.randint(3, 16, (16, 4), generator=g)
            r = Rollout(
                ids, torch.ones_like(ids, dtype=torch.bool), rids, torch.ones_like(rids, dtype=torch.bool), torch.zeros(16, 4)
            )
            trainer.update(
                r, {"advantages": torch.randn(16, generator=g)}, loss=ppo_clip(), kl_coef=0.0, kl_kind="k1",
                entropy_coef=0.0, mini_sizes=[16], epochs=1, micro=16,
            )  # fmt: skip
            t0 = time.perf_counter()
            req = None
            if path == "merged":
                engine.load(trainer.weights())
            else:
                params, _ = trainer.b.full_params()
                folder = f"{scratch}/v{k}"
                save_adapter(params, lora, model, folder)
                req = LoRARequest(f"v{k}", k + 1, folder)
                if k:
                    llm.llm_engine.remove_lora(k)
                llm.llm_engine.add_lora(req)
                llm.reset_prefix_cache()
            t1 = time.perf_counter()
            sp = [
                VSP(temperature=1.0, max_tokens=MAX_TOKENS, logprobs=0, stop_token_ids=[tok.eos_token_id], seed=1000 * k + i)
                for i in range(len(reqs))
            ]
            outs = llm.generate(reqs, sp, use_tqdm=False, lora_request=req)
            t2 = time.perf_counter()
            made = sum(len(o.outputs[0].token_ids) for o in outs)
            syncs.append(t1 - t0)
            rates.append(made / (t2 - t1))
            rounds_s.append(t2 - t0)
            # the engine runs the updated adapters: its log-probabilities of the rollout are the trainer's
            full = [TokensPrompt(prompt_token_ids=t + list(o.outputs[0].token_ids)) for t, o in zip(toks, outs[::N], strict=True)]
            got = llm.generate(full, VSP(temperature=1.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False, lora_request=req)
            worst = 0.0
            for t, o, full_o in zip(toks, outs[::N], got, strict=True):
                resp = list(o.outputs[0].token_ids)
                if not resp:
                    continue
                rr = Rollout(
                    torch.tensor([t]), torch.ones(1, len(t), dtype=torch.bool), torch.tensor([resp]),
                    torch.ones(1, len(resp), dtype=torch.bool), torch.zeros(1, len(resp)),
                )  # fmt: skip
                mine = trainer.forward(rr, 1)[0]
                theirs = [full_o.prompt_logprobs[len(t) + i][x].logprob for i, x in enumerate(resp)]
                worst = max(worst, max(abs(a - b) for a, b in zip(mine.tolist(), theirs, strict=True)))
            errors.append(worst)
    keep = slice(1, None)  # the first round warms up
    return {
        "sync_s": statistics.median(syncs[keep]),
        "tokens_per_s": statistics.median(rates[keep]),
        "round_s": statistics.median(rounds_s[keep]),
        "max_logprob_error": max(errors),
    }


def run(path: str, model: str, rounds: int, rank: int) -> dict:
    return in_fresh_process("lora_sync", "measure", path, model, rounds, rank)


def main() -> None:
    from run import model_dir  # bench/grpo_vs_trl/run.py

    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="tiny,mid")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--rank", type=int, default=8)
    args = ap.parse_args()
    cache = ROOT / "bench" / ".cache"
    cache.mkdir(exist_ok=True)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores; LoRA rank {args.rank} all-linear; medians of rounds 2..{args.rounds}"
    )
    print()
    print("| size | path | sync s | rollout tokens/s | sync + rollout s | max |Δ logprob| vs trainer |")
    print("|---|---|---:|---:|---:|---:|")
    for size in args.sizes.split(","):
        model = model_dir(size, cache)
        for path in ("merged", "adapter"):
            m = run(path, model, args.rounds, args.rank)
            print(
                f"| {size} | {path} | {m['sync_s']:.4f} | {m['tokens_per_s']:,.0f} | {m['round_s']:.3f} | {m['max_logprob_error']:.1e} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
