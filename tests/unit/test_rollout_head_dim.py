"""A model whose head_dim vLLM's CPU build cannot run is caught when the run is planned,
before anything starts: generated with hf when the rollout backend is the planner's to
choose (and the plan says why), refused with the fix when vllm is pinned.

Regression: such a model (head_dim 16) failed 38 s into the run with a bare vLLM error."""

from __future__ import annotations

import importlib.util
import json

import pytest
from helpers import EXAMPLES

from flowc.compile import check_saved, compile_plan
from flowc.errors import SpecError
from flowc.ir.cluster import ClusterSpec
from flowc.ir.models import ModelSpec
from flowc.ir.plan import Target
from flowc.ir.run_config import RunConfig
from flowc.ir.workload import WorkloadSpec
from flowc.loader import load_flow
from flowc.passes.pins import parse_pins
from flowc.passes.pipeline import make_plan
from flowc.planning import fit_rollout

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

WORKLOAD = WorkloadSpec(prompts=8, prompt_len=16, response_len=16)


def _model(tmp_path, head_dim: int):
    """A tiny Qwen2 config (no weights: nothing here loads it) with 4 heads of ``head_dim``."""
    d = tmp_path / f"qwen-hd{head_dim}"
    d.mkdir()
    cfg = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 4 * head_dim,
        "intermediate_size": 8 * head_dim,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 64,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def _grpo():
    return load_flow(str(EXAMPLES / "grpo.py")).trace()


def _compile(g, src: str, rollout: str | None, pins: list[str] = ()):
    return compile_plan(
        g,
        {"actor": src, "ref": src},
        ClusterSpec.parse("local"),
        WORKLOAD,
        RunConfig(),
        pin_words=list(pins),
        rollout=rollout,
        split_local=False,
    )


def test_the_supported_head_sizes_are_vllms_own():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from flowc.runtime.backends.vllm import cpu_head_sizes

    assert cpu_head_sizes() == tuple(CPUAttentionBackend.get_supported_head_sizes())
    assert 16 not in cpu_head_sizes() and 32 in cpu_head_sizes()


def test_unpinned_rollout_generates_with_hf_and_says_why(tmp_path):
    g, src = _grpo(), _model(tmp_path, 16)
    assert ModelSpec.resolve(src).head_dim == 16
    target = Target.of(ClusterSpec.parse("local"), rollout_backends=("vllm", "hf"))
    pins, notes = fit_rollout(g, {"actor": ModelSpec.resolve(src)}, target, parse_pins([]))
    assert pins.phase("actor", "generate").backend == "hf"
    assert len(notes) == 1 and "head_dim is 16" in notes[0] and "32, 64" in notes[0] and src in notes[0]
    plan = _compile(g, src, None)
    assert plan.phase("actor", "generate").layout.backend == "hf"
    assert "head_dim is 16" in plan.why[0] and plan.why[0].startswith("actor generates with hf, not vllm")
    # a head size vLLM runs leaves the planner both backends to choose from, with nothing to say
    ok = _model(tmp_path, 32)
    assert fit_rollout(g, {"actor": ModelSpec.resolve(ok)}, target, parse_pins([])) == (parse_pins([]), [])
    assert _compile(g, ok, "vllm").phase("actor", "generate").layout.backend == "vllm"


def test_pinned_vllm_is_refused_before_anything_starts(tmp_path):
    g, src = _grpo(), _model(tmp_path, 16)
    with pytest.raises(SpecError) as e:
        _compile(g, src, "vllm")
    msg = str(e.value)
    assert src in msg and "head_dim is 16" in msg and "32, 64, 80" in msg and "--rollout vllm" in msg
    assert "--rollout hf" in e.value.fix
    with pytest.raises(SpecError, match="head_dim is 16") as e:
        _compile(g, src, None, ["actor.generate.backend=vllm"])
    assert "--pin actor.generate.backend=hf" in e.value.fix


def test_a_saved_plan_generating_with_vllm_is_refused(tmp_path):
    g, src = _grpo(), _model(tmp_path, 16)
    m = ModelSpec.resolve(src)
    target = Target.of(ClusterSpec.parse("local"), rollout_backends=("vllm", "hf"))
    plan, _, _ = make_plan(
        g,
        {"actor": m, "ref": m},
        ClusterSpec.parse("local"),
        WORKLOAD,
        parse_pins(["actor.generate.backend=vllm"]),
        target=target,
    )
    assert plan.phase("actor", "generate").layout.backend == "vllm"
    with pytest.raises(SpecError, match=r"the saved plan p\.json generates actor with vllm, which cannot run .*head_dim is 16"):
        check_saved(plan, g, {"actor": src, "ref": src}, what="the saved plan p.json")
