"""Plan diagrams: HTML (one self-contained file), SVG (through Graphviz), DOT, Mermaid.

The HTML page shows the placement (devices × time, one band per pool), the
dataflow graph annotated with bytes and times, memory bars per role and phase
against the device capacity, the iteration timeline, the reshards and the
planner's reasons. Everything is drawn here as inline SVG from the plan; the
page's only script highlights a role across the figures and reports errors.
"""

from __future__ import annotations

import html
import json
import shutil
import subprocess
from importlib import resources

import jinja2

from flowc.errors import FlowcError
from flowc.ir.graph import FlowGraph
from flowc.ir.plan import Plan
from flowc.ir.steady_state import drawn_period, pipelined_spans
from flowc.ir.targets import short_name
from flowc.ir.text import COMPUTE_COLOR, INPUT_COLOR, text_color

ROLE_COLORS = ["#a0cbe8", "#ffbe7d", "#8cd17d", "#ff9d9a", "#86bcb6", "#f1ce63", "#d4a6c8", "#d7b5a6"]
"""One colour per role, in the plan's order then the graph's (reward functions have no plan
entry); text on them is black or white, whichever reads better (:func:`text_color`)."""
MEM_COLORS = {
    "weights": "#4e79a7",
    "gradients": "#f28e2b",
    "optimizer": "#e15759",
    "activations": "#76b7b2",
    "kv_cache": "#59a14f",
    "buffers": "#bab0ac",
    "other_roles": "#d4a6c8",
}


def human_bytes(b: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= k:
            return f"{b / k:.1f} {unit}"
    return f"{b:.0f} B"


def _seconds(s: float) -> str:
    return f"{s:.2f} s" if s >= 1 else f"{s * 1000:.0f} ms"


def _color_map(plan: Plan, g: FlowGraph | None = None) -> dict[str, str]:
    """A colour for every role: the plan's (model roles) and the graph's (reward functions too)."""
    names = [*plan.roles, *(r for r in (g.roles if g is not None else {}) if r not in plan.roles)]
    return {r: ROLE_COLORS[i % len(ROLE_COLORS)] for i, r in enumerate(names)}


def _node_fill(g: FlowGraph, nid: str, colors: dict[str, str]) -> str:
    """A node's fill: its role's colour; controller compute and inputs their own."""
    n = g[nid]
    if n.op == "compute":
        return COMPUTE_COLOR
    return colors.get(n.role, INPUT_COLOR) if n.role else INPUT_COLOR


def _pool_of_op(plan: Plan) -> dict[str, str]:
    return {e.op: e.pool for e in plan.schedule if e.pool}


def _ops_by_pool(plan: Plan, g: FlowGraph) -> dict[str, list[str]]:
    """Node ids per pool (controller ops under "controller"), in graph order."""
    pools = _pool_of_op(plan)
    out: dict[str, list[str]] = {}
    for n in g.nodes:
        out.setdefault(pools.get(n.id, "controller"), []).append(n.id)
    return out


def _op_label(g: FlowGraph, nid: str) -> str:
    n = g[nid]
    if n.op == "compute":
        return short_name(n.target or "?")
    if n.op == "input":
        return f"input {n.kwargs.get('source')}"
    return nid


# --------------------------------------------------------------------- DOT
def to_plan_dot(plan: Plan, g: FlowGraph) -> str:
    """The planned dataflow graph, one cluster per pool, edges with their bytes."""
    spans = {e.op: e for e in plan.schedule}
    edge_bytes = {e.src: g[e.src].meta.get("bytes", 0) for e in g.edges("data")}
    colors = _color_map(plan, g)
    out = [
        f'digraph "{plan.flow}" {{',
        "  rankdir=TB; compound=true;",
        '  node [fontname="Helvetica", fontsize=10, style="filled,rounded", shape=box];',
        '  edge [fontname="Helvetica", fontsize=8];',
    ]
    for i, (pool, ids) in enumerate(_ops_by_pool(plan, g).items()):
        dev = next((p.device_count for p in plan.pools if p.name == pool), None)
        label = f"{pool} ({dev} devices)" if dev else "controller"
        out.append(f'  subgraph "cluster_{i}" {{ label="{label}"; style="rounded,dashed"; color="#888888";')
        for nid in ids:
            n = g[nid]
            t = spans.get(nid)
            time = f"\\n{_seconds(t.end_s - t.start_s)}" if t and t.end_s > t.start_s else ""
            fill = _node_fill(g, nid, colors)
            font = text_color(fill)
            shape = "ellipse" if n.op == "compute" else "box"
            out.append(f'    "{nid}" [label="{_op_label(g, nid)}{time}", fillcolor="{fill}", fontcolor="{font}", shape={shape}];')
        out.append("  }")
    for e in g.edges():
        if e.kind == "weights":
            out.append(f'  "{e.src}" -> "{e.dst}" [style=dashed, color="#dc3545", label="weights", constraint=false];')
        else:
            b = human_bytes(edge_bytes.get(e.src, 0)) if not e.path else ".".join(map(str, e.path))
            out.append(f'  "{e.src}" -> "{e.dst}" [label="{b}"];')
    out.append("}")
    return "\n".join(out) + "\n"


def to_plan_mermaid(plan: Plan, g: FlowGraph) -> str:
    """The planned dataflow graph as a Mermaid flowchart, one subgraph per pool."""
    spans = {e.op: e for e in plan.schedule}

    def mid(x: str) -> str:
        return "n_" + "".join(c if c.isalnum() else "_" for c in x)

    colors = _color_map(plan, g)
    out = ["flowchart TD"]
    for i, (pool, ids) in enumerate(_ops_by_pool(plan, g).items()):
        out.append(f'  subgraph p{i}["{pool}"]')
        for nid in ids:
            t = spans.get(nid)
            time = f"<br/>{_seconds(t.end_s - t.start_s)}" if t and t.end_s > t.start_s else ""
            out.append(f'    {mid(nid)}["{_op_label(g, nid)}{time}"]')
        out.append("  end")
    for e in g.edges():
        if e.kind == "weights":
            out.append(f"  {mid(e.src)} -. weights .-> {mid(e.dst)}")
        else:
            out.append(f"  {mid(e.src)} --> {mid(e.dst)}")
    # every node gets a class with its fill and text colour (class names prefixed: a role may be called "default")
    classes: dict[str, list[str]] = {}
    for n in g.nodes:
        cls = "op_compute" if n.op == "compute" else (f"role_{mid(n.role)[2:]}" if n.role else "op_input")
        classes.setdefault(cls, []).append(n.id)
    for cls, members in classes.items():
        fill = _node_fill(g, members[0], colors)
        out.append(f"  classDef {cls} fill:{fill},color:{text_color(fill)},stroke:#555555")
        out.append(f"  class {','.join(map(mid, members))} {cls}")
    return "\n".join(out) + "\n"


def to_svg(plan: Plan, g: FlowGraph) -> str:
    dot = shutil.which("dot")
    if dot is None:
        raise FlowcError(
            "SVG export needs Graphviz's `dot`, which is not installed",
            fix="install Graphviz (Debian/Ubuntu: apt-get install graphviz; macOS: brew install graphviz; conda: conda install graphviz), or export --format html",
        )
    r = subprocess.run([dot, "-Tsvg"], input=to_plan_dot(plan, g), capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise FlowcError(f"Graphviz failed: {r.stderr.strip()}")
    return r.stdout


# -------------------------------------------------------------------- HTML
def _placement_svg(plan: Plan, g: FlowGraph) -> str:
    """Devices × time: a band per pool (height ∝ devices), a bar per op; a pipelined plan over
    two consecutive steps (:func:`pipelined_spans`), each bar tagged with its step."""
    windows = 2 if plan.staleness else 1
    spans = pipelined_spans(plan, windows)
    step = max(drawn_period(plan) * windows, 1e-9)
    width, left, top, band_min = 900, 190, 20, 26
    total_dev = sum(p.device_count for p in plan.pools)
    heights = [max(band_min, 220 * p.device_count / total_dev) for p in plan.pools]
    colors = _color_map(plan, g)
    h = top + sum(heights) + 40
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + left + 20}" height="{h:.0f}" class="placement">']
    y = top
    pool_y = {}
    for p, ph in zip(plan.pools, heights, strict=True):
        pool_y[p.name] = (y, ph)
        parts.append(f'<rect x="{left}" y="{y:.1f}" width="{width}" height="{ph - 4:.1f}" fill="#f3f3f3"/>')
        parts.append(f'<text x="{left - 6}" y="{y + ph / 2:.1f}" text-anchor="end" font-size="11">{html.escape(p.name)}</text>')
        parts.append(
            f'<text x="{left - 6}" y="{y + ph / 2 + 12:.1f}" text-anchor="end" font-size="9" fill="#666">devices {html.escape(p.devices)}</text>'
        )
        y += ph
    for sp in spans:
        e = sp.entry
        if e.pool not in pool_y or e.end_s <= e.start_s:
            continue
        py, ph = pool_y[e.pool]
        x0 = left + width * sp.start_s / step
        w = max(width * (sp.end_s - sp.start_s) / step, 1.0)
        color = colors.get(e.role or "", "#999999")
        tag = "s" if sp.step == 0 else f"s+{sp.step}"
        label = html.escape(f"{e.op} [{tag}]" if plan.staleness else e.op)
        parts.append(
            f'<g class="bar" data-role="{html.escape(e.role or "")}" data-step="{sp.step}"><rect x="{x0:.1f}" y="{py + 2:.1f}" width="{w:.1f}" height="{ph - 8:.1f}" fill="{color}" stroke="#ffffff">'
            f"<title>{label}: {sp.start_s:.2f}–{sp.end_s:.2f} s</title></rect>"
            + (
                f'<text x="{x0 + 3:.1f}" y="{py + ph / 2 + 3:.1f}" font-size="10" fill="{text_color(color)}">{label}</text>'
                if w > 60
                else ""
            )
            + "</g>"
        )
    for k in range(6):
        t = step * k / 5
        x = left + width * k / 5
        parts.append(f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{y:.1f}" stroke="#ccc" stroke-dasharray="2,3"/>')
        parts.append(f'<text x="{x:.1f}" y="{y + 14:.1f}" text-anchor="middle" font-size="10">{t:.1f} s</text>')
    if plan.staleness:  # where one step of the steady state ends and the next begins
        x = left + width / 2
        parts.append(f'<line x1="{x:.1f}" y1="{top - 6}" x2="{x:.1f}" y2="{y:.1f}" stroke="#333" stroke-width="1.5"/>')
        parts.append(
            f'<text x="{left:.1f}" y="{top - 8}" font-size="10">steady state, staleness {plan.staleness}: steps s and s+1,'
            f" {drawn_period(plan):.2f} s each at the mean lengths ([s+{plan.staleness}]: a later step's rollouts, generated ahead)</text>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _graph_svg(plan: Plan, g: FlowGraph) -> str:
    """The dataflow graph in layers (longest path), with bytes on edges and times on ops."""
    import networkx as nx

    dag = g.data_dag()
    layer = {}
    for nid in nx.topological_sort(dag):
        preds = list(dag.predecessors(nid))
        layer[nid] = 1 + max((layer[p] for p in preds), default=-1)
    rows: dict[int, list[str]] = {}
    for nid in g.nodes:
        rows.setdefault(layer[nid.id], []).append(nid.id)
    bw, bh, gx, gy = 150, 40, 24, 56
    width = max(len(r) for r in rows.values()) * (bw + gx) + gx
    height = len(rows) * (bh + gy) + gy
    pos = {}
    for li, ids in rows.items():
        row_w = len(ids) * (bw + gx) - gx
        x0 = (width - row_w) / 2
        for j, nid in enumerate(ids):
            pos[nid] = (x0 + j * (bw + gx), gy / 2 + li * (bh + gy))
    spans = {e.op: e for e in plan.schedule}
    colors = _color_map(plan, g)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" class="graph">',
        '<defs><marker id="arrow" markerWidth="8" markerHeight="8" refX="7" refY="4" orient="auto"><path d="M0,0 L8,4 L0,8 z" fill="#777"/></marker></defs>',
    ]
    for e in g.edges("data"):
        x1, y1 = pos[e.src]
        x2, y2 = pos[e.dst]
        b = human_bytes(g[e.src].meta.get("bytes", 0)) if not e.path else ".".join(map(str, e.path))
        parts.append(
            f'<line x1="{x1 + bw / 2:.1f}" y1="{y1 + bh:.1f}" x2="{x2 + bw / 2:.1f}" y2="{y2:.1f}" stroke="#999" marker-end="url(#arrow)"><title>{html.escape(e.what)}</title></line>'
        )
        parts.append(
            f'<text x="{(x1 + x2) / 2 + bw / 2:.1f}" y="{(y1 + bh + y2) / 2:.1f}" font-size="9" fill="#555">{html.escape(b)}</text>'
        )
    for n in g.nodes:
        x, y = pos[n.id]
        fill = _node_fill(g, n.id, colors)
        fg = text_color(fill)
        t = spans.get(n.id)
        sub = (
            _seconds(t.end_s - t.start_s)
            if t and t.end_s > t.start_s
            else ("controller" if n.op in ("compute", "reward", "input") else "")
        )
        rx = 18 if n.op == "compute" else 5
        parts.append(
            f'<g class="node" data-role="{html.escape(n.role or "")}"><rect x="{x:.1f}" y="{y:.1f}" width="{bw}" height="{bh}" rx="{rx}" fill="{fill}" stroke="#555"/>'
            f'<text x="{x + bw / 2:.1f}" y="{y + 16:.1f}" text-anchor="middle" font-size="11" fill="{fg}">{html.escape(_op_label(g, n.id))}</text>'
            f'<text x="{x + bw / 2:.1f}" y="{y + 31:.1f}" text-anchor="middle" font-size="9" fill="{fg}">{html.escape(sub)}</text></g>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _memory_svg(plan: Plan) -> str:
    rows = [(f"{r}.{ph}", pp) for r, rp in plan.roles.items() for ph, pp in rp.phases.items()]
    left, width, bar, gap = 150, 640, 18, 8
    cap = max((pp.capacity_gb for _, pp in rows), default=1.0)
    scale = max(cap, max((pp.memory_gb_per_device for _, pp in rows), default=1.0)) * 1.05
    h = len(rows) * (bar + gap) + 50
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 120}" height="{h}" class="memory">']
    for i, (name, pp) in enumerate(rows):
        y = 10 + i * (bar + gap)
        parts.append(f'<text x="{left - 6}" y="{y + 13}" text-anchor="end" font-size="11">{html.escape(name)}</text>')
        x = left
        for cat, color in MEM_COLORS.items():
            v = getattr(pp.memory, cat)
            if v <= 0:
                continue
            w = width * v / scale
            parts.append(
                f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{bar}" fill="{color}"><title>{cat}: {v:.2f} GB</title></rect>'
            )
            x += w
        parts.append(f'<text x="{x + 4:.1f}" y="{y + 13}" font-size="10">{pp.memory_gb_per_device:.1f} GB</text>')
    xc = left + width * cap / scale
    parts.append(f'<line x1="{xc:.1f}" y1="4" x2="{xc:.1f}" y2="{h - 40}" stroke="#dc3545" stroke-dasharray="4,3"/>')
    parts.append(
        f'<text x="{xc:.1f}" y="{h - 28}" text-anchor="middle" font-size="10" fill="#dc3545">capacity {cap:.0f} GB</text>'
    )
    lx = left
    for cat, color in MEM_COLORS.items():
        parts.append(
            f'<rect x="{lx}" y="{h - 16}" width="10" height="10" fill="{color}"/><text x="{lx + 13}" y="{h - 7}" font-size="10">{cat}</text>'
        )
        lx += 95
    parts.append("</svg>")
    return "".join(parts)


def to_html(plan: Plan, g: FlowGraph) -> str:
    env = jinja2.Environment(autoescape=jinja2.select_autoescape(["html", "j2"]), undefined=jinja2.StrictUndefined)
    template = env.from_string(resources.files("flowc").joinpath("templates/plan.html.j2").read_text())
    return template.render(
        plan=plan,
        colors=_color_map(plan, g),
        kinds={r.name: str(r.kind) for r in g.roles.values()} | {r: rp.kind for r, rp in plan.roles.items()},
        placement_svg=_placement_svg(plan, g),
        spans=sorted(pipelined_spans(plan), key=lambda sp: (sp.start_s, sp.step)) if plan.staleness else [],
        graph_svg=_graph_svg(plan, g),
        memory_svg=_memory_svg(plan),
        plan_json=json.dumps(json.loads(plan.to_json(indent=None))).replace("</", "<\\/"),
        human_bytes=human_bytes,
        seconds=_seconds,
    )


def render(plan: Plan, g: FlowGraph, fmt: str) -> str:
    if fmt == "html":
        return to_html(plan, g)
    if fmt == "svg":
        return to_svg(plan, g)
    if fmt == "dot":
        return to_plan_dot(plan, g)
    if fmt == "mermaid":
        return to_plan_mermaid(plan, g)
    raise FlowcError(f"unknown export format {fmt!r}", fix="use html, svg, dot or mermaid")
