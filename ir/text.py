"""Printers of a FlowGraph: the deterministic text form, DOT and Mermaid.

The text form (``str(graph)``) is what golden tests diff::

    flow grpo(n=8, clip=0.2, kl=0.001)
      roles    actor: policy, ref: reference, reward: reward
      symbols  B prompts/step, P prompt tokens, R response tokens, n=8

      %prompts        : Prompts[B]    = input(source='prompts')
      %actor.generate : Rollout[B*n]  = generate[actor](%prompts, n=8)
      ...

      weights (loop-carried into the next iteration)
        actor.update ~> actor.generate, actor.logprobs
"""

from __future__ import annotations

from typing import Any

from flowc.ir.graph import FlowGraph, Node, ValueRef
from flowc.ir.targets import short_name

ROLE_COLORS = {
    "policy": "#cfe2ff",
    "critic": "#ffe5b4",
    "reference": "#e2e3e5",
    "reward_model": "#d1e7dd",
    "reward": "#f8d7da",
    None: "#ffffff",
}
"""Fill of a node by its role's kind (light tints: their text is black)."""
COMPUTE_COLOR = "#fff3cd"
"""Fill of controller-side compute nodes."""
INPUT_COLOR = "#ffffff"


def _luminance(color: str) -> float:
    """WCAG relative luminance of a ``#rrggbb`` colour."""
    h = color.lstrip("#")
    chans = [int(h[i : i + 2], 16) / 255 for i in (0, 2, 4)]
    r, g, b = (c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in chans)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def contrast_ratio(a: str, b: str) -> float:
    """WCAG 2 contrast ratio of two ``#rrggbb`` colours (1 to 21; body text wants 4.5)."""
    la, lb = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (la + 0.05) / (lb + 0.05)


def text_color(fill: str) -> str:
    """Black or white, whichever reads better on ``fill`` (at least 4.58:1 on any colour)."""
    return "#000000" if contrast_ratio(fill, "#000000") >= contrast_ratio(fill, "#ffffff") else "#ffffff"


def node_fill(n: Node, kinds: dict[str, str]) -> str:
    """A node's fill: its role kind's colour; controller compute and inputs their own."""
    if n.op == "compute":
        return COMPUTE_COLOR
    if n.role is None:
        return INPUT_COLOR
    return ROLE_COLORS.get(kinds.get(n.role), INPUT_COLOR)


def format_value(x: Any) -> str:
    """A constant or reference as the text form shows it."""
    if isinstance(x, ValueRef):
        return str(x)
    if isinstance(x, str):
        return repr(x)
    if isinstance(x, tuple):
        inner = ", ".join(format_value(y) for y in x)
        return f"({inner},)" if len(x) == 1 else f"({inner})"
    if isinstance(x, list):
        return "[" + ", ".join(format_value(y) for y in x) + "]"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k!r}: {format_value(v)}" for k, v in x.items()) + "}"
    if isinstance(x, slice):
        parts = ["" if p is None else format_value(p) for p in (x.start, x.stop, x.step)]
        return ":".join(parts[:2]) + (f":{parts[2]}" if x.step is not None else "")
    if x is Ellipsis:
        return "..."
    return str(x)


def node_call(n: Node) -> str:
    """``generate[actor](%prompts, n=8)`` — the right-hand side of a node."""
    if n.op == "compute":
        head = f"compute[{short_name(n.target or '?')}]"
    elif n.role is not None:
        head = f"{n.op}[{n.role}]"
    else:
        head = n.op
    parts = [format_value(a) for a in n.args] + [f"{k}={format_value(v)}" for k, v in n.kwargs.items()]
    return f"{head}({', '.join(parts)})"


def format_header(g: FlowGraph) -> list[str]:
    hp = ", ".join(f"{k}={format_value(v)}" for k, v in g.hyperparams.items())
    roles = ", ".join(f"{r.name}: {r.kind}" for r in g.roles.values())
    syms = ["B prompts/step", "P prompt tokens", "R response tokens"] + [f"{k}={v}" for k, v in g.symbols.items()]
    head = [f"flow {g.name}({hp})", f"  roles    {roles}", f"  symbols  {', '.join(syms)}"]
    if g.max_staleness is not None:
        head.append(f"  staleness ≤ {g.max_staleness} weight version(s) (declared: @fc.flow(max_staleness={g.max_staleness}))")
    return head


def format_graph(g: FlowGraph) -> str:
    """The deterministic text form of a graph."""
    lines = format_header(g)
    lines.append("")
    nodes = g.nodes
    w_id = max((len(n.id) for n in nodes), default=0) + 1
    w_ty = max((len(str(n.type)) for n in nodes), default=0)
    for n in nodes:
        lines.append(f"  %{n.id:<{w_id - 1}} : {n.type!s:<{w_ty}} = {node_call(n)}")
    weights = g.edges("weights")
    if weights:
        lines.append("")
        lines.append("  weights (loop-carried into the next iteration)")
        by_src: dict[str, list[str]] = {}
        for e in weights:
            by_src.setdefault(e.src, []).append(e.dst)
        for src, dsts in by_src.items():
            lines.append(f"    {src} ~> {', '.join(dsts)}")
    return "\n".join(lines) + "\n"


def _path_label(path: tuple[str | int, ...]) -> str:
    return ".".join(str(p) for p in path)


def _dot_id(s: str) -> str:
    return '"' + s.replace('"', '\\"') + '"'


def _label(n: Node) -> str:
    if n.op == "compute":
        return short_name(n.target or "?")
    if n.op == "input":
        return f"input: {n.kwargs.get('source')}"
    return f"{n.role}.{n.op}" if n.op != "reward" else f"{n.role}()"


def to_dot(
    g: FlowGraph, *, edge_labels: dict[tuple[str, str, str], str] | None = None, node_notes: dict[str, str] | None = None
) -> str:
    """Graphviz DOT: role ops as filled boxes (colour by role kind), controller
    compute as ellipses, weight edges dashed. ``edge_labels`` (keyed by
    ``(src, dst, arg)``) and ``node_notes`` let the planner add bytes and times."""
    kinds = {r.name: r.kind for r in g.roles.values()}
    out = [
        f"digraph {_dot_id(g.name)} {{",
        "  rankdir=TB;",
        '  node [fontname="Helvetica", fontsize=11];',
        '  edge [fontname="Helvetica", fontsize=9];',
    ]
    for n in g.nodes:
        shape = "ellipse" if n.op == "compute" else ("parallelogram" if n.op == "input" else "box")
        color = node_fill(n, kinds)
        label = _label(n) + f"\\n{n.type}"
        if node_notes and n.id in node_notes:
            label += f"\\n{node_notes[n.id]}"
        out.append(
            f'  {_dot_id(n.id)} [label="{label}", shape={shape}, style="filled,rounded", fillcolor="{color}", fontcolor="{text_color(color)}"];'
        )
    for e in g.edges():
        lab = "weights" if e.kind == "weights" else _path_label(e.path)
        if edge_labels and (e.src, e.dst, e.arg) in edge_labels:
            lab = f"{lab} {edge_labels[(e.src, e.dst, e.arg)]}".strip()
        style = ', style=dashed, color="#dc3545", constraint=false' if e.kind == "weights" else ""
        out.append(f'  {_dot_id(e.src)} -> {_dot_id(e.dst)} [label="{lab}"{style}];')
    out.append("}")
    return "\n".join(out) + "\n"


def _mm_id(s: str) -> str:
    return "n_" + "".join(c if c.isalnum() else "_" for c in s)


def to_mermaid(g: FlowGraph) -> str:
    """A Mermaid flowchart of the graph (renders on GitHub and in docs)."""
    out = ["flowchart TD"]
    for n in g.nodes:
        label = f"{_label(n)}<br/>{n.type}".replace('"', "'")
        if n.op == "compute":
            out.append(f'  {_mm_id(n.id)}(["{label}"])')
        elif n.op == "input":
            out.append(f'  {_mm_id(n.id)}[/"{label}"/]')
        else:
            out.append(f'  {_mm_id(n.id)}["{label}"]')
    for e in g.edges():
        if e.kind == "weights":
            out.append(f"  {_mm_id(e.src)} -. weights .-> {_mm_id(e.dst)}")
        else:
            lab = _path_label(e.path)
            arrow = f" -- {lab} --> " if lab else " --> "
            out.append(f"  {_mm_id(e.src)}{arrow}{_mm_id(e.dst)}")
    # every node gets a class with its fill and text colour (a theme's defaults can be white on white)
    kinds = {r.name: str(r.kind) for r in g.roles.values()}
    classes: dict[str, list[str]] = {}
    for n in g.nodes:
        cls = "compute" if n.op == "compute" else kinds.get(n.role or "", "input")
        classes.setdefault(cls, []).append(_mm_id(n.id))
    for cls, members in classes.items():
        fill = COMPUTE_COLOR if cls == "compute" else ROLE_COLORS.get(cls, INPUT_COLOR)
        out.append(f"  classDef {cls} fill:{fill},color:{text_color(fill)},stroke:#555555")
        out.append(f"  class {','.join(members)} {cls}")
    return "\n".join(out) + "\n"
