"""``fc.ops``: tensor ops for the math between role calls.

Each is traced as one ``compute`` node and runs on the controller; the
definitions (and their documentation) live in :mod:`flowc.ir.functional`,
the IR's vocabulary of controller ops.
"""

from flowc.ir.functional import (
    discounted_returns,
    gae,
    group_normalize,
    kl,
    masked_mean,
    masked_sum,
    overlong_penalty,
    rloo_baseline,
    token_level,
    whiten,
)

__all__ = [
    "discounted_returns",
    "gae",
    "group_normalize",
    "kl",
    "masked_mean",
    "masked_sum",
    "overlong_penalty",
    "rloo_baseline",
    "token_level",
    "whiten",
]
