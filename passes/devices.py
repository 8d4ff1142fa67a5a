"""Which global device ids each pool gets, and whether two pools share a node.

Pools of whole nodes come first (largest first); pools smaller than a node
are packed first-fit decreasing into the nodes left over. The search and the
plan builder both read placements from here, so the links a cross-pool sync is
priced on are the links the plan's pools use.
"""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1 << 14)
def assign_devices(sizes: tuple[int, ...], node: int) -> tuple[tuple[int, ...], ...]:
    """Global device ids per pool (node-major)."""
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    out: list[tuple[int, ...]] = [() for _ in sizes]
    nxt = 0
    for i in order:
        if sizes[i] >= node:
            out[i] = tuple(range(nxt, nxt + sizes[i]))
            nxt += sizes[i]
    fill: list[tuple[int, int]] = []  # (start, free) per leftover node
    for i in order:
        if sizes[i] < node:
            for j, (start, free) in enumerate(fill):
                if free >= sizes[i]:
                    used = node - free
                    out[i] = tuple(range(start + used, start + used + sizes[i]))
                    fill[j] = (start, free - sizes[i])
                    break
            else:
                out[i] = tuple(range(nxt, nxt + sizes[i]))
                fill.append((nxt, node - sizes[i]))
                nxt += node
    return tuple(out)


def same_node(sizes: tuple[int, ...], i: int, j: int, node: int) -> bool:
    """Pools ``i`` and ``j`` of a split lie within one node."""
    if sizes[i] + sizes[j] > node:
        return False
    ids = assign_devices(sizes, node)
    return len({d // node for d in ids[i] + ids[j]}) == 1


def node_count(ids: tuple[int, ...], node: int) -> int:
    return len({d // node for d in ids})


def ranges(ids: tuple[int, ...] | list[int]) -> str:
    """``[0,1,2,3,8,9]`` → ``"0-3,8-9"``."""
    if not ids:
        return ""
    ids = list(ids)
    parts, start, prev = [], ids[0], ids[0]
    for x in ids[1:]:
        if x == prev + 1:
            prev = x
            continue
        parts.append(f"{start}-{prev}" if prev > start else str(start))
        start = prev = x
    parts.append(f"{start}-{prev}" if prev > start else str(start))
    return ",".join(parts)
