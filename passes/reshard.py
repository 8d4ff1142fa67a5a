"""Resharding weights from the training layout to the layout of another phase.

Geometry. A model's weights are a rectangle: the *layer* axis (cut by
pipeline parallelism) times the *tensor* axis (each layer's matrices, cut by
tensor parallelism or by FSDP). A layout gives every device a shard:

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


def train_shards(lay: Layout) -> int:
    """``s_t``: distinct weight shards of a training layout."""
    return lay.tp * lay.pp * (lay.dp * lay.cp if lay.fsdp else 1)


def gen_shards(lay: Layout) -> int:
    """``s_g``: distinct weight shards of a generation layout."""
    return lay.tp * lay.pp


def _grid(lay: Layout, generation: bool) -> tuple[int, int]:
    """(layer cuts, tensor cuts) of a layout's shards."""
    if generation:
        return lay.pp, lay.tp
    if lay.fsdp:
        return 1, lay.dp * lay.cp * lay.tp
    return lay.pp, lay.tp


def nested(train: Layout, gen: Layout) -> bool:
    """Every generation shard is a union of whole training shards."""
    tl, tt = _grid(train, False)
    gl, gt = _grid(gen, True)
    return tl % gl == 0 and tt % gt == 0


def overlap_bytes(m: ModelSpec, train: Layout, gen: Layout) -> float:
    """Bytes of a device's generation shard that its own training shard holds, at best
    (co-located): the overlap of the two rectangles when they are aligned."""
    tl, tt = _grid(train, False)
    gl, gt = _grid(gen, True)
    return float(m.weight_bytes) * float(min(Fraction(1, tl), Fraction(1, gl)) * min(Fraction(1, tt), Fraction(1, gt)))


def lower_bound_bytes(m: ModelSpec, train: Layout, gen: Layout, colocated: bool) -> float:
    """Bytes a generation device must receive at least: its shard, less the
    part its own training shard already holds."""
    need = float(m.weight_bytes) / gen_shards(gen)
    if not colocated:
        return need
    return max(need - overlap_bytes(m, train, gen), 0.0)


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
    tl, tt = _grid(train, False)
    gl, gt = _grid(gen, True)
    stages, slices = tl // gl, tt // gt
    if train.fsdp:  # tensor slices are consecutive ranks
        span = slices
    else:  # tp ranks are consecutive; pipeline stages are tp·cp·dp ranks apart
        span = (stages - 1) * train.tp * train.cp * train.dp + slices
    crosses = hw.nodes > 1 and span > hw.node
    return (min(hw.intra, hw.inter) if crosses else hw.intra), ("inter-node" if crosses else "intra-node")


def _with_reload(options: list[ReshardCost], m: ModelSpec, gen: Layout, hw: Hw) -> list[ReshardCost]:
    """Every method ends with the engine taking its shard in (vLLM's in-place reload)."""
    reload = hw.engine_reload(gen.backend, float(m.weight_bytes) / gen_shards(gen))
    return [dataclasses.replace(o, time=o.time + reload) for o in options] if reload else options


def colocated_options(m: ModelSpec, train: Layout, gen: Layout, hw: Hw) -> list[ReshardCost]:
    """Methods available when training and generation share devices.

    Megatron keeps bf16 parameters, so the generation engine can use the
    training shards in place and hold only what it gathers; FSDP2 keeps fp32
    shards, so the engine holds its own bf16 copy of its shard, sleeping
    through training with it in host memory."""
    big_m = float(m.weight_bytes)
    s_t, s_g = train_shards(train), gen_shards(gen)
    devices = train.world
    # FSDP2 (sharded or replicated) keeps fp32 state: the engine holds its own copy of its shard,
    # sleeping through training with it in host memory (on GPUs)
    copy = train.fsdp or train.backend == "fsdp2"
    own_copy = big_m / s_g / 1e9 if copy else None
    wake = big_m / s_g / hw.host if copy and hw.kind == "gpu" else 0.0
    out: list[ReshardCost] = []
    if not train.fsdp and (train.pp, train.tp) == (gen.pp, gen.tp):
        # the engine reads the training shard in place (a local copy when it keeps its own)
        local = big_m / s_g / hw.hbm if copy else 0.0
        out.append(ReshardCost("in_place", 0.0, 0.0, local, "none", own_copy or 0.0))
    if nested(train, gen) and s_t > s_g:
        k = s_t // s_g
        bw, link = _micro_dp_link(hw, train, gen)
        per_dev = big_m / s_g - big_m / s_t
        t = gather_time(big_m / s_g, k, bw, hw.latency) + wake
        extra = own_copy if own_copy is not None else per_dev / 1e9
        out.append(ReshardCost("micro_dp_allgather", per_dev, per_dev * devices, t, link, extra))
    if s_t == 1:
        return _with_reload(out, m, gen, hw)  # nothing to gather
    crosses = hw.nodes > 1 and devices > hw.node
    bw = min(hw.intra, hw.inter) if crosses else hw.intra
    per_dev = big_m * (s_t - 1) / s_t
    t = gather_time(big_m, s_t, bw, hw.latency) + wake
    # the engine holds its whole shard; only the part its own training shard holds is shared (when the
    # shards do not nest, that is less than the training shard: a pp cut feeding a tp cut)
    extra = own_copy if own_copy is not None else lower_bound_bytes(m, train, gen, colocated=True) / 1e9
    out.append(ReshardCost("full_allgather", per_dev, per_dev * devices, t, "inter-node" if crosses else "intra-node", extra))
    return _with_reload(out, m, gen, hw)


def separate_options(m: ModelSpec, train: Layout, gen: Layout, hw: Hw, *, same_node: bool) -> list[ReshardCost]:
    """Methods available when generation runs on devices of its own."""
    big_m = float(m.weight_bytes)
    s_t, s_g = train_shards(train), gen_shards(gen)
    link_bw = hw.intra if same_node else min(hw.intra, hw.inter)
    link = "intra-node" if same_node else "inter-node"
    n_gen = gen.world
    gen_w = big_m / s_g / 1e9
    # broadcast: the training side assembles full buckets, every generation device receives the whole model
    assemble = gather_time(big_m, s_t, hw.link(s_t), hw.latency) if s_t > 1 else 0.0
    bcast = assemble + big_m / link_bw + math.ceil(big_m / 256e6) * hw.latency * math.log2(max(n_gen, 2))
    out = [ReshardCost("broadcast", big_m, big_m * n_gen, bcast, link, gen_w)]
    # p2p: each generation device receives only its shard; all training devices send
    send_bytes = big_m * gen.dp / train.world  # every generation replica needs the whole model once
    p2p = max(big_m / s_g / link_bw, send_bytes / link_bw) + math.ceil(big_m / s_g / 256e6) * hw.latency
    out.append(ReshardCost("p2p", big_m / s_g, big_m * gen.dp, p2p, link, gen_w))
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
        opts = whole_tensor_options(opts, gen)
    return best(opts, method)


# ---------------------------------------------------------------- deliveries
Rect = tuple[Fraction, Fraction, Fraction, Fraction]  # layer lo, hi, tensor lo, hi


@dataclass(frozen=True)
class Delivery:
    """One rectangle of the weights sent from ``src`` to ``dst`` (global device
    ids; ``src == dst`` means it is already there)."""

    src: int
    dst: int
    rect: Rect

    @property
    def area(self) -> Fraction:
        a, b, c, d = self.rect
        return (b - a) * (d - c)


def _coords(lay: Layout, rank: int) -> tuple[int, int, int, int]:
    """(tp, cp, dp, pp) coordinates of a rank (Megatron order: tp fastest)."""
    return (
        rank % lay.tp,
        (rank // lay.tp) % lay.cp,
        (rank // (lay.tp * lay.cp)) % lay.dp,
        rank // (lay.tp * lay.cp * lay.dp),
    )


def train_rect(lay: Layout, rank: int) -> Rect:
    tp_r, cp_r, dp_r, pp_r = _coords(lay, rank)
    if lay.fsdp:
        s = lay.dp * lay.cp * lay.tp
        i = (dp_r * lay.cp + cp_r) * lay.tp + tp_r
        return (F0, F1, Fraction(i, s), Fraction(i + 1, s))
    return (Fraction(pp_r, lay.pp), Fraction(pp_r + 1, lay.pp), Fraction(tp_r, lay.tp), Fraction(tp_r + 1, lay.tp))


def gen_rect_of_rank(gen: Layout, rank: int) -> Rect:
    """A generation rank's shard (vLLM order: tp fastest, then pp, then replicas)."""
    tp_r = rank % gen.tp
    pp_r = (rank // gen.tp) % gen.pp
    return (Fraction(pp_r, gen.pp), Fraction(pp_r + 1, gen.pp), Fraction(tp_r, gen.tp), Fraction(tp_r + 1, gen.tp))


def _cut(a: Rect, b: Rect) -> Rect | None:
    r = (max(a[0], b[0]), min(a[1], b[1]), max(a[2], b[2]), min(a[3], b[3]))
    return r if r[0] < r[1] and r[2] < r[3] else None


def _contains(outer: Rect, inner: Rect) -> bool:
    return outer[0] <= inner[0] and inner[1] <= outer[1] and outer[2] <= inner[2] and inner[3] <= outer[3]


def colocated_gen_rect(train: Layout, gen: Layout, rank: int) -> Rect:
    """The generation shard of a co-located device: the one containing its own training shard."""
    own = train_rect(train, rank)
    for j in range(gen_shards(gen)):
        g = gen_rect_of_rank(gen, j)
        if _cut(g, own) is not None and (_contains(g, own) or _contains(own, g)):
            return g
    raise ValueError("training and generation shards are not nested")


def deliveries(method: str, train: Layout, gen: Layout, train_devices: list[int], gen_devices: list[int]) -> list[Delivery]:
    """Every rectangle each generation device receives (small layouts only)."""
    whole: Rect = (F0, F1, F0, F1)
    holders: dict[Rect, list[int]] = {}
    for r, dev in enumerate(train_devices):
        holders.setdefault(train_rect(train, r), []).append(dev)
    out: list[Delivery] = []
    if method in ("in_place", "micro_dp_allgather"):
        for r, dev in enumerate(train_devices):
            target = colocated_gen_rect(train, gen, r)
            _, cp_r, dp_r, _ = _coords(train, r)
            for rr, other in enumerate(train_devices):
                piece = _cut(train_rect(train, rr), target)
                if piece is None:
                    continue
                if not train.fsdp and _coords(train, rr)[1:3] != (cp_r, dp_r):
                    continue  # take each piece from this device's own data-parallel replica
                out.append(Delivery(other, dev, piece))
        return out
    for g_rank, dev in enumerate(gen_devices):
        target = whole if method in ("full_allgather", "broadcast") else gen_rect_of_rank(gen, g_rank)
        for rect, devs in holders.items():
            piece = _cut(rect, target)
            if piece is None:
                continue
            src = dev if dev in devs else devs[(g_rank // gen_shards(gen)) % len(devs)]
            out.append(Delivery(src, dev, piece))
    return out
