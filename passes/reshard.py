"""Resharding weights from the training layout to the layout of another phase.

Geometry. A model's weights are boxes on three axes — *layer* (cut by
pipeline parallelism), *expert* and *tensor* (each matrix, cut by tensor
parallelism or by FSDP) — in two parts: the dense weights and an MoE model's
routed experts (see :func:`grid`: Megatron cuts experts ``ep`` ways and keeps
each whole, a vLLM engine cuts each by ``tp`` or, with ``ep = tp``, hands its
ranks whole experts). Every method below is priced part by part; for the
dense part a layout gives every device a shard:

* Megatron training: layers ``[pp_r/p, (pp_r+1)/p)`` × tensor slice ``tp_r``
  of ``t`` — ``s_t = t·p`` shards, replicated over dp;
* FSDP training: all layers × tensor slice ``(dp_r·cp + cp_r)·t + tp_r`` of
  ``s_t = dp·cp·t`` (every parameter is split along its first dimension);
* generation: layers ``[pp_r/p_g, …)`` × tensor slice ``tp_r`` of ``t_g`` —
  ``s_g = t_g·p_g`` shards, replicated over the engine's dp replicas.

Let ``M`` be the weights' bytes. Methods:

``in_place``
    The generation shards are the training shards (Megatron, ``t_g = t``,
    ``p_g = p``): nothing moves.
``micro_dp_allgather`` (HybridFlow's 3D-HybridEngine)
    Co-located, and each generation shard is a union of training shards
    (``p_g | p`` and ``t_g | t``; FSDP: ``t_g | s_t``): every device gathers its
    generation shard within its micro-DP group of ``k = s_t/s_g`` devices.
    Bytes per device ``M/s_g − M/s_t = (t·p − t_g·p_g)/(t_g·p_g·t·p)·M``.
``full_allgather`` (DeepSpeed-Chat style)
    Co-located: every device gathers the whole model, then keeps its
    generation shard: ``(s_t − 1)/s_t·M`` per device.
``broadcast`` (OpenRLHF style)
    Separate pools: the training pool gathers each bucket and broadcasts the
    full tensors to every generation device: ``M`` per receiving device.
``p2p``
    Separate pools: every generation device receives exactly its shard
    ``M/s_g`` from the training devices that hold its pieces.

:func:`deliveries` spells out, for small layouts, which device sends which
rectangle of the weights to which device; tests check that every piece of
every generation shard arrives exactly once and that no method moves fewer
bytes than :func:`lower_bound_bytes`.

Every method ends with the generation engine taking its shard in. For a
vLLM engine that is an in-place reload whose measured cost (a fixed part and
a rate, ``engine_reload_*`` in the hardware profile) is added to the time.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from fractions import Fraction

from flowc.ir.models import ModelSpec
from flowc.ir.plan import Layout
from flowc.passes.costs import Hw, gather_time

F0, F1 = Fraction(0), Fraction(1)


PARTS = ("dense", "experts")
Grid = tuple[int, int, int]  # cuts along the (layer, expert, tensor) axes


def part_bytes(m: ModelSpec) -> dict[str, float]:
    """The weights' bytes in each part: the dense rectangle and, for an MoE model, the experts."""
    experts = float(m.expert_params_total) * m.bytes_per_param
    out = {"dense": float(m.weight_bytes) - experts}
    if experts:
        out["experts"] = experts
    return out


def grid(lay: Layout, generation: bool, part: str = "dense") -> Grid:
    """How a layout cuts one part of the weights, along (layer, expert, tensor).

    Dense weights: ``pp`` layer cuts × ``tp`` tensor cuts (FSDP: ``dp·cp·tp`` cuts of every
    tensor's first dimension). Experts in Megatron training are whole (expert tensor parallelism
    1) and split ``ep`` ways along the expert axis (FSDP: along the fused expert tensors' first
    dimension, the expert axis); a generation engine with ``ep > 1`` splits them over its tp ranks,
    ``ep`` ways along the expert axis and ``tp/ep`` ways within each expert."""
    if generation:
        if part == "experts" and lay.ep > 1:
            return lay.pp, lay.ep, max(lay.tp // lay.ep, 1)
        return lay.pp, 1, lay.tp
    if lay.fsdp:
        s = lay.dp * lay.cp * lay.tp
        return (1, s, 1) if part == "experts" else (1, 1, s)
    return (lay.pp, max(lay.ep, 1), 1) if part == "experts" else (lay.pp, 1, lay.tp)


def _count(g: Grid) -> int:
    return g[0] * g[1] * g[2]


def train_shards(lay: Layout, part: str = "dense") -> int:
    """``s_t``: distinct weight shards of a training layout (of one part)."""
    return _count(grid(lay, False, part))


def gen_shards(lay: Layout, part: str = "dense") -> int:
    """``s_g``: distinct weight shards of a generation layout (of one part)."""
    return _count(grid(lay, True, part))


def _parts(m: ModelSpec) -> dict[str, float]:
    return {k: v for k, v in part_bytes(m).items() if v > 0}


def nested(train: Layout, gen: Layout, parts: tuple[str, ...] = ("dense",)) -> bool:
    """Every generation shard is a union of whole training shards (in every part)."""
    for part in parts:
        t, g = grid(train, False, part), grid(gen, True, part)
        if any(a % b for a, b in zip(t, g, strict=True)):
            return False
    return True


def _overlap(train: Layout, gen: Layout, part: str) -> Fraction:
    """The share of a part both a device's training shard and its generation shard hold, aligned."""
    t, g = grid(train, False, part), grid(gen, True, part)
    out = F1
    for a, b in zip(t, g, strict=True):
        out *= min(Fraction(1, a), Fraction(1, b))
    return out


def gen_shard_bytes(m: ModelSpec, gen: Layout) -> float:
    """The bytes of one generation device's shard (every part)."""
    return sum(b / gen_shards(gen, part) for part, b in _parts(m).items())


def overlap_bytes(m: ModelSpec, train: Layout, gen: Layout) -> float:
    """Bytes of a device's generation shard that its own training shard holds, at best
    (co-located): the overlap of the two boxes of every part when they are aligned."""
    return sum(b * float(_overlap(train, gen, part)) for part, b in _parts(m).items())


def lower_bound_bytes(m: ModelSpec, train: Layout, gen: Layout, colocated: bool) -> float:
    """Bytes a generation device must receive at least: its shard, less the
    part its own training shard already holds."""
    need = gen_shard_bytes(m, gen)
    if not colocated:
        return need
    return max(need - overlap_bytes(m, train, gen), 0.0)


def _contained(train: Layout, gen: Layout, part: str) -> bool:
    """A device's generation shard of ``part`` lies inside its training shard (nothing to fetch)."""
    t, g = grid(train, False, part), grid(gen, True, part)
    return all(b % a == 0 for a, b in zip(t, g, strict=True))


@dataclass(frozen=True)
class ReshardCost:
    method: str
    bytes_per_device: float
    total_bytes: float
    time: float
    link: str
    extra_memory_gb: float  # generation weights held beyond the training state


def _micro_dp_link(hw: Hw, train: Layout, gen: Layout) -> tuple[float, str]:
    """Bandwidth of the micro-DP group: the training shards inside one generation shard."""
    t, g = grid(train, False), grid(gen, True)
    stages, slices = t[0] // g[0], t[2] // g[2]
    if train.fsdp:  # tensor slices are consecutive ranks
        span = slices
    else:  # tp ranks are consecutive; pipeline stages are tp·cp·dp ranks apart
        span = (stages - 1) * train.tp * train.cp * train.dp + slices
    if train.ep > 1 and not train.fsdp:  # expert ranks are consecutive within a stage
        span = max(span, (stages - 1) * train.tp * train.cp * train.dp + train.ep)
    crosses = hw.nodes > 1 and span > hw.node
    return (min(hw.intra, hw.inter) if crosses else hw.intra), ("inter-node" if crosses else "intra-node")


def _with_reload(options: list[ReshardCost], m: ModelSpec, gen: Layout, hw: Hw) -> list[ReshardCost]:
    """Every method ends with the engine taking its shard in (vLLM's in-place reload)."""
    reload = hw.engine_reload(gen.backend, gen_shard_bytes(m, gen))
    return [dataclasses.replace(o, time=o.time + reload) for o in options] if reload else options


def colocated_options(m: ModelSpec, train: Layout, gen: Layout, hw: Hw) -> list[ReshardCost]:
    """Methods available when training and generation share devices.

    Megatron keeps bf16 parameters, so the generation engine can use the
    training shards in place and hold only what it gathers; FSDP2 keeps fp32
    shards, so the engine holds its own bf16 copy of its shard, sleeping
    through training with it in host memory. Every part of the weights (the
    dense rectangle, and an MoE model's experts, cut by ``ep``) is priced."""
    parts = _parts(m)
    names = tuple(parts)
    shard = gen_shard_bytes(m, gen)
    devices = train.world
    # FSDP2 (sharded or replicated) keeps fp32 state: the engine holds its own copy of its shard,
    # sleeping through training with it in host memory (on GPUs)
    copy = train.fsdp or train.backend == "fsdp2"
    own_copy = shard / 1e9 if copy else None
    wake = shard / hw.host if copy and hw.kind == "gpu" else 0.0
    held = lower_bound_bytes(m, train, gen, colocated=True)  # what the engine holds beyond its training shard
    out: list[ReshardCost] = []
    lined_up = aligned(train, gen, names)
    if not train.fsdp and lined_up and all(_contained(train, gen, part) for part in names):
        # the engine reads the training shard in place (a local copy when it keeps its own)
        local = shard / hw.hbm if copy else 0.0
        out.append(ReshardCost("in_place", 0.0, 0.0, local, "none", own_copy or 0.0))
    s_t = {part: train_shards(train, part) for part in names}
    s_g = {part: gen_shards(gen, part) for part in names}
    if lined_up and nested(train, gen, names) and any(s_t[p] > s_g[p] for p in names):
        bw, link = _micro_dp_link(hw, train, gen)
        per_dev = sum(b / s_g[p] - b / s_t[p] for p, b in parts.items())
        t = sum(gather_time(b / s_g[p], s_t[p] // s_g[p], bw, hw.latency) for p, b in parts.items()) + wake
        extra = own_copy if own_copy is not None else per_dev / 1e9
        out.append(ReshardCost("micro_dp_allgather", per_dev, per_dev * devices, t, link, extra))
    if all(n == 1 for n in s_t.values()):
        return _with_reload(out, m, gen, hw)  # every device holds the whole model: nothing to gather
    crosses = hw.nodes > 1 and devices > hw.node
    bw = min(hw.intra, hw.inter) if crosses else hw.intra
    per_dev = sum(b * (s_t[p] - 1) / s_t[p] for p, b in parts.items())
    t = sum(gather_time(b, s_t[p], bw, hw.latency) for p, b in parts.items()) + wake
    # the engine holds its whole shard; only the part its own training shard holds is shared (when the
    # shards do not nest, that is less than the training shard: a pp cut feeding a tp cut, or experts
    # split by ep feeding an engine that splits every expert by tp)
    extra = own_copy if own_copy is not None else held / 1e9
    out.append(ReshardCost("full_allgather", per_dev, per_dev * devices, t, "inter-node" if crosses else "intra-node", extra))
    return _with_reload(out, m, gen, hw)


def separate_options(m: ModelSpec, train: Layout, gen: Layout, hw: Hw, *, same_node: bool) -> list[ReshardCost]:
    """Methods available when generation runs on devices of its own."""
    big_m = float(m.weight_bytes)
    s_t = max(train_shards(train, p) for p in _parts(m))
    link_bw = hw.intra if same_node else min(hw.intra, hw.inter)
    link = "intra-node" if same_node else "inter-node"
    n_gen = gen.world
    shard = gen_shard_bytes(m, gen)
    gen_w = shard / 1e9
    # broadcast: the training side assembles full buckets, every generation device receives the whole model
    assemble = gather_time(big_m, s_t, hw.link(s_t), hw.latency) if s_t > 1 else 0.0
    bcast = assemble + big_m / link_bw + math.ceil(big_m / 256e6) * hw.latency * math.log2(max(n_gen, 2))
    out = [ReshardCost("broadcast", big_m, big_m * n_gen, bcast, link, gen_w)]
    # p2p: each generation device receives only its shard; all training devices send
    send_bytes = big_m * gen.dp / train.world  # every generation replica needs the whole model once
    p2p = max(shard / link_bw, send_bytes / link_bw) + math.ceil(shard / 256e6) * hw.latency
    out.append(ReshardCost("p2p", shard, big_m * gen.dp, p2p, link, gen_w))
    return _with_reload(out, m, gen, hw)


def whole_tensor_options(options: list[ReshardCost], gen: Layout) -> list[ReshardCost]:
    """The methods of a runtime whose generation engines reload whole HF tensors
    and shard them themselves (vLLM's ``reload_weights``): co-located, every
    device receives what its training shard lacks of the whole model
    (``full_allgather``; ``micro_dp_allgather`` and ``in_place`` only where
    they are the same, one generation shard); across pools, every generation
    device receives the whole model (``broadcast``)."""
    keep = {"full_allgather", "broadcast"} | ({"micro_dp_allgather", "in_place"} if gen_shards(gen) == 1 else set())
    return [o for o in options if o.method in keep]


def best(options: list[ReshardCost], method: str | None = None) -> ReshardCost | None:
    """The fastest option (or the one named by ``method``, if available)."""
    if method is not None:
        options = [o for o in options if o.method == method]
    return min(options, key=lambda o: (o.time, o.bytes_per_device)) if options else None


@functools.lru_cache(maxsize=1 << 16)
def sync_cost(
    m: ModelSpec,
    train: Layout,
    gen: Layout,
    hw: Hw,
    *,
    colocated: bool,
    same_node: bool = True,
    whole_tensor: bool = False,
    method: str | None = None,
) -> ReshardCost | None:
    """The one price of a weight sync from ``train`` to ``gen``, used by the pool
    table, the search and the plan builder alike (so the plan the search ranks is
    the plan that is emitted): the methods open to the layout pair (co-located, or
    across pools within one node or not), only the whole-tensor ones when the
    runtime's engines reload whole tensors, the pinned ``method`` if any, and the
    fastest of those. None when no method is open."""
    opts = colocated_options(m, train, gen, hw) if colocated else separate_options(m, train, gen, hw, same_node=same_node)
    if whole_tensor:
        # an engine that reloads whole tensors holds its own copy of its whole shard (it reads no
        # training tensor in place)
        own = gen_shard_bytes(m, gen) / 1e9
        opts = [dataclasses.replace(o, extra_memory_gb=max(o.extra_memory_gb, own)) for o in whole_tensor_options(opts, gen)]
    return best(opts, method)


# ---------------------------------------------------------------- deliveries
Rect = tuple[Fraction, Fraction, Fraction, Fraction, Fraction, Fraction]  # (lo, hi) on the layer, expert, tensor axes
WHOLE: Rect = (F0, F1, F0, F1, F0, F1)


@dataclass(frozen=True)
class Delivery:
    """One box of one part of the weights sent from ``src`` to ``dst`` (global
    device ids; ``src == dst`` means it is already there)."""

    src: int
    dst: int
    rect: Rect
    part: str = "dense"

    @property
    def area(self) -> Fraction:
        return _area(self.rect)


def _area(r: Rect) -> Fraction:
    return (r[1] - r[0]) * (r[3] - r[2]) * (r[5] - r[4])


def _box(g: Grid, idx: tuple[int, int, int]) -> Rect:
    return tuple(x for n, i in zip(g, idx, strict=True) for x in (Fraction(i, n), Fraction(i + 1, n)))  # type: ignore[return-value]


def _coords(lay: Layout, rank: int) -> tuple[int, int, int, int]:
    """(tp, cp, dp, pp) coordinates of a rank (Megatron order: tp fastest)."""
    return (
        rank % lay.tp,
        (rank // lay.tp) % lay.cp,
        (rank // (lay.tp * lay.cp)) % lay.dp,
        rank // (lay.tp * lay.cp * lay.dp),
    )


def _expert_coords(lay: Layout, rank: int) -> tuple[int, int]:
    """(expert rank, expert-data-parallel rank) of a Megatron rank: with expert tensor parallelism 1,
    the ranks of a pipeline stage (tp fastest, then cp, dp) take the ``ep`` expert shards in turn."""
    tp_r, cp_r, dp_r, _ = _coords(lay, rank)
    local = tp_r + lay.tp * (cp_r + lay.cp * dp_r)
    ep = max(lay.ep, 1)
    return local % ep, local // ep


def train_rect(lay: Layout, rank: int, part: str = "dense") -> Rect:
    """A training rank's box of one part of the weights."""
    tp_r, cp_r, dp_r, pp_r = _coords(lay, rank)
    g = grid(lay, False, part)
    if lay.fsdp:
        i = (dp_r * lay.cp + cp_r) * lay.tp + tp_r
        return _box(g, (0, i, 0) if part == "experts" else (0, 0, i))
    if part == "experts":
        return _box(g, (pp_r, _expert_coords(lay, rank)[0], 0))
    return _box(g, (pp_r, 0, tp_r))


def gen_rect_of_rank(gen: Layout, rank: int, part: str = "dense") -> Rect:
    """A generation rank's box (vLLM order: tp fastest, then pp, then replicas)."""
    tp_r = rank % gen.tp
    pp_r = (rank // gen.tp) % gen.pp
    g = grid(gen, True, part)
    if part == "experts" and gen.ep > 1:
        return _box(g, (pp_r, tp_r // g[2], tp_r % g[2]))
    return _box(g, (pp_r, 0, tp_r))


def _cut(a: Rect, b: Rect) -> Rect | None:
    r = tuple(max(a[i], b[i]) if i % 2 == 0 else min(a[i], b[i]) for i in range(6))
    return r if all(r[i] < r[i + 1] for i in (0, 2, 4)) else None  # type: ignore[return-value]


def _contains(outer: Rect, inner: Rect) -> bool:
    return all(outer[i] <= inner[i] and inner[i + 1] <= outer[i + 1] for i in (0, 2, 4))


def _nests(a: Rect, b: Rect) -> bool:
    return _cut(a, b) is not None and (_contains(a, b) or _contains(b, a))


def colocated_gen_rank(train: Layout, gen: Layout, rank: int, parts: tuple[str, ...] = ("dense",)) -> int:
    """The generation shard of a co-located device: the one that nests with its own training
    shard in every part."""
    for j in range(gen_shards(gen)):
        if all(_nests(gen_rect_of_rank(gen, j, p), train_rect(train, rank, p)) for p in parts):
            return j
    raise ValueError("training and generation shards are not nested")


def colocated_gen_rect(train: Layout, gen: Layout, rank: int, part: str = "dense", parts: tuple[str, ...] = ("dense",)) -> Rect:
    return gen_rect_of_rank(gen, colocated_gen_rank(train, gen, rank, parts), part)


SHAPE_FIELDS = ("dp", "tp", "pp", "cp", "ep", "fsdp")  # what decides how a layout cuts the weights


def aligned(train: Layout, gen: Layout, parts: tuple[str, ...]) -> bool:
    """Every co-located device has a generation shard that nests with its training shard in every
    part (divisible grids guarantee it for the dense part; expert shards must line up too). Asked
    for every training layout the search prices, it is answered once per pair of shapes (micro-batches,
    recomputation or offload cut nothing: a Qwen3-235B search on 256 GPUs asked 3.8k times for 1.9k
    distinct pairs), with each generation shard's boxes built once rather than once per rank."""
    if parts == ("dense",) or train.world > 4096:
        return True
    return _aligned(tuple(getattr(train, f) for f in SHAPE_FIELDS), tuple(getattr(gen, f) for f in SHAPE_FIELDS), parts)


@functools.lru_cache(maxsize=1 << 12)
def _aligned(train_shape: tuple, gen_shape: tuple, parts: tuple[str, ...]) -> bool:
    train = Layout(**dict(zip(SHAPE_FIELDS, train_shape, strict=True)))
    gen = Layout(**dict(zip(SHAPE_FIELDS, gen_shape, strict=True)))
    # colocated_gen_rank for every rank, with each shard's boxes built once (not once per rank)
    shards = [tuple(gen_rect_of_rank(gen, j, p) for p in parts) for j in range(gen_shards(gen))]
    seen: set[tuple[Rect, ...]] = set()
    for r in range(train.world):
        own = tuple(train_rect(train, r, p) for p in parts)
        if own in seen:  # a replica of a shard already matched
            continue
        if not any(all(_nests(g, t) for g, t in zip(shard, own, strict=True)) for shard in shards):
            return False
        seen.add(own)
    return True


def _same_source(train: Layout, r: int, rr: int, part: str) -> bool:
    """Whether co-located device ``r`` takes its pieces of ``part`` from ``rr``: its own data-parallel
    replica (dense), its own expert-data-parallel replica (experts)."""
    if train.fsdp:
        return True
    if part == "experts":
        return _expert_coords(train, rr)[1] == _expert_coords(train, r)[1]
    return _coords(train, rr)[1:3] == _coords(train, r)[1:3]


def deliveries(
    method: str, train: Layout, gen: Layout, train_devices: list[int], gen_devices: list[int], parts: tuple[str, ...] = ("dense",)
) -> list[Delivery]:
    """Every box of every part each generation device receives (small layouts only)."""
    out: list[Delivery] = []
    for part in parts:
        holders: dict[Rect, list[int]] = {}
        for r, dev in enumerate(train_devices):
            holders.setdefault(train_rect(train, r, part), []).append(dev)
        if method in ("in_place", "micro_dp_allgather"):
            for r, dev in enumerate(train_devices):
                target = colocated_gen_rect(train, gen, r, part, parts)
                for rr, other in enumerate(train_devices):
                    piece = _cut(train_rect(train, rr, part), target)
                    if piece is not None and _same_source(train, r, rr, part):
                        out.append(Delivery(other, dev, piece, part))
            continue
        for g_rank, dev in enumerate(gen_devices):
            target = WHOLE if method in ("full_allgather", "broadcast") else gen_rect_of_rank(gen, g_rank, part)
            for rect, devs in holders.items():
                piece = _cut(rect, target)
                if piece is None:
                    continue
                src = dev if dev in devs else devs[(g_rank // gen_shards(gen)) % len(devs)]
                out.append(Delivery(src, dev, piece, part))
    return out
