"""The analytic cost model's foundations: the hardware's achieved rates, collectives, parameters
and memory per device, and the record of one role's cost in one phase.

The time of a phase is priced in :mod:`flowc.passes.train_costs` (update and forward ops) and
:mod:`flowc.passes.generation_costs` (generate). Every function is pure: (model, layout, demand,
hardware) → numbers.
Formulas are written out in docs/planner.md; the hardware's achieved
fractions (``efficiency``) are calibrated there against published runs.

Units: bytes, seconds, FLOP/s. ``Hw`` holds the achieved bandwidths (peak ×
efficiency) so the formulas below read as "bytes / bandwidth".
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, make_dataclass
from typing import NamedTuple

from flowc.ir.cluster import ClusterSpec
from flowc.ir.hardware import Efficiency, RolloutCost
from flowc.ir.models import ModelSpec
from flowc.ir.plan import Layout, Memory
from flowc.passes.flops import Demand

GB = 1e9
ACT_BYTES_PER_TOKEN_HIDDEN = 34.0  # Korthikanti et al. 2022, per layer, bf16, with flash attention and sequence parallelism
CKPT_BYTES_PER_TOKEN_HIDDEN = 2.0  # a checkpointed layer keeps only its bf16 input
CPU_ADAM_PARAMS_PER_S = 1.0e9  # host-side Adam throughput per device share (assumption, see docs/planner.md)
FIXED_BUFFERS_GB = {"gpu": 1.0, "cpu": 0.1}  # CUDA graphs / NCCL / sampler workspaces


@dataclass(frozen=True)
class Hw:
    """Achieved rates of one device of a cluster."""

    kind: str
    peak: float  # FLOP/s (peak, before efficiency)
    hbm: float  # B/s, peak
    intra: float  # B/s per device per direction, achieved
    inter: float  # B/s per device (share of the node's network), achieved
    node: int
    capacity: float  # usable bytes per device
    latency: float  # s per collective
    layer_overhead: float  # s per layer per decode step
    host: float  # B/s host link
    half_width: float  # GEMM width at half efficiency
    half_tokens: float  # GEMM token count at half efficiency
    overlap: float  # fraction of data-parallel communication hidden under compute
    eff: Efficiency
    nodes: int = 1
    host_per_device_gb: float = 0.0  # host memory offloaded states may use, per device
    reload_fixed: float = 0.0  # s per sync into a live vLLM engine, beyond moving the bytes
    reload_bw: float = math.inf  # B/s of that reload
    pool_bw: float = 0.0  # B/s per device for data moving between pools (the network across nodes, else NVLink)
    controller_bw: float = 0.0  # B/s between the controller and a pool
    rollout: tuple[tuple[str, RolloutCost], ...] = ()  # per rollout backend, beyond the shared model (hashable)
    process_gb: float = 0.0  # a CPU worker process's own resident memory, in every phase's buffers

    def rollout_cost(self, backend: str) -> RolloutCost:
        """What ``backend`` costs here beyond the shared model (nothing, where not profiled)."""
        return dict(self.rollout).get(backend) or RolloutCost()

    def engine_reload(self, backend: str, nbytes: float) -> float:
        """Seconds a rollout engine spends taking ``nbytes`` of synced weights in (vLLM only)."""
        return self.reload_fixed + nbytes / self.reload_bw if backend == "vllm" else 0.0

    @classmethod
    def of(cls, cluster: ClusterSpec, dtype: str = "bfloat16") -> Hw:
        """The achieved rates of ``cluster``'s devices computing in ``dtype``."""
        p = cluster.profile
        intra = p.intra_node_gb_s * GB * p.efficiency.intra_node
        inter = p.inter_node_gb_s * GB / p.devices_per_node * p.efficiency.inter_node
        return cls(
            kind=p.kind,
            peak=p.tflops(dtype) * 1e12,
            hbm=p.mem_bw_tb_s * 1e12,
            intra=intra,
            inter=inter,
            node=cluster.devices_per_node,
            capacity=p.usable_bytes,
            latency=p.latency_us * 1e-6,
            layer_overhead=p.layer_overhead_us * 1e-6,
            host=p.host_link_gb_s * GB,
            half_width=p.gemm_half_width,
            half_tokens=p.gemm_half_tokens,
            overlap=p.comm_overlap,
            eff=p.efficiency,
            nodes=cluster.nodes,
            host_per_device_gb=0.8 * p.host_memory_gb / p.devices_per_node,
            reload_fixed=p.engine_reload_ms * 1e-3,
            reload_bw=p.engine_reload_gb_s * GB if p.engine_reload_gb_s else math.inf,
            pool_bw=inter if cluster.nodes > 1 else intra,
            controller_bw=p.inter_node_gb_s * GB * p.efficiency.inter_node,
            rollout=tuple(sorted(p.rollout.items())),
            process_gb=p.process_gb,
        )

    def link(self, group: int, stride: int = 1) -> float:
        """Bandwidth of a collective over ``group`` devices spaced ``stride`` apart."""
        if group <= 1:
            return math.inf
        return self.intra if group * stride <= self.node else min(self.intra, self.inter)


def allreduce_time(nbytes: float, group: int, bw: float, lat: float) -> float:
    """Ring all-reduce: 2(g-1)/g × bytes over the link, plus latency."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    return 2.0 * (group - 1) / group * nbytes / bw + 2.0 * (group - 1) * lat


def gather_time(nbytes: float, group: int, bw: float, lat: float) -> float:
    """All-gather or reduce-scatter of a tensor of ``nbytes`` (full size)."""
    if group <= 1 or nbytes <= 0:
        return 0.0
    return (group - 1) / group * nbytes / bw + (group - 1) * lat


def shape_efficiency(tokens_per_micro: float | None, width: float, hw: Hw | None = None) -> float:
    """GEMMs on few tokens or narrow shards run below the calibrated rate:
    a saturating factor in the micro-batch tokens and the per-device width
    (half rate at the profile's ``gemm_half_tokens`` / ``gemm_half_width``);
    ``tokens_per_micro`` None: the width's factor alone."""
    ht, hw_ = (hw.half_tokens, hw.half_width) if hw is not None else (64.0, 256.0)
    tokens = 1.0 if tokens_per_micro is None else tokens_per_micro / (tokens_per_micro + ht)
    return tokens * (width / (width + hw_))


# ------------------------------------------------------------------ params
class ParamSplit(NamedTuple):
    """Parameters per device of a layout (dense part over tp·pp, experts over ep·pp). A tuple:
    the planner builds one for every cost it prices (hundreds of thousands per search)."""

    dense: float
    expert: float

    @property
    def total(self) -> float:
        return self.dense + self.expert


def params_per_device(m: ModelSpec, lay: Layout, *, sharded_over_dp: bool | None = None, every_stage: bool = False) -> ParamSplit:
    """Parameters the fullest device holds (before any dp sharding unless ``sharded_over_dp``):
    with a pipeline, a device of its largest stage (the embedding's or the LM head's,
    :meth:`ModelSpec.largest_stage`); ``every_stage``: the devices of one tensor-parallel rank
    across all the stages together (what a pipelined decode step reads, one stage after another)."""
    dense, experts = m.largest_stage(1 if every_stage else lay.pp)
    fsdp = lay.fsdp if sharded_over_dp is None else sharded_over_dp
    dp_shard = lay.dp * lay.cp if fsdp else 1
    ep = max(lay.ep, 1)
    if lay.backend in ("vllm", "hf"):
        exp_div = ep if ep > 1 else lay.tp
        return ParamSplit(dense / lay.tp, experts / exp_div)
    return ParamSplit(dense / (lay.tp * dp_shard), experts / (ep * (dp_shard if fsdp else 1)))


# ------------------------------------------------------------------ memory
def _memory_total(self) -> float:
    return sum(_MEMORY_VALUES(self))


def _memory_to_plan(self) -> Memory:
    return Memory(**{f: round(getattr(self, f), 4) for f in MEMORY_CATEGORIES})


MEMORY_CATEGORIES = tuple(Memory.model_fields)
_MEMORY_VALUES = operator.attrgetter(*MEMORY_CATEGORIES)
# GB per device by category while the cost model works: a plain record with the plan's Memory
# categories (it is built for every layout tried, so not a pydantic model); ``to_plan`` turns the
# chosen one into the plan's Memory.
MemoryGB = make_dataclass(
    "MemoryGB",
    [(f, float, field(default=0.0)) for f in MEMORY_CATEGORIES],
    frozen=True,
    slots=True,
    namespace={"total": property(_memory_total), "to_plan": _memory_to_plan},
)


def memory_gb(**kw: float) -> MemoryGB:
    return MemoryGB(**kw)


@dataclass(frozen=True)
class PhaseCost:
    """What one role costs in one phase with one layout."""

    time: float
    memory: MemoryGB  # GB per device; resident + this phase's transient
    resident_gb: float  # stays on the device while other phases run
    mfu: float = 0.0
    waves: int = 1
    detail: dict[str, float] = field(default_factory=dict)
    host_gb: float = 0.0  # offloaded state in host memory
    # a micro-batch's fixed cost (dispatch or launches, per-micro-batch collectives) in padded tokens
    # of its compute: where splitting a token budget's rows further saves more padding than this, it pays
    micro_overhead_tokens: float = 0.0
    # a generate's seconds over its mean at the quantiles of where a step's longest response falls
    # (``steady_period.longest_spread``): what makes one step's generate slower than another's
    spread: tuple[float, ...] = ()


def replica_sequences(d: Demand, lay: Layout, *, train: bool) -> float:
    """Sequences one data-parallel replica processes per pass (per optimizer update when ``train``)."""
    return d.sequences * d.passes / (d.updates if train else 1) / lay.dp


def padded_seq_len(d: Demand, lay: Layout, seqs_per_replica: float, *, unpacked: bool = False) -> float:
    """Mean tokens per sequence as the runtime pads them: each micro-batch is as wide as its
    longest row. Responses range up to ``R`` around their mean; a micro-batch of ``m`` rows
    taken in order is padded a share ``1 - 1/m`` of that spread, and a token budget (rows
    sorted by length, ``k`` micro-batches of similar lengths) a share ``(1 - 1/s)/k`` of
    it, where ``s`` is the replica's rows. With no mean given (every response at ``R``) there
    is no padding, and none when the layout packs its rows (``pack_sequences``; ``unpacked``:
    what the rows would compute padded, as a micro-batch that shares its prompts does)."""
    spread = d.response_len - d.mean_response_len
    s = max(seqs_per_replica, 1.0)
    if spread <= 0 or s <= 1 or (lay.pack_sequences and not unpacked):
        return d.seq_len
    if lay.micro_tokens:
        k = max(1, math.ceil(s * d.seq_len / lay.cp / lay.micro_tokens))
        share = (1.0 - 1.0 / s) / k
    else:
        share = 1.0 - 1.0 / min(float(lay.micro_batch), s)
    return d.seq_len + spread * share


def prompt_tokens_saved(d: Demand, lay: Layout, seqs_per_replica: float, micro_batches: int) -> float:
    """Prompt tokens per sequence that computing each distinct prompt once in a micro-batch
    saves (``share_prompts``): of a micro-batch's ``m`` rows, those beyond its distinct prompts.
    A replica's ``s`` rows hold ``s/g`` prompts of ``g`` rows each; a micro-batch's rows are cut
    by length, not by prompt, so a prompt is in it with the chance that any of its ``g`` rows
    is: ``1 − (1 − m/s)^g``. Packed (``pack_sequences``) the rows are cut by prompt, so a
    micro-batch holds ``m/g`` whole groups."""
    if not lay.share_prompts or d.group < 2:
        return 0.0
    s = max(seqs_per_replica, 1.0)
    m = s / max(micro_batches, 1)
    g = min(float(d.group), s)
    if lay.pack_sequences:  # packed micro-batches are cut by prompt: they hold whole groups
        return d.prompt_len * max(m - max(m / g, 1.0), 0.0) / m
    distinct = s / g * (1.0 - (1.0 - min(m / s, 1.0)) ** g)
    return d.prompt_len * max(m - distinct, 0.0) / m


def param_tensors(m: ModelSpec) -> int:
    """Parameter tensors of a decoder (q, k, v, o, three MLP matrices, two norms per layer; biases when present)."""
    per_layer = 9 + (3 if m.attention_bias else 0) + (2 if m.qk_norm else 0)
    return per_layer * m.num_layers + 2 + (0 if m.tie_word_embeddings else 1)


def expert_dp(lay: Layout) -> int:
    """Replicas of each expert shard: the tp·dp·cp ranks over the ep groups."""
    return max(lay.tp * lay.dp * lay.cp // max(lay.ep, 1), 1)


def trained_fraction(m: ModelSpec) -> float:
    """The share of a role's parameters that train: 1, or its LoRA adapters' share of the model."""
    return m.trained_params / m.params_total if m.lora is not None and m.lora.enabled else 1.0


def train_state_gb(m: ModelSpec, lay: Layout) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) GB per device of a trained role, after offload."""
    if m.lora is not None and m.lora.enabled:
        return _lora_state_gb(m, lay)
    if lay.fsdp:  # FSDP2 mixed precision: fp32 sharded params (master), fp32 grads, Adam m, v
        p = params_per_device(m, lay).total
        w, g, o = 4.0 * p, 4.0 * p, 8.0 * p
        if lay.offload_params:  # CPUOffloadPolicy: params, grads and optimizer live on the host
            return 0.0, 0.0, 0.0
    elif lay.backend == "fsdp2":  # replicated data parallelism (DDP): the whole fp32 state on every rank
        p = params_per_device(m, lay).total
        w, g, o = 4.0 * p, 4.0 * p, 8.0 * p
    else:  # Megatron: params in the compute dtype, fp32 grad buffer, distributed optimizer (fp32 master + m + v) over dp
        ps = params_per_device(m, lay)
        w, g = m.bytes_per_param * ps.total, 4.0 * ps.total
        o = 12.0 * (ps.dense / (lay.dp * lay.cp) + ps.expert / expert_dp(lay))
    if lay.offload_optimizer:
        o = 0.0
    return w / GB, g / GB, o / GB


def _lora_state_gb(m: ModelSpec, lay: Layout) -> tuple[float, float, float]:
    """LoRA: the frozen base holds weights only, in the compute dtype (it is never updated, so
    it needs no fp32 master copy); the adapters (sharded like the base) hold fp32 weights,
    fp32 gradients and Adam's two moments."""
    p = params_per_device(m, lay).total
    a = p * trained_fraction(m)
    if lay.fsdp and lay.offload_params:
        return 0.0, 0.0, 0.0
    w, g, o = m.bytes_per_param * (p - a) + 4.0 * a, 4.0 * a, 8.0 * a
    if lay.offload_optimizer:
        o = 0.0
    return w / GB, g / GB, o / GB


def host_state_gb(m: ModelSpec, lay: Layout) -> float:
    """GB per device of training state kept in host memory by offload."""
    p = params_per_device(m, lay).total
    if m.lora is not None and m.lora.enabled:
        a = p * trained_fraction(m)
        if lay.fsdp and lay.offload_params:
            return (m.bytes_per_param * (p - a) + 16.0 * a) / GB
        return 8.0 * a / GB if lay.offload_optimizer else 0.0
    if lay.fsdp and lay.offload_params:
        return 16.0 * p / GB
    if lay.offload_optimizer:
        if lay.fsdp:
            return 8.0 * p / GB
        ps = params_per_device(m, lay)
        return 12.0 * (ps.dense / (lay.dp * lay.cp) + ps.expert / expert_dp(lay)) / GB
    return 0.0


def activation_gb(m: ModelSpec, lay: Layout, t: float, *, train: bool, logits: bool, in_flight: float) -> float:
    """Peak activation GB per device: ``in_flight`` micro-batches of ``t`` tokens when training (1F1B keeps
    up to ``pp`` on the first stage), one layer's working set of one micro-batch otherwise."""
    h = m.hidden_size
    layers = max(m.stages(lay.pp))  # the fullest stage's
    wide = m.bytes_per_param / 2.0  # the constants are for bf16 activations
    per_layer_full = wide * ACT_BYTES_PER_TOKEN_HIDDEN * t * h / lay.tp
    if train:
        if lay.activation_checkpointing:
            act = wide * CKPT_BYTES_PER_TOKEN_HIDDEN * t * h * layers + per_layer_full
        else:
            act = per_layer_full * layers
        act *= in_flight
    else:
        act = 2 * per_layer_full  # inference keeps a layer's working set
    if logits:  # fp32 logits (+ their gradient when training), vocab-parallel over tp
        act += (8.0 if train else 4.0) * t * m.vocab_size / lay.tp
    return act / GB


def buffers_gb(m: ModelSpec, lay: Layout, hw: Hw) -> float:
    """Workspaces beside the model state: fixed buffers, a CPU worker's own process, and FSDP's
    unsharded layers in flight."""
    fixed = FIXED_BUFFERS_GB[hw.kind] + hw.process_gb
    if lay.fsdp:  # two unsharded layers in flight (current + prefetched), in the compute dtype
        layer_params = (m.params_total - m.embedding_params) / m.num_layers
        fixed += 2 * m.bytes_per_param * layer_params / lay.tp / GB
    return fixed
