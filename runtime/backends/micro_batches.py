"""How the shared training loop cuts a replica's rows: mini-batches (the same global rows on any
layout), micro-batches of a fixed row count or within a token budget (binned by length at the
fewest passes, DPO's pairs never split), padding trimmed, and whether a micro-batch computes each
distinct prompt once or runs its rows packed without their padding."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace

import torch

from flowc.errors import DataError
from flowc.ir.functional import Rollout
from flowc.runtime.batches import even_split, num_rows
from flowc.runtime.modeling import prompt_groups


def trim(r: Rollout) -> Rollout:
    """Drop columns that are padding in every row (left of the prompts, right of the responses)."""
    p_keep = int(r.prompt_mask.long().sum(-1).max().item()) if r.prompt_mask.numel() else 0
    r_keep = int(r.present.long().sum(-1).max().item()) if r.response_mask.numel() else 0
    p_keep, r_keep = max(p_keep, 1), max(r_keep, 1)
    p = r.prompt_ids.shape[1]
    return replace(
        r,
        prompt_ids=r.prompt_ids[:, p - p_keep :],
        prompt_mask=r.prompt_mask[:, p - p_keep :],
        response_ids=r.response_ids[:, :r_keep],
        response_mask=r.response_mask[:, :r_keep],
        logprobs=r.logprobs[:, :r_keep],
        **({"env_mask": r.env_mask[:, :r_keep]} if r.env_mask is not None else {}),
    )


def pad_right(x: torch.Tensor, width: int, value: float = 0.0) -> torch.Tensor:
    if x.shape[1] == width:
        return x
    pad = torch.full((x.shape[0], width - x.shape[1]), value, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad], dim=1)


def chunk_ranges(rows: int, k: int, unit: int = 1) -> Iterator[tuple[int, int]]:
    """``k`` near-equal row ranges that never split a group of ``unit`` rows."""
    for lo, hi in even_split(rows // unit, k):
        yield lo * unit, hi * unit


def token_bins(
    r: Rollout, budget: int, unit: int = 1, overhead: float = 0.0, share: bool = False, pack: bool = False
) -> list[torch.Tensor]:
    """Rows of ``r`` in micro-batches of at most ``budget`` padded tokens each: a micro-batch
    costs its rows × the prompt and response width it keeps once trimmed. Rows are taken
    longest response first (then longest prompt), so each micro-batch holds rows of similar
    length; a unit wider than the budget on its own runs alone. Units of ``unit`` rows (DPO's
    pairs) stay together, and each micro-batch's rows are in their original order.

    With ``overhead`` (a micro-batch's fixed cost, in padded tokens of compute) the cuts
    minimise padded tokens + ``overhead`` × micro-batches (an exact dynamic programme over the
    sorted rows, up to ``MAX_CUT_ROWS`` units); without it each micro-batch is filled up to the
    budget. With ``share`` (the backend computes a prompt once for the rows that share it, see
    :func:`shares_prompt`) a micro-batch's prompt tokens are the cheaper of every row's and its
    distinct prompts' plus one more pass (``overhead``), and the cuts weigh that too. With
    ``pack`` (the backend packs a micro-batch's rows without their padding, see
    :mod:`flowc.runtime.packing`) a micro-batch costs its real tokens, so the fewest
    micro-batches that fit the budget are the cheapest: each takes the next rows while their
    real tokens fit."""
    n = num_rows(r) // unit
    if n == 0:
        return []
    p = r.prompt_mask.long().sum(-1).clamp(min=1).view(n, unit).amax(1).tolist()
    q = r.present.long().sum(-1).clamp(min=1).view(n, unit).amax(1).tolist()
    order = sorted(range(n), key=lambda i: (-q[i], -p[i], i))
    one = n * unit * (max(p) + max(q))
    prompt = prompt_groups(r.prompt_ids, r.prompt_mask).view(n, unit)[:, 0].tolist() if share else None
    if prompt is not None:  # a prompt's rows of one length next to each other: the cuts are contiguous runs
        order = sorted(range(n), key=lambda i: (-q[i], -p[i], prompt[i], i))
    if pack:  # a prompt's rows next to each other, so that a micro-batch holds whole groups to compute it once
        if prompt is not None:
            order = sorted(range(n), key=lambda i: (prompt[i], -q[i], i))
        groups = _filled(order, p, q, budget, unit, packed=True, prompt=prompt)
    elif one <= budget and one - unit * sum(p[i] + q[i] for i in range(n)) <= overhead:
        # all the padding there is costs less than one more micro-batch: no cut can pay (nor share more
        # prompts than one micro-batch of every row does, for one extra pass instead of several)
        groups = [order]
    elif 0 < overhead and n <= MAX_CUT_ROWS:
        groups = _cheapest_cuts(order, p, q, budget, unit, overhead, prompt)
    else:
        groups = _filled(order, p, q, budget, unit)
    return [torch.tensor([u * unit + j for u in sorted(g) for j in range(unit)], dtype=torch.long) for g in groups]


MAX_CUT_ROWS = 512  # beyond this many units a replica's micro-batches are filled greedily (the cuts are quadratic)


def _filled(
    order: list[int],
    p: list[int],
    q: list[int],
    budget: int,
    unit: int,
    packed: bool = False,
    prompt: list[int] | None = None,
) -> list[list[int]]:
    """Greedy: each micro-batch takes the next rows while they fit the budget (their padded
    tokens, or ``packed`` the tokens computed: real ones, with ``prompt`` each distinct prompt
    once — and a prompt's rows, which come together, start a new micro-batch rather than be
    split where they would fit one whole)."""
    whole: dict[int, int] = {}  # packed, with prompts: each prompt's tokens computed, its rows all together
    if packed and prompt is not None:
        for i in order:
            whole[prompt[i]] = whole.get(prompt[i], p[i]) + q[i]
    bins: list[list[int]] = []
    cur: list[int] = []
    seen: set[int] = set()
    wp = wq = real = 0
    for i in order:
        once = prompt is not None and prompt[i] in seen
        np_, nq, nr = max(wp, p[i]), max(wq, q[i]), real + q[i] + (0 if once else p[i])
        fresh = whole and not once and unit * (real + whole[prompt[i]]) > budget >= unit * whole[prompt[i]]
        if cur and (fresh or (unit * nr if packed else (len(cur) + 1) * unit * (np_ + nq)) > budget):
            bins.append(cur)
            cur, np_, nq, nr = [], p[i], q[i], p[i] + q[i]
            seen = set()
        cur.append(i)
        if prompt is not None:
            seen.add(prompt[i])
        wp, wq, real = np_, nq, nr
    bins.append(cur)
    return bins


def _cheapest_cuts(
    order: list[int], p: list[int], q: list[int], budget: int, unit: int, overhead: float, prompt: list[int] | None = None
) -> list[list[int]]:
    """Contiguous runs of the sorted rows, each within the budget (or one unit), minimising
    padded tokens + ``overhead`` per run. A run starting at sorted row ``i`` is as wide as
    that row's response (the longest) plus its longest prompt. With ``prompt`` (each unit's
    prompt number) a run's prompts may be computed once per distinct prompt, for one more
    ``overhead`` (:func:`shares_prompt`)."""
    n = len(order)
    best = [0.0] + [math.inf] * n  # best[j]: the cheapest cuts of the first j sorted rows
    start = [0] * (n + 1)
    for i in range(n):  # runs [i, j) extend best[i]
        if best[i] == math.inf:
            continue
        wq, wp = q[order[i]], 0
        seen: set[int] = set()
        for j in range(i + 1, n + 1):
            wp = max(wp, p[order[j - 1]])
            rows = (j - i) * unit
            prompts = rows * wp
            if prompt is not None:
                seen.add(prompt[order[j - 1]])
                prompts = min(prompts, len(seen) * wp + overhead)
            padded = rows * wq + prompts
            if rows * (wp + wq) > budget and j > i + 1:  # memory: a micro-batch may still run unshared (ranks agree)
                break
            cost = best[i] + overhead + padded
            if cost < best[j]:
                best[j], start[j] = cost, i
    runs, j = [], n
    while j > 0:
        runs.append(order[start[j] : j])
        j = start[j]
    return runs[::-1]


def real_tokens(part: Rollout) -> int:
    """The tokens of a micro-batch that are not padding (prompts and responses)."""
    return int(part.prompt_mask.long().sum() + part.present.long().sum())


def shares_prompt(part: Rollout, overhead: float, packed: bool = False) -> torch.Tensor | None:
    """The prompt groups of a micro-batch (:func:`~flowc.runtime.modeling.prompt_groups`) when
    computing each distinct prompt once pays: the prompt tokens it saves, ``(rows − distinct) ×
    width``, exceed ``overhead`` (a pass's fixed cost in tokens of compute, the plan's
    micro-batch cost: the shared prompt is a pass of its own) — and, where the backend would
    otherwise pack the rows (``packed``), the shared pass (padded responses) computes fewer
    tokens than the packed one (:func:`real_tokens`). None: one pass over every row."""
    rows, width = part.prompt_ids.shape
    if rows < 2:
        return None
    groups = prompt_groups(part.prompt_ids, part.prompt_mask)
    distinct = int(groups.max()) + 1
    saved = (rows - distinct) * width
    if packed:
        return groups if rows * (width + part.response_ids.shape[1]) - saved + overhead < real_tokens(part) else None
    return groups if saved > overhead else None


def packs_rows(part: Rollout) -> bool:
    """Whether packing a micro-batch computes less than padding it: some of it is padding."""
    return num_rows(part) > 1 and real_tokens(part) < part.prompt_ids.numel() + part.response_ids.numel()


def minibatch_bounds(role: str, mini_sizes: list[int], rows: int) -> list[tuple[int, int]]:
    """Row ranges of the mini-batches: ``mini_sizes[k]`` rows, in order, belong to mini-batch k."""
    bounds, start = [], 0
    for size in mini_sizes:
        bounds.append((start, start + size))
        start += size
    if start != rows:
        raise DataError(f"{role}.update: mini-batches of {start} rows for {rows} rows")
    return bounds
