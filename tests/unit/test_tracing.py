"""Tracing: the examples and flows written without the team in mind."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import EXAMPLES

from flowc.ir.serialize import from_json, to_json
from flowc.ir.types import BundleType, TensorType, TupleType
from flowc.ir.verify import verify
from flowc.loader import load_flow

EXAMPLE_FILES = sorted(p.name for p in EXAMPLES.glob("*.py"))


@pytest.mark.parametrize("name", EXAMPLE_FILES)
def test_examples_trace_verify_and_round_trip(name):
    g = load_flow(str(EXAMPLES / name)).trace()
    verify(g)
    again = from_json(to_json(g))
    assert again == g
    assert to_json(again) == to_json(g)
    assert str(again) == str(g)


def test_ppo_graph_has_every_role_op():
    g = load_flow(str(EXAMPLES / "ppo.py")).trace()
    ops = [(n.op, n.role) for n in g.nodes]
    for expected in [
        ("generate", "actor"),
        ("logprobs", "actor"),
        ("logprobs", "ref"),
        ("values", "critic"),
        ("score", "rm"),
        ("update", "actor"),
        ("update", "critic"),
    ]:
        assert expected in ops
    assert any(n.op == "compute" and n.target == "flowc.ir.functional.gae" for n in g.nodes)
    # the two outputs of gae feed different updates, as projections on edges
    critic_in = {e.arg: e.what for e in g.inputs("critic.update")}
    assert critic_in["returns"] == "gae[1]"
    assert critic_in["old_values"] == "critic.values"
    actor_in = {e.arg: e.what for e in g.inputs("actor.update")}
    assert actor_in["advantages"] == "whiten"
    # weight edges: each trained role feeds its next-iteration readers
    weights = {(e.src, e.dst) for e in g.edges("weights")}
    assert weights == {
        ("actor.update", "actor.generate"),
        ("actor.update", "actor.logprobs"),
        ("critic.update", "critic.values"),
    }


def test_shapes_are_symbolic():
    g = load_flow(str(EXAMPLES / "grpo.py")).trace()
    assert g.symbols == {"n": 8}
    assert g["actor.generate"].type.batch == "B*n"
    assert g["actor.logprobs"].type == TensorType(shape=("B*n", "R"), dtype="float32")
    assert g["group_normalize"].type == TensorType(shape=("B*n",), dtype="float32")
    mask = next(e for e in load_flow(str(EXAMPLES / "ppo.py")).trace().edges() if e.what.endswith("response_mask"))
    assert mask.type == TensorType(shape=("B", "R"), dtype="bool")


def test_hyperparameter_override_changes_the_graph():
    fl = load_flow(str(EXAMPLES / "grpo.py"))
    g = fl.trace(n=4)
    assert g.symbols == {"n": 4}
    assert g["actor.generate"].kwargs["n"] == 4
    assert g.hyperparams["n"] == 4


STRANGER = '''
@fc.flow
def clipped_reinforce(batch: fc.Prompts, pi: fc.Policy, frozen: fc.Reference, judge: fc.RewardModel,
                      *, samples: int = 6, beta: float = 0.02, cap: float = 3.0, greedy_bonus: bool = True):
    """Written without the flowc team: torch ops, tensor methods, slicing."""
    out = pi.generate(batch, n=samples, temperature=0.9, top_p=0.95, max_tokens=64)
    lp = pi.logprobs(out)
    lp_ref = frozen.logprobs(out)
    s = judge.score(out)
    s = torch.clamp(s, -cap, cap)
    grouped = s.view(-1, samples)
    centred = (grouped - grouped.mean(dim=1, keepdim=True)).flatten()
    if greedy_bonus:                      # a hyperparameter: ordinary Python
        centred = centred + 0.1
    k3 = fc.ops.kl(lp, lp_ref, kind="k3")
    penalty = fc.ops.masked_mean(k3, out.response_mask, dim=-1)
    adv = torch.where(centred > 0, centred, 0.5 * centred) - beta * penalty
    first_tokens = out.response_ids[:, :4]
    tok_adv = adv.unsqueeze(-1) * out.response_mask.float()
    pi.update(out, advantages=tok_adv, old_logprobs=lp, loss=fc.losses.ppo_clip(0.2, 0.28, agg="seq-mean-token-sum-norm"))
'''


def test_a_flow_nobody_on_the_team_wrote(flow_file):
    p = flow_file(STRANGER)
    g = load_flow(str(p)).trace()
    verify(g)
    assert g.symbols == {"n": 6}
    assert g.roles["judge"].kind == "reward_model"
    gen = g["pi.generate"]
    assert gen.kwargs == {"n": 6, "temperature": 0.9, "top_p": 0.95, "max_tokens": 64}
    # torch.clamp, Tensor.view, Tensor.mean, where, unsqueeze … all recorded as compute
    targets = [n.target for n in g.nodes if n.op == "compute"]
    assert "torch.clamp" in targets
    assert "Tensor.view" in targets and "Tensor.mean" in targets and "torch.where" in targets
    assert "flowc.ir.functional.masked_mean" in targets
    # shapes: the grouped view is [B, n]; the mean over dim 1 keeps a 1; the slice is [B*n, 4]
    by_target = {n.target: n for n in g.nodes if n.op == "compute"}
    assert by_target["Tensor.view"].type.shape == ("B", "n")
    assert by_target["Tensor.mean"].type.shape == ("B", "1")
    getitem = next(n for n in g.nodes if n.target == "operator.getitem")
    assert getitem.type.shape == ("B*n", "4")
    upd = g["pi.update"]
    assert upd.kwargs["loss"].clip_high == 0.28
    assert upd.kwargs["loss"].agg == "seq-mean-token-sum-norm"
    assert g[next(e.src for e in g.inputs("pi.update") if e.arg == "advantages")].type.shape == ("B*n", "R")
    # the hyperparameter branch was taken at trace time
    assert any(n.target == "operator.add" for n in g.nodes)
    assert from_json(to_json(g)) == g


def test_gae_tuple_type():
    g = load_flow(str(EXAMPLES / "ppo.py")).trace()
    t = g["gae"].type
    assert isinstance(t, TupleType) and len(t.items) == 2
    assert all(i == TensorType(shape=("B", "R"), dtype="float32") for i in t.items)


def test_two_sample_counts_bind_two_symbols(flow_file):
    p = flow_file(
        """
@fc.flow
def two(prompts: fc.Prompts, actor: fc.Policy, reward: fc.Reward):
    a = actor.generate(prompts, n=4)
    b = actor.generate(prompts, n=2)
    actor.update(a, advantages=fc.ops.group_normalize(reward(a), 4) + reward(b).repeat_interleave(2))
"""
    )
    g = load_flow(str(p)).trace()
    assert g.symbols == {"n": 4, "n2": 2}
    assert isinstance(g["actor.generate_1"].type, BundleType)
    assert g["actor.generate_1"].type.batch == "B*n2"
    rep = next(n for n in g.nodes if n.target == "Tensor.repeat_interleave")
    assert rep.type.shape == ("B*n",)


def test_cli_graph_json_lists_nodes_and_edges():
    r = subprocess.run(
        [sys.executable, "-m", "flowc.cli", "graph", str(EXAMPLES / "ppo.py"), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    doc = json.loads(r.stdout)
    ops = {(n["op"], n["role"]) for n in doc["nodes"]}
    assert ("compute", None) in ops and ("values", "critic") in ops and ("score", "rm") in ops
    assert sum(1 for n in doc["nodes"] if n["op"] == "update") == 2
    for e in doc["edges"]:
        assert {"src", "dst", "what", "kind", "type"} <= set(e)
    assert any(e["kind"] == "weights" for e in doc["edges"])


@pytest.mark.parametrize("fmt,needle", [("text", "%actor.generate"), ("dot", "digraph"), ("mermaid", "flowchart TD")])
def test_cli_graph_formats(fmt, needle):
    r = subprocess.run(
        [sys.executable, "-m", "flowc.cli", "graph", str(EXAMPLES / "grpo.py"), "--format", fmt, "n=4"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert needle in r.stdout


def test_cli_version_and_help():
    import flowc

    r = subprocess.run([sys.executable, "-m", "flowc.cli", "--version"], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == f"flowc {flowc.__version__}"
    r = subprocess.run([sys.executable, "-m", "flowc.cli", "--help"], capture_output=True, text=True, check=True)
    assert "graph" in r.stdout
