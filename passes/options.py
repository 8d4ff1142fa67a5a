"""Candidate layouts of each placement unit on a given number of devices.

For a unit and a device count the enumerator tries every layout the backends
support (degrees, FSDP sharding, activation checkpointing, offload,
micro-batch), prices each with the cost model, and keeps the Pareto front of
(resident memory, transient memory, time): the options worth trying when the
unit shares devices with others. The fastest option that does not fit is kept
too, to say why the planner did not take it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

from flowc.errors import SpecError
from flowc.ir.models import ModelSpec
from flowc.ir.plan import Layout
from flowc.ir.workload import WorkloadSpec
from flowc.passes.costs import GB, Hw, PhaseCost, params_per_device, replica_sequences, train_state_gb
from flowc.passes.degrees import (
    LAYOUT_DEFAULTS,
    powers_dividing,
    pp_choices,
    tp_choices,
    tp_refusal,
    unchecked_layout,
    unchecked_with,
)
from flowc.passes.flops import Demand
from flowc.passes.fronts import UnitOption, UnitOptions, pareto
from flowc.passes.generation_costs import generation_weights_gb, takes_device_share
from flowc.passes.pins import PhasePin, Pins
from flowc.passes.train_costs import forward_cost, train_cost
from flowc.passes.units import Unit

MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MICRO_FIELDS = ("micro_batch", "micro_tokens")  # what grows a layout's memory along one chain


@dataclass
class _Scan:
    """A unit's layouts on some devices as :meth:`OptionTable._scan` priced them."""

    price: Callable[[Layout], UnitOption]
    priced: list[UnitOption] = field(default_factory=list)
    misses: list[tuple[list[Layout], int, UnitOption]] = field(
        default_factory=list
    )  # (chain, index of its first miss, its price)
    hopeless: list[tuple[float, list[Layout]]] = field(default_factory=list)  # (resident state, chain), ascending


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
        out: list[dict] = []  # the fields each layout sets; _budgeted makes them Layouts
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
                            dict(
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
                    out.append(dict(dp=rest, tp=tp, backend="fsdp2", fsdp=False, activation_checkpointing=ckpt, micro_batch=mb))
                    # Megatron-core: tp, pp, cp, ep with the distributed optimizer
                    for pp in pp_choices(rest, m.num_layers) if gpu else ():
                        for cp in powers_dividing(rest // pp, 8 if long_ctx else 2):  # the cost decides
                            dp = rest // pp // cp
                            # experts spread over tp·dp·cp ranks (expert tensor parallelism 1, as Megatron's MoE recipes)
                            eps = [e for e in powers_dividing(tp * dp * cp, 64) if m.num_experts % e == 0] if m.is_moe else [1]
                            for ep in eps:
                                for off_o in (False, True):
                                    out.append(
                                        dict(
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
        lays = self._budgeted(u, out, pin.micro_tokens, pin.share_prompts, pin.pack_sequences)
        return [lay for lay in lays if pin.allows(lay) and self.pins.within_limits(lay)]

    def _budgeted(
        self, u: Unit, layouts: list[dict], pinned: int | None, share: bool | None = None, pack: bool | None = None
    ) -> list[Layout]:
        """Token budgets for the micro-batches wherever the backend runs them: ``micro_batch``
        rows of the workload's longest length (what memory is priced at), so shorter rows
        share a micro-batch and are binned by length. Megatron's pipeline schedule pads every
        micro-batch to one shape, so with pp > 1 micro-batches stay rows. A pinned budget
        (``micro_tokens``) fixes it; a pinned 0 keeps row micro-batches.

        Shared prompts wherever fsdp2 runs rows that share a prompt without recomputing
        activations (the runtime shares only in a micro-batch where it pays, and the cost
        model prices the same choice); ``share`` pinned fixes it. Packed rows (no padding)
        wherever fsdp2 runs them; ``pack`` pinned fixes it.

        ``layouts`` are the fields the enumerators set (the rest at their defaults). A micro-batch
        larger than a replica's sequences can use is dropped here, before its layout is built
        (:meth:`micro_batch_useful`), unless the workload fixes the micro-batch."""
        dem = self.demand[u.update_op or u.ops[-1]]
        longest = dem.prompt_len + dem.response_len
        out = []
        if share and dem.group < 2:
            raise SpecError(
                f"{u.role}: share_prompts is pinned, but the rows its {u.name} ops read do not share prompts (one sample per prompt)",
                fix=f"drop the pin {u.role}.PHASE.share_prompts=true",
            )
        fixed = self.workload.train_micro_batch if u.trainable else self.workload.forward_micro_batch
        useful: dict[tuple[int, int], bool] = {}
        for raw in layouts:
            lay = {**LAYOUT_DEFAULTS, **raw}
            fsdp2, cp = lay["backend"] == "fsdp2", lay["cp"]
            packs = fsdp2 and pack is not False
            # packed lines compute a shared prompt in the same pass, recomputation or not (the KV-cache sharing cannot)
            can = fsdp2 and (packs or not lay["activation_checkpointing"]) and dem.group > 1
            mb = lay["micro_batch"]
            if lay["backend"] == "megatron" and lay["pp"] > 1:
                budget = 0
            elif pinned is not None:
                budget = pinned
                if pinned:  # the rows of the longest length the pinned budget holds
                    mb = max(1, pinned // (longest // cp or 1))
            else:
                budget = mb * max(longest // cp, 1)
            if not fixed:
                key = (lay["dp"], mb)
                if key not in useful:
                    useful[key] = self.micro_batch_useful(u, *key)
                if not useful[key]:
                    continue
            lay.update(
                share_prompts=can if share is None else share and can, pack_sequences=packs, micro_batch=mb, micro_tokens=budget
            )
            out.append(unchecked_layout(**lay))
        return list(dict.fromkeys(out))  # a pinned budget maps every micro-batch to the same layout

    def _forward_layouts(self, u: Unit, m: ModelSpec, d: int) -> list[Layout]:
        out: list[dict] = []  # the fields each layout sets; _budgeted makes them Layouts
        mbs = (self.workload.forward_micro_batch,) if self.workload.forward_micro_batch else MICRO_BATCHES
        gpu = self.hw.kind == "gpu"
        long_ctx = self.demand[u.ops[-1]].seq_len >= 8192
        for tp in tp_choices(m, d, self.hw):
            rest = d // tp
            for mb in mbs:
                for off in (False, True) if gpu else (False,):
                    out.append(dict(dp=rest, tp=tp, backend="fsdp2", fsdp=True, offload_params=off, micro_batch=mb))
                out.append(dict(dp=rest, tp=tp, backend="fsdp2", fsdp=False, micro_batch=mb))  # replicated weights
                for pp in pp_choices(rest, m.num_layers) if gpu else ():
                    for cp in powers_dividing(rest // pp, 8 if long_ctx else 2):
                        dp = rest // pp // cp
                        eps = [e for e in powers_dividing(tp * dp * cp, 64) if m.num_experts % e == 0] if m.is_moe else [1]
                        for ep in eps:
                            for off in (False, True):  # offload: weights swapped in for the op, host memory between ops
                                out.append(
                                    dict(
                                        dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, backend="megatron", offload_params=off, micro_batch=mb
                                    )
                                )
        fpin = self.pins.phase(u.role, "forward")
        lays = self._budgeted(u, out, fpin.micro_tokens, fpin.share_prompts, fpin.pack_sequences)
        return [lay for lay in lays if self.pins.allows(u.role, "forward", lay)]

    def generation_refusal(self, u: Unit, d: int) -> str:
        """The constraint a pinned generation layout fails on ``d`` devices (what
        :meth:`generation_layouts` found nothing for), named."""
        m = self.models[u.role]
        pin = self.pins.phase(u.role, "generate")
        backend = pin.backend or self.rollout_backends[0]
        if pin.gpu_memory_utilization is not None and not any(
            takes_device_share(b, self.hw.kind) for b in ((pin.backend,) if pin.backend else self.rollout_backends)
        ):
            engine = (
                "vLLM on CPUs is given its KV cache in bytes"
                if backend == "vllm"
                else f"the {backend} engine allocates as it goes"
            )
            fix = f", or pin {u.role}.generate.backend=vllm" if self.hw.kind == "gpu" and "vllm" in self.rollout_backends else ""
            return (
                f"gpu_memory_utilization={pin.gpu_memory_utilization:g} is the share of each GPU a vLLM engine takes, "
                f"and {engine}: drop the pin{fix}"
            )
        tp, pp = pin.tp or 1, pin.pp or 1
        if pin.tp is not None and (why := tp_refusal(m, d, tp, self.hw, across_nodes=True)):
            return why
        if d % (tp * pp):
            return f"tp·pp = {tp * pp} does not divide the {d} devices"
        if pp > 1 and m.num_layers // pp < 1:
            return f"pp={pp} is more stages than {m.name}'s {m.num_layers} layers"
        if pin.ep not in (None, 1) and (not m.is_moe or pin.ep != tp):
            return f"ep={pin.ep}: a generation engine splits experts over its tp ranks (ep = tp) or not at all (ep = 1)"
        lay = unchecked_layout(dp=max(d // (tp * pp), 1), tp=tp, pp=pp, ep=pin.ep or 1, backend=backend)
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
            if pin.gpu_memory_utilization is not None and not takes_device_share(backend, self.hw.kind):
                continue  # a pinned share of the device, for an engine that takes none (generation_refusal says so)
            # within a node first; over nodes only for models whose weights need more than a node's tp group
            tps = [1] if agent and pin.tp is None else tp_choices(m, d, self.hw)
            widest = generation_weights_gb(m, unchecked_layout(tp=max(tps or [1]), backend=backend))
            if not agent and (pin.tp is not None or widest > 0.5 * self.capacity_gb):
                tps = tp_choices(m, d, self.hw, across_nodes=True)
            for tp in tps:
                for pp in [1] if agent and pin.pp is None else powers_dividing(d // tp, 16):
                    eps = [1, tp] if (m.is_moe and tp > 1) else [1]
                    for ep in eps:
                        lay = unchecked_layout(dp=d // tp // pp, tp=tp, pp=pp, ep=ep, backend=backend)
                        if pp > 1 and generation_weights_gb(m, unchecked_with(lay, pp=1)) < 0.5 * self.capacity_gb:
                            continue  # pipeline generation only for models too large for one tp group
                        if generation_weights_gb(m, lay) < self.capacity_gb and self.pins.allows(u.role, "generate", lay):
                            out.append(lay)
        return out

    # -------------------------------------------------------------- options
    @cache  # noqa: B019 - the table lives for one planning run
    def options(self, unit: str, d: int) -> UnitOptions:
        """The unit's Pareto front of layouts that fit ``d`` devices; when none fits, the nearest
        miss as ``oom`` (what the refusal shows). The nearest *faster* miss beside a front, which
        only an explanation shows, is :meth:`faster_miss`, found on demand."""
        scan = self._scan(unit, d)
        if scan is None:
            return UnitOptions(front=[])
        fits = [o for o in scan.priced if o.fits_alone]
        if fits:
            return UnitOptions(front=pareto(fits))
        return UnitOptions(front=[], oom=self._nearest_miss(scan))

    @cache  # noqa: B019 - the table lives for one planning run
    def faster_miss(self, unit: str, d: int) -> UnitOption | None:
        """A layout faster than the unit's fastest that fits, which misses the device by the least
        (its need, then its time); or, when nothing fits, the nearest miss. ``None``: no faster
        layout exists, or the unit generates."""
        opts = self.options(unit, d)
        if not opts.front:
            return opts.oom
        scan = self._scan(unit, d)
        assert scan is not None
        return self._nearest_faster_miss(scan, opts.front[0].time)

    def _scan(self, unit: str, d: int) -> _Scan | None:
        """Every layout chain's micro-batches priced in ascending order up to its first miss, except
        the chains whose resident state alone exceeds the device (``hopeless``: they never fit, and
        only a nearest miss can be among them)."""
        u = self.units[unit]
        if u.generates:
            return None
        m = self.models[u.role]
        logits = u.kind in ("policy", "reference")
        layouts = self._train_layouts(u, m, d) if u.trainable else self._forward_layouts(u, m, d)
        raw = self._trained if u.trainable else self._frozen

        def price(lay: Layout) -> UnitOption:
            return raw(u, m, lay, d, logits)

        # Device memory grows with the micro-batch and nothing else in a layout changes with it, so
        # once a layout misses the device at micro-batch m it misses at every larger one: price the
        # micro-batches in ascending order and stop a layout at its first miss.
        chains: dict[tuple, list[Layout]] = {}
        rest = [k for k in LAYOUT_DEFAULTS if k not in MICRO_FIELDS]
        for lay in sorted(layouts, key=lambda lay: lay.micro_batch):
            f = lay.__dict__
            chains.setdefault(tuple([f[k] for k in rest]), []).append(lay)
        scan = _Scan(price)
        # At cluster scale most chains hold a resident state larger than the device (a 70B role's
        # replicated or unsharded states): pricing them took most of the search, for nothing but
        # the explanation's nearest miss.
        for chain in chains.values():
            floor = self._resident_floor(u, m, chain[0])
            if floor > self.capacity_gb:
                scan.hopeless.append((floor, chain))
                continue
            for i, lay in enumerate(chain):
                o = price(lay)
                scan.priced.append(o)
                if o.need_gb > self.capacity_gb:
                    scan.misses.append((chain, i, o))
                    break
        scan.hopeless.sort(key=lambda h: h[0])
        return scan

    def _nearest_miss(self, scan: _Scan) -> UnitOption | None:
        """Nothing fits: the nearest miss shows the shortfall; among equally near ones, the smallest
        device need, then the fastest. A larger micro-batch can need exactly as much (the pipeline
        holds as many sequences in flight), so each chain is followed while its need does not grow.
        A chain's need, and so its shortfall, never shrinks along it, and a hopeless chain's is at
        least its state's excess: chains are taken nearest first and stop beyond the nearest found."""
        over = [o for o in scan.priced if not o.fits_alone]

        def follow(chain: list[Layout], i: int, first: UnitOption) -> None:
            for lay in chain[i + 1 :]:
                o = scan.price(lay)
                if o.need_gb > first.need_gb:
                    break
                over.append(o)

        # (what a chain follows on has its first miss's need and host state: the same shortfall)
        nearest = min((self.shortfall(o) for o in over), default=math.inf)
        for chain, i, first in sorted(scan.misses, key=lambda x: self.shortfall(x[2])):
            if self.shortfall(first) > nearest:
                break
            follow(chain, i, first)
        for floor, chain in scan.hopeless:
            if floor - self.capacity_gb > nearest:
                break
            first = scan.price(chain[0])
            over.append(first)
            nearest = min(nearest, self.shortfall(first))
            follow(chain, 0, first)
        return min(over, key=lambda o: (self.shortfall(o), o.need_gb, o.time)) if over else None

    def _nearest_faster_miss(self, scan: _Scan, best: float) -> UnitOption | None:
        """The nearest miss among the layouts faster than ``best``. A chain's misses only grow with
        the micro-batch, so its candidates are the first miss faster than ``best`` and the ones after
        it that need no more; chains are taken nearest first, and stop once one starts beyond the
        nearest faster miss found."""
        over = [o for o in scan.priced if not o.fits_alone]
        nearest_gb = min((o.need_gb for o in over if o.time < best), default=math.inf)

        def nearest(chain: list[Layout], i: int, first: UnitOption) -> None:
            nonlocal nearest_gb
            found = first if first.time < best else None
            for lay in chain[i + 1 :]:
                o = scan.price(lay)
                if found is not None and o.need_gb > found.need_gb:
                    break
                over.append(o)
                if o.time < best:
                    nearest_gb = min(nearest_gb, o.need_gb)
                    found = found or o

        for chain, i, first in sorted(scan.misses, key=lambda x: x[2].need_gb):
            if first.need_gb > nearest_gb:
                break
            nearest(chain, i, first)
        for floor, chain in scan.hopeless:
            if floor > nearest_gb:
                break
            first = scan.price(chain[0])
            over.append(first)
            if first.time < best:
                nearest_gb = min(nearest_gb, first.need_gb)
            nearest(chain, 0, first)
        faster = [o for o in over if o.time < best]
        return min(faster, key=lambda o: (o.need_gb, o.time)) if faster else None

    def _resident_floor(self, u: Unit, m: ModelSpec, lay: Layout) -> float:
        """GB per device that every micro-batch of ``lay`` keeps resident: what its priced option's
        ``resident_gb`` is, without pricing it (the training state, or a frozen role's weights)."""
        if u.trainable:
            return sum(train_state_gb(m, lay))
        return 0.0 if lay.offload_params else m.bytes_per_param * params_per_device(m, lay).total / GB

    def micro_batch_useful(self, u: Unit, dp: int, micro_batch: int) -> bool:
        """False when half this micro-batch already holds every sequence a replica of ``dp`` has
        (same time, more memory)."""
        if micro_batch == 1:
            return True
        replica = unchecked_layout(dp=dp)
        most = max(
            replica_sequences(self.demand[op], replica, train=kind == "update") for op, kind in zip(u.ops, u.kinds, strict=True)
        )
        return micro_batch // 2 < most

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
        return unchecked_with(lay, share_prompts=False)
    return lay
