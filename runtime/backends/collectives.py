"""Where a worker's tensors live and how the ranks of a pool agree on a number.

Every engine runs inside one worker process of a pool; all workers of a pool
share one ``torch.distributed`` world (gloo on CPU, NCCL on GPU). Collective
calls are made by every rank in the same order: the controller sends each rank
the same instructions, and counts that must match (micro-batches) are agreed
with an all-reduce.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from flowc.ir.functional import Rollout
from flowc.runtime.batches import map_fields


def compute_device() -> torch.device:
    """This worker's device: its GPU (Ray sets CUDA_VISIBLE_DEVICES per worker) or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def to_device(r: Rollout, device: torch.device) -> Rollout:
    if r.prompt_ids.device == device:
        return r
    return map_fields(r, lambda x: x.to(device))


def collective_device() -> torch.device:
    """Where small collective tensors live: NCCL takes CUDA tensors only."""
    return compute_device() if dist.get_backend() == "nccl" else torch.device("cpu")


def world() -> tuple[int, int]:
    """(size, rank) of this worker's pool (1, 0 without a process group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def all_true(flags: list[bool], group: Any = None) -> list[bool]:
    """Each flag true on every rank of ``group`` (the whole pool by default): ranks that must
    run the same passes agree on them."""
    size, _ = world()
    if size == 1 or not flags:
        return flags
    t = torch.tensor([float(f) for f in flags], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [bool(v) for v in t.tolist()]


def allreduce(x: float, op: str = "sum", group: Any = None) -> float:
    """``x`` summed (or maxed) over the ranks of ``group`` (the whole pool by default)."""
    size, _ = world()
    if size == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=group)
    return float(t.item())
