"""The ``megatron`` backend's training path on a CUDA GPU: Megatron's
distributed optimizer and forward-backward schedule give the same update as
the ``fsdp2`` backend on the same weights and batch. Skipped without a GPU
(Megatron's optimizer and schedules allocate CUDA tensors); run by
``bench/megatron_gpu.sh`` on a GPU machine."""

from __future__ import annotations

import dataclasses
import socket

import pytest
import torch
import torch.distributed as dist

from flowc.ir.losses import ppo_clip
from flowc.ir.plan import Layout
from flowc.ir.run_config import OptimConfig
from flowc.tasks.arithmetic import asset_dir

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (Megatron's optimizer and schedules)"),
]
pytest.importorskip("megatron.core", reason="megatron-core is not installed")


@pytest.fixture(scope="module")
def world():
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_one_update_equals_the_fsdp2_backend(world):
    from test_megatron import batch  # the CPU tests' batch: varied prompt lengths, padded responses

    from flowc.runtime.backends import EngineInit
    from flowc.runtime.backends.fsdp2 import Fsdp2Trainer
    from flowc.runtime.backends.megatron import MegatronTrainer
    from flowc.runtime.backends.training import TrainEngine

    r, _ = batch()
    adv = torch.randn(r.prompt_ids.shape[0], generator=torch.Generator().manual_seed(1))
    args = dict(loss=ppo_clip(), kl_coef=0.0, kl_kind="k1", entropy_coef=0.0, mini_sizes=[6], epochs=1, micro=2)
    optim = OptimConfig(lr=1e-3)
    source = str(asset_dir())
    init = EngineInit(role="actor", kind="policy", source=source, layout=Layout(), dtype="float32", seed=0, optim=optim)
    mg = TrainEngine(MegatronTrainer(dataclasses.replace(init, layout=Layout(backend="megatron"))))
    before = mg.forward(r, micro=6)
    s_mg = mg.update(r, {"advantages": adv, "old_logprobs": before}, **args)
    after_mg = mg.forward(r, micro=6)
    fs = TrainEngine(Fsdp2Trainer(init))
    s_fs = fs.update(r, {"advantages": adv, "old_logprobs": before}, **args)
    after_fs = fs.forward(r, micro=6)
    assert s_mg["pg_loss"] == pytest.approx(s_fs["pg_loss"], rel=1e-4, abs=1e-6)
    assert s_mg["grad_norm"] == pytest.approx(s_fs["grad_norm"], rel=1e-3)
    m = r.response_mask
    assert float(((after_mg - after_fs) * m).abs().max()) < 1e-3
    assert float(((after_mg - before) * m).abs().max()) > 1e-3  # the update moved the policy
