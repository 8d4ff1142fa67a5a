"""One local Ray cluster for the whole test session (started on first use), and the tiny policy."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def lm():
    """The shipped tiny policy in fp32, in training mode (one per test module: tests back-propagate through it)."""
    import torch

    from flowc.runtime.modeling import load_causal_lm
    from flowc.tasks.arithmetic import asset_dir

    torch.manual_seed(0)
    m = load_causal_lm(str(asset_dir()), dtype=torch.float32)
    m.train()
    return m


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from flowc.runtime.ray_session import init_ray, shutdown_ray

    started = init_ray(None)
    yield ray
    if started:
        shutdown_ray()


@pytest.fixture(scope="session")
def vllm_worker(ray_cluster):
    """One flowc rollout worker hosting one vLLM engine (the shipped tiny model) for
    the whole session: vLLM's import and start take ~15 s, so tests share it and
    each loads the weights it needs first. vLLM lives in the worker, never in
    the test process."""
    from flowc.ir.plan import Layout
    from flowc.runtime.backends import EngineInit
    from flowc.runtime.program import EngineKey, EngineKind
    from flowc.runtime.worker import RayWorker
    from flowc.tasks import arithmetic as arith

    src = str(arith.asset_dir())
    w = RayWorker.options(num_cpus=1, name="flowc-test-vllm").remote("vllm-test", 0, 1, 1, 600.0)
    init = EngineInit(
        role="actor",
        kind="policy",
        source=src,
        layout=Layout(backend="vllm"),
        dtype="float32",
        seed=0,
        tokenizer=src,
        max_model_len=512,
    )
    ray_cluster.get(w.add_engine.remote(EngineKey("actor", EngineKind.ROLLOUT), init), timeout=600)
    yield w
    ray_cluster.kill(w)
