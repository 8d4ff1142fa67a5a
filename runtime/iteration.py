"""The values of one pass over a program's steps: what the controller holds itself
(:class:`Local`), what the workers hold (:class:`~flowc.runtime.batches.Sharded`), and the
record of one iteration (:class:`Iteration`) that the controller fills and the step's
metrics read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flowc.ir.graph import ValueRef
from flowc.runtime.batches import Sharded, project


@dataclass
class Local:
    """A value held by the controller itself."""

    value: Any


@dataclass
class Iteration:
    """The values and pending results of one pass over the steps (a filter round is one too)."""

    step: int
    round: int
    prompts: list[str]  # the batch's prompt texts
    columns: dict[str, list[Any]]  # its other data columns
    rows: list[int] = field(default_factory=list)  # the data rows drawn (for errors)
    env: dict[str, Any] = field(default_factory=dict)  # node → Sharded | Local
    metas: dict[str, list[Any]] = field(default_factory=dict)  # device node → refs of its metadata
    samples: dict[str, int] = field(default_factory=dict)  # generate node → n
    reward_metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # reward node → its dicts' extra numbers


def value_at(env: dict[str, Any], ref: ValueRef) -> Sharded | Local:
    """The value ``ref`` names (a node's output, or a field or item of it) without fetching it:
    a worker-held value stays sharded, a controller value is projected."""
    base = env[ref.node]
    if isinstance(base, Sharded):
        out = base
        for p in ref.path:
            out = out.project(p)
        return out
    return Local(project(base.value, ref.path))


__all__ = ["Iteration", "Local", "value_at"]
