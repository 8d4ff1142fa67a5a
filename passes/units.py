"""Placement units: the groups of model ops that are placed together.

A trainable role's ``update`` and its forward ops share one training engine
(one unit, ``actor.train``); a policy's ``generate`` ops form a second unit
(``actor.gen``) that the planner may put on the same devices (co-located, the
HybridFlow hybrid engine) or on devices of its own (disaggregated, with a
cross-pool weight sync). Frozen roles (reference, reward model) are one
forward unit each. ``Reward`` functions and ``compute`` nodes run on the
controller and are not placed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from flowc.errors import PlanError
from flowc.ir.graph import FlowGraph
from flowc.ir.losses import update_skips_idle
from flowc.ir.models import ModelSpec
from flowc.ir.ops import MODEL_OPS, PHASE_OF_OP
from flowc.ir.types import project
from flowc.ir.verify import filter_region
from flowc.ir.workload import WorkloadSpec, percentiles_mean
from flowc.passes.flops import Demand
from flowc.passes.response_lengths import LengthDist


@dataclass(frozen=True)
class Unit:
    """A group of ops of one role placed on one device pool.

    Attributes:
        name: ``actor.train``, ``actor.gen``, ``critic``, ``ref``, ``rm``.
        role: the role name.
        kind: the role kind (policy, critic, reference, reward_model).
        phases: the phases it runs (train, forward, generate).
        ops: node ids of its ops, in graph order.
    """

    name: str
    role: str
    kind: str
    phases: tuple[str, ...]
    ops: tuple[str, ...]
    kinds: tuple[str, ...] = ()  # the op of each entry of ops

    @property
    def update_op(self) -> str | None:
        ups = [o for o, k in zip(self.ops, self.kinds, strict=True) if k == "update"]
        return ups[-1] if ups else None

    @property
    def trainable(self) -> bool:
        return "train" in self.phases

    @property
    def generates(self) -> bool:
        return self.phases == ("generate",)


def train_unit(units: Iterable[Unit], role: str) -> Unit:
    """The unit that trains ``role``."""
    return _find(units, role, lambda u: u.trainable, "training")


def gen_unit(units: Iterable[Unit], role: str) -> Unit:
    """The unit that generates with ``role``."""
    return _find(units, role, lambda u: u.generates, "generation")


def _find(units: Iterable[Unit], role: str, pred: Callable[[Unit], bool], what: str) -> Unit:
    for u in units:
        if u.role == role and pred(u):
            return u
    raise PlanError(f"role {role!r} has no {what} unit")


def units_of(g: FlowGraph) -> list[Unit]:
    """The placement units of a graph, in a deterministic order."""
    out: list[Unit] = []
    for role in g.roles.values():
        ops = [n for n in g.nodes if n.role == role.name and n.op in MODEL_OPS]
        if not ops:
            continue
        gen = tuple(n.id for n in ops if n.op == "generate")
        rest = tuple(n.id for n in ops if n.op != "generate")
        rest_kinds = tuple(n.op for n in ops if n.op != "generate")
        phases = tuple(sorted({PHASE_OF_OP[n.op] for n in ops if n.op != "generate"}, key=("train", "forward").index))
        if rest:
            name = f"{role.name}.train" if (gen and "train" in phases) else role.name
            out.append(Unit(name, role.name, role.kind, phases, rest, rest_kinds))
        if gen:
            out.append(Unit(f"{role.name}.gen", role.name, role.kind, ("generate",), gen, ("generate",) * len(gen)))
    return out


def demands(g: FlowGraph, w: WorkloadSpec) -> dict[str, Demand]:
    """The work of each model op of one iteration, by node id."""
    out: dict[str, Demand] = {}
    updates = w.mini_batches * w.epochs
    rounds = generation_rounds(g)
    for n in g.nodes:
        if n.op not in MODEL_OPS:
            continue
        batch = _batch_of(g, n.id)
        seqs = math.ceil(batch * w.prompts * rounds.get(n.id, 1.0))
        mean_r = w.avg_response_len
        resp = w.response_len
        if n.op == "generate":
            pct = w.response_percentiles
            max_tokens = n.kwargs.get("max_tokens")
            if max_tokens is not None and int(max_tokens) < resp:
                resp = int(max_tokens)
                if pct is None:
                    mean_r = min(mean_r, float(resp))
                else:  # the workload's distribution (at its mean), cut at this generate's limit, and that cut's mean
                    whole = LengthDist.of(w.response_len, mean_r, pct)
                    pct = tuple(min(x, float(resp)) for _, x in whole.knots)
                    mean_r = percentiles_mean(pct)
            agent = {}
            if n.kwargs.get("env") is not None:  # a multi-turn generate: its turns, observations and environment
                most = n.kwargs.get("max_turns")  # the flow's bound; without it the environment class's (unknown here)
                turns = min(w.turns or most or 1, most or math.inf)
                agent = dict(agent=True, turns=float(turns), obs_len=w.obs_len, env_latency_s=w.env_latency_s)
            out[n.id] = Demand(seqs, w.prompt_len, resp, mean_r, percentiles=pct, **agent)
        elif n.op == "update":
            idle = 0
            if w.idle_rows and update_skips_idle(n.kwargs):  # the rows with zero advantages are not computed
                idle = seqs - max(1, math.ceil(seqs * (1.0 - w.idle_rows)))
            out[n.id] = Demand(seqs - idle, w.prompt_len, resp, mean_r, passes=w.epochs, updates=updates, group=batch, idle=idle)
        else:
            out[n.id] = Demand(seqs, w.prompt_len, resp, mean_r, group=batch)
    return out


def generation_rounds(g: FlowGraph) -> dict[str, float]:
    """Expected executions per iteration of the ops a ``filter`` re-runs (DAPO's
    dynamic sampling): ``min(1 / expected_keep, max_rounds)``; ops absent run once."""
    out: dict[str, float] = {}
    for f in g.nodes:
        if f.op != "filter":
            continue
        expected = min(1.0 / float(f.kwargs["expected_keep"]), float(f.kwargs["max_rounds"]))
        for op in filter_region(g, f.id):
            out[op] = out.get(op, 1.0) * expected
    return out


def _batch_of(g: FlowGraph, node_id: str) -> int:
    """Sequences per prompt that an op processes (the n of its rollout)."""
    from flowc.ir.shapes import eval_dim
    from flowc.ir.types import BundleType

    n = g[node_id]
    t = n.type if n.op == "generate" else None
    if t is None:
        ref = n.args[0]
        t = project(g[ref.node].type, ref.path)
    if not isinstance(t, BundleType):
        raise PlanError(f"op {node_id} does not read a rollout")
    return eval_dim(t.batch, {"B": 1, **g.symbols})


def model_of(models: dict[str, ModelSpec], role: str) -> ModelSpec:
    try:
        return models[role]
    except KeyError:
        raise PlanError(f"no model given for role {role!r}", fix=f"pass --model {role}=NAME") from None
