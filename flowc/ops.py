"""``fc.ops``: tensor ops for the math between role calls.

Each is traced as one ``compute`` node and runs on the controller; the
definitions (and their documentation) live in :mod:`flowc.ir.functional`,
the IR's vocabulary of controller ops.
"""

from dataclasses import fields
from typing import Any

import torch
import torch.fx

from flowc.ir.functional import (
    Rollout,
    discounted_returns,
    gae,
    group_normalize,
    kl,
    masked_mean,
    masked_sum,
    overlong_penalty,
    rloo_baseline,
    token_level,
    varied_groups,
    whiten,
)


def filter_groups(rollout: Any, scores: Any, group_size: int, *, max_rounds: int = 4, expected_keep: float = 0.5) -> Any:
    """DAPO's dynamic sampling: ``rollout, scores = fc.ops.filter_groups(rollout, scores, group_size=n)``.

    Drops the prompt groups whose ``scores`` do not vary (all right or all
    wrong: zero advantage, no gradient) and has the runtime generate again on
    fresh prompts until the batch holds as many varying groups as it asked
    for, at most ``max_rounds`` generation rounds (when they run out, the
    batch is topped up with the non-varying groups). ``expected_keep`` is the
    fraction of groups you expect to vary: the planner prices
    ``min(1 / expected_keep, max_rounds)`` rounds of generation and reward.
    The returned rollout and scores replace the originals for the rest of
    the flow. Outside a flow (real tensors), one round: the varying groups.
    """
    if isinstance(rollout, torch.fx.Proxy):
        from flowc.tracing import record_filter

        kwargs = {"group_size": group_size, "max_rounds": max_rounds, "expected_keep": expected_keep}
        return record_filter(rollout, scores, kwargs)
    keep = varied_groups(scores, group_size).repeat_interleave(group_size)
    idx = keep.nonzero().squeeze(-1)
    kept = {f.name: getattr(rollout, f.name) for f in fields(Rollout)}
    return Rollout(**{k: (v if v is None else v[idx]) for k, v in kept.items()}), scores[idx]


__all__ = [
    "discounted_returns",
    "filter_groups",
    "gae",
    "group_normalize",
    "kl",
    "masked_mean",
    "masked_sum",
    "overlong_penalty",
    "rloo_baseline",
    "token_level",
    "varied_groups",
    "whiten",
]


def __getattr__(name: str) -> object:
    from flowc.roles import suggest

    raise AttributeError(f"fc.ops has no {name!r}{suggest(name, __all__)}; it has {', '.join(__all__)}")
