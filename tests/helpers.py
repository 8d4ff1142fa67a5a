"""Helpers shared by the tests (importable as ``helpers``: pytest puts
tests/ on sys.path).

Golden files live in ``tests/golden``: graphs (``tests/unit/test_ir.py``) and
plans (``tests/unit/test_planner.py``). Run ``FLOWC_UPDATE_GOLDEN=1 pytest
tests/unit/test_ir.py tests/unit/test_planner.py -k golden`` to rewrite them
after an intended change, then review the diff.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
GOLDEN = Path(__file__).resolve().parent / "golden"
FLOWS = sorted(p.stem for p in EXAMPLES.glob("*.py"))
"""Every example flow (one per algorithm), by file name."""

DECOUPLED_FLOW = """
import flowc as fc

@fc.flow
def decoupled(prompts: fc.Prompts, actor: fc.Policy, ref: fc.Reference, reward: fc.Reward, *, n: int = 8):
    rollout = actor.generate(prompts, n=n)
    old = actor.logprobs(rollout)
    ref_logp = ref.logprobs(rollout)
    adv = fc.ops.group_normalize(reward(rollout), group_size=n)
    actor.update(rollout, advantages=adv, old_logprobs=old, ref_logprobs=ref_logp,
                 loss=fc.losses.{loss}, kl_coef=0.001)
"""
"""GRPO with a policy loss ``{loss}`` to fill in (``decoupled_ppo(0.2)``: it may run ahead), for the
staleness tests."""


def flowc_cmd(*args: str) -> list[str]:
    """The command line that runs ``flowc ARGS…`` with this interpreter."""
    import sys

    return [sys.executable, "-m", "flowc.cli", *args]


def line_of(path: Path, needle: str) -> int:
    """1-based line number of the first line containing ``needle``."""
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if needle in line:
            return i
    raise AssertionError(f"{needle!r} not in {path}")


def check_golden(name: str, text: str) -> None:
    """Compare ``text`` with tests/golden/<name>; rewrite it when
    FLOWC_UPDATE_GOLDEN=1."""
    path = GOLDEN / name
    if os.environ.get("FLOWC_UPDATE_GOLDEN"):
        path.write_text(text)
        return
    assert path.exists(), f"golden file {path} is missing; run with FLOWC_UPDATE_GOLDEN=1 to create it"
    expected = path.read_text()
    assert text == expected, f"output differs from golden {path.name}; if intended, rerun with FLOWC_UPDATE_GOLDEN=1"


def policy_graph(
    name: str = "tiny", *, n: int = 2, chain: int = 1, target: str = "torch.exp", constants: tuple = (), hyper: dict | None = None
):
    """A hand-built graph: prompts → actor.generate → ``chain`` compute nodes
    over the sampler's logprobs → actor.update (advantages = the last one)."""
    from flowc.ir.graph import FlowGraph, Node, RoleInfo, ValueRef
    from flowc.ir.losses import ppo_clip
    from flowc.ir.types import StatsType, TensorType, prompts_type, rollout_type

    g = FlowGraph(name, roles={"actor": RoleInfo("actor", "policy")}, hyperparams=hyper or {"n": n}, symbols={"n": n})
    g.add(Node("prompts", "input", None, prompts_type(), kwargs={"source": "prompts", "kind": "prompts"}))
    g.add(Node("actor.generate", "generate", "actor", rollout_type("B*n"), args=(ValueRef("prompts"),), kwargs={"n": n}))
    prev = ValueRef("actor.generate", ("logprobs",))
    t = TensorType(shape=("B*n", "R"), dtype="float32")
    for i in range(chain):
        nid = g.unique_id("adv")
        g.add(Node(nid, "compute", None, t, args=(prev, *constants), target=target, meta={"i": i, "x": list(constants)}))
        prev = ValueRef(nid)
    update_kwargs = {"advantages": prev, "loss": ppo_clip()}
    g.add(Node("actor.update", "update", "actor", StatsType(), args=(ValueRef("actor.generate"),), kwargs=update_kwargs))
    g.add_weight_edges()
    return g


def request(tmp_path: Path, flow: Any = "grpo", **kw):
    """A ``RunRequest`` for an example flow (its name, or a loaded flow) on the embedded default
    (local Ray, built-in task), 3 steps unless ``kw`` says otherwise."""
    from flowc.ir.run_config import RunConfig
    from flowc.loader import load_flow
    from flowc.run import RunRequest

    base = dict(
        flow=load_flow(str(EXAMPLES / f"{flow}.py")) if isinstance(flow, str) else flow,
        overrides={},
        models={},
        data=None,
        eval_data=None,
        rewards={},
        cluster="local",
        workload=None,
        steps=3,
        out=str(tmp_path / "run"),
        resume=None,
        rollout="hf",  # the vLLM backend has its own tests (test_vllm.py)
        pins=[],
        config=RunConfig(steps=3, eval_every=3, eval_size=64, checkpoint_every=0),
    )
    base.update(kw)
    return RunRequest(**base)


def random_rollout(n: int = 8, seed: int = 0):
    """A seeded random rollout of ``n`` rows (6 prompt and 4 response tokens of the tiny model's
    vocabulary; every other row's last response token masked out) and ``n`` advantages."""
    import torch

    from flowc.ir.functional import Rollout

    g = torch.Generator().manual_seed(seed)
    p, r = 6, 4
    ids = torch.randint(3, 16, (n, p), generator=g)
    rids = torch.randint(3, 16, (n, r), generator=g)
    rmask = torch.ones(n, r, dtype=torch.bool)
    rmask[::2, 3] = False
    return Rollout(ids, torch.ones(n, p, dtype=torch.bool), rids, rmask, torch.zeros(n, r)), torch.randn(n, generator=g)


def fsdp2_engine(layout: Any = None, lr: float = 1e-4, **optim: Any):
    """The shipped tiny policy on fsdp2 in fp32 under the shared training loop (one process, or
    this rank of a pool the caller set up)."""
    from flowc.ir.plan import Layout
    from flowc.ir.run_config import OptimConfig
    from flowc.runtime.backends import EngineInit
    from flowc.runtime.backends.fsdp2 import Fsdp2Trainer
    from flowc.runtime.backends.training import TrainEngine
    from flowc.tasks.arithmetic import asset_dir

    init = EngineInit(
        role="actor",
        kind="policy",
        source=str(asset_dir()),
        layout=layout or Layout(),
        dtype="float32",
        seed=0,
        optim=OptimConfig(lr=lr, **optim),
    )
    return TrainEngine(Fsdp2Trainer(init))
