"""Calling a user's reward function and checking what it returns.

Neither this module nor anything it imports loads torch or Ray: the reward process
(:mod:`flowc.runtime.reward_worker`) holds the user's function and what *it* imports, not a
second copy of torch (~250 MB resident per reward worker), and the planning front end reads
rewards without Ray. Scores are floats; :mod:`flowc.runtime.rewards` makes the tensor.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

from flowc.errors import DataError

RewardFn = Callable[..., Sequence[float]]
FLOAT32_MAX = 3.4028234663852886e38  # scores become float32: a larger one would be inf


def score_reward(
    fn: RewardFn,
    name: str,
    prompts: list[str],
    responses: list[str],
    columns: dict[str, list[Any]],
    *,
    offset: int = 0,
) -> tuple[list[float], dict[str, float]]:
    """Call a user's reward function and check what it returns (one finite score per response);
    also the batch mean of every other number a response's dict carried (verl's ``{"score": 1.0,
    "acc": True, "pred": "4"}``: ``{"acc": 1.0}``; text is left out). ``offset``: the first
    response's number in the whole batch (a shard's), for errors."""
    extras: dict[str, list[float]] = {}
    try:
        sig = inspect.signature(fn)
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
        cols = columns if takes_kwargs else {k: v for k, v in columns.items() if k in sig.parameters}
        out = fn(prompts, responses, **cols)
    except DataError:
        raise
    except Exception as e:
        raise DataError(
            f"reward function {name} raised {type(e).__name__}: {e}",
            fix="it is called as fn(prompts: list[str], responses: list[str], **columns) and must return one float per response",
        ) from e
    try:
        out = list(out)
        scores: list[float] = []
        for i, x in enumerate(out):
            if isinstance(x, dict):  # verl's {"score": …, other metrics}
                if "score" not in x:
                    raise DataError(
                        f"reward function {name} returned a dict without 'score' for response {offset + i} (keys: {', '.join(x)})",
                        fix='return {"score": float, …} or a float',
                    )
                for k, v in x.items():
                    if k != "score" and isinstance(v, numbers.Real | bool):  # a number, numpy's too
                        extras.setdefault(k, []).append(float(v))
                x = x["score"]
            elif x is None:  # TRL's "not applicable": there other functions score the sample; here none would
                raise DataError(
                    f"reward function {name} returned None for response {offset + i}",
                    fix="return a score for every response (a flowc Reward role's scores are used alone; TRL's None "
                    "'not applicable' needs another function to score the sample: combine them in one)",
                )
            if isinstance(x, str | bytes) or getattr(x, "ndim", 0) != 0:  # float("1") and a 1-element row would pass
                raise TypeError(f"response {offset + i}'s score is {type(x).__name__}")
            scores.append(float(x))
    except DataError:
        raise
    except Exception as e:
        raise DataError(
            f"reward function {name} returned {type(out).__name__}, not a sequence of numbers ({e})",
            fix="return a list of floats, one per response",
        ) from e
    if len(scores) != len(responses):
        raise DataError(
            f"reward function {name} returned ({len(scores)},) scores for {len(responses)} responses",
            fix="return one float per response",
        )
    if not all(math.isfinite(s) and abs(s) <= FLOAT32_MAX for s in scores):
        raise DataError(
            f"reward function {name} returned a non-finite score (or one beyond float32's range)", fix="return finite floats"
        )
    return scores, {k: sum(v) / len(v) for k, v in extras.items()}


__all__ = ["FLOAT32_MAX", "RewardFn", "score_reward"]
