"""bf16 compute on the ``fsdp2`` backend: fp32 master weights, bf16 matmuls (issue 19).

With ``dtype: bfloat16`` a trained role keeps its parameters in fp32 — what the planner prices
for FSDP2 ("fp32 sharded params (master)") — and runs its forward and backward under autocast;
its weight stream carries the plan's dtype to the rollout engines. Regression: the backend held
the weights themselves in bf16, so an Adam step smaller than bf16's resolution (lr 1e-6 on
weights of ~0.05) was lost and the model never moved, and the stream carried what the planner
did not price. On this machine's CPU a bf16 matmul runs ~4.8× an fp32 one (docs/benchmarks.md)."""

from __future__ import annotations

import torch
from helpers import random_rollout

from flowc.ir.functional import Rollout
from flowc.ir.losses import ppo_clip
from flowc.ir.plan import Layout
from flowc.ir.run_config import OptimConfig
from flowc.runtime.backends import EngineInit
from flowc.tasks.arithmetic import asset_dir

SRC = str(asset_dir())


batch = random_rollout


def trainer(dtype: str, *, lr: float = 1e-6, optim: bool = True):
    from flowc.runtime.backends.fsdp2 import Fsdp2Trainer
    from flowc.runtime.backends.training import TrainEngine

    init = EngineInit(
        role="actor", kind="policy", source=SRC, layout=Layout(), dtype=dtype, seed=0, optim=OptimConfig(lr=lr) if optim else None
    )
    return TrainEngine(Fsdp2Trainer(init))


def update(eng, r: Rollout, adv: torch.Tensor) -> dict[str, float]:
    n = r.response_ids.shape[0]
    return eng.update(
        r, {"advantages": adv}, loss=ppo_clip(), kl_coef=0.0, kl_kind="k1", entropy_coef=0.0, mini_sizes=[n], epochs=1, micro=8
    )


def test_bf16_trains_fp32_master_weights_and_streams_bf16():
    eng = trainer("bfloat16")
    assert {p.dtype for p in eng.b.model.parameters()} == {torch.float32}
    before = {n: p.detach().clone() for n, p in eng.b.model.named_parameters()}
    r, adv = batch()
    update(eng, r, adv)
    moved = [n for n, p in eng.b.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert len(moved) == len(before), "an lr-1e-6 step must move every fp32 master weight"
    # what bf16 weights would have kept of that step: almost nothing (the regression)
    w = before["model.layers.0.mlp.up_proj.weight"]
    stepped = dict(eng.b.model.named_parameters())["model.layers.0.mlp.up_proj.weight"].detach()
    assert (stepped.bfloat16() != w.bfloat16()).float().mean() < 0.05
    stream = dict(eng.weights())
    assert {t.dtype for t in stream.values()} == {torch.bfloat16}  # the plan's dtype, as priced


def test_bf16_logprobs_track_fp32_and_a_frozen_role_is_held_in_bf16():
    fp32, bf16 = trainer("float32"), trainer("bfloat16")
    probe, _ = batch(16, seed=3)
    a, b = fp32.forward(probe, 16), bf16.forward(probe, 16)
    # bf16 matmuls keep ~3 significant digits: measured ≤ 0.06 here (log-probabilities near −9),
    # ≤ 0.02 on the 34M model; the PPO ratio's clip (0.2) is ten times wider
    assert float((a - b).abs().max()) < 0.1
    assert float((a - b).abs().max()) > 0.0  # really computed in bf16
    frozen = trainer("bfloat16", optim=False)
    assert {p.dtype for p in frozen.b.model.parameters()} == {torch.bfloat16}
    c = frozen.forward(probe, 16)
    assert float((a - c).abs().max()) < 0.1


# ------------------------------------------------------------ two processes
def _ranks(rank: int, world: int, init: str | None, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    from flowc.runtime.backends.fsdp2 import Fsdp2Trainer
    from flowc.runtime.backends.training import TrainEngine
    from flowc.runtime.batches import cat_rows, minibatch_rows, slice_rows

    init_ = EngineInit(
        role="actor",
        kind="policy",
        source=SRC,
        layout=Layout(dp=world, fsdp=True),
        dtype="bfloat16",
        seed=0,
        optim=OptimConfig(lr=1e-3),
    )
    eng = TrainEngine(Fsdp2Trainer(init_))
    r, adv = batch()
    mine = minibatch_rows(8, 1, world)[rank]
    rows = cat_rows([slice_rows(r, a, b) for a, b in mine])
    n = sum(b - a for a, b in mine)
    eng.update(
        rows, {"advantages": torch.cat([adv[a:b] for a, b in mine])}, loss=ppo_clip(), kl_coef=0.0, kl_kind="k1",
        entropy_coef=0.0, mini_sizes=[n], epochs=1, micro=8,
    )  # fmt: skip
    stream = dict(eng.weights())  # a collective: every rank iterates
    if rank == 0:
        out[world] = ({k: v.float().clone() for k, v in stream.items()}, {v.dtype for v in stream.values()}, eng.b.last_received)
    if world > 1:
        dist.barrier()  # neither rank tears gloo down while the other still uses it
        dist.destroy_process_group()


def test_two_sharded_ranks_gather_bf16_and_equal_one_process():
    import tempfile

    import torch.multiprocessing as mp

    with mp.Manager() as m:
        out = m.dict()
        _ranks(0, 1, None, out)
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_ranks, args=(2, f"file://{d}/rdv", out), nprocs=2, join=True)
        one, _, _ = out[1]
        two, dtypes, received = out[2]
    assert dtypes == {torch.bfloat16}
    numel = sum(t.numel() for t in two.values())
    assert received == 2 * (numel - numel // 2) or abs(received - numel) <= 2 * 1024  # half the model, 2 bytes each
    # bf16 gathers and matmuls on each rank: the step agrees with one process to bf16's resolution
    assert max(float((one[k] - two[k]).abs().max()) for k in one) < 2e-2
