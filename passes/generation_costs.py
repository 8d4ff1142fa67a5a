"""Time and memory of ``generate`` (:func:`generate_cost`): prefill, decode steps bound by memory or
compute, the rollout backend's own host costs, and the KV cache that sets the concurrency."""

from __future__ import annotations

import math

from flowc.ir.models import ModelSpec
from flowc.ir.plan import STATIC_BATCH_BACKENDS, Layout, kv_tokens_held
from flowc.passes.costs import (
    FIXED_BUFFERS_GB,
    GB,
    Hw,
    PhaseCost,
    allreduce_time,
    memory_gb,
    params_per_device,
    shape_efficiency,
)
from flowc.passes.flops import Demand, attention_flops_per_token, forward_flops, matmul_params


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
    mem = memory_gb(
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
