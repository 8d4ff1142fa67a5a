"""The analytic cost model: memory per device and time of one role in one phase.

Every function here is pure: (model, layout, demand, hardware) → numbers.
Formulas are written out in docs/planner.md; the hardware's achieved
fractions (``efficiency``) are calibrated there against published runs.

Units: bytes, seconds, FLOP/s. ``Hw`` holds the achieved bandwidths (peak ×
efficiency) so the formulas below read as "bytes / bandwidth".
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, make_dataclass

from flowc.ir.cluster import ClusterSpec
from flowc.ir.hardware import Efficiency, RolloutCost
from flowc.ir.models import ModelSpec
from flowc.ir.plan import STATIC_BATCH_BACKENDS, Layout, Memory, kv_tokens_held
from flowc.passes.flops import Demand, attention_flops_per_token, forward_flops, matmul_params, train_flops, useful_train_flops

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


def shape_efficiency(tokens_per_micro: float, width: float, hw: Hw | None = None) -> float:
    """GEMMs on few tokens or narrow shards run below the calibrated rate:
    a saturating factor in the micro-batch tokens and the per-device width
    (half rate at the profile's ``gemm_half_tokens`` / ``gemm_half_width``)."""
    ht, hw_ = (hw.half_tokens, hw.half_width) if hw is not None else (64.0, 256.0)
    return (tokens_per_micro / (tokens_per_micro + ht)) * (width / (width + hw_))


# ------------------------------------------------------------------ params
@dataclass(frozen=True)
class ParamSplit:
    """Parameters per device of a layout (dense part over tp·pp, experts over ep·pp)."""

    dense: float
    expert: float

    @property
    def total(self) -> float:
        return self.dense + self.expert


def expert_params_total(m: ModelSpec) -> int:
    return m.expert_params_total


def params_per_device(m: ModelSpec, lay: Layout, *, sharded_over_dp: bool | None = None) -> ParamSplit:
    """Parameters one device holds (before any dp sharding unless ``sharded_over_dp``)."""
    experts = expert_params_total(m)
    dense = m.params_total - experts
    fsdp = lay.fsdp if sharded_over_dp is None else sharded_over_dp
    dp_shard = lay.dp * lay.cp if fsdp else 1
    ep = max(lay.ep, 1)
    if lay.backend in ("vllm", "hf"):
        exp_div = ep if ep > 1 else lay.tp
        return ParamSplit(dense / (lay.tp * lay.pp), experts / (exp_div * lay.pp))
    return ParamSplit(dense / (lay.tp * lay.pp * dp_shard), experts / (ep * lay.pp * (dp_shard if fsdp else 1)))


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


def _memory(**kw: float) -> MemoryGB:
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


def replica_sequences(d: Demand, lay: Layout, *, train: bool) -> float:
    """Sequences one data-parallel replica processes per pass (per optimizer update when ``train``)."""
    return d.sequences * d.passes / (d.updates if train else 1) / lay.dp


def padded_seq_len(d: Demand, lay: Layout, seqs_per_replica: float) -> float:
    """Mean tokens per sequence as the runtime pads them: each micro-batch is as wide as its
    longest row. Responses range up to ``R`` around their mean; a micro-batch of ``m`` rows
    taken in order is padded a share ``1 - 1/m`` of that spread, and a token budget (rows
    sorted by length, ``k`` micro-batches of similar lengths) a share ``(1 - 1/s)/k`` of
    it, where ``s`` is the replica's rows. With no mean given (every response at ``R``) there
    is no padding."""
    spread = d.response_len - d.mean_response_len
    s = max(seqs_per_replica, 1.0)
    if spread <= 0 or s <= 1:
        return d.seq_len
    if lay.micro_tokens:
        k = max(1, math.ceil(s * d.seq_len / lay.cp / lay.micro_tokens))
        share = (1.0 - 1.0 / s) / k
    else:
        share = 1.0 - 1.0 / min(float(lay.micro_batch), s)
    return d.seq_len + spread * share


def _tokens_per_micro(lay: Layout, seq_len: float, seqs_per_replica: float, longest: float = 0.0) -> float:
    """Tokens of one micro-batch (``seq_len`` padded per sequence) on one device: never more
    than its replica has, nor than the layout's token budget — except that a row of the
    ``longest`` length runs whole even when it alone exceeds the budget."""
    rows = max(seqs_per_replica, 1.0)
    if lay.micro_tokens:
        return min(max(float(lay.micro_tokens), longest / lay.cp), rows * seq_len / lay.cp)
    return min(lay.micro_batch, rows) * seq_len / lay.cp


def _param_tensors(m: ModelSpec) -> int:
    """Parameter tensors of a decoder (q, k, v, o, three MLP matrices, two norms per layer; biases when present)."""
    per_layer = 9 + (3 if m.attention_bias else 0) + (2 if m.qk_norm else 0)
    return per_layer * m.num_layers + 2 + (0 if m.tie_word_embeddings else 1)


def _expert_dp(lay: Layout) -> int:
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
        o = 12.0 * (ps.dense / (lay.dp * lay.cp) + ps.expert / _expert_dp(lay))
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
        return 12.0 * (ps.dense / (lay.dp * lay.cp) + ps.expert / _expert_dp(lay)) / GB
    return 0.0


def activation_gb(m: ModelSpec, lay: Layout, t: float, *, train: bool, logits: bool, in_flight: float) -> float:
    """Peak activation GB per device: ``in_flight`` micro-batches of ``t`` tokens when training (1F1B keeps
    up to ``pp`` on the first stage), one layer's working set of one micro-batch otherwise."""
    h = m.hidden_size
    layers = math.ceil(m.num_layers / lay.pp)
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


# -------------------------------------------------------------------- time
def _micro_batches(seqs_per_replica: float, lay: Layout, seq_len: float) -> int:
    """Micro-batches per replica and pass: rows over the micro-batch, or padded tokens (per
    device) over the token budget."""
    if lay.micro_tokens:
        return max(1, math.ceil(seqs_per_replica * seq_len / lay.cp / lay.micro_tokens))
    return max(1, math.ceil(seqs_per_replica / lay.micro_batch))


def _in_flight(seqs_per_replica: float, lay: Layout) -> float:
    """Micro-batches whose activations the first pipeline stage holds at once (1F1B): up to ``pp``, and
    never more sequences than the replica has, so it only grows with the micro-batch."""
    return min(float(lay.pp), max(seqs_per_replica / lay.micro_batch, 1.0))


def _dp_bw(hw: Hw, lay: Layout) -> float:
    return hw.link(lay.dp, lay.tp * lay.cp)


def train_cost(m: ModelSpec, lay: Layout, d: Demand, hw: Hw, *, logits: bool) -> PhaseCost:
    """Time and memory of ``update`` with layout ``lay`` (``d.updates`` optimizer steps)."""
    devices = lay.world
    seqs_per_dp = replica_sequences(d, lay, train=True)
    padded = padded_seq_len(d, lay, seqs_per_dp)  # what the micro-batches compute on, padding included
    mbs = _micro_batches(seqs_per_dp, lay, padded)
    t_micro = _tokens_per_micro(lay, padded, seqs_per_dp, d.prompt_len + d.response_len)
    eff = hw.eff.train * (hw.eff.moe_train if m.is_moe else 1.0) * shape_efficiency(t_micro, m.hidden_size / lay.tp, hw)
    flops = train_flops(m, d.tokens * padded / d.seq_len, padded, recompute=lay.activation_checkpointing)
    if m.lora is not None and m.lora.enabled:  # frozen weights get no weight gradients: those backward GEMMs drop out
        flops -= 2.0 * d.tokens * padded / d.seq_len * max(matmul_params(m) - m.trained_params, 0)
    compute = flops / (devices * hw.peak * eff)
    tokens_per_rank = d.tokens * padded / d.seq_len / lay.dp / lay.cp  # padding travels too
    layers = m.num_layers / lay.pp
    wb = m.bytes_per_param  # compute dtype: activations, gathered weights
    h2 = m.hidden_size * wb
    # tensor parallel: 4 all-reduce-equivalents per layer (2 fwd, 2 bwd), 2 more when recomputing
    n_tp = (6 if lay.activation_checkpointing else 4) * layers
    tp = 0.0
    if lay.tp > 1:
        tp = allreduce_time(tokens_per_rank * h2, lay.tp, hw.link(lay.tp), 0.0) * n_tp + n_tp * mbs * d.updates * hw.latency
    # context parallel: K/V passed around the ring, mostly overlapped with attention
    cp = 0.0
    if lay.cp > 1:
        kv = 2 * m.num_kv_heads * m.head_dim * wb
        cp = 0.3 * 3 * layers * (lay.cp - 1) * tokens_per_rank * kv / hw.link(lay.cp, lay.tp)
    # pipeline: fill and drain once per optimizer update, plus activations between stages
    bubble = compute / d.updates * (lay.pp - 1) / mbs * d.updates if lay.pp > 1 else 0.0
    pp_p2p = 0.0
    if lay.pp > 1:
        pp_p2p = 2 * tokens_per_rank * h2 / hw.link(lay.pp, lay.tp * lay.cp * lay.dp) * (lay.pp - 1) / lay.pp
    # data parallel: gradient reduction (and parameter gathering) per update or per micro-batch
    ps_full = params_per_device(m, lay, sharded_over_dp=False)
    trained = trained_fraction(m)  # LoRA: only the adapters have gradients to reduce and an optimizer step
    dp_bw = _dp_bw(hw, lay)
    dp = per_mb = 0.0
    if lay.dp * lay.cp > 1:
        group = lay.dp * lay.cp
        if lay.fsdp:  # all-gather fwd + bwd (compute dtype) every micro-batch; fp32 grads reduce-scattered once per update
            groups = m.num_layers + 1  # one collective per layer group and the root
            per_mb = gather_time(ps_full.total * wb, group, dp_bw, 0.0) * 2 + 2 * groups * hw.latency
            comm = (
                per_mb * mbs + gather_time(ps_full.total * trained * 4.0, group, dp_bw, 0.0) + groups * hw.latency
            ) * d.updates
            # the sharded (DTensor) optimizer step and norm pay a dispatch per parameter tensor
            dtensor = 2 * _param_tensors(m) * hw.layer_overhead * d.updates
            dp = max(comm - hw.overlap * compute, (1 - hw.overlap) * comm) + dtensor
        elif lay.backend == "fsdp2":  # replicated: one all-reduce of the fp32 gradients per update
            comm = allreduce_time(ps_full.total * trained * 4.0, group, dp_bw, hw.latency) * d.updates
            dp = comm
        else:  # distributed optimizer: reduce-scatter fp32 grads + all-gather the params, per update
            comm = (
                gather_time(ps_full.dense * (4.0 + wb), group, dp_bw, hw.latency)
                + gather_time(ps_full.expert * (4.0 + wb), _expert_dp(lay), dp_bw, hw.latency)
            ) * d.updates
            dp = (1 - 0.5 * hw.overlap) * comm  # gradient reduction overlaps only the last micro-batch's backward
    # expert parallel: token dispatch and combine (all-to-all), forward and backward
    ep = 0.0
    if m.is_moe and lay.ep > 1:
        # sequence parallelism scatters a replica's tokens over its tp ranks before dispatch
        a2a = tokens_per_rank / lay.tp * m.experts_per_token * h2 * (lay.ep - 1) / lay.ep
        ep = 4 * m.moe_layers / lay.pp * a2a / hw.link(lay.ep)
    # optimizer step: memory-bound pass over master weights, moments and grads
    local = params_per_device(m, lay).total
    stepped = local * trained
    if lay.offload_optimizer or lay.offload_params:
        opt = (stepped * 6.0 / hw.host + stepped / CPU_ADAM_PARAMS_PER_S) * d.updates
    else:
        opt = stepped * 32.0 / (hw.hbm * 0.8) * d.updates
    offload = 0.0
    if lay.offload_params:  # host → device copies of the shards every micro-batch (half hidden by prefetch)
        offload = 0.5 * local * wb * 2 / hw.host * mbs * d.updates
    # fixed cost of every micro-batch: kernel launches (GPU) or Python dispatch (CPU), forward and backward
    launch = 3.0 * mbs * d.updates * layers * hw.layer_overhead
    # mixed precision over fp32 master weights: every micro-batch casts them to the compute dtype and
    # accumulates its gradients back into fp32 (read 4 + write 2 bytes, then read 2 + 4, write 4)
    cast = MASTER_CAST_BYTES * stepped / (hw.hbm * 0.8) * mbs * d.updates if _casts_master(m, lay) else 0.0
    launch += cast
    total = compute + tp + cp + bubble + pp_p2p + dp + ep + opt + offload + launch
    w, g, o = train_state_gb(m, lay)
    act = activation_gb(m, lay, t_micro, train=True, logits=logits, in_flight=_in_flight(seqs_per_dp, lay))
    buf = buffers_gb(m, lay, hw)
    resident = w + g + o
    mem = _memory(weights=w, gradients=g, optimizer=o, activations=act, buffers=buf)
    mfu = useful_train_flops(m, d.tokens, d.seq_len) / (total * devices * hw.peak) if total > 0 else 0.0
    detail = {
        "compute": compute,
        "tp": tp,
        "cp": cp,
        "pp_bubble": bubble + pp_p2p,
        "dp": dp,
        "ep": ep,
        "optimizer": opt,
        "offload": offload,
    }
    per_micro = (launch + offload) / (mbs * d.updates) + per_mb
    return PhaseCost(total, mem, resident, mfu, 1, detail, host_state_gb(m, lay), _in_tokens(per_micro, compute, tokens_per_rank))


MASTER_CAST_BYTES = 16.0  # per trained parameter and micro-batch, forward cast and gradient accumulation


def _casts_master(m: ModelSpec, lay: Layout) -> bool:
    """fsdp2 trains a role in a 16-bit compute dtype over fp32 master weights (Megatron holds its
    parameters in the compute dtype; LoRA's frozen base is held in it)."""
    return lay.backend == "fsdp2" and m.bytes_per_param < 4 and not (m.lora is not None and m.lora.enabled)


def _in_tokens(per_micro_s: float, compute_s: float, tokens_per_rank: float) -> float:
    """A micro-batch's fixed seconds as the padded tokens whose compute takes as long."""
    return per_micro_s / (compute_s / tokens_per_rank) if compute_s > 0 and tokens_per_rank > 0 else 0.0


def forward_cost(m: ModelSpec, lay: Layout, d: Demand, hw: Hw, *, logits: bool, frozen: bool) -> PhaseCost:
    """Time and memory of a forward op (logprobs / values / score) with ``lay``.

    ``frozen``: the role has no training state (its weights are its whole
    resident memory); otherwise the training state is resident and counted by
    :func:`train_cost`, so only the transient part is added here."""
    devices = lay.world
    seqs_per_dp = replica_sequences(d, lay, train=False)
    padded = padded_seq_len(d, lay, seqs_per_dp)
    mbs = _micro_batches(seqs_per_dp, lay, padded)
    t_micro = _tokens_per_micro(lay, padded, seqs_per_dp, d.prompt_len + d.response_len)
    eff = hw.eff.matmul * shape_efficiency(t_micro, m.hidden_size / lay.tp, hw)
    compute = forward_flops(m, d.tokens * padded / d.seq_len, padded) / (devices * hw.peak * eff)
    tokens_per_rank = d.tokens * padded / d.seq_len / lay.dp / lay.cp  # padding travels too
    layers = m.num_layers / lay.pp
    wb = m.bytes_per_param  # compute dtype: activations, gathered weights
    h2 = m.hidden_size * wb
    tp = 0.0
    if lay.tp > 1:
        tp = allreduce_time(tokens_per_rank * h2, lay.tp, hw.link(lay.tp), 0.0) * 2 * layers + 2 * layers * mbs * hw.latency
    bubble = compute * (lay.pp - 1) / mbs if lay.pp > 1 else 0.0
    ep = 0.0
    if m.is_moe and lay.ep > 1:
        ep = (
            2
            * m.moe_layers
            / lay.pp
            * tokens_per_rank
            / lay.tp
            * m.experts_per_token
            * h2
            * (lay.ep - 1)
            / lay.ep
            / hw.link(lay.ep)
        )
    ps_full = params_per_device(m, lay, sharded_over_dp=False)
    gather = per_mb = 0.0
    if lay.fsdp and lay.dp * lay.cp > 1:
        per_mb = gather_time(ps_full.total * wb, lay.dp * lay.cp, _dp_bw(hw, lay), hw.latency)
        comm = per_mb * mbs
        gather = max(comm - hw.overlap * compute, (1 - hw.overlap) * comm)
    local = params_per_device(m, lay).total
    offload = 0.0
    if lay.offload_params:
        # frozen roles swap their weights in once per op; FSDP's CPU offload copies them every micro-batch
        offload = local * wb / hw.host if frozen else 0.5 * local * wb / hw.host * mbs
    launch = mbs * layers * hw.layer_overhead
    if not frozen and _casts_master(m, lay):  # a trained role's forward casts its fp32 master weights each micro-batch
        launch += 6.0 * local / (hw.hbm * 0.8) * mbs
    total = compute + tp + bubble + ep + gather + offload + launch
    act = activation_gb(m, lay, t_micro, train=False, logits=logits, in_flight=1.0)
    buf = buffers_gb(m, lay, hw)
    host = 0.0
    if frozen:  # offloaded weights are on the device only while the op runs
        w = wb * local / GB
        host = w if lay.offload_params else 0.0
        mem = _memory(weights=w, activations=act, buffers=buf)
        resident = 0.0 if lay.offload_params else w
    else:
        mem = _memory(activations=act, buffers=buf)
        resident = 0.0
    return PhaseCost(
        total,
        mem,
        resident,
        0.0,
        1,
        {"compute": compute, "tp": tp, "pp_bubble": bubble, "ep": ep, "dp": gather, "offload": offload},
        host,
        _in_tokens(launch / mbs + per_mb + (0.0 if frozen else offload / mbs), compute, tokens_per_rank),
    )


def generation_weights_gb(m: ModelSpec, lay: Layout) -> float:
    return m.bytes_per_param * params_per_device(m, lay).total / GB


def kv_bytes_per_token_device(m: ModelSpec, lay: Layout) -> float:
    split = 1 if m.is_mla else min(lay.tp, m.num_kv_heads)
    return m.kv_bytes_per_token / split / lay.pp


def longest_of(n: float, mean: float, limit: float) -> float:
    """Expected longest of ``n`` response lengths with mean ``mean``, cut at ``limit``: lengths
    taken as exponential (the maximum of n is mean × H_n, H_n ≈ ln n + γ); every response runs
    to the limit when the mean is the limit."""
    if mean >= limit or n <= 1:
        return min(mean, limit) if n <= 1 else limit
    return min(limit, mean * (math.log(n) + 0.5772))


def prefill_device_s(m: ModelSpec, lay: Layout, hw: Hw, rows: float, prompt_len: float) -> float:
    """Seconds of a compute-bound forward over ``rows`` prompts of ``prompt_len`` tokens on one
    device of ``lay`` (the tensor-parallel all-reduces not included)."""
    flops = forward_flops(m, rows * prompt_len, prompt_len) / lay.tp
    return flops / (hw.peak * hw.eff.matmul * shape_efficiency(rows * prompt_len, m.hidden_size / lay.tp, hw))


def decode_step_device_s(m: ModelSpec, lay: Layout, hw: Hw, active: float, ctx: float) -> float:
    """Seconds of one decode step's device work at the profile's rates, before any backend's
    host costs and kernel speed: reading the weight shard and the KV cache of ``active``
    sequences at context ``ctx`` (memory-bound) or their matmul and attention FLOPs
    (compute-bound), whichever is longer; the stages of a pipeline run one after the other."""
    w_dev = generation_weights_gb(m, lay) * GB
    mem_t = lay.pp * (w_dev + active * ctx * kv_bytes_per_token_device(m, lay)) / (hw.hbm * hw.eff.decode_bw)
    mm = 2.0 * matmul_params(m) / lay.tp
    flops_t = active * (mm + attention_flops_per_token(m, ctx) / lay.tp) / (hw.peak * hw.eff.matmul)
    return max(mem_t, flops_t)


def generate_cost(m: ModelSpec, lay: Layout, d: Demand, hw: Hw, *, free_gb: float) -> PhaseCost | None:
    """Time and memory of ``generate`` with ``lay`` when ``free_gb`` per device
    is left for this phase (after co-located roles and the generation weights
    are counted by the caller). None when not even one sequence fits.

    The layout's backend decides how a wave decodes: vLLM batches continuously (a finished
    sequence leaves the batch, so the mean response length sets the work), the HF loop
    decodes the wave as one padded batch until its longest response ends; each backend adds
    its own per-request, per-step and per-layer host costs and kernel speed
    (:class:`flowc.ir.hardware.RolloutCost`)."""
    rc = hw.rollout_cost(lay.backend)
    static = lay.backend in STATIC_BATCH_BACKENDS
    buf = FIXED_BUFFERS_GB[hw.kind] + hw.process_gb + rc.resident_gb
    kv_tok = kv_bytes_per_token_device(m, lay)
    kv_seq = kv_tokens_held(d.prompt_len + d.response_len, lay.backend, hw.kind) * kv_tok
    logits_seq = m.vocab_size * 4.0 / lay.tp  # fp32 logits of the sampling step, per sequence in the batch
    free = free_gb * GB - buf * GB
    if free < kv_seq + logits_seq:
        return None
    seqs = math.ceil(d.sequences * d.passes / lay.dp)
    conc = int(free // (kv_seq + logits_seq))
    waves = max(1, math.ceil(seqs / conc))
    b = math.ceil(seqs / waves)
    prefill = prefill_device_s(m, lay, hw, b, d.prompt_len)
    if lay.tp > 1:
        prefill += (
            allreduce_time(b * d.prompt_len * m.hidden_size * m.bytes_per_param, lay.tp, hw.link(lay.tp), hw.latency)
            * 2
            * m.num_layers
        )
    # decode: one step per token of the longest response (continuous batching: of the longest
    # still admitted); each reads the weight shard and the KV cache (memory-bound) or is compute-bound
    if static:  # a padded batch: every row computes every step until the wave's longest ends
        steps = longest_of(b, d.mean_response_len, d.response_len)
        active = float(b)
        ctx = d.prompt_len + steps / 2.0
    else:
        steps = d.response_len
        active = b * d.mean_response_len / d.response_len  # mean active sequences over the steps
        ctx = d.prompt_len + d.mean_response_len / 2.0
    per_layer = hw.layer_overhead if rc.layer_overhead_us is None else rc.layer_overhead_us * 1e-6
    floor = m.num_layers * per_layer + rc.step_ms * 1e-3
    floor += (2 * m.num_layers * hw.latency if lay.tp > 1 else 0.0) + (lay.pp - 1) * hw.latency
    if m.is_moe and lay.ep > 1:
        floor += 2 * m.moe_layers * hw.latency
    step = decode_step_device_s(m, lay, hw, active, ctx) / rc.decode_scale + floor
    decode = steps * step
    requests = seqs * rc.request_ms * 1e-3  # host work per request, which the engine does not hide
    total = waves * (prefill + decode) + requests
    kv_used = min(b, conc) * kv_seq / GB
    mem = _memory(
        weights=generation_weights_gb(m, lay), kv_cache=kv_used, activations=b * m.vocab_size * 4.0 / lay.tp / GB, buffers=buf
    )
    detail = {
        "prefill": waves * prefill,
        "decode": waves * decode,
        "requests": requests,
        "step_s": step,
        "decode_steps": float(steps),
        "concurrency": float(conc),
    }
    return PhaseCost(total, mem, 0.0, 0.0, waves, detail)
