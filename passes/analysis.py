"""Analyses: annotate the graph (``node.meta``) with sizes, FLOPs and tokens.

They change nothing else. After them every node carries ``meta["bytes"]``
(its output under the workload) and every model op ``meta["tokens"]`` and
``meta["flops"]``; the planner's later passes and the plan export read them.
"""

from __future__ import annotations

from flowc.ir.graph import FlowGraph
from flowc.ir.types import nbytes
from flowc.passes.flops import forward_flops, train_flops
from flowc.passes.manager import PlanContext
from flowc.passes.units import demands, model_of


def annotate_bytes(g: FlowGraph, ctx: PlanContext) -> FlowGraph:
    """``meta["bytes"]``: bytes of each node's output under the workload
    (whose symbols go to ``ctx.env``)."""
    ctx.env = ctx.workload.env(g.symbols)
    for n in g.nodes:
        n.meta["bytes"] = nbytes(n.type, ctx.env)
    return g


def annotate_flops(g: FlowGraph, ctx: PlanContext) -> FlowGraph:
    """``meta["tokens"]`` and ``meta["flops"]`` of every model op (generation:
    prefill plus decode)."""
    dem = demands(g, ctx.workload)
    ctx.demands = dem
    for nid, d in dem.items():
        n = g[nid]
        m = model_of(ctx.models, n.role)
        if n.op == "update":
            n.meta["tokens"] = d.tokens
            n.meta["flops"] = train_flops(m, d.tokens, d.seq_len)
        elif n.op == "generate":
            prefill = forward_flops(m, d.sequences * d.prompt_len, d.prompt_len)
            decode_tokens = d.sequences * d.mean_response_len
            decode = forward_flops(m, decode_tokens, 2 * d.prompt_len + d.mean_response_len)
            n.meta["tokens"] = d.sequences * d.seq_len
            n.meta["flops"] = prefill + decode
        else:
            n.meta["tokens"] = d.tokens
            n.meta["flops"] = forward_flops(m, d.tokens, d.seq_len)
    return g
