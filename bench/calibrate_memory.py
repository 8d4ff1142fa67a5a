"""Measure the resident memory the planner adds on CPUs beyond model state, for ir/hardware/cpu.yaml.

    python bench/calibrate_memory.py [--sizes tiny,mid]

Memory is PSS (proportional set size: a shared library page is split among the processes that
map it, so summing PSS over processes gives what they take from the machine together). Each
figure is measured in a fresh process:

* ``process_gb``: a worker process before any model (Python, torch, transformers, Ray's worker
  core and flowc's runtime imported, one HF model built and dropped: the allocator's arenas);
* ``rollout.vllm.resident_gb``: what building a vLLM engine adds to a worker beyond its weights
  and the KV cache it was given (vLLM's libraries, scheduler, sampler and workspaces), for each
  model size (the profile takes the largest);
* ``reserved_gb``: the controller process with its tokenizer and the local Ray cluster's own
  processes (GCS, raylet and its agents, log monitor, reaper), per core of this machine.

It prints the YAML lines to paste into ir/hardware/cpu.yaml.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from fresh import in_fresh_process  # bench/fresh.py

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE / "grpo_vs_trl"))


def pss_gb(pid: int | None = None) -> float:
    import psutil

    return psutil.Process(pid or os.getpid()).memory_full_info().pss / 1e9


def worker_base() -> dict:
    """(In a fresh process) a worker's resident memory before any model state."""
    import gc

    import ray  # noqa: F401  (a Ray worker's core)
    import torch

    from flowc.runtime.modeling import load_causal_lm
    from flowc.runtime.worker import Worker  # noqa: F401  (the runtime and its backends' imports)
    from flowc.tasks import arithmetic as arith

    m = load_causal_lm(str(arith.asset_dir()), dtype=torch.float32)
    del m
    gc.collect()
    return {"process_gb": pss_gb()}


def vllm_engine(model: str) -> dict:
    """(In a fresh process) what a vLLM engine adds beyond its weights and its KV cache."""
    import json as _json

    from flowc.ir.models import ModelSpec
    from flowc.ir.plan import Layout
    from flowc.runtime.backends import EngineInit
    from flowc.runtime.backends.vllm import cpu_kv_cache_bytes
    from flowc.runtime.worker import make_engine

    init = EngineInit(
        role="actor",
        kind="policy",
        source=model,
        layout=Layout(backend="vllm"),
        dtype="bfloat16",
        seed=0,
        tokenizer=model,
        max_model_len=32,
        kv_cache_bytes=16_000_000,
    )
    before = pss_gb()
    make_engine(init)
    after = pss_gb()
    spec = ModelSpec.from_hf_config(_json.loads((Path(model) / "config.json").read_text()), "m")
    weights = spec.params_total * 2 / 1e9  # bf16
    kv = cpu_kv_cache_bytes(init) / 1e9
    return {"added_gb": after - before, "weights_gb": weights, "kv_gb": kv, "resident_gb": after - before - weights - kv}


def head() -> dict:
    """(In a fresh process) the controller with a tokenizer, and a local Ray cluster's processes."""
    import time

    from transformers import AutoTokenizer

    from flowc.runtime.controller import Controller  # noqa: F401  (the controller's imports)
    from flowc.runtime.ray_session import init_ray, running_temp_dir, shutdown_ray
    from flowc.runtime.reaper import session_pids
    from flowc.tasks import arithmetic as arith

    AutoTokenizer.from_pretrained(str(arith.asset_dir()))
    init_ray(None)
    try:
        time.sleep(5)  # the agents settle
        ray_gb = sum(pss_gb(p) for p in session_pids(running_temp_dir()) if p != os.getpid())
        return {"controller_gb": pss_gb(), "ray_gb": ray_gb}
    finally:
        shutdown_ray()


def fresh(fn: str, *args: str) -> dict:
    return in_fresh_process("calibrate_memory", fn, *args, timeout=1200)


def main() -> None:
    from run import model_dir  # bench/grpo_vs_trl: the shipped tiny model and the 34M one

    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="tiny,mid")
    args = ap.parse_args()
    cache = ROOT / "bench" / ".cache"
    cache.mkdir(exist_ok=True)
    base = fresh("worker_base")
    print(f"worker process: {base['process_gb']:.3f} GB")
    engines = {}
    for size in args.sizes.split(","):
        engines[size] = fresh("vllm_engine", model_dir(size, cache))
        e = engines[size]
        print(
            f"vLLM engine ({size}): +{e['added_gb']:.3f} GB = weights {e['weights_gb']:.3f} + KV {e['kv_gb']:.3f} "
            f"+ resident {e['resident_gb']:.3f}"
        )
    h = fresh("head")
    cores = os.cpu_count() or 1
    print(f"controller: {h['controller_gb']:.3f} GB, Ray's processes: {h['ray_gb']:.3f} GB ({cores} cores)")
    print()
    print(f"process_gb: {base['process_gb']:.2f}")
    print(f"reserved_gb: {(h['controller_gb'] + h['ray_gb']) / cores:.2f}")
    print(f"rollout.vllm.resident_gb: {max(e['resident_gb'] for e in engines.values()):.2f}")


if __name__ == "__main__":
    main()
