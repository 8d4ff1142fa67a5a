"""The planner chooses the rollout backend by predicted cost (issue 19).

Each backend is priced by the same FLOP and byte model plus what its engine costs on the
device type (``rollout:`` in the hardware profile): vLLM's host work per request and its
continuous batching, the HF loop's padded batch that decodes until the wave's longest response
ends. Regression: the planner took the first installed backend (vLLM), which on the shipped
0.5 M model generates at 0.35× the HF loop's rate."""

from __future__ import annotations

import pytest
from helpers import EXAMPLES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowc.ir.cluster import ClusterSpec
from flowc.ir.hardware import RolloutCost
from flowc.ir.models import ModelSpec
from flowc.ir.plan import Layout, Target
from flowc.ir.workload import WorkloadSpec
from flowc.loader import load_flow
from flowc.passes.costs import Hw
from flowc.passes.flops import Demand
from flowc.passes.generation_costs import generate_cost
from flowc.passes.pins import parse_pins
from flowc.passes.pipeline import make_plan
from flowc.runtime.step_metrics import covered_seconds

LOCAL = ClusterSpec.parse("local")
BOTH = Target.of(LOCAL, rollout_backends=("vllm", "hf"))


def _grpo():
    return load_flow(str(EXAMPLES / "grpo.py")).trace()


def _models(name: str = "flowc-tiny"):
    m = ModelSpec.resolve(name).model_copy(update={"dtype": "float32"})
    return {"actor": m, "ref": m}


def _hw(**rollout: RolloutCost) -> Hw:
    from dataclasses import replace

    return replace(Hw.of(LOCAL), rollout=tuple(sorted(rollout.items())))


def test_vllm_pays_per_request_and_hf_decodes_the_padded_batch():
    m = ModelSpec.resolve("flowc-tiny").model_copy(update={"dtype": "float32"})
    d = Demand(sequences=64, prompt_len=8, response_len=24, mean_response_len=4.0)
    plain = _hw()
    v0 = generate_cost(m, Layout(backend="vllm"), d, plain, free_gb=8.0)
    h0 = generate_cost(m, Layout(backend="hf"), d, plain, free_gb=8.0)
    # continuous batching decodes until the longest of the 64 ends, with the unfinished sequences;
    # the padded batch as long, every row every step (the longest of 64 exponential lengths of
    # mean 4 is about 4 × H_64 ≈ 18.9 steps)
    assert v0.detail["decode_steps"] == pytest.approx(d.lengths.quantile(1 - 0.5 / 64))
    assert h0.detail["decode_steps"] == pytest.approx(d.lengths.expected_max(64))
    assert 17 < h0.detail["decode_steps"] < 21 and 17 < v0.detail["decode_steps"] < 21
    assert v0.detail["concurrency"] == 64 and h0.detail["concurrency"] == 64
    # the padded rows compute to the end; the finished leave: a step of the continuous batch costs less
    # (the totals also differ by the two estimates of the longest of 64, a quantile and an expectation)
    assert v0.detail["step_s"] < h0.detail["step_s"]
    assert v0.detail["requests"] == 0.0 == h0.detail["requests"]
    costly = _hw(vllm=RolloutCost(request_ms=2.0, step_ms=1.0))
    v1 = generate_cost(m, Layout(backend="vllm"), d, costly, free_gb=8.0)
    assert v1.detail["requests"] == pytest.approx(64 * 2e-3)
    assert v1.time == pytest.approx(v0.time + 64 * 2e-3 + v0.detail["decode_steps"] * 1e-3)
    slow = _hw(hf=RolloutCost(decode_scale=0.5, layer_overhead_us=0.0))
    h1 = generate_cost(m, Layout(backend="hf"), d, slow, free_gb=8.0)
    floor = m.num_layers * plain.layer_overhead
    assert h1.detail["step_s"] == pytest.approx(2 * (h0.detail["step_s"] - floor))  # kernels at half speed, no layer cost


def _plan(models, workload, pins=(), cluster=LOCAL, target=BOTH):
    plan, _, _ = make_plan(_grpo(), models, cluster, workload, parse_pins(list(pins)), target=target)
    return plan


def test_the_tiny_model_generates_with_hf_on_cpu_and_why_says_what_vllm_would_cost():
    plan = _plan(_models(), WorkloadSpec(prompts=64, prompt_len=8, response_len=6))
    assert plan.phase("actor", "generate").layout.backend == "hf"
    line = next(w for w in plan.why if w.startswith("actor.gen generates with hf"))
    assert "vllm would take" in line and "per-request host work" in line
    alone = _plan(
        _models(), WorkloadSpec(prompts=64, prompt_len=8, response_len=6), target=Target.of(LOCAL, rollout_backends=("vllm",))
    )
    assert alone.phase("actor", "generate").layout.backend == "vllm"
    assert not any("generates with" in w for w in alone.why)  # one backend offered: nothing to choose


def test_a_pin_overrides_the_choice_and_why_says_so():
    plan = _plan(_models(), WorkloadSpec(prompts=64, prompt_len=8, response_len=6), pins=["actor.generate.backend=vllm"])
    assert plan.phase("actor", "generate").layout.backend == "vllm"
    assert any(w.startswith("actor.gen generates with vllm") and w.endswith("(pinned).") for w in plan.why)


def test_gpu_clusters_generate_with_vllm():
    h100 = ClusterSpec.parse("1x8xH100")
    plan = _plan(
        _models("qwen2.5-7b"),
        WorkloadSpec(prompts=256, prompt_len=512, response_len=1024),
        cluster=h100,
        target=Target.of(h100, rollout_backends=("vllm", "hf")),
    )
    assert plan.phase("actor", "generate").layout.backend == "vllm"
    assert any(w.startswith("actor.gen generates with vllm") and "hf would take" in w for w in plan.why)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.sampled_from([4, 16, 64, 256]),
    response_len=st.sampled_from([4, 24, 128]),
    mean_frac=st.sampled_from([0.1, 0.5, 1.0]),
    request_ms=st.sampled_from([0.0, 0.8, 5.0]),
)
def test_choosing_is_never_slower_than_pinning_either_backend(prompts, response_len, mean_frac, request_ms):
    """Whatever the workload and the engines' costs, the planner's free choice predicts a step
    no slower than the better of the two pinned backends."""
    from unittest import mock

    from flowc.passes import costs

    hw = _hw(vllm=RolloutCost(request_ms=request_ms), hf=RolloutCost(decode_scale=0.7))
    wl = WorkloadSpec(
        prompts=prompts, prompt_len=8, response_len=response_len, mean_response_len=max(1.0, mean_frac * response_len)
    )
    with mock.patch.object(costs.Hw, "of", classmethod(lambda cls, cluster, dtype="bfloat16": hw)):
        free = _plan(_models(), wl).predicted.step_time_s
        pinned = [_plan(_models(), wl, pins=[f"actor.generate.backend={b}"]).predicted.step_time_s for b in ("vllm", "hf")]
    assert free <= min(pinned) * (1 + 1e-9)


def test_covered_seconds_is_the_union_of_the_spans():
    assert covered_seconds([], 0.0, 10.0) == 0.0
    assert covered_seconds([(1.0, 2.0), (2.0, 2.0), (8.0, 5.0)], 0.0, 10.0) == pytest.approx(5.0)  # [1,4] ∪ [8,10]
    assert covered_seconds([(-1.0, 2.0), (0.5, 0.1)], 0.0, 10.0) == pytest.approx(1.0)
    assert covered_seconds([(2.0, 1.0), (1.0, 5.0)], 0.0, 3.0) == pytest.approx(2.0)
