"""Measure this machine for the local CPU hardware profile (ir/hardware/cpu.yaml).

    python bench/calibrate_cpu.py                 # prints YAML lines to paste
    python bench/calibrate_cpu.py --from-run DIR… # the efficiency factors: flowc calibrate DIR…

One "device" of the CPU profile is one core. Measured: fp32 matmul throughput
with one thread (the runtime trains tiny models in fp32 on CPU), memory copy
bandwidth with one thread, and gloo all-reduce bus bandwidth between two
processes on this machine (what weight sync and gradient reduction use).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _best(fn, reps: int = 7) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def matmul_gflops(n: int = 1024, dtype: torch.dtype = torch.float32) -> float:
    torch.set_num_threads(1)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n**3 / _best(lambda: a @ b) / 1e9


def copy_gb_s(mb: int = 256) -> float:
    torch.set_num_threads(1)
    x = torch.empty(mb * 2**20 // 4)
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / _best(lambda: y.copy_(x)) / 1e9


def _allreduce_worker(rank: int, world: int, init: str, mb: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    x = torch.ones(mb * 2**20 // 4)
    dist.all_reduce(x)
    dist.barrier()
    t = _best(lambda: dist.all_reduce(x), reps=5)
    lat = _best(lambda: dist.all_reduce(torch.ones(1)), reps=20)
    if rank == 0:
        # bus bandwidth of a ring all-reduce: 2 (w-1)/w × bytes / time
        out["busbw"] = 2 * (world - 1) / world * x.numel() * 4 / t / 1e9
        out["latency_us"] = lat * 1e6
    dist.destroy_process_group()


def gloo_busbw(mb: int = 64, world: int = 2) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as d:
        init = f"file://{os.path.join(d, 'rdv')}"
        with mp.Manager() as m:
            out = m.dict()
            mp.spawn(_allreduce_worker, args=(world, init, mb, out), nprocs=world, join=True)
            return out["busbw"], out["latency_us"]


def fit_from_run(run_dirs: list[str]) -> None:
    """The efficiency factors that match runs' measurements: ``flowc calibrate`` (its fit and
    re-planned residuals); this bench measures the raw figures it cannot fit."""
    from pathlib import Path

    from flowc.calibrate import fit, report

    print(report(fit([Path(d) for d in run_dirs])))


if __name__ == "__main__":
    import sys

    if len(sys.argv) >= 3 and sys.argv[1] == "--from-run":
        fit_from_run(sys.argv[2:])
        raise SystemExit
    gf = matmul_gflops()
    gf16 = matmul_gflops(dtype=torch.bfloat16)
    bw = copy_gb_s()
    busbw, lat = gloo_busbw()
    print(f"# measured by bench/calibrate_cpu.py on {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"peak_tflops: {gf16 / 1e3:.4f}      # bf16 1024³ matmul, one thread: {gf16:.1f} GFLOP/s")
    print(f"fp32_tflops: {gf / 1e3:.4f}      # fp32 1024³ matmul, one thread: {gf:.1f} GFLOP/s")
    print(f"mem_bw_tb_s: {bw / 1e3:.4f}      # one-thread copy (read + write): {bw:.1f} GB/s")
    print(f"intra_node_gb_s: {busbw:.3f}    # gloo all-reduce bus bandwidth, 2 processes, 64 MB")
    print(f"latency_us: {lat:.0f}            # gloo all-reduce of one float")
