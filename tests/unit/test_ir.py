"""The IR core: graph building, use-def, JSON encoding, verifier, shapes."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import EXAMPLES, FLOWS, check_golden, policy_graph

from flowc.errors import IRError, VerificationError
from flowc.ir.graph import FlowGraph, Node, RoleInfo, ValueRef
from flowc.ir.losses import ppo_clip
from flowc.ir.serialize import decode, encode, from_dict, from_json, to_dict, to_json
from flowc.ir.shapes import eval_dim, match_dim, numel
from flowc.ir.text import to_dot, to_mermaid
from flowc.ir.types import StatsType, TensorType, nbytes, prompts_type, rollout_type
from flowc.ir.verify import verify
from flowc.loader import load_flow


def tiny_graph() -> FlowGraph:
    return policy_graph("tiny", n=2, chain=1, target="torch.exp")


def test_use_def_is_kept_by_the_graph():
    g = tiny_graph()
    assert [n.id for n in g.users("actor.generate")] == ["adv", "actor.update"]
    assert [n.id for n in g.predecessors("actor.update")] == ["actor.generate", "adv"]
    edge = next(iter(g.inputs("adv")))
    assert edge.what == "actor.generate.logprobs" and edge.type == TensorType(shape=("B*n", "R"), dtype="float32")
    assert [(e.src, e.dst) for e in g.edges("weights")] == [("actor.update", "actor.generate")]
    verify(g)


def test_adding_a_node_that_uses_a_missing_value_fails():
    g = tiny_graph()
    with pytest.raises(IRError, match="before it exists"):
        g.add(Node("x", "compute", None, StatsType(), args=(ValueRef("nope"),), target="torch.exp"))
    with pytest.raises(IRError, match="no field"):
        g.add(Node("y", "compute", None, StatsType(), args=(ValueRef("actor.generate", ("mask",)),), target="torch.exp"))
    with pytest.raises(IRError, match="already used"):
        g.add(Node("adv", "compute", None, StatsType(), target="torch.exp"))


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        3,
        -0.1,
        float("inf"),
        "s",
        (1, 2),
        [1, (2, 3)],
        {"a": 1, "b": (2,)},
        slice(None, 4, None),
        slice(1, None, 2),
        Ellipsis,
        torch.float32,
        torch.bool,
        ValueRef("n", ("f", 1)),
        ppo_clip(0.2, 0.28, agg="seq-mean-token-mean"),
    ],
)
def test_constants_round_trip_exactly(value):
    back = decode(json.loads(json.dumps(encode(value))))
    assert back == value and type(back) is type(value)


def test_tensor_constant_round_trips():
    t = torch.tensor([1.5, 2.0])
    back = decode(json.loads(json.dumps(encode(t))))
    assert torch.equal(back, t) and back.dtype == t.dtype


def test_unstorable_value_is_an_error():
    with pytest.raises(IRError, match="cannot store"):
        encode(object())


def test_json_document_is_validated():
    d = to_dict(tiny_graph())
    d["nodes"][1]["colour"] = "red"
    with pytest.raises(IRError, match="not a valid flowc graph"):
        from_dict(d)
    d = to_dict(tiny_graph())
    d["edges"] = d["edges"][:-1]
    with pytest.raises(IRError, match="edges do not match"):
        from_dict(d)
    with pytest.raises(IRError, match="not JSON"):
        from_json("{")


def test_verifier_catches_broken_invariants():
    g = tiny_graph()
    bad = g.with_nodes(
        [
            *g.nodes[:-1],
            Node("actor.update", "update", "actor", StatsType(), args=(ValueRef("actor.generate"),), kwargs={"loss": ppo_clip()}),
        ]
    )
    with pytest.raises(VerificationError, match="needs advantages"):
        verify(bad)
    g2 = FlowGraph("x", roles={"ref": RoleInfo("ref", "reference")})
    g2.add(Node("prompts", "input", None, prompts_type(), kwargs={"source": "prompts", "kind": "prompts"}))
    g2.add(Node("ref.generate", "generate", "ref", rollout_type("B"), args=(ValueRef("prompts"),), kwargs={"n": 1}))
    with pytest.raises(VerificationError, match="role 'ref' is a reference; generate runs on policy"):
        verify(g2)
    g3 = tiny_graph()
    g3._g.remove_edges_from([(e.src, e.dst) for e in g3.edges("weights")])
    with pytest.raises(VerificationError, match="no weight edge"):
        verify(g3)
    g4 = tiny_graph()
    g4["adv"].type = TensorType(shape=("B*k",), dtype="float32")
    with pytest.raises(VerificationError, match="unbound symbol"):
        verify(g4)
    g5 = tiny_graph()
    g5.nodes[1].kwargs["n"] = 0
    with pytest.raises(VerificationError, match="integer n >= 1"):
        verify(g5)


def test_shape_expressions():
    env = {"B": 4, "n": 8, "P": 16, "R": 32}
    assert eval_dim("B*n", env) == 32
    assert eval_dim("(P+R)*B", env) == 192
    assert numel(("B*n", "R"), env) == 1024
    with pytest.raises(IRError):
        eval_dim("B**2", env)
    with pytest.raises(IRError, match="has no value"):
        eval_dim("Z", env)
    assert nbytes(rollout_type("B*n"), env) == 32 * 16 * (8 + 1) + 32 * 32 * (8 + 1 + 4)


def test_match_dim_prefers_symbolic_forms():
    # probes: B=3,P=5,R=7 and B=11,P=13,R=17
    assert match_dim([3 * 8, 11 * 8], {"n": 8}) == "B*n"
    assert match_dim([8, 8], {"n": 8}) == "n"
    assert match_dim([4, 4], {"n": 8}) == "4"
    assert match_dim([12, 30], {}) == "P+R"
    assert match_dim([6, 22], {}) == "2*B"
    assert match_dim([1000003, 7], {}) == "?"


@pytest.mark.parametrize("name", FLOWS)
def test_golden_text_of_examples(name):
    g = load_flow(str(EXAMPLES / f"{name}.py")).trace()
    check_golden(f"{name}.graph.txt", str(g))


def test_golden_dot_and_mermaid_of_ppo():
    g = load_flow(str(EXAMPLES / "ppo.py")).trace()
    check_golden("ppo.graph.dot", to_dot(g))
    check_golden("ppo.graph.mmd", to_mermaid(g))


def test_text_form_is_deterministic_across_traces():
    fl = load_flow(str(EXAMPLES / "ppo.py"))
    assert str(fl.trace()) == str(fl.trace())
    assert to_json(fl.trace()) == to_json(fl.trace())
