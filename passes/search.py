"""Search over co-location and device splits.

The space (HybridFlow's, and a little more): every partition of the placement
units into pools — a policy's generation may share the training devices or
get its own — and every split of the cluster's devices among the pools in
which each pool is whole nodes or fits inside one node (sub-node pools are
packed into the nodes left over). For each pool and size the best layouts
come from :class:`~flowc.passes.pools.PoolTable`; each split is scored by the
list schedule of one iteration (:mod:`flowc.passes.schedule`), evaluated for
many splits at once with numpy.

Exact when the number of splits is small (all of them are scored); otherwise
pruned: a coarse grid of sizes first, then hill-climbing from the best few by
moving devices between pairs of pools. The search is a pure function of its
inputs: the same inputs give the same plan.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np

from flowc.passes.costs import Hw
from flowc.passes.devices import same_node
from flowc.passes.options import OptionTable
from flowc.passes.pins import Pins
from flowc.passes.pools import PoolChoice, PoolTable
from flowc.passes.reshard import ReshardCost, sync_cost
from flowc.passes.schedule import OpSpec, SyncSpec, simulate
from flowc.passes.steady_period import Variation
from flowc.passes.units import Unit, train_unit

EXACT_LIMIT = 400_000  # splits scored exactly per co-location
COARSE_GRID_LIMIT = 40  # above this many pool sizes, start from a coarse grid and refine
KEEP_PER_PARTITION = 4


def set_partitions(items: list[str]) -> Iterator[list[list[str]]]:
    """Every partition of ``items`` into non-empty blocks (deterministic order)."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        for i in range(len(part)):
            yield [*part[:i], [first, *part[i]], *part[i + 1 :]]
        yield [[first], *part]


def size_grid(total: int, node: int) -> list[int]:
    """Pool sizes: anything inside one node, else whole nodes."""
    small = list(range(1, min(node, total) + 1))
    big = list(range(2 * node, total + 1, node)) if total > node else []
    return sorted(set(small + big))


def packs(sizes: tuple[int, ...], total: int, node: int) -> bool:
    """Sub-node pools fit, first-fit decreasing, into the nodes that whole-node pools leave."""
    if total <= node:
        return sum(sizes) == total
    small = sorted((s for s in sizes if s < node), reverse=True)
    free_nodes = (total - sum(s for s in sizes if s >= node)) // node
    bins = [node] * free_nodes
    for s in small:
        for i, b in enumerate(bins):
            if b >= s:
                bins[i] -= s
                break
        else:
            return False
    return True


@dataclass
class Candidate:
    partition: tuple[tuple[str, ...], ...]
    sizes: tuple[int, ...]
    step: float
    choices: tuple[PoolChoice, ...]


@dataclass
class SearchResult:
    ranked: list[Candidate]
    per_partition: dict[tuple[tuple[str, ...], ...], Candidate]
    infeasible: dict[tuple[tuple[str, ...], ...], str]
    evaluated: int = 0
    strategy: str = "exact"
    notes: list[str] = field(default_factory=list)


def cross_pool_sync(
    t: OptionTable, tu: Unit, gu: Unit, tc: PoolChoice, gc: PoolChoice, sizes: tuple[int, ...], ti: int, gi: int
) -> ReshardCost | None:
    """The sync of a policy trained on pool ``ti`` into its engine on pool ``gi``
    of a split: what the search ranks and the plan builder emits (one function)."""
    return sync_cost(
        t.models[tu.role],
        tc.options[tu.name].layouts["train"],
        gc.gens[gu.name].layout,
        t.hw,
        colocated=False,
        same_node=same_node(sizes, ti, gi, t.hw.node),
        whole_tensor=t.pins.whole_tensor_sync,
        method=t.pins.reshard.get(tu.role),
    )


class Searcher:
    """Scores splits of the devices among pools for every allowed partition."""

    def __init__(self, pools: PoolTable, ops: list[OpSpec], unit_of_op: dict[str, str], total: int, hw: Hw, pins: Pins) -> None:
        self.pt = pools
        self.ops = ops
        self.unit_of_op = unit_of_op
        self.total = total
        self.node = hw.node
        self.hw = hw
        self.colocate = pins.colocate
        self.staleness = pins.staleness or 0
        self.units = list(pools.t.units)
        self.devices_pin = {
            u: d for u in self.units for ph in pools.t.units[u].phases if (d := pins.phase(pools.t.units[u].role, ph).devices)
        }
        self.grid = size_grid(total, self.node)
        self.grid_set = set(self.grid)

    # ------------------------------------------------------------ partitions
    def partitions(self) -> list[tuple[tuple[str, ...], ...]]:
        out = []
        for part in set_partitions(self.units):
            canon = tuple(sorted(tuple(sorted(b, key=self.units.index)) for b in part))
            if self.colocate is not None and not self._matches_colocate(canon):
                continue
            out.append(canon)
        return sorted(set(out), key=lambda p: (len(p), p))

    def _matches_colocate(self, part: tuple[tuple[str, ...], ...]) -> bool:
        want = []
        for group in self.colocate or []:
            names = set()
            for item in group:
                matched = [u for u in self.units if u == item or self.pt.t.units[u].role == item]
                if not matched:
                    return False
                names.update(matched)
            want.append(frozenset(names))
        covered = set().union(*want) if want else set()
        blocks = [frozenset(b) for b in part]
        for w in want:
            if w not in blocks:
                return False
        return all(b in want for b in blocks if b & covered)

    def _pinned(self, block: tuple[str, ...]) -> set[int]:
        return {self.devices_pin[u] for u in block if u in self.devices_pin}

    def _feasible(self, block: tuple[str, ...], d: int) -> bool:
        pinned = self._pinned(block)
        if pinned and pinned != {d}:
            return False
        return d in self.grid_set and self.pt.choice(block, d).feasible

    def _candidates_for(self, block: tuple[str, ...], coarse: bool) -> list[int]:
        sizes = self._coarse(self.grid) if coarse else self.grid
        pinned = self._pinned(block)
        if pinned:
            sizes = sorted(pinned)
        return [d for d in sizes if self._feasible(block, d)]

    # ---------------------------------------------------------------- scoring
    def _arrays(self, part, sizes: np.ndarray):
        """Per-op times and sync times for candidates (rows of ``sizes``)."""
        times: dict[str, np.ndarray] = {}
        sync_times: dict[str, np.ndarray] = {}
        syncs: list[SyncSpec] = []
        pool_of_unit = {u: i for i, b in enumerate(part) for u in b}
        n = sizes.shape[0]
        choices = [[self.pt.choice(b, int(d)) for d in sizes[:, i]] for i, b in enumerate(part)]
        for i, b in enumerate(part):
            col = choices[i]
            for u in b:
                for op in self.pt.t.units[u].ops:
                    times[op] = np.array([c.op_times.get(op, np.inf) for c in col])
        units = self.pt.t.units
        for u in self.units:
            gu = units[u]
            if not gu.generates or not any(x.role == gu.role and x.trainable for x in units.values()):
                continue
            tu = train_unit(units.values(), gu.role)
            gi, ti = pool_of_unit[u], pool_of_unit[tu.name]
            spec = SyncSpec(gu.role, tu.update_op, (gi,) if gi == ti else (ti, gi))
            if gi == ti:  # co-located: the pool table chose the sync with the generation layout
                sync_times[spec.id] = np.array([c.gens[u].reshard.time if c.gens.get(u) else np.inf for c in choices[gi]])
            else:
                sync_times[spec.id] = self._cross_pool_times(tu, gu, choices[ti], choices[gi], sizes, ti, gi)
            syncs.append(spec)
        return times, sync_times, syncs, choices, n

    def _cross_pool_times(self, tu: Unit, gu: Unit, tcs: list[PoolChoice], gcs: list[PoolChoice], sizes, ti: int, gi: int):
        """:func:`cross_pool_sync` of every row, priced once per distinct (train choice, generation choice, split)."""
        memo: dict[tuple, float] = {}
        out = np.empty(len(tcs))
        for r, (tc, gc) in enumerate(zip(tcs, gcs, strict=True)):
            if not (tc.feasible and gc.feasible):
                out[r] = np.inf
                continue
            row = tuple(int(x) for x in sizes[r])
            near = row[ti] + row[gi] <= self.node and same_node(row, ti, gi, self.node)
            key = (id(tc), id(gc), near)
            if key not in memo:
                rc = cross_pool_sync(self.pt.t, tu, gu, tc, gc, row, ti, gi)
                memo[key] = rc.time if rc is not None else np.inf
            out[r] = memo[key]
        return out

    def score(self, part, sizes: np.ndarray) -> tuple[np.ndarray, list]:
        times, sync_times, syncs, choices, _ = self._arrays(part, sizes)
        pool_of_unit = {u: i for i, b in enumerate(part) for u in b}
        ops = [replace(o, pool=pool_of_unit[self.unit_of_op[o.id]] if o.pool is not None else None) for o in self.ops]
        step, _, _ = simulate(
            ops,
            syncs,
            times,
            sync_times,
            [sizes[:, i].astype(float) for i in range(len(part))],
            self.hw.pool_bw,
            self.hw.controller_bw,
            staleness=self.staleness,
            variation=self._variation(part, choices) if self.staleness else None,
        )
        return step, choices

    def _variation(self, part, choices: list[list[PoolChoice]]) -> Variation:
        return Variation(generate_spreads(self.pt.t.units, part, choices), self.pt.t.workload.mean_response_cv)

    # ------------------------------------------------------------- enumerate
    def _enumerate(self, part, heads: list[list[int]]) -> np.ndarray:
        k = len(part)
        if k == 1:
            return np.array([[self.total]]) if self._feasible(part[0], self.total) else np.zeros((0, 1), int)
        rows = []
        for head in itertools.product(*heads):
            rest = self.total - sum(head)
            if rest >= 1 and self._feasible(part[-1], rest):
                t = (*head, rest)
                if packs(t, self.total, self.node):
                    rows.append(t)
        return np.array(rows, dtype=int).reshape(-1, k)

    def _coarse(self, sizes: list[int]) -> list[int]:
        keep = [s for s in sizes if s < self.node or s in _geometric(self.total, self.node)]
        return keep or sizes

    def run(self) -> SearchResult:
        result = SearchResult([], {}, {})
        coarse_grid = len(self.grid) > COARSE_GRID_LIMIT
        pruned = False
        for part in self.partitions():
            if len(part) > self.total:
                result.infeasible[part] = f"{len(part)} pools need at least {len(part)} devices; the cluster has {self.total}"
                continue
            coarse = coarse_grid
            heads = [self._candidates_for(b, coarse) for b in part[:-1]]
            if not coarse and math.prod(len(h) for h in heads) > EXACT_LIMIT:
                coarse = True
                heads = [self._candidates_for(b, True) for b in part[:-1]]
            pruned |= coarse
            empty = next((b for b, h in zip(part, heads, strict=False) if not h), None)
            if empty is not None:
                result.infeasible[part] = self._why_no_size(empty)
                continue
            sizes = self._enumerate(part, heads)
            if len(sizes) == 0:
                result.infeasible[part] = self._why_no_split(part)
                continue
            step, choices = self.score(part, sizes)
            result.evaluated += len(sizes)
            order = np.argsort(step, kind="stable")[:KEEP_PER_PARTITION]
            cands = [self._cand(part, sizes[i], float(step[i]), [c[i] for c in choices]) for i in order if np.isfinite(step[i])]
            if coarse:
                cands = [self._refine(c, result) for c in cands]
                cands.sort(key=lambda c: c.step)
            if not cands:
                result.infeasible[part] = "every split leaves some op without memory"
                continue
            result.per_partition[part] = cands[0]
            result.ranked.extend(cands)
        result.ranked.sort(key=lambda c: (c.step, len(c.partition), c.partition, c.sizes))
        result.strategy = "pruned" if pruned else "exact"
        return result

    def _cand(self, part, sizes, step, choices) -> Candidate:
        return Candidate(part, tuple(int(s) for s in sizes), step, tuple(choices))

    def _refine(self, c: Candidate, result: SearchResult) -> Candidate:
        """Hill-climb: move devices between two pools while the step gets shorter."""
        best = c
        for _ in range(64):
            neigh = set()
            for i, j in itertools.permutations(range(len(best.sizes)), 2):
                for size_i in _neighbours(best.sizes[i], self.grid):
                    new_j = best.sizes[j] - (size_i - best.sizes[i])
                    if new_j < 1 or not self._feasible(best.partition[i], size_i) or not self._feasible(best.partition[j], new_j):
                        continue
                    s = list(best.sizes)
                    s[i], s[j] = size_i, new_j
                    if packs(tuple(s), self.total, self.node):
                        neigh.add(tuple(s))
            if not neigh:
                break
            arr = np.array(sorted(neigh), dtype=int)
            step, choices = self.score(best.partition, arr)
            result.evaluated += len(arr)
            k = int(np.argmin(step))
            if step[k] < best.step - 1e-9:
                best = self._cand(best.partition, arr[k], float(step[k]), [ch[k] for ch in choices])
            else:
                break
        return best

    def _why_no_size(self, block: tuple[str, ...]) -> str:
        pinned = self._pinned(block)
        if pinned:
            d = min(pinned)
            if d not in self.grid_set:
                return f"pinned size {d} is not a pool size on this cluster (whole nodes, or up to {self.node} devices)"
            return self.pt.choice(block, d).reason or f"pinned size {d} does not fit"
        return self.pt.choice(block, self.total).reason or "does not fit at any size"

    def _why_no_split(self, part) -> str:
        most = self.total - (len(part) - 1)
        for b in part:
            if not any(self._feasible(b, d) for d in self.grid if d <= most):
                return self._why_no_size(b)
        return "no split of the devices gives every pool a size it fits in"


def _geometric(total: int, node: int) -> set[int]:
    out, k = set(), 1
    while k * node <= total:
        for f in (1, 3):
            if f * k * node <= total:
                out.add(f * k * node)
        k *= 2
    return out


def _neighbours(size: int, allowed: list[int]) -> list[int]:
    """The next larger and next smaller allowed sizes."""
    i = allowed.index(size) if size in allowed else None
    if i is None:
        return []
    out = []
    if i + 1 < len(allowed):
        out.append(allowed[i + 1])
    if i - 1 >= 0:
        out.append(allowed[i - 1])
    return out


def generate_spreads(units: dict[str, Unit], part, choices: list[list[PoolChoice]]) -> dict[str, np.ndarray]:
    """Each generate op's deviations from its time (``PhaseCost.spread``), ``(points, candidates)``,
    from the pools' choices (a candidate whose pool has no engine for it: none)."""
    out: dict[str, np.ndarray] = {}
    for i, b in enumerate(part):
        for u in b:
            if not units[u].generates:
                continue
            for op in units[u].ops:
                rows = [c.gens[u].op_costs[op].spread if u in c.gens else () for c in choices[i]]
                width = max((len(r) for r in rows), default=0)
                if width:
                    out[op] = np.array([r or (0.0,) * width for r in rows], dtype=float).T
    return out
