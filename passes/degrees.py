"""The parallel degrees a layout may take, and the enumerator's unvalidated layouts.

Tensor parallelism must split the devices, the heads and (or be a multiple of) the KV heads, and
stays within a node except for generation engines (:func:`tp_refusal` says which rule failed);
pipelines take divisors of the devices up to :data:`PP_LIMIT` with at least 2 layers a stage,
split as the runtime splits them (:func:`flowc.ir.models.stage_split`).
"""

from __future__ import annotations

from flowc.ir.models import ModelSpec
from flowc.ir.plan import Layout
from flowc.passes.costs import Hw


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def tp_choices(m: ModelSpec, d: int, hw: Hw, *, across_nodes: bool = False) -> list[int]:
    """Tensor-parallel degrees for ``m`` on ``d`` devices: within a node, or (``across_nodes``, for
    generation engines too large for one node's tp group) whole nodes' worth over several nodes."""
    out = []
    limit = d if across_nodes else min(d, hw.node)
    for tp in divisors(limit):
        if tp_refusal(m, d, tp, hw, across_nodes=across_nodes) is None:
            out.append(tp)
    return out


def tp_refusal(m: ModelSpec, d: int, tp: int, hw: Hw, *, across_nodes: bool = False) -> str | None:
    """Why ``tp`` cannot split ``m`` on ``d`` devices (None: it can)."""
    if d % tp:
        return f"tp={tp} does not divide the {d} devices"
    if tp > hw.node and not across_nodes:
        return f"tp={tp} spans more than a node ({hw.node} devices); only generation engines cross nodes"
    if tp > hw.node and tp % hw.node:
        return f"tp={tp} over nodes must be a whole number of nodes ({hw.node} devices each)"
    if m.num_heads % tp:
        return f"tp={tp} does not divide {m.name}'s {m.num_heads} attention heads"
    if m.num_kv_heads % tp and tp % m.num_kv_heads:
        return f"tp={tp} neither divides nor is a multiple of {m.name}'s {m.num_kv_heads} KV heads"
    return None


LAYOUT_DEFAULTS = {k: f.default for k, f in Layout.model_fields.items()}
_FIELDS = frozenset(LAYOUT_DEFAULTS)


def unchecked_layout(**kw) -> Layout:
    """A Layout built without validation (the enumerator only makes valid ones). The search
    builds hundreds of thousands at cluster scale: this sets the instance's state as pydantic's
    ``model_construct`` would with every field given, at a fraction of its cost (checked equal by
    tests/unit/test_planner_speed.py)."""
    lay = object.__new__(Layout)
    object.__setattr__(lay, "__dict__", {**LAYOUT_DEFAULTS, **kw})
    object.__setattr__(lay, "__pydantic_fields_set__", set(_FIELDS))
    object.__setattr__(lay, "__pydantic_extra__", None)
    object.__setattr__(lay, "__pydantic_private__", None)
    return lay


def unchecked_with(lay: Layout, **kw) -> Layout:
    """``lay.model_copy(update=kw)`` for the enumerator's unvalidated layouts."""
    return unchecked_layout(**{**lay.__dict__, **kw})


PP_LIMIT = 16  # deeper pipelines pay per-stage overheads the model does not price


def pp_choices(n: int, layers: int) -> list[int]:
    """Pipeline depths: divisors of ``n`` up to PP_LIMIT with at least 2 layers a stage, split as
    the runtime splits them (:func:`~flowc.ir.models.stage_split`: uneven ends where ``pp`` does
    not divide the layers)."""
    return [k for k in divisors(n) if k <= PP_LIMIT and (k == 1 or layers // k >= 2)]


def powers_dividing(n: int, limit: int) -> list[int]:
    out, k = [], 1
    while k <= min(n, limit):
        if n % k == 0:
            out.append(k)
        k *= 2
    return out
