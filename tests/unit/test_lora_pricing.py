"""LoRA in the planner and the config: the adapters' size equals peft's, the planner prices
only the adapters' gradients and optimizer state (by hand), the plan records the adapters and
the runtime refuses them on a backend that does not train them."""

from __future__ import annotations

import pytest
import torch
from helpers import EXAMPLES

from flowc.compile import compile_plan, saved_conflicts
from flowc.errors import PlanError, SpecError
from flowc.ir.cluster import ClusterSpec
from flowc.ir.lora import LoraConfig, adapter_params
from flowc.ir.models import ModelSpec
from flowc.ir.plan import Layout
from flowc.ir.plan_text import format_plan
from flowc.ir.run_config import RunConfig
from flowc.ir.workload import WorkloadSpec
from flowc.loader import load_flow
from flowc.passes.costs import train_state_gb
from flowc.run import checkpoint_bytes
from flowc.runtime.program import check_executable

Q7 = ModelSpec.resolve("qwen2.5-7b")
R16 = LoraConfig(rank=16)  # all-linear


def test_config_keys_and_their_errors():
    cfg, _ = RunConfig.load(None, ["optim.actor.lora.rank=8", "optim.actor.lora.target_modules=[q_proj, v_proj]"])
    lora = cfg.optim_for("actor").lora
    assert (lora.rank, lora.modules, lora.scaling) == (8, ("q_proj", "v_proj"), 2.0)
    assert not cfg.optim_for("critic").lora.enabled  # off unless asked for
    cfg, _ = RunConfig.load(None, ["default_optim.lora.rank=4", "default_optim.lora.target_modules=q_proj,o_proj"])
    assert cfg.optim_for("critic").lora.modules == ("q_proj", "o_proj")
    with pytest.raises(SpecError, match="did you mean 'rank'"):
        RunConfig.load(None, ["optim.actor.lora.rnak=8"])
    with pytest.raises(SpecError, match="qkv is not a decoder linear layer") as e:
        RunConfig.load(None, ["optim.actor.lora.target_modules=qkv"])
    assert "all-linear" in e.value.fix


@pytest.mark.parametrize("name", ["qwen2.5-7b", "llama-3.1-8b"])
@pytest.mark.parametrize("lora", [R16, LoraConfig(rank=8, target_modules=["q_proj", "v_proj"])], ids=["all", "qv"])
def test_adapter_count_equals_peft(name, lora):
    """The planner's count is the number of parameters peft makes trainable on the real
    architecture (built on the meta device); Qwen2.5-7B r16 all-linear is peft's 40,370,176."""
    from transformers import AutoModelForCausalLM

    from flowc.runtime.lora import add_adapters
    from flowc.runtime.modeling import hf_config

    m = ModelSpec.resolve(name)
    with torch.device("meta"):
        lm = add_adapters(AutoModelForCausalLM.from_config(hf_config(m)), lora, seed=0, role="actor")
    assert sum(p.numel() for p in lm.parameters() if p.requires_grad) == adapter_params(m, lora)
    if name == "qwen2.5-7b" and lora == R16:
        assert adapter_params(m, lora) == 40_370_176


def test_planner_prices_only_the_adapters_state_by_hand():
    p, a = Q7.params_total, adapter_params(Q7, R16)
    lora = Q7.model_copy(update={"lora": R16})
    for lay, shards in ((Layout(dp=8, fsdp=True), 8), (Layout(dp=8), 1)):
        full = train_state_gb(Q7, lay)
        assert full == pytest.approx((4 * p / shards / 1e9, 4 * p / shards / 1e9, 8 * p / shards / 1e9))
        w, g, o = train_state_gb(lora, lay)
        # the frozen base: bf16 weights only; the adapters: fp32 weights, gradients, Adam m and v
        assert w == pytest.approx((2 * (p - a) + 4 * a) / shards / 1e9)
        assert (g, o) == pytest.approx((4 * a / shards / 1e9, 8 * a / shards / 1e9))
        assert g + o < (full[1] + full[2]) / 150  # 0.5 % of the parameters train


def _grpo(model: str, sets: list[str], cluster: str = "1x8xH100", pins: list[str] | None = None):
    g = load_flow(str(EXAMPLES / "grpo.py")).trace()
    cfg, _ = RunConfig.load(None, sets)
    plan = compile_plan(
        g, {"actor": model, "ref": model}, ClusterSpec.parse(cluster), WorkloadSpec(), cfg,
        pin_words=pins or [], rollout=None, split_local=False, here=False,
    )  # fmt: skip
    return plan, cfg


def test_plan_with_lora_records_it_and_its_memory():
    """Llama-3.1-70B GRPO on one 8×H100 node: trained whole, the actor's state must be offloaded
    to the host; with LoRA r16 its gradients and optimizer state are the adapters' alone and
    the whole state can stay on the GPUs (the planner may still offload the frozen base to
    leave the generation engine more cache: pinned resident, the plan is feasible)."""
    full, _ = _grpo("llama-3.1-70b", [])
    lora, _ = _grpo("llama-3.1-70b", ["optim.actor.lora.rank=16"])
    resident = ["actor.train.offload_params=false", "actor.train.offload_optimizer=false"]
    kept, _ = _grpo("llama-3.1-70b", ["optim.actor.lora.rank=16"], pins=resident)
    assert full.roles["actor"].lora is None and lora.roles["actor"].lora == R16
    assert lora.roles["ref"].lora is None  # only trained roles have adapters
    tr_full, tr = full.phase("actor", "train"), kept.phase("actor", "train")
    assert tr_full.layout.offload_params  # 70B × 16 bytes does not fit 8 × 80 GB
    assert tr.layout.backend == "fsdp2" and not tr.layout.offload_params and not tr.layout.offload_optimizer
    m = ModelSpec.resolve("llama-3.1-70b")
    a = adapter_params(m, R16) / (tr.layout.dp if tr.layout.fsdp else 1)
    assert tr.memory.gradients == pytest.approx(4 * a / 1e9, abs=1e-4)
    assert tr.memory.optimizer == pytest.approx(8 * a / 1e9, abs=1e-4)
    assert lora.predicted.step_time_s < full.predicted.step_time_s
    assert "actor=llama-3.1-70b (70.5537B, LoRA r16 α16 all-linear)" in format_plan(lora)
    # the room a run checks for: a checkpoint holds the adapters and their Adam moments (2.5 GB, not 847)
    assert checkpoint_bytes(lora) == 12 * adapter_params(m, R16)
    assert checkpoint_bytes(full) == pytest.approx(12 * m.params_total)


def test_lora_is_refused_where_it_cannot_run():
    with pytest.raises(SpecError, match="megatron backend does not do") as e:
        _grpo("qwen2.5-7b", ["optim.actor.lora.rank=8"], pins=["actor.train.backend=megatron"])
    assert "fsdp2" in e.value.fix
    with pytest.raises(SpecError, match="mixture-of-experts") as e:
        _grpo("qwen3-30b-a3b", ["optim.actor.lora.rank=8"])
    assert "q_proj,k_proj,v_proj,o_proj" in e.value.fix
    plan, _ = _grpo("qwen3-30b-a3b", ["optim.actor.lora.rank=8", "optim.actor.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"])
    assert plan.roles["actor"].lora.modules == ("q_proj", "k_proj", "v_proj", "o_proj")
    # a plan (edited, or from another flowc) that trains LoRA on megatron does not lower
    rp = plan.roles["actor"]
    tr = rp.phases["train"]
    bad_tr = tr.model_copy(update={"layout": tr.layout.model_copy(update={"backend": "megatron", "fsdp": False})})
    bad = plan.model_copy(
        update={"roles": {**plan.roles, "actor": rp.model_copy(update={"phases": {**rp.phases, "train": bad_tr}})}}
    )
    with pytest.raises(PlanError, match="megatron backend does not do"):
        check_executable(bad, here=False)


def test_saved_plan_and_config_must_agree_on_lora():
    plan, cfg = _grpo("qwen2.5-7b", ["optim.actor.lora.rank=16"])
    common = {"workload": None, "pins": [], "rollout": None}
    assert saved_conflicts(plan, config=cfg, **common) == []
    assert saved_conflicts(plan, config=RunConfig(), **common) == []  # silent: the plan's adapters run
    # the same workload beside the plan agrees, also with a plan saved before a workload field existed
    words = ",".join(f"{k}={v}" for k, v in plan.workload.items() if v is not None and k != "response_percentiles")
    older = plan.model_copy(update={"workload": {k: v for k, v in plan.workload.items() if k != "mean_response_cv"}})
    assert saved_conflicts(older, config=cfg, pins=[], rollout=None, workload=words) == []
    (wl,) = saved_conflicts(older, config=cfg, pins=[], rollout=None, workload=words + ",mean_response_cv=0.3")
    assert wl.startswith("--workload")
    other, _ = RunConfig.load(None, ["optim.actor.lora.rank=8"])
    (msg,) = saved_conflicts(plan, config=other, **common)
    assert "optim.actor.lora: r8 α16 all-linear" in msg and "the plan's: r16" in msg
    off, _ = RunConfig.load(None, ["optim.actor.lora.rank=0"])
    assert "optim.actor.lora: off" in saved_conflicts(plan, config=off, **common)[0]
