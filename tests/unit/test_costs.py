"""The cost model against numbers computed by hand, and its qualitative laws."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowc.ir.cluster import ClusterSpec
from flowc.ir.models import ModelSpec, stage_split
from flowc.ir.plan import Layout, kv_tokens_held
from flowc.passes.costs import Hw, params_per_device, train_state_gb
from flowc.passes.flops import Demand, forward_flops, matmul_params, train_flops
from flowc.passes.generation_costs import generate_cost
from flowc.passes.train_costs import forward_cost, train_cost

Q7 = ModelSpec.resolve("qwen2.5-7b")
MOE = ModelSpec.resolve("qwen3-30b-a3b")
H100 = Hw.of(ClusterSpec.parse("2x8xH100"))


def test_qwen7b_flops_by_hand():
    total = 7_615_616_512  # the catalogue's count (checked against the model card in test_specs)
    assert Q7.params_total == total
    mm = total - 152064 * 3584  # the input embedding is a lookup
    assert matmul_params(Q7) == mm
    tokens, seq = 1000, 2048
    # causal attention: each token attends to seq/2 keys on average; QK and AV, 28 heads of 128, 28 layers
    attn = 2 * (seq / 2) * 28 * (128 + 128) * 28
    assert forward_flops(Q7, tokens, seq) == pytest.approx(tokens * (2 * mm + attn))
    assert train_flops(Q7, tokens, seq) == pytest.approx(3 * tokens * (2 * mm + attn))
    assert train_flops(Q7, tokens, seq, recompute=True) == pytest.approx(4 * tokens * (2 * mm + attn))


def test_qwen3_moe_flops_count_active_params_only():
    active = MOE.params_active
    mm = active - 151936 * 2048
    attn = 2 * 512 * 32 * (128 + 128) * 48
    assert forward_flops(MOE, 10, 1024) == pytest.approx(10 * (2 * mm + attn))
    assert active < MOE.params_total / 9  # ~3.3B of ~30.5B


def test_qwen7b_training_memory_by_hand():
    p = 7_615_616_512
    # two stages: 14 layers and the embedding, or 14 layers, the LM head and the final norm (3,584)
    stage = p / 2 + 3584 / 2
    mega = Layout(dp=2, tp=2, pp=2, backend="megatron")
    w, g, o = train_state_gb(Q7, mega)
    assert w == pytest.approx(2 * stage / 2 / 1e9)  # bf16 params of the largest stage over tp
    assert g == pytest.approx(4 * stage / 2 / 1e9)  # fp32 grad buffer over tp
    assert o == pytest.approx(12 * stage / 2 / 2 / 1e9)  # fp32 master + Adam m, v over tp and dp
    fsdp = Layout(dp=8, tp=1, backend="fsdp2", fsdp=True)
    w, g, o = train_state_gb(Q7, fsdp)
    assert (w, g, o) == pytest.approx((4 * p / 8 / 1e9, 4 * p / 8 / 1e9, 8 * p / 8 / 1e9))
    w, g, o = train_state_gb(Q7, fsdp.model_copy(update={"offload_optimizer": True}))
    assert o == 0.0 and w > 0
    assert train_state_gb(Q7, fsdp.model_copy(update={"offload_params": True, "offload_optimizer": True})) == (0.0, 0.0, 0.0)


def test_qwen3_moe_expert_parallel_memory_by_hand():
    experts = 48 * 128 * 3 * 2048 * 768
    dense = MOE.params_total - experts
    lay = Layout(dp=4, tp=1, pp=2, ep=4, backend="megatron")
    split = params_per_device(MOE, lay)
    stage = dense / 2 + 2048 / 2  # half the layers with the embedding, or with the head and the final norm
    assert split.dense == pytest.approx(stage)
    assert split.expert == pytest.approx(experts / (4 * 2))
    w, _, o = train_state_gb(MOE, lay)
    assert w == pytest.approx(2 * (stage + experts / 8) / 1e9)
    # distributed optimizer: dense part over dp (4), experts over the expert-data-parallel group (dp/ep = 1)
    assert o == pytest.approx(12 * (stage / 4 + experts / 8 / 1) / 1e9)


def test_a_pipeline_device_holds_its_largest_stage():
    """Qwen2.5-7B on 4 stages (28 layers, untied 152,064 × 3,584 embedding and head): a device of the
    last stage holds 7 layers, the head and the final norm — 14 % more than a quarter of the model,
    which is what the planner used to count — and every phase's memory counts that device."""
    e, h = 152064 * 3584, 3584
    layers = Q7.params_total - 2 * e - h
    stage = layers * 7 / 28 + e + h
    assert Q7.largest_stage(4) == (pytest.approx(stage), 0.0)
    assert stage / (Q7.params_total / 4) == pytest.approx(1.14, abs=0.01)
    assert params_per_device(Q7, Layout(tp=2, pp=4, backend="megatron")).total == pytest.approx(stage / 2)
    assert params_per_device(Q7, Layout(tp=2, pp=4, backend="vllm")).total == pytest.approx(stage / 2)
    assert Q7.largest_stage(1) == (Q7.params_total, 0.0)
    tied = ModelSpec.resolve("qwen2.5-1.5b")  # tied: the last stage keeps a copy of the embedding as its head
    assert tied.tie_word_embeddings
    te = tied.vocab_size * tied.hidden_size
    half = (tied.params_total - te - tied.hidden_size) / 2 + te + tied.hidden_size
    assert sum(tied.largest_stage(2)) == pytest.approx(half)
    # a pipelined decode step reads every stage's weights one after another: the whole model over tp
    assert params_per_device(Q7, Layout(tp=2, pp=4, backend="vllm"), every_stage=True).total == Q7.params_total / 2


def test_a_paged_kv_cache_sized_by_its_peak_and_preemption_when_it_runs_out():
    assert Q7.kv_bytes_per_token == 2 * 4 * 128 * 28 * 2
    lay = Layout(dp=1, tp=1, backend="vllm")
    d = Demand(sequences=512, prompt_len=1024, response_len=1024, mean_response_len=1024)
    per_seq = 2048 * Q7.kv_bytes_per_token  # every response runs to the limit: 2048 tokens in 16-token blocks
    roomy = generate_cost(Q7, lay, d, H100, free_gb=70.0)
    # all 512 run at once; the cache the engine gets is their peak, not all that is free
    assert roomy.detail["preempted"] == 0 and roomy.detail["concurrency"] == 512
    assert roomy.memory.kv_cache == pytest.approx(512 * per_seq / 1e9)
    assert roomy.detail["decode_steps"] == 1024
    tight = generate_cost(Q7, lay, d, H100, free_gb=8.0)
    # about 55 sequences fit at their peak: the rest wait, the cache fills, the last admitted are preempted and recomputed
    assert tight.detail["concurrency"] < 512 / 4 and tight.detail["preempted"] > 0 and tight.detail["recomputed_tokens"] > 0
    assert tight.memory.kv_cache <= 8.0 - 1.0 and tight.detail["decode_steps"] > 4 * 1024
    assert tight.time > roomy.time
    assert generate_cost(Q7, lay, d, H100, free_gb=1.05) is None  # not even one sequence fits


def test_a_paged_kv_cache_holds_whole_blocks():
    """vLLM hands a sequence whole blocks (16 tokens on GPUs, 128 on CPUs); the HF loop's own
    cache holds exactly its tokens. Regression: a CPU plan priced 40-token sequences at 40 tokens
    each, a quarter of what the engine holds, and the runtime then sized the cache from it."""
    assert kv_tokens_held(40, "vllm", "cpu") == 128 and kv_tokens_held(129, "vllm", "cpu") == 256
    assert kv_tokens_held(40, "vllm", "gpu") == 48 and kv_tokens_held(40, "hf", "cpu") == 40
    d = Demand(sequences=64, prompt_len=8, response_len=32, mean_response_len=16)
    tiny = ModelSpec.resolve("flowc-tiny").model_copy(update={"dtype": "float32"})
    cpu = Hw.of(ClusterSpec.parse("local"))
    paged = generate_cost(tiny, Layout(backend="vllm"), d, cpu, free_gb=4.0)
    static = generate_cost(tiny, Layout(backend="hf"), d, cpu, free_gb=4.0)
    assert paged.memory.kv_cache == pytest.approx(64 * 128 * tiny.kv_bytes_per_token / 1e9)
    assert static.memory.kv_cache == pytest.approx(64 * 40 * tiny.kv_bytes_per_token / 1e9)


def test_decode_has_a_latency_floor():
    lay = Layout(dp=1, tp=1, backend="vllm")
    one = generate_cost(Q7, lay, Demand(1, 16, 256, 256), H100, free_gb=60.0)
    # one sequence: every step still reads all the weights — the step time is at least weights / bandwidth
    weights = 2 * Q7.params_total
    assert one.detail["step_s"] >= weights / (H100.hbm * H100.eff.decode_bw)


def test_more_devices_train_faster_and_tp_pays_communication():
    d = Demand(sequences=256, prompt_len=512, response_len=512, mean_response_len=512, updates=4)
    t4 = train_cost(Q7, Layout(dp=4, backend="fsdp2", fsdp=True), d, H100, logits=True).time
    t8 = train_cost(Q7, Layout(dp=8, backend="fsdp2", fsdp=True), d, H100, logits=True).time
    assert t8 < t4
    # FSDP across nodes gathers the parameters over the network every micro-batch: bigger micro-batches pay it less often
    mb1 = train_cost(Q7, Layout(dp=16, backend="fsdp2", fsdp=True, micro_batch=1), d, H100, logits=True).detail["dp"]
    mb4 = train_cost(Q7, Layout(dp=16, backend="fsdp2", fsdp=True, micro_batch=4), d, H100, logits=True).detail["dp"]
    assert mb4 < mb1
    tp1 = train_cost(Q7, Layout(dp=8, tp=1, backend="megatron"), d, H100, logits=True)
    tp4 = train_cost(Q7, Layout(dp=2, tp=4, backend="megatron"), d, H100, logits=True)
    assert tp1.detail["tp"] == 0 and tp4.detail["tp"] > 0
    # pipeline bubbles shrink as the micro-batch count grows
    pp_small = train_cost(Q7, Layout(dp=2, pp=4, backend="megatron", micro_batch=16), d, H100, logits=True)
    pp_many = train_cost(Q7, Layout(dp=2, pp=4, backend="megatron", micro_batch=1), d, H100, logits=True)
    assert pp_small.detail["pp_bubble"] > pp_many.detail["pp_bubble"]
    # the gradient all-reduce crosses nodes once the data-parallel group leaves one
    one_node = train_cost(Q7, Layout(dp=8, backend="megatron"), d, H100, logits=True).detail["dp"]
    two_nodes = train_cost(Q7, Layout(dp=16, backend="megatron"), d, H100, logits=True).detail["dp"]
    assert two_nodes > one_node


def test_forward_of_a_frozen_role_keeps_its_weights_resident():
    d = Demand(sequences=64, prompt_len=512, response_len=512, mean_response_len=512)
    c = forward_cost(Q7, Layout(dp=4, tp=2, backend="megatron"), d, H100, logits=True, frozen=True)
    assert c.resident_gb == pytest.approx(2 * Q7.params_total / 2 / 1e9)
    off = forward_cost(Q7, Layout(dp=8, backend="fsdp2", fsdp=True, offload_params=True), d, H100, logits=True, frozen=True)
    assert off.resident_gb == 0.0 and off.host_gb > 0


def test_a_cpu_plan_counts_each_worker_process_and_its_engine():
    """On CPUs the device memory is the host's: every phase's buffers hold the worker process
    itself (torch, transformers, Ray's worker core) and a vLLM engine its own libraries and
    workspaces; a worker of k cores reserves k cores' share of the controller and Ray. Measured
    by bench/calibrate_memory.py; before, a CPU plan priced the 34M run at 1.1 GB per worker
    while it took 2.4 GB."""
    from flowc.ir.hardware import get_profile
    from flowc.passes.costs import FIXED_BUFFERS_GB

    core = get_profile("cpu")
    assert core.process_gb > 0.2 and core.rollout["vllm"].resident_gb > 0.2 and core.reserved_gb > 0
    two = ClusterSpec(device="cpu", nodes=1, devices_per_node=1, cores_per_device=2).profile
    assert two.reserved_gb == pytest.approx(2 * core.reserved_gb)
    hw = Hw.of(ClusterSpec(device="cpu", nodes=1, devices_per_node=1, cores_per_device=2), "float32")
    tiny = ModelSpec.resolve("flowc-tiny").model_copy(update={"dtype": "float32"})
    d = Demand(sequences=64, prompt_len=8, response_len=32, mean_response_len=16, updates=1)
    base = FIXED_BUFFERS_GB["cpu"] + core.process_gb
    assert train_cost(tiny, Layout(backend="fsdp2"), d, hw, logits=True).memory.buffers == pytest.approx(base)
    assert generate_cost(tiny, Layout(backend="hf"), d, hw, free_gb=4.0).memory.buffers == pytest.approx(base)
    vllm = generate_cost(tiny, Layout(backend="vllm"), d, hw, free_gb=4.0)
    assert vllm.memory.buffers == pytest.approx(base + core.rollout["vllm"].resident_gb)
    gpu = generate_cost(Q7, Layout(backend="vllm"), d, H100, free_gb=60.0)
    assert gpu.memory.buffers == pytest.approx(FIXED_BUFFERS_GB["gpu"])  # a GPU's host process is not device memory


def test_padding_by_hand_and_token_budgets_bin_it_away():
    """A micro-batch is as wide as its longest row. Responses of mean 256 up to 1024 tokens:
    micro-batches of m rows in order pay a share 1 - 1/m of the 768-token spread, a token
    budget (rows sorted by length into k micro-batches) a share (1 - 1/s)/k (issue 14)."""
    from flowc.passes.costs import padded_seq_len

    d = Demand(sequences=64, prompt_len=256, response_len=1024, mean_response_len=256)
    rows = Layout(dp=1, micro_batch=4)
    assert padded_seq_len(d, rows, 64) == pytest.approx(512 + 768 * (1 - 1 / 4))
    budget = rows.model_copy(update={"micro_tokens": 4 * 1280})  # 4 rows of the longest length
    k = -(-64 * 512 // (4 * 1280))  # 7 micro-batches of the 64 rows' 512 mean tokens
    assert padded_seq_len(d, budget, 64) == pytest.approx(512 + 768 * (1 - 1 / 64) / k)
    # every response at the limit: nothing to pad
    full = Demand(sequences=64, prompt_len=256, response_len=1024, mean_response_len=1024)
    assert padded_seq_len(full, rows, 64) == padded_seq_len(full, budget, 64) == 1280
    # the budget trains faster (fewer padded tokens, fewer and fuller micro-batches) and never holds more
    # activations than micro_batch rows of the longest length
    t_rows = train_cost(Q7, rows, d, H100, logits=True)
    t_budget = train_cost(Q7, budget, d, H100, logits=True)
    assert t_budget.time < 0.7 * t_rows.time
    worst = train_cost(Q7, rows, full, H100, logits=True)
    assert t_budget.memory.activations <= worst.memory.activations + 1e-9
    f_rows = forward_cost(Q7, rows, d, H100, logits=True, frozen=True)
    f_budget = forward_cost(Q7, budget, d, H100, logits=True, frozen=True)
    assert f_budget.time < f_rows.time


def test_a_micro_batchs_fixed_cost_includes_the_master_weight_cast():
    """fsdp2 in bf16 over fp32 master weights casts them every micro-batch (16 bytes per
    parameter with the gradient accumulation); Megatron holds bf16 parameters and does not.
    The fixed cost is reported in tokens of compute for the runtime's cuts."""
    from flowc.passes.train_costs import MASTER_CAST_BYTES

    d = Demand(sequences=256, prompt_len=512, response_len=512, mean_response_len=512)
    one, four = Layout(dp=8, fsdp=False, micro_batch=32), Layout(dp=8, fsdp=False, micro_batch=8)
    c1, c4 = (train_cost(Q7, lay, d, H100, logits=True) for lay in (one, four))
    cast = 3 * MASTER_CAST_BYTES * Q7.params_total / (H100.hbm * 0.8)  # three more micro-batches
    mega = train_cost(Q7, Layout(dp=8, backend="megatron", micro_batch=32), d, H100, logits=True)
    mega4 = train_cost(Q7, Layout(dp=8, backend="megatron", micro_batch=8), d, H100, logits=True)
    # the same compute, launches and gradient all-reduce on both: what differs is the cast
    assert (c4.time - c1.time) - (mega4.time - mega.time) == pytest.approx(cast, rel=0.02)
    assert c1.micro_overhead_tokens > mega.micro_overhead_tokens > 0


def test_the_slowest_pipeline_stage_sets_the_pace():
    """Qwen2.5-7B (28 layers, 152,064 × 3,584 LM head, untied) on 4 stages: 7 layers each, and the
    last also holds the head. By hand: layers' matmul parameters = matmul_params − head; the last
    stage's share = 7/28 of them + the head, against the mean quarter of both. Every micro-batch
    waits for it, so the pipeline's extra time (pp_bubble) holds the skew on top of fill and
    drain; without logits (a critic's value head) or without a pipeline there is none."""
    from flowc.passes.train_costs import stage_skew

    head = 152064 * 3584
    body = matmul_params(Q7) - head
    assert stage_skew(Q7, 4, logits=True) == pytest.approx((body * 7 / 28 + head) / ((body + head) / 4))
    assert stage_skew(Q7, 4, logits=True) == pytest.approx(1.23, abs=0.005)  # (2.18 B against 1.77 B parameters)
    assert stage_skew(Q7, 3, logits=False) == pytest.approx(10 / (28 / 3))  # ⌈28/3⌉ = 10 layers on the slowest
    assert stage_skew(Q7, 1, logits=True) == 1.0
    # the layers' attention is spread over every stage: at 32k tokens the head's share, and the skew, are smaller
    assert 1.1 < stage_skew(Q7, 4, logits=True, seq_len=32768) < stage_skew(Q7, 4, logits=True, seq_len=1024) < 1.23
    d = Demand(sequences=256, prompt_len=512, response_len=512, mean_response_len=512, updates=4)
    lay = Layout(dp=2, pp=4, backend="megatron", micro_batch=1)
    cost = train_cost(Q7, lay, d, H100, logits=True)
    mbs = 256 / 2 / 4  # micro-batches per replica per update
    skew = cost.detail["compute"] * (stage_skew(Q7, 4, logits=True, seq_len=1024) - 1)  # (prompt 512 + response 512)
    fill_drain = (cost.detail["compute"] + skew) * 3 / mbs
    assert skew + fill_drain < cost.detail["pp_bubble"] < (skew + fill_drain) * 1.05  # (+ the activations' p2p)
    fwd = forward_cost(Q7, lay, d, H100, logits=True, frozen=True)
    assert fwd.detail["pp_bubble"] > fwd.detail["compute"] * 0.2  # the head's stage, for log-probs too


def test_forward_ops_are_priced_at_the_forward_factor_not_a_bare_gemms():
    """A framework's forward pass runs the training pass's kernels: its compute is priced at
    ``eff.forward`` (GPU profiles: ``train``), not the bare-GEMM ``matmul`` rate that a rollout
    engine's prefill and decode keep."""
    from dataclasses import replace

    from flowc.ir.hardware import Efficiency

    d = Demand(sequences=256, prompt_len=512, response_len=512, mean_response_len=512)
    lay = Layout(dp=16, backend="fsdp2", fsdp=True)
    assert H100.eff.forward == H100.eff.train < H100.eff.matmul
    base = forward_cost(Q7, lay, d, H100, logits=True, frozen=True)
    half = replace(H100, eff=H100.eff.model_copy(update={"forward": H100.eff.forward / 2}))
    no_gemm = replace(H100, eff=H100.eff.model_copy(update={"matmul": H100.eff.matmul / 2}))
    assert forward_cost(Q7, lay, d, half, logits=True, frozen=True).detail["compute"] == pytest.approx(2 * base.detail["compute"])
    assert forward_cost(Q7, lay, d, no_gemm, logits=True, frozen=True).time == pytest.approx(base.time)
    # a profile or a cluster file's efficiency without ``forward`` keeps the earlier pricing (matmul's)
    legacy = Efficiency(matmul=0.7, train=0.5, decode_bw=0.6, intra_node=0.8, inter_node=0.8)
    assert legacy.forward == 0.7


def test_a_compute_bound_decode_step_pays_the_gemm_shape_factor():
    """On an H20 (148 TFLOP/s) a 7B engine at tp 4 decoding 1024 sequences is compute-bound; its
    step's GEMMs run on 896-wide shards: 896/(896+256) of the rate. The token term is not taken (a
    step of one sequence is bound by reading the weights, which the memory term prices)."""
    from flowc.passes.costs import shape_efficiency
    from flowc.passes.flops import attention_flops_per_token
    from flowc.passes.generation_costs import decode_step_device_s

    h20 = Hw.of(ClusterSpec.parse("1x8xH20"))
    lay = Layout(tp=4, backend="vllm")
    shape = shape_efficiency(None, Q7.hidden_size / 4, h20)
    assert shape == pytest.approx(896 / 1152)
    flops = 1024 * (2 * matmul_params(Q7) / 4 + attention_flops_per_token(Q7, 1500) / 4)
    assert decode_step_device_s(Q7, lay, h20, 1024, 1500) == pytest.approx(flops / (h20.peak * h20.eff.matmul * shape))
    # one sequence: memory-bound, the weight shard read once
    from flowc.passes.generation_costs import kv_bytes_per_token_device

    one = (2 * Q7.params_total / 4 + 1500 * kv_bytes_per_token_device(Q7, lay)) / (h20.hbm * h20.eff.decode_bw)
    assert decode_step_device_s(Q7, lay, h20, 1, 1500) == pytest.approx(one)


@settings(max_examples=300, deadline=None)
@given(layers=st.integers(1, 160), pp=st.integers(1, 32))
def test_a_pipeline_split_gives_every_stage_a_layer_as_megatron_builds_it(layers, pp):
    """``stage_split`` is what the runtime has Megatron build (equal middle stages, the first and
    last stages set apart) and what the planner prices: every stage a layer, the layers all placed,
    the last stage (the LM head's) no fuller than the first, ``⌈L/pp⌉`` at most where the ends allow."""
    split = stage_split(layers, pp)
    if pp > layers:
        assert split is None
        return
    assert split is not None and len(split) == pp and sum(split) == layers and min(split) >= 1
    assert len(set(split[1:-1])) <= 1 and split[-1] <= split[0]
    k = -(-layers // pp)
    if layers % pp == 0:
        assert set(split) == {layers // pp}
    elif layers - (pp - 2) * k >= 2:
        assert max(split) == k
    else:  # the middle stages at ⌊L/pp⌋ and the ends the rest (the fullest stage: what memory prices)
        assert set(split[1:-1]) == {layers // pp} and split[-1] >= layers // pp


def test_a_pipeline_that_does_not_divide_the_layers_is_priced_by_its_split():
    """Qwen2.5-7B's 28 layers on 8 stages: 2, 4 × 6, 2. The fullest device is the last stage's (2
    layers, the head and the final norm), not ⌈28/8⌉ = 4 layers beside the head (what the planner
    counted before it split as the runtime does); the slowest stage is the last too."""
    from flowc.passes.train_costs import stage_skew

    assert stage_split(28, 8) == (2, 4, 4, 4, 4, 4, 4, 2)
    e, h = 152064 * 3584, 3584
    per = (Q7.params_total - 2 * e - h) / 28
    assert Q7.largest_stage(8) == (pytest.approx(2 * per + e + h), 0.0)
    assert 2 * per + e + h > 4 * per  # the head's stage, not a middle one
    head = 152064 * 3584
    body = (matmul_params(Q7) - head) / 28
    assert stage_skew(Q7, 8, logits=True) == pytest.approx((2 * body + head) / ((28 * body + head) / 8))
    assert stage_skew(Q7, 8, logits=False) == pytest.approx(4 / (28 / 8))  # a middle stage, without the head
    # 61 layers in 12 stages (DeepSeek-V3 as verl runs it): the middle take 5, the first 6
    assert stage_split(61, 12) == (6, *[5] * 10, 5)
    # 28 layers in 12 stages: 3 a stage in the middle would leave the ends none, so 4, 2 × 10, 4 —
    # the first stage (pp micro-batches in flight under 1F1B) holds 4 layers' activations, as at pp 7
    from flowc.passes.costs import activation_gb

    assert stage_split(28, 12) == (4, *[2] * 10, 4)
    for ckpt in (False, True):
        kw = dict(train=True, logits=False, in_flight=4.0)
        at12 = activation_gb(Q7, Layout(pp=12, backend="megatron", activation_checkpointing=ckpt), 4096, **kw)
        at7 = activation_gb(Q7, Layout(pp=7, backend="megatron", activation_checkpointing=ckpt), 4096, **kw)
        assert at12 == pytest.approx(at7)


def test_more_pipeline_stages_than_layers_is_an_error_not_a_price():
    from flowc.errors import SpecError

    tiny = ModelSpec.resolve("flowc-tiny")
    with pytest.raises(SpecError, match=rf"pp=3 is more pipeline stages than .*'s {tiny.num_layers} layers"):
        tiny.largest_stage(3)
