"""Row-wise data: slicing, joining and sharding the values that flow between ops.

Values are tensors with a leading batch dimension, ``PromptBatch`` and
``Rollout`` bundles, or lists (decoded texts). Bulk values live in the Ray
object store as one shard per producing worker; a consumer worker receives
the pieces that cover its rows (``RowSpec``) and joins them itself, so the
controller handles references and counts, not the data. A small value the
controller made itself (prompts, advantages: under ``INLINE_BYTES``) travels
inside the calls that use it instead (:class:`Inline`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any

import torch

from flowc.ir.functional import PromptBatch, Rollout

# A value this small travels inside the call that uses it (Ray copies task arguments under
# ~100 KB into the task itself), not through the object store: see :class:`Inline`.
INLINE_BYTES = 64 * 1024


def map_fields(x: Any, fn: Any) -> Any:
    """``x`` (a dataclass of tensors) with ``fn`` applied to each field that is set."""
    return replace(x, **{f.name: fn(getattr(x, f.name)) for f in fields(x) if getattr(x, f.name) is not None})


def nbytes(x: Any) -> int:
    """The payload bytes of a row-wise value (tensors, bundles of tensors, lists of texts or
    numbers); a size it cannot tell counts as large."""
    if isinstance(x, torch.Tensor):  # its whole storage travels, also for a small view of a big tensor
        return max(x.numel() * x.element_size(), x.untyped_storage().nbytes())
    if is_dataclass(x):
        return sum(nbytes(getattr(x, f.name)) for f in fields(x) if getattr(x, f.name) is not None)
    if isinstance(x, list | tuple) and all(isinstance(v, str | int | float | bool) for v in x):
        return sum(len(v.encode()) if isinstance(v, str) else 8 for v in x)
    return INLINE_BYTES + 1


def num_rows(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.shape[0]
    if is_dataclass(x):
        return getattr(x, fields(x)[0].name).shape[0]
    return len(x)


def slice_rows(x: Any, lo: int, hi: int) -> Any:
    if isinstance(x, torch.Tensor):
        return x[lo:hi]
    if is_dataclass(x):
        return map_fields(x, lambda t: t[lo:hi])
    return x[lo:hi]


def take_rows(x: Any, rows: torch.Tensor) -> Any:
    """The rows ``rows`` (an index tensor) of a tensor or a dataclass of tensors."""
    if isinstance(x, torch.Tensor):
        return x[rows]
    if is_dataclass(x):
        return map_fields(x, lambda t: t[rows])
    return [x[i] for i in rows.tolist()]


def cat_rows(parts: Sequence[Any]) -> Any:
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, torch.Tensor):
        return torch.cat(list(parts), dim=0)
    if is_dataclass(first):
        if any((getattr(p, f.name) is None) != (getattr(first, f.name) is None) for p in parts for f in fields(first)):
            raise ValueError("cannot join rows of rollouts with different fields (an agent rollout and a single-turn one)")
        return replace(
            first,
            **{
                f.name: torch.cat([getattr(p, f.name) for p in parts], dim=0)
                for f in fields(first)
                if getattr(first, f.name) is not None
            },
        )
    out: list[Any] = []
    for p in parts:
        out.extend(p)
    return out


def repeat_rows(x: Any, n: int) -> Any:
    """Each row ``n`` times, consecutively (prompt i → samples i·n … i·n+n-1)."""
    if n == 1:
        return x
    if isinstance(x, torch.Tensor):
        return x.repeat_interleave(n, dim=0)
    if is_dataclass(x):
        return map_fields(x, lambda t: t.repeat_interleave(n, dim=0))
    return [r for r in x for _ in range(n)]


def even_split(n: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges covering ``range(n)``, sizes differing by ≤ 1."""
    base, extra = divmod(n, parts)
    out, lo = [], 0
    for i in range(parts):
        hi = lo + base + (1 if i < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


def minibatch_rows(n: int, mini_batches: int, ranks: int, unit: int = 1) -> list[list[tuple[int, int]]]:
    """For each rank, its row ranges — one per mini-batch. Mini-batch k is the
    same global rows whatever the number of ranks (each rank takes its part of
    every mini-batch), so an update is the same computation on any layout.
    Ranges never split a group of ``unit`` consecutive rows (2: DPO's pairs)."""
    out: list[list[tuple[int, int]]] = [[] for _ in range(ranks)]
    for mlo, mhi in even_split(n // unit, mini_batches):
        for r, (lo, hi) in enumerate(even_split(mhi - mlo, ranks)):
            out[r].append(((mlo + lo) * unit, (mlo + hi) * unit))
    return out


@dataclass(frozen=True, eq=False)
class Inline:
    """A small value held by its reference itself: it travels inside the call that uses it
    (no ``ray.put`` by the controller, no fetch by the worker: two object-store round trips
    fewer per value per step)."""

    value: Any


@dataclass(frozen=True)
class Piece:
    """Rows ``[lo, hi)`` of the object behind ``ref`` (a shard), then ``path``."""

    ref: Any  # a ray.ObjectRef, or an Inline value
    lo: int
    hi: int
    path: tuple[str | int, ...] = ()


@dataclass(frozen=True)
class Sharded:
    """A bulk value held as shards in the object store, in row order."""

    refs: tuple[Any, ...]
    counts: tuple[int, ...]
    path: tuple[str | int, ...] = ()

    @property
    def rows(self) -> int:
        return sum(self.counts)

    def project(self, step: str | int) -> Sharded:
        return Sharded(self.refs, self.counts, (*self.path, step))

    def pieces(self, lo: int, hi: int) -> list[Piece]:
        """The shard pieces that hold rows ``[lo, hi)``."""
        out, start = [], 0
        for ref, c in zip(self.refs, self.counts, strict=True):
            a, b = max(lo, start), min(hi, start + c)
            if a < b:
                out.append(Piece(ref, a - start, b - start, self.path))
            start += c
        return out


def project(x: Any, path: Sequence[str | int]) -> Any:
    for step in path:
        x = getattr(x, step) if isinstance(step, str) else x[step]
    return x


def assemble(pieces: Sequence[Piece], fetch) -> Any:
    """Join pieces into one value; ``fetch`` turns refs into objects (ray.get); an inline
    piece holds its object already."""
    remote = [p.ref for p in pieces if not isinstance(p.ref, Inline)]
    fetched = iter(fetch(remote) if remote else ())
    objs = [p.ref.value if isinstance(p.ref, Inline) else next(fetched) for p in pieces]
    return cat_rows([slice_rows(project(o, p.path), p.lo, p.hi) for o, p in zip(objs, pieces, strict=True)])


__all__ = [
    "INLINE_BYTES",
    "Inline",
    "Piece",
    "PromptBatch",
    "Rollout",
    "Sharded",
    "assemble",
    "cat_rows",
    "even_split",
    "nbytes",
    "num_rows",
    "repeat_rows",
    "slice_rows",
    "take_rows",
]
