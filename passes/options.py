"""Candidate layouts of each placement unit on a given number of devices.

For a unit and a device count the enumerator tries every layout the backends
support (degrees, FSDP sharding, activation checkpointing, offload,
micro-batch), prices each with the cost model, and keeps the Pareto front of
(resident memory, transient memory, time): the options worth trying when the
unit shares devices with others. The fastest option that does not fit is kept
too, to say why the planner did not take it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from flowc.errors import SpecError
from flowc.ir.models import ModelSpec
from flowc.ir.plan import Layout
from flowc.ir.workload import WorkloadSpec
from flowc.passes.costs import GB, Hw, PhaseCost, replica_sequences
from flowc.passes.flops import Demand
from flowc.passes.generation_costs import generation_weights_gb
from flowc.passes.pins import PhasePin, Pins
from flowc.passes.train_costs import forward_cost, train_cost
from flowc.passes.units import Unit

MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
FRONT_LIMIT = 8
MICRO_FIELDS = ("micro_batch", "micro_tokens")  # what grows a layout's memory along one chain


@dataclass(frozen=True)
class UnitOption:
    """One way to run a unit on ``devices`` devices."""

    unit: str
    devices: int
    layouts: dict[str, Layout]  # phase → layout
    op_costs: dict[str, PhaseCost]  # node id → cost
    resident_gb: float
    transient_gb: float  # peak over the unit's phases, on top of the resident state
    time: float
    fits_alone: bool = True
    need_gb: float = 0.0
    host_gb: float = 0.0  # state offloaded to host memory, per device

    @property
    def op_times(self) -> dict[str, float]:
        return {k: v.time for k, v in self.op_costs.items()}


@dataclass
class UnitOptions:
    front: list[UnitOption]
    oom: UnitOption | None = None  # fastest option that does not fit, if faster than the front


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def tp_choices(m: ModelSpec, d: int, hw: Hw, *, across_nodes: bool = False) -> list[int]:
    """Tensor-parallel degrees for ``m`` on ``d`` devices: within a node, or (``across_nodes``, for
    generation engines too large for one node's tp group) whole nodes' worth over several nodes."""
    out = []
    limit = d if across_nodes else min(d, hw.node)
    for tp in divisors(limit):
        if tp_refusal(m, d, tp, hw, across_nodes=across_nodes) is None:
            out.append(tp)
    return out


def tp_refusal(m: ModelSpec, d: int, tp: int, hw: Hw, *, across_nodes: bool = False) -> str | None:
    """Why ``tp`` cannot split ``m`` on ``d`` devices (None: it can)."""
    if d % tp:
        return f"tp={tp} does not divide the {d} devices"
    if tp > hw.node and not across_nodes:
        return f"tp={tp} spans more than a node ({hw.node} devices); only generation engines cross nodes"
    if tp > hw.node and tp % hw.node:
        return f"tp={tp} over nodes must be a whole number of nodes ({hw.node} devices each)"
    if m.num_heads % tp:
        return f"tp={tp} does not divide {m.name}'s {m.num_heads} attention heads"
    if m.num_kv_heads % tp and tp % m.num_kv_heads:
        return f"tp={tp} neither divides nor is a multiple of {m.name}'s {m.num_kv_heads} KV heads"
    return None


_DEFAULTS = {k: f.default for k, f in Layout.model_fields.items()}


def _layout(**kw) -> Layout:
    """A Layout built without validation (the enumerator only makes valid ones)."""
    return Layout.model_construct(**{**_DEFAULTS, **kw})


PP_LIMIT = 16  # deeper pipelines pay per-stage overheads the model does not price


def pp_choices(n: int, layers: int) -> list[int]:
    """Pipeline depths: divisors of ``n`` up to PP_LIMIT with at least 2 layers a stage."""
    return [k for k in divisors(n) if k <= PP_LIMIT and (k == 1 or layers // k >= 2)]


def _powers_dividing(n: int, limit: int) -> list[int]:
    out, k = [], 1
    while k <= min(n, limit):
        if n % k == 0:
            out.append(k)
        k *= 2
    return out


def pareto(options: list[UnitOption], limit: int = FRONT_LIMIT) -> list[UnitOption]:
    """Options not beaten on all of (time, resident, transient), fastest first."""
    ordered = sorted(options, key=lambda o: (o.time, o.resident_gb, o.transient_gb))
    front: list[UnitOption] = []
    for o in ordered:
        if all(o.resident_gb < f.resident_gb - 1e-9 or o.transient_gb < f.transient_gb - 1e-9 for f in front):
            front.append(o)
    if len(front) > limit:  # keep the fastest, the leanest, and an even spread between
        idx = sorted({round(i * (len(front) - 1) / (limit - 1)) for i in range(limit)})
        front = [front[i] for i in idx]
    return front


class OptionTable:
    """Memoised options of every unit at every device count."""

    def __init__(
        self,
        units: list[Unit],
        models: dict[str, ModelSpec],
        demand: dict[str, Demand],
        workload: WorkloadSpec,
        hw: Hw,
        pins: Pins,
        rollout_backends: tuple[str, ...],
    ):
        self.units = {u.name: u for u in units}
        self.rollout_backends = tuple(rollout_backends)  # the planner prices each, unless a pin names one
        self.models = models
        self.demand = demand
        self.workload = workload
        self.hw = hw
        self.pins = pins
        self.capacity_gb = hw.capacity / GB

    # -------------------------------------------------------------- layouts
    def _train_layouts(self, u: Unit, m: ModelSpec, d: int) -> list[Layout]:
        pin = self.pins.phase(u.role, "train").merged(self.pins.phase(u.role, "forward"))
        out: list[Layout] = []
        long_ctx = self.demand[u.update_op or u.ops[-1]].seq_len >= 8192
        gpu = self.hw.kind == "gpu"  # Megatron and offload need GPUs
        # FSDP2's CPUOffloadPolicy moves parameters, gradients and optimizer state together:
        # it has no optimizer-only offload (Megatron's optimizer_cpu_offload is that)
        offloads = ((False, False), (True, True)) if gpu else ((False, False),)
        mbs = (self.workload.train_micro_batch,) if self.workload.train_micro_batch else MICRO_BATCHES
        for tp in tp_choices(m, d, self.hw):
            rest = d // tp
            for mb in mbs:
                for ckpt in (False, True):
                    # FSDP2 (+ optional DTensor TP): pp = cp = 1, no expert parallel
                    for off_p, off_o in offloads:
                        out.append(
                            _layout(
                                dp=rest,
                                tp=tp,
                                backend="fsdp2",
                                fsdp=True,
                                offload_params=off_p,
                                offload_optimizer=off_o,
                                activation_checkpointing=ckpt,
                                micro_batch=mb,
                            )
                        )
                    # replicated data parallelism (DDP): no gathers, every rank holds the whole state
                    out.append(
                        _layout(dp=rest, tp=tp, backend="fsdp2", fsdp=False, activation_checkpointing=ckpt, micro_batch=mb)
                    )
                    # Megatron-core: tp, pp, cp, ep with the distributed optimizer
                    for pp in pp_choices(rest, m.num_layers) if gpu else ():
                        for cp in _powers_dividing(rest // pp, 8 if long_ctx else 2):  # the cost decides
                            dp = rest // pp // cp
                            # experts spread over tp·dp·cp ranks (expert tensor parallelism 1, as Megatron's MoE recipes)
                            eps = [e for e in _powers_dividing(tp * dp * cp, 64) if m.num_experts % e == 0] if m.is_moe else [1]
                            for ep in eps:
                                for off_o in (False, True):
                                    out.append(
                                        _layout(
                                            dp=dp,
                                            tp=tp,
                                            pp=pp,
                                            cp=cp,
                                            ep=ep,
                                            backend="megatron",
                                            offload_optimizer=off_o,
                                            activation_checkpointing=ckpt,
                                            micro_batch=mb,
                                        )
                                    )
        out = self._budgeted(u, out, pin.micro_tokens, pin.share_prompts, pin.pack_sequences)
        return [lay for lay in out if pin.allows(lay) and self.pins.within_limits(lay)]

    def _budgeted(
        self, u: Unit, layouts: list[Layout], pinned: int | None, share: bool | None = None, pack: bool | None = None
    ) -> list[Layout]:
        """Token budgets for the micro-batches wherever the backend runs them: ``micro_batch``
        rows of the workload's longest length (what memory is priced at), so shorter rows
        share a micro-batch and are binned by length. Megatron's pipeline schedule pads every
        micro-batch to one shape, so with pp > 1 micro-batches stay rows. A pinned budget
        (``micro_tokens``) fixes it; a pinned 0 keeps row micro-batches.

        Shared prompts wherever fsdp2 runs rows that share a prompt without recomputing
        activations (the runtime shares only in a micro-batch where it pays, and the cost
        model prices the same choice); ``share`` pinned fixes it. Packed rows (no padding)
        wherever fsdp2 runs them; ``pack`` pinned fixes it."""
        dem = self.demand[u.update_op or u.ops[-1]]
        longest = dem.prompt_len + dem.response_len
        out = []
        if share and dem.group < 2:
            raise SpecError(
                f"{u.role}: share_prompts is pinned, but the rows its {u.name} ops read do not share prompts (one sample per prompt)",
                fix=f"drop the pin {u.role}.PHASE.share_prompts=true",
            )
        for lay in layouts:
            packs = lay.backend == "fsdp2" and pack is not False
            # packed lines compute a shared prompt in the same pass, recomputation or not (the KV-cache sharing cannot)
            can = lay.backend == "fsdp2" and (packs or not lay.activation_checkpointing) and dem.group > 1
            lay = lay.model_copy(update={"share_prompts": can if share is None else share and can, "pack_sequences": packs})
            if lay.backend == "megatron" and lay.pp > 1:
                budget = 0
            elif pinned is not None:
                budget = pinned
                if pinned:  # the rows of the longest length the pinned budget holds
                    lay = lay.model_copy(update={"micro_batch": max(1, pinned // (longest // lay.cp or 1))})
            else:
                budget = lay.micro_batch * max(longest // lay.cp, 1)
            out.append(lay.model_copy(update={"micro_tokens": budget}))
        return list(dict.fromkeys(out))  # a pinned budget maps every micro-batch to the same layout

    def _forward_layouts(self, u: Unit, m: ModelSpec, d: int) -> list[Layout]:
        out: list[Layout] = []
        mbs = (self.workload.forward_micro_batch,) if self.workload.forward_micro_batch else MICRO_BATCHES
        gpu = self.hw.kind == "gpu"
        long_ctx = self.demand[u.ops[-1]].seq_len >= 8192
        for tp in tp_choices(m, d, self.hw):
            rest = d // tp
            for mb in mbs:
                for off in (False, True) if gpu else (False,):
                    out.append(_layout(dp=rest, tp=tp, backend="fsdp2", fsdp=True, offload_params=off, micro_batch=mb))
                out.append(_layout(dp=rest, tp=tp, backend="fsdp2", fsdp=False, micro_batch=mb))  # replicated weights
                for pp in pp_choices(rest, m.num_layers) if gpu else ():
                    for cp in _powers_dividing(rest // pp, 8 if long_ctx else 2):
                        dp = rest // pp // cp
                        eps = [e for e in _powers_dividing(tp * dp * cp, 64) if m.num_experts % e == 0] if m.is_moe else [1]
                        for ep in eps:
                            for off in (False, True):  # offload: weights swapped in for the op, host memory between ops
                                out.append(
                                    _layout(
                                        dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, backend="megatron", offload_params=off, micro_batch=mb
                                    )
                                )
        fpin = self.pins.phase(u.role, "forward")
        out = self._budgeted(u, out, fpin.micro_tokens, fpin.share_prompts, fpin.pack_sequences)
        return [lay for lay in out if self.pins.allows(u.role, "forward", lay)]

    def generation_refusal(self, u: Unit, d: int) -> str:
        """The constraint a pinned generation layout fails on ``d`` devices (what
        :meth:`generation_layouts` found nothing for), named."""
        m = self.models[u.role]
        pin = self.pins.phase(u.role, "generate")
        backend = pin.backend or self.rollout_backends[0]
        tp, pp = pin.tp or 1, pin.pp or 1
        if pin.tp is not None and (why := tp_refusal(m, d, tp, self.hw, across_nodes=True)):
            return why
        if d % (tp * pp):
            return f"tp·pp = {tp * pp} does not divide the {d} devices"
        if pp > 1 and m.num_layers // pp < 1:
            return f"pp={pp} is more stages than {m.name}'s {m.num_layers} layers"
        if pin.ep not in (None, 1) and (not m.is_moe or pin.ep != tp):
            return f"ep={pin.ep}: a generation engine splits experts over its tp ranks (ep = tp) or not at all (ep = 1)"
        lay = _layout(dp=max(d // (tp * pp), 1), tp=tp, pp=pp, ep=pin.ep or 1, backend=backend)
        need = generation_weights_gb(m, lay)
        if need >= self.capacity_gb:
            return f"its weight shard needs {need:.1f} GB per device, of {self.capacity_gb:.1f} GB"
        if not self.pins.within_limits(lay):
            return f"the runtime's {backend} backend does not run {lay.short()}"
        return "no layout the pins allow fits"

    def multi_turn(self, u: Unit) -> bool:
        """Whether the unit runs a multi-turn generate (``generate(env=…)``)."""
        return any(self.demand[op].agent for op in u.ops if op in self.demand)

    def generation_layouts(self, u: Unit, d: int) -> list[Layout]:
        """Generation layouts whose weight shard fits a device, with each rollout backend the
        target offers (or the one pinned): the cost model prices them apart."""
        m = self.models[u.role]
        pin = self.pins.phase(u.role, "generate")
        out: list[Layout] = []
        # a multi-turn generate runs on single-rank replicas: a tensor- or pipeline-parallel replica's ranks would
        # each run their own environments (runtime.agent); its model must fit one device
        agent = self.multi_turn(u)
        for backend in (pin.backend,) if pin.backend else self.rollout_backends:
            # within a node first; over nodes only for models whose weights need more than a node's tp group
            tps = [1] if agent and pin.tp is None else tp_choices(m, d, self.hw)
            widest = generation_weights_gb(m, _layout(tp=max(tps or [1]), backend=backend))
            if not agent and (pin.tp is not None or widest > 0.5 * self.capacity_gb):
                tps = tp_choices(m, d, self.hw, across_nodes=True)
            for tp in tps:
                for pp in [1] if agent and pin.pp is None else _powers_dividing(d // tp, 16):
                    eps = [1, tp] if (m.is_moe and tp > 1) else [1]
                    for ep in eps:
                        lay = _layout(dp=d // tp // pp, tp=tp, pp=pp, ep=ep, backend=backend)
                        if pp > 1 and generation_weights_gb(m, lay.model_copy(update={"pp": 1})) < 0.5 * self.capacity_gb:
                            continue  # pipeline generation only for models too large for one tp group
                        if generation_weights_gb(m, lay) < self.capacity_gb and self.pins.allows(u.role, "generate", lay):
                            out.append(lay)
        return out

    # -------------------------------------------------------------- options
    @cache  # noqa: B019 - the table lives for one planning run
    def options(self, unit: str, d: int) -> UnitOptions:
        u = self.units[unit]
        if u.generates:
            return UnitOptions(front=[])
        m = self.models[u.role]
        logits = u.kind in ("policy", "reference")
        layouts = self._train_layouts(u, m, d) if u.trainable else self._forward_layouts(u, m, d)
        if not (self.workload.train_micro_batch if u.trainable else self.workload.forward_micro_batch):
            layouts = [lay for lay in layouts if self._micro_batch_useful(u, lay)]
        price = self._trained if u.trainable else self._frozen

        # Device memory grows with the micro-batch and nothing else in a layout changes with it, so
        # once a layout misses the device at micro-batch m it misses at every larger one: price the
        # micro-batches in ascending order and stop a layout at its first miss.
        chains: dict[tuple, list[Layout]] = {}
        for lay in sorted(layouts, key=lambda lay: lay.micro_batch):
            chains.setdefault(tuple(v for k, v in lay.__dict__.items() if k not in MICRO_FIELDS), []).append(lay)
        priced: list[UnitOption] = []
        misses: list[tuple[list[Layout], int, UnitOption]] = []  # (chain, index of its first miss, its price)
        for chain in chains.values():
            for i, lay in enumerate(chain):
                o = price(u, m, lay, d, logits)
                priced.append(o)
                if o.need_gb > self.capacity_gb:
                    misses.append((chain, i, o))
                    break
        fits = [o for o in priced if o.fits_alone]
        front = pareto(fits)
        over = [o for o in priced if not o.fits_alone]
        oom = None
        if over and not fits:
            # Nothing fits: the nearest miss shows the shortfall; among equally near ones, the smallest
            # device need, then the fastest.
            # A larger micro-batch can need exactly as much (the pipeline holds as many sequences
            # in flight), so each chain is followed while its need does not grow.
            for chain, i, first in misses:
                for lay in chain[i + 1 :]:
                    o = price(u, m, lay, d, logits)
                    if o.need_gb > first.need_gb:
                        break
                    over.append(o)
            oom = min(over, key=lambda o: (self.shortfall(o), o.need_gb, o.time))
        elif over:
            # The nearest miss among the layouts that would have been faster. A chain's misses only
            # grow with the micro-batch, so its candidates are the first miss faster than the front
            # and the ones after it that need no more.
            best = front[0].time
            for chain, i, first in misses:
                found = first if first.time < best else None
                for lay in chain[i + 1 :]:
                    o = price(u, m, lay, d, logits)
                    if found is not None and o.need_gb > found.need_gb:
                        break
                    over.append(o)
                    if found is None and o.time < best:
                        found = o
            faster = [o for o in over if o.time < best]
            if faster:
                oom = min(faster, key=lambda o: (o.need_gb, o.time))
        return UnitOptions(front=front, oom=oom)

    def _micro_batch_useful(self, u: Unit, lay: Layout) -> bool:
        """False when half this micro-batch already holds every sequence a replica has (same time, more memory)."""
        if lay.micro_batch == 1:
            return True
        most = max(
            replica_sequences(self.demand[op], lay, train=kind == "update") for op, kind in zip(u.ops, u.kinds, strict=True)
        )
        return lay.micro_batch // 2 < most

    def _trained(self, u: Unit, m: ModelSpec, lay: Layout, d: int, logits: bool) -> UnitOption:
        costs: dict[str, PhaseCost] = {}
        for op, kind in zip(u.ops, u.kinds, strict=True):
            dem = self.demand[op]
            if kind == "update":
                costs[op] = train_cost(m, lay, dem, self.hw, logits=logits)
            else:
                costs[op] = forward_cost(m, lay, dem, self.hw, logits=logits, frozen=False)
        resident = costs[u.update_op].resident_gb
        transient = max(c.memory.total - c.resident_gb for c in costs.values())
        lay = _sharing(lay, costs, self.pins.phase(u.role, "train"))
        return self._option(u, d, {"train": lay, "forward": lay}, costs, resident, transient)

    def _frozen(self, u: Unit, m: ModelSpec, lay: Layout, d: int, logits: bool) -> UnitOption:
        costs = {op: forward_cost(m, lay, self.demand[op], self.hw, logits=logits, frozen=True) for op in u.ops}
        lay = _sharing(lay, costs, self.pins.phase(u.role, "forward"))
        resident = max(c.resident_gb for c in costs.values())
        transient = max(c.memory.total - c.resident_gb for c in costs.values())
        return self._option(u, d, {"forward": lay}, costs, resident, transient)

    def shortfall(self, o: UnitOption) -> float:
        """How far an option is from fitting (GB over device or host capacity)."""
        return max(o.need_gb - self.capacity_gb, o.host_gb - self.hw.host_per_device_gb)

    def _option(
        self, u: Unit, d: int, lays: dict[str, Layout], costs: dict[str, PhaseCost], resident: float, transient: float
    ) -> UnitOption:
        need = resident + transient
        host = max(c.host_gb for c in costs.values())
        return UnitOption(
            unit=u.name,
            devices=d,
            layouts=lays,
            op_costs=costs,
            resident_gb=resident,
            transient_gb=transient,
            time=sum(c.time for c in costs.values()),
            fits_alone=need <= self.capacity_gb and host <= self.hw.host_per_device_gb + 1e-9,
            need_gb=need,
            host_gb=host,
        )


def _sharing(lay: Layout, costs: dict[str, PhaseCost], pin: PhasePin) -> Layout:
    """``lay`` sharing prompts only where the cost model found that it pays in one of its ops (the
    plan then says what it does: a layout that may share but never would shows it does not),
    or where the pins ask for it (the runtime still shares only in micro-batches where it pays).
    Packing stays wherever the backend packs: it costs nothing where a micro-batch has no
    padding (the runtime packs only those that have), and responses that end before the limit
    leave padding whether or not the workload says how long they are."""
    if lay.share_prompts and not pin.share_prompts and not any(c.detail.get("shared_prompts", 0.0) > 0 for c in costs.values()):
        return lay.model_copy(update={"share_prompts": False})
    return lay
