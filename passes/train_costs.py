"""Time and memory of a trained or frozen role's update and forward ops (:func:`train_cost`,
:func:`forward_cost`): compute at the calibrated rate, the parallel axes' communication, the
optimizer step, offload copies and each micro-batch's fixed cost. Formulas: docs/planner.md."""

from __future__ import annotations

import math

from flowc.ir.models import ModelSpec
from flowc.ir.plan import Layout
from flowc.passes.costs import (
    CPU_ADAM_PARAMS_PER_S,
    GB,
    Hw,
    PhaseCost,
    activation_gb,
    allreduce_time,
    buffers_gb,
    expert_dp,
    gather_time,
    host_state_gb,
    memory_gb,
    padded_seq_len,
    param_tensors,
    params_per_device,
    prompt_tokens_saved,
    replica_sequences,
    shape_efficiency,
    train_state_gb,
    trained_fraction,
)
from flowc.passes.flops import (
    Demand,
    attention_flops_per_token,
    forward_flops,
    matmul_params,
    train_flops,
    useful_train_flops,
)


def _tokens_per_micro(lay: Layout, seq_len: float, seqs_per_replica: float, longest: float = 0.0) -> float:
    """Tokens of one micro-batch (``seq_len`` padded per sequence) on one device: never more
    than its replica has, nor than the layout's token budget — except that a row of the
    ``longest`` length runs whole even when it alone exceeds the budget."""
    rows = max(seqs_per_replica, 1.0)
    if lay.micro_tokens:
        return min(max(float(lay.micro_tokens), longest / lay.cp), rows * seq_len / lay.cp)
    return min(lay.micro_batch, rows) * seq_len / lay.cp


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


def stage_skew(m: ModelSpec, pp: int, *, logits: bool, seq_len: float = 0.0) -> float:
    """How much longer the slowest of ``pp`` pipeline stages computes than the mean stage: the
    stages hold the layers :func:`~flowc.ir.models.stage_split` gives them (``⌈L/pp⌉`` or fewer)
    and the last one also the LM head (its vocabulary-wide matmul, when the op computes
    ``logits``), and every micro-batch waits for the slowest (Megatron places the head on the
    last stage; the embedding's lookup on the first costs no matmul). Per token, in sequences of
    ``seq_len`` (the layers' attention, as :func:`~flowc.passes.flops.forward_flops` counts it).
    1 without a pipeline."""
    if pp <= 1:
        return 1.0
    head = 2.0 * m.vocab_size * m.hidden_size if logits else 0.0
    body = 2.0 * max(matmul_params(m) - m.vocab_size * m.hidden_size, 0.0)  # the layers' matmuls
    body += attention_flops_per_token(m, seq_len / 2.0)
    split = m.stages(pp)
    per = body / m.num_layers
    slowest = max(max(split[:-1]) * per, split[-1] * per + head)
    return max(slowest / ((body + head) / pp), 1.0)


def pipeline_wait(m: ModelSpec, lay: Layout, compute: float, mbs: float, *, logits: bool, seq_len: float) -> float:
    """Seconds a pipeline adds to ``compute`` spread evenly over its stages: every one of the ``mbs``
    micro-batches waits for the slowest stage (:func:`stage_skew`), and the pipeline fills and
    drains once at that pace. 0 without a pipeline."""
    if lay.pp <= 1:
        return 0.0
    skew = compute * (stage_skew(m, lay.pp, logits=logits, seq_len=seq_len) - 1.0)
    return skew + (compute + skew) * (lay.pp - 1) / mbs


def train_cost(m: ModelSpec, lay: Layout, d: Demand, hw: Hw, *, logits: bool) -> PhaseCost:
    """Time and memory of ``update`` with layout ``lay`` (``d.updates`` optimizer steps)."""
    devices = lay.world
    seqs_per_dp = replica_sequences(d, lay, train=True)
    padded = padded_seq_len(d, lay, seqs_per_dp)  # what the micro-batches compute on, padding included
    mbs = _micro_batches(seqs_per_dp, lay, padded)
    t_micro = _tokens_per_micro(lay, padded, seqs_per_dp, d.prompt_len + d.response_len)
    eff = hw.eff.train * (hw.eff.moe_train if m.is_moe else 1.0) * shape_efficiency(t_micro, m.hidden_size / lay.tp, hw)

    def compute_of(width: float) -> float:  # seconds of compute with rows ``width`` tokens wide
        flops = train_flops(m, d.tokens * width / d.seq_len, padded, recompute=lay.activation_checkpointing)
        if m.lora is not None and m.lora.enabled:  # frozen weights get no weight gradients: those backward GEMMs drop out
            flops -= 2.0 * d.tokens * width / d.seq_len * max(matmul_params(m) - m.trained_params, 0)
        return flops / (devices * hw.peak * eff)

    ps_full = params_per_device(m, lay, sharded_over_dp=False)
    dp_bw = _dp_bw(hw, lay)
    groups = m.num_layers + 1  # FSDP: one collective per layer group and the root
    wb = m.bytes_per_param  # compute dtype: activations, gathered weights
    gathers = lay.fsdp and lay.dp * lay.cp > 1  # all-gather fwd + bwd (compute dtype) every micro-batch and pass
    per_mb = gather_time(ps_full.total * wb, lay.dp * lay.cp, dp_bw, 0.0) * 2 + 2 * groups * hw.latency if gathers else 0.0
    compute = plain = compute_of(padded)
    # shared prompts: each distinct prompt once, for one more pass per micro-batch (its dispatch, forward
    # and backward, and FSDP's gathers)
    extra = (3.0 * m.num_layers / lay.pp * hw.layer_overhead + per_mb) * mbs * d.updates
    # (a shared micro-batch's responses stay padded, packed or not)
    rows = padded_seq_len(d, lay, seqs_per_dp, unpacked=True)
    if lay.pack_sequences:  # packed lines compute each prompt once in the same pass
        compute, passes, saved = _shared_prompts(plain, compute_of(padded - prompt_tokens_saved(d, lay, seqs_per_dp, mbs)), 0.0)
        passes = 1.0
    else:
        compute, passes, saved = _shared_prompts(plain, compute_of(rows - prompt_tokens_saved(d, lay, seqs_per_dp, mbs)), extra)
    tokens_per_rank = d.tokens * padded / d.seq_len / lay.dp / lay.cp  # padding travels too
    layers = m.num_layers / lay.pp
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
    # pipeline: every micro-batch waits for the slowest stage (the LM head's), fill and drain once per
    # optimizer update, plus activations between stages
    bubble = pipeline_wait(m, lay, compute, mbs, logits=logits, seq_len=padded)
    pp_p2p = 0.0
    if lay.pp > 1:
        pp_p2p = 2 * tokens_per_rank * h2 / hw.link(lay.pp, lay.tp * lay.cp * lay.dp) * (lay.pp - 1) / lay.pp
    # data parallel: gradient reduction (and parameter gathering) per update or per micro-batch
    trained = trained_fraction(m)  # LoRA: only the adapters have gradients to reduce and an optimizer step
    dp = 0.0
    if lay.dp * lay.cp > 1:
        group = lay.dp * lay.cp
        if lay.fsdp:  # per_mb's gathers every micro-batch and pass; fp32 grads reduce-scattered once per update
            comm = (
                per_mb * mbs * passes + gather_time(ps_full.total * trained * 4.0, group, dp_bw, 0.0) + groups * hw.latency
            ) * d.updates
            # the sharded (DTensor) optimizer step and norm pay a dispatch per parameter tensor
            dtensor = 2 * param_tensors(m) * hw.layer_overhead * d.updates
            dp = max(comm - hw.overlap * compute, (1 - hw.overlap) * comm) + dtensor
        elif lay.backend == "fsdp2":  # replicated: one all-reduce of the fp32 gradients per update
            comm = allreduce_time(ps_full.total * trained * 4.0, group, dp_bw, hw.latency) * d.updates
            dp = comm
        else:  # distributed optimizer: reduce-scatter fp32 grads + all-gather the params, per update
            comm = (
                gather_time(ps_full.dense * (4.0 + wb), group, dp_bw, hw.latency)
                + gather_time(ps_full.expert * (4.0 + wb), expert_dp(lay), dp_bw, hw.latency)
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
    one_pass = 3.0 * mbs * d.updates * layers * hw.layer_overhead
    launch = one_pass * passes
    # mixed precision over fp32 master weights: every micro-batch casts them to the compute dtype and
    # accumulates its gradients back into fp32 (read 4 + write 2 bytes, then read 2 + 4, write 4)
    cast = MASTER_CAST_BYTES * stepped / (hw.hbm * 0.8) * mbs * d.updates if _casts_master(m, lay) else 0.0
    launch += cast
    total = compute + tp + cp + bubble + pp_p2p + dp + ep + opt + offload + launch
    w, g, o = train_state_gb(m, lay)
    act = activation_gb(m, lay, t_micro, train=True, logits=logits, in_flight=_in_flight(seqs_per_dp, lay))
    buf = buffers_gb(m, lay, hw)
    resident = w + g + o
    mem = memory_gb(weights=w, gradients=g, optimizer=o, activations=act, buffers=buf)
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
        "shared_prompts": saved,
        "padding_removed": compute_of(rows) - plain,  # what packing saves against padded rows
    }
    per_micro = (launch - one_pass * (passes - 1) + offload) / (mbs * d.updates) + per_mb  # one pass's dispatch
    # the fixed cost in tokens of one pass's compute, which is what the runtime weighs it against
    return PhaseCost(total, mem, resident, mfu, 1, detail, host_state_gb(m, lay), _in_tokens(per_micro, plain, tokens_per_rank))


MASTER_CAST_BYTES = 16.0  # per trained parameter and micro-batch, forward cast and gradient accumulation


def _shared_prompts(plain: float, saved_to: float, extra: float) -> tuple[float, float, float]:
    """Whether shared prompts pay: ``plain`` compute seconds against ``saved_to`` (with the prompt
    tokens saved) plus the extra pass (``extra`` seconds: its dispatch and gathers, which the
    caller counts by the passes). Returns the compute seconds, the passes per micro-batch (1 or
    2) and the seconds saved net of the extra pass (0 when one pass is cheaper: the runtime then
    runs one, as it decides per micro-batch by the same fixed cost)."""
    if saved_to + extra < plain:
        return saved_to, 2.0, plain - saved_to - extra
    return plain, 1.0, 0.0


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
    eff = hw.eff.forward * shape_efficiency(t_micro, m.hidden_size / lay.tp, hw)
    compute = plain = forward_flops(m, d.tokens * padded / d.seq_len, padded) / (devices * hw.peak * eff)
    wb = m.bytes_per_param  # compute dtype: activations, gathered weights
    ps_full = params_per_device(m, lay, sharded_over_dp=False)
    gathers = lay.fsdp and lay.dp * lay.cp > 1
    per_mb = gather_time(ps_full.total * wb, lay.dp * lay.cp, _dp_bw(hw, lay), hw.latency) if gathers else 0.0
    # shared prompts: one more pass per micro-batch (its dispatch and FSDP's gathers)
    rows = padded_seq_len(d, lay, seqs_per_dp, unpacked=True)  # a shared micro-batch's responses stay padded
    width = (padded if lay.pack_sequences else rows) - prompt_tokens_saved(d, lay, seqs_per_dp, mbs)
    extra = (m.num_layers / lay.pp * hw.layer_overhead + per_mb) * mbs
    compute, passes, saved = _shared_prompts(plain, plain * width / padded, 0.0 if lay.pack_sequences else extra)
    passes = 1.0 if lay.pack_sequences else passes  # packed lines compute each prompt once in the same pass
    removed = plain * (rows / padded - 1.0)  # what packing saves against padded rows
    tokens_per_rank = d.tokens * padded / d.seq_len / lay.dp / lay.cp  # padding travels too
    layers = m.num_layers / lay.pp
    h2 = m.hidden_size * wb
    tp = 0.0
    if lay.tp > 1:
        tp = allreduce_time(tokens_per_rank * h2, lay.tp, hw.link(lay.tp), 0.0) * 2 * layers + 2 * layers * mbs * hw.latency
    bubble = pipeline_wait(m, lay, compute, mbs, logits=logits, seq_len=padded)
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
    gather = 0.0
    if gathers:
        comm = per_mb * mbs * passes
        gather = max(comm - hw.overlap * compute, (1 - hw.overlap) * comm)
    local = params_per_device(m, lay).total
    offload = 0.0
    if lay.offload_params:
        # frozen roles swap their weights in once per op; FSDP's CPU offload copies them every micro-batch
        offload = local * wb / hw.host if frozen else 0.5 * local * wb / hw.host * mbs
    launch = mbs * layers * hw.layer_overhead * passes
    if not frozen and _casts_master(m, lay):  # a trained role's forward casts its fp32 master weights each micro-batch
        launch += 6.0 * local / (hw.hbm * 0.8) * mbs
    total = compute + tp + bubble + ep + gather + offload + launch
    act = activation_gb(m, lay, t_micro, train=False, logits=logits, in_flight=1.0)
    buf = buffers_gb(m, lay, hw)
    host = 0.0
    if frozen:  # offloaded weights are on the device only while the op runs
        w = wb * local / GB
        host = w if lay.offload_params else 0.0
        mem = memory_gb(weights=w, activations=act, buffers=buf)
        resident = 0.0 if lay.offload_params else w
    else:
        mem = memory_gb(activations=act, buffers=buf)
        resident = 0.0
    return PhaseCost(
        total,
        mem,
        resident,
        0.0,
        1,
        {
            "compute": compute,
            "tp": tp,
            "pp_bubble": bubble,
            "ep": ep,
            "dp": gather,
            "offload": offload,
            "shared_prompts": saved,
            "padding_removed": removed,
        },
        host,
        _in_tokens(
            (launch - layers * hw.layer_overhead * mbs * (passes - 1)) / mbs + per_mb + (0.0 if frozen else offload / mbs),
            plain,
            tokens_per_rank,
        ),
    )
