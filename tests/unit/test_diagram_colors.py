"""Every node of every diagram flowc draws has a fill and a text colour that reads on it
(WCAG contrast >= 4.5), and each role — reward functions included — a fill of its own.

Regression: a Reward role's node was drawn white on white (no plan entry, so no colour,
and white text because it has a role)."""

from __future__ import annotations

import re

import pytest
from helpers import EXAMPLES

from flowc.export import to_html, to_plan_dot, to_plan_mermaid
from flowc.ir.cluster import ClusterSpec
from flowc.ir.graph import FlowGraph
from flowc.ir.text import contrast_ratio, to_dot, to_mermaid
from flowc.ir.workload import WorkloadSpec
from flowc.loader import load_flow
from flowc.passes.pipeline import make_plan
from flowc.planning import resolve_models

# grpo: policy, reference, a reward function; ppo: policy, critic, reference, reward model;
# ppo_rlvr: a critic beside a reward function
FLOWS = ["grpo", "ppo", "ppo_rlvr"]
HEX = re.compile(r"^#[0-9a-fA-F]{6}$")


def _planned(flow: str):
    g = load_flow(str(EXAMPLES / f"{flow}.py")).trace()
    models, _ = resolve_models(g, {})
    plan, planned, _ = make_plan(g, models, ClusterSpec.parse("local"), WorkloadSpec())
    return g, plan, planned


def _readable(colors: dict[str, tuple[str, str]], what: str) -> None:
    for node, (fill, text) in colors.items():
        assert HEX.match(fill) and HEX.match(text), f"{what}: {node} has fill {fill!r}, text {text!r}"
        ratio = contrast_ratio(fill, text)
        assert ratio >= 4.5, f"{what}: {node}'s text {text} on {fill} has contrast {ratio:.2f} < 4.5"


def _distinct(g: FlowGraph, colors: dict[str, tuple[str, str]], what: str) -> None:
    """One fill per role, none of them white (the page) or the controller compute's."""
    by_role: dict[str, set[str]] = {}
    for n in g.nodes:
        if n.id in colors and n.role:
            by_role.setdefault(n.role, set()).add(colors[n.id][0].lower())
    assert set(by_role) == set(g.roles), f"{what}: roles without a node drawn: {set(g.roles) - set(by_role)}"
    compute = {colors[n.id][0].lower() for n in g.nodes if n.op == "compute"}
    for role, fills in by_role.items():
        assert len(fills) == 1, f"{what}: role {role} drawn in {fills}"
        assert fills.isdisjoint({"#ffffff"} | compute), f"{what}: role {role} has no colour of its own ({fills})"
    assert len({f for fs in by_role.values() for f in fs}) == len(by_role), f"{what}: two roles share a colour: {by_role}"


def _dot_colors(text: str) -> dict[str, tuple[str, str]]:
    out = {}
    for m in re.finditer(r'^\s*"([^"]+)" \[(.*)\];$', text, re.M):
        attrs = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        out[m.group(1)] = (attrs.get("fillcolor", ""), attrs.get("fontcolor", ""))
    return out


def _mermaid_colors(text: str, g: FlowGraph) -> dict[str, tuple[str, str]]:
    styles = {c: (f, t) for c, f, t in re.findall(r"^\s*classDef (\w+) fill:(#\w+),color:(#\w+)", text, re.M)}
    member: dict[str, list[str]] = {}
    for ids, cls in re.findall(r"^\s*class ([\w,]+) (\w+)$", text, re.M):
        for i in ids.split(","):
            member.setdefault(i, []).append(cls)
    out = {}
    for n in g.nodes:
        mid = "n_" + "".join(c if c.isalnum() else "_" for c in n.id)
        assert re.search(rf"^\s*{mid}[\[(]", text, re.M), f"mermaid: node {n.id} not drawn"
        assert len(member.get(mid, [])) == 1, f"mermaid: node {n.id} has classes {member.get(mid)}"
        out[n.id] = styles.get(member[mid][0], ("", ""))
    return out


def _html_colors(page: str) -> tuple[dict[str, tuple[str, str]], list[tuple[str, str]]]:
    nodes = {}
    for fill, text, label in re.findall(
        r'<g class="node"[^>]*><rect [^>]*fill="([^"]+)"[^>]*/><text [^>]*fill="([^"]+)">([^<]*)</text>', page
    ):
        nodes[label] = (fill, text)
    bars = re.findall(r'<g class="bar"[^>]*><rect [^>]*fill="([^"]+)"[^>]*>.*?</rect><text [^>]*fill="([^"]+)"', page)
    return nodes, bars


@pytest.mark.parametrize("flow", FLOWS)
def test_graph_diagrams_colour_every_node_readably(flow):
    g = load_flow(str(EXAMPLES / f"{flow}.py")).trace()
    dot = _dot_colors(to_dot(g))
    assert set(dot) == {n.id for n in g.nodes}
    _readable(dot, "graph dot")
    _distinct(g, dot, "graph dot")
    mmd = _mermaid_colors(to_mermaid(g), g)
    _readable(mmd, "graph mermaid")
    _distinct(g, mmd, "graph mermaid")


@pytest.mark.parametrize("flow", FLOWS)
def test_plan_diagrams_colour_every_node_readably(flow):
    from flowc.export import _op_label

    g, plan, planned = _planned(flow)
    assert any(r.kind in ("reward", "reward_model") for r in g.roles.values())
    dot = _dot_colors(to_plan_dot(plan, planned))
    assert set(dot) == {n.id for n in planned.nodes}
    _readable(dot, "plan dot")
    _distinct(planned, dot, "plan dot")
    mmd = _mermaid_colors(to_plan_mermaid(plan, planned), planned)
    _readable(mmd, "plan mermaid")
    _distinct(planned, mmd, "plan mermaid")
    nodes, bars = _html_colors(to_html(plan, planned))
    by_id = {n.id: nodes[_op_label(planned, n.id)] for n in planned.nodes}  # every node drawn
    _readable(by_id, "plan html graph")
    _distinct(planned, by_id, "plan html graph")
    _readable({f"bar {i}": b for i, b in enumerate(bars)}, "plan html placement")
    page = to_html(plan, planned)
    for role in g.roles:  # the legend names every role, reward functions too
        assert f'<span data-role="{role}">' in page
