"""Time and memory of ``generate`` (:func:`generate_cost`): prefill, decode steps bound by memory or
compute, the rollout backend's own host costs, and the KV cache that sets the concurrency."""

from __future__ import annotations

import math
from typing import Any

from flowc.ir.models import ModelSpec
from flowc.ir.plan import KV_BLOCK_TOKENS, STATIC_BATCH_BACKENDS, Layout, kv_tokens_held
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
from flowc.passes.response_lengths import continuous_batch
from flowc.passes.steady_period import longest_spread


def takes_device_share(backend: str, kind: str) -> bool:
    """Whether a rollout engine is given a share of each device (vLLM on GPUs: its
    ``gpu_memory_utilization``); the HF loop allocates as it goes and vLLM on CPUs is given its
    KV cache in bytes."""
    return kind == "gpu" and backend not in STATIC_BATCH_BACKENDS


def generation_weights_gb(m: ModelSpec, lay: Layout) -> float:
    return m.bytes_per_param * params_per_device(m, lay).total / GB


def kv_bytes_per_token_device(m: ModelSpec, lay: Layout) -> float:
    split = 1 if m.is_mla else min(lay.tp, m.num_kv_heads)
    return m.kv_bytes_per_token / split / lay.pp


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
    w_stages = m.bytes_per_param * params_per_device(m, lay, every_stage=True).total  # every stage's shard, in turn
    mem_t = (w_stages + lay.pp * active * ctx * kv_bytes_per_token_device(m, lay)) / (hw.hbm * hw.eff.decode_bw)
    mm = 2.0 * matmul_params(m) / lay.tp
    # the step's GEMMs run on width-``hidden/tp`` shards: narrow ones run below the calibrated rate,
    # as every other priced GEMM does (shape_efficiency's width term; its token term is not taken:
    # a step of few sequences is bound by reading the weights, which mem_t prices)
    eff = hw.eff.matmul * shape_efficiency(None, m.hidden_size / lay.tp, hw)
    flops_t = active * (mm + attention_flops_per_token(m, ctx) / lay.tp) / (hw.peak * eff)
    return max(mem_t, flops_t)


def agent_turns(d: Demand, seqs: int, request_s: float, prefill_s: Any, *, static: bool, gen_s: float) -> dict[str, float]:
    """What a multi-turn generate adds to one replica's rollout of ``seqs`` trajectories:

    * ``obs_prefill``: every turn after the first prefills what came since the last one — the
      observation on vLLM (the trajectory so far is in its prefix cache), the whole context on the
      ``hf`` loop (a new padded batch each turn, no cache kept across turns);
    * ``turn_requests``: each later turn is a request of its own (host work);
    * ``env_wait``: a trajectory waits for its environment after each turn, and the rollout ends
      with its last trajectory, so one chain of ``turns`` environment steps is on the critical path;
    * ``env_busy``: the environment processes' work, ``seqs × turns`` steps over ``env_workers``
      of them — the rollout takes at least that long (the pool's size, :func:`env_workers_for`,
      keeps it under the generation's own time, ``gen_s``).
    """
    later = max(d.turns - 1.0, 0.0)
    ctx = d.prompt_len + d.mean_response_len / 2.0 + d.obs_len * d.turns / 2.0  # a later turn's context, on average
    tokens = seqs * later * (ctx if static else d.obs_len)
    rows = float(max(1, min(seqs, 64)))
    steps = seqs * d.turns
    workers = env_workers_for(d, seqs, gen_s)
    return {
        "turns": d.turns,
        "obs_prefill": prefill_s(rows, tokens) if tokens > 0 else 0.0,
        "turn_requests": seqs * later * request_s,
        "env_wait": d.turns * d.env_latency_s,
        "env_busy": steps * d.env_latency_s / max(workers, 1),
        "env_workers": float(workers),
        "gen_s": gen_s,
    }


ENV_WORKERS_MAX = 64  # environment processes per rollout replica the planner suggests at most


def env_workers_for(d: Demand, seqs: int, gen_s: float) -> int:
    """Environment processes per replica: the fewest whose work (``seqs × turns`` steps of
    ``env_latency_s``) fits in the generation's own time ``gen_s``, so the environments keep up with
    the engine; at least one, at most one per trajectory (and :data:`ENV_WORKERS_MAX`). 0 — no
    opinion, the run config's ``env_workers`` — when the workload gives no environment latency."""
    work = seqs * d.turns * d.env_latency_s
    if work <= 0:
        return 0
    need = math.ceil(work / gen_s) if gen_s > 0 else seqs
    return int(max(1, min(need, seqs, ENV_WORKERS_MAX)))


def generate_cost(m: ModelSpec, lay: Layout, d: Demand, hw: Hw, *, free_gb: float) -> PhaseCost | None:
    """Time and memory of ``generate`` with ``lay`` when ``free_gb`` per device
    is left for this phase (after co-located roles and the generation weights
    are counted by the caller). None when not even one sequence fits.

    The layout's backend decides how a replica decodes its share of the requests, over the
    workload's response-length distribution (:class:`flowc.passes.response_lengths.LengthDist`):
    vLLM batches continuously in a paged cache (:func:`continuous_batch`: a finished sequence
    leaves the batch and frees its blocks, a waiting one takes its place, a full cache preempts
    and recomputes; the batch ends with its longest response, the last ones decoding few at a
    time); the HF loop decodes waves of padded rows until each wave's longest response ends.
    Each backend adds its own per-request, per-step and per-layer host costs and kernel speed
    (:class:`flowc.ir.hardware.RolloutCost`)."""
    rc = hw.rollout_cost(lay.backend)
    buf = FIXED_BUFFERS_GB[hw.kind] + hw.process_gb + rc.resident_gb
    kv_tok = kv_bytes_per_token_device(m, lay)
    kv_one = kv_tokens_held(d.prompt_len + d.response_len, lay.backend, hw.kind) * kv_tok
    logits_seq = m.vocab_size * 4.0 / lay.tp  # fp32 logits of the sampling step, per sequence in the batch
    free = free_gb * GB - buf * GB
    if free < kv_one + logits_seq:
        return None
    seqs = math.ceil(d.sequences * d.passes / lay.dp)
    dist = d.lengths
    per_layer = hw.layer_overhead if rc.layer_overhead_us is None else rc.layer_overhead_us * 1e-6
    fixed = m.num_layers * per_layer + rc.step_ms * 1e-3 + (lay.pp - 1) * hw.latency
    if m.is_moe and lay.ep > 1:
        fixed += 2 * m.moe_layers * hw.latency

    def step_s(running: float, ctx: float) -> float:
        """One decode step with ``running`` sequences: device work at the backend's kernel speed,
        its fixed host costs, and two tensor-parallel all-reduces of the hidden states per layer
        (small messages: one latency each, as a one-shot all-reduce takes, plus the ring's bytes)."""
        comm = 0.0
        if lay.tp > 1:
            comm = allreduce_time(running * m.hidden_size * m.bytes_per_param, lay.tp, hw.link(lay.tp), 0.0) + hw.latency
        return decode_step_device_s(m, lay, hw, running, ctx) / rc.decode_scale + fixed + 2 * m.num_layers * comm

    def prefill_s(rows: float, tokens: float) -> float:
        """Prefill of ``tokens`` prompt tokens in chunks of ``rows`` prompts."""
        one = prefill_device_s(m, lay, hw, rows, d.prompt_len)
        one += (
            2
            * m.num_layers
            * allreduce_time(rows * d.prompt_len * m.hidden_size * m.bytes_per_param, lay.tp, hw.link(lay.tp), hw.latency)
        )
        return one * tokens / (rows * d.prompt_len)

    requests = seqs * rc.request_ms * 1e-3  # host work per request, which the engine does not hide
    if lay.backend in STATIC_BATCH_BACKENDS:  # padded waves: every row computes every step until the wave's longest ends
        conc = int(free // (kv_one + logits_seq))
        waves = max(1, math.ceil(seqs / conc))
        b = math.ceil(seqs / waves)
        # each wave decodes until its longest response ends; the last, until the longest of the last
        # waves of every replica (the generate waits for the slowest)
        steps = ((waves - 1) * dist.expected_max(b) + dist.expected_max(b * lay.dp)) / waves
        step = step_s(float(b), d.prompt_len + steps / 2.0)
        prefill = waves * prefill_s(float(b), b * d.prompt_len)
        decode = waves * steps * step
        kv_used, running, detail = min(b, conc) * kv_one / GB, float(b), {}
    else:
        rows = min(seqs, rc.max_seqs or seqs)
        while rows > 1 and free - rows * logits_seq < kv_one:
            rows = max(1, rows // 2)
        cap = (free - rows * logits_seq) / kv_tok
        # the generate ends with its slowest replica: the one that drew the batch's longest response
        every = math.ceil(d.sequences * d.passes)
        sched = continuous_batch(dist, seqs, d.prompt_len, cap, KV_BLOCK_TOKENS[hw.kind], rows, longest_of=every)
        ctx = d.prompt_len + dist.held_mean
        decode = sum(n * step_s(r, ctx) for n, r in sched.levels)
        steps, waves, running = sched.steps, 1, float(sched.most_running)
        prefill = prefill_s(float(max(1, min(seqs, sched.most_running))), seqs * d.prompt_len + sched.recomputed_tokens)
        step = decode / steps if steps else 0.0
        kv_used = sched.peak_tokens * kv_tok / GB  # the cache the engine is given: its peak demand, or all that is free
        detail = {
            "preempted": float(sched.preempted),
            "recomputed_tokens": sched.recomputed_tokens,
            "tail_steps": sched.tail_steps,
            "tail": sum(n * step_s(r, ctx) for n, r in sched.levels if r < sched.most_running / 4.0),
        }
    total = prefill + decode + requests
    agent: dict[str, float] = {}
    if d.agent:
        agent = agent_turns(d, seqs, rc.request_ms * 1e-3, prefill_s, static=lay.backend in STATIC_BATCH_BACKENDS, gen_s=total)
        total = max(total + agent["obs_prefill"] + agent["turn_requests"], agent["env_busy"]) + agent["env_wait"]
    mem = memory_gb(
        weights=generation_weights_gb(m, lay),
        kv_cache=kv_used,
        activations=running * m.vocab_size * 4.0 / lay.tp / GB,
        buffers=buf,
    )
    detail = {
        "prefill": prefill,
        "decode": decode,
        "requests": requests,
        "step_s": step,
        "decode_steps": float(steps),
        **agent,
        "concurrency": running,
        **detail,
    }
    # a step's generate varies with where its longest response falls: the op ends with the slowest
    # replica, i.e. the longest of all its responses (continuous batching: decoded alone at the end),
    # or, in padded waves, with each wave's longest, every row computing every step
    if lay.backend in STATIC_BATCH_BACKENDS:
        spread = longest_spread(dist.quantile, float(b * lay.dp), step, waves=waves)
    else:
        longest = dist.expected_max(d.sequences * d.passes)
        spread = longest_spread(dist.quantile, float(d.sequences * d.passes), step_s(1.0, d.prompt_len + longest))
    return PhaseCost(total, mem, 0.0, 0.0, waves, detail, spread=spread)
