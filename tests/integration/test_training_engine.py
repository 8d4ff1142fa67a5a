"""The fsdp2 backend under the shared training loop on real torch.distributed
(gloo, two processes): one update on two ranks equals one update in one
process, sharded or replicated, and the flat weight gather equals DTensor's own."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flowc.ir.functional import Rollout
from flowc.ir.losses import ppo_clip
from flowc.ir.plan import Layout
from flowc.ir.run_config import OptimConfig
from flowc.tasks.arithmetic import asset_dir


def batch():
    g = torch.Generator().manual_seed(0)
    n, p, r = 8, 6, 4
    ids = torch.randint(3, 16, (n, p), generator=g)
    rids = torch.randint(3, 16, (n, r), generator=g)
    rmask = torch.ones(n, r, dtype=torch.bool)
    rmask[::2, 3] = False
    return Rollout(ids, torch.ones(n, p, dtype=torch.bool), rids, rmask, torch.zeros(n, r)), torch.randn(n, generator=g)


def worker(rank: int, world: int, init: str | None, fsdp: bool, out) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    from flowc.runtime.backends import EngineInit
    from flowc.runtime.backends.fsdp2 import Fsdp2Trainer
    from flowc.runtime.backends.training import TrainEngine
    from flowc.runtime.batches import cat_rows, minibatch_rows, slice_rows

    init = EngineInit(
        role="actor",
        kind="policy",
        source=str(asset_dir()),
        layout=Layout(dp=world, fsdp=fsdp),
        dtype="float32",
        seed=0,
        optim=OptimConfig(lr=1e-3),
    )
    eng = TrainEngine(Fsdp2Trainer(init))
    r, adv = batch()
    mine = minibatch_rows(8, 2, world)[rank]
    rows = cat_rows([slice_rows(r, a, b) for a, b in mine])
    advs = torch.cat([adv[a:b] for a, b in mine])
    stats = eng.update(
        rows,
        {"advantages": advs},
        loss=ppo_clip(),
        kl_coef=0.0,
        kl_kind="k1",
        entropy_coef=0.0,
        mini_sizes=[b - a for a, b in mine],
        epochs=1,
        micro=1,
    )
    params, received = eng.b.full_params()
    if world > 1 and fsdp:
        reference = {n: p.full_tensor() for n, p in eng.b.model.named_parameters()}
        assert all(torch.equal(reference[n], params[n]) for n in params)
    if rank == 0:
        out[(world, fsdp)] = ({k: v.clone() for k, v in params.items()}, stats["grad_norm"], received)
    if world > 1:
        dist.destroy_process_group()


@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp", "replicated"])
def test_two_ranks_equal_one_process(fsdp):
    with mp.Manager() as m:
        out = m.dict()
        worker(0, 1, None, fsdp, out)
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(worker, args=(2, f"file://{d}/rdv", fsdp, out), nprocs=2, join=True)
        one, grad_one, _ = out[(1, fsdp)]
        two, grad_two, received = out[(2, fsdp)]
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-5
    assert grad_one == pytest.approx(grad_two, rel=1e-4)
    assert (received > 0) == fsdp  # sharded weights must be gathered; replicated ones are already whole
