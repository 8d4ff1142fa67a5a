"""Off-policy corrections and the rollout/trainer mismatch, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

import flowc as fc
from flowc.errors import SpecError
from flowc.ir.cluster import ClusterSpec
from flowc.ir.losses import LOSS_ADAPTER, ISCorrection, is_weights, mismatch, policy_loss
from flowc.ir.models import ModelSpec
from flowc.ir.run_config import RunConfig
from flowc.ir.sampling import SamplingParams
from flowc.ir.workload import WorkloadSpec
from flowc.loader import load_flow
from flowc.passes.pipeline import make_plan
from flowc.planning import run_target, runtime_pins
from flowc.runtime.program import lower
from flowc.runtime.run_checks import behaviour_comparable

# two sequences of two tokens; the second sequence's second token is padding
TRAINER = torch.log(torch.tensor([[0.5, 0.3], [0.2, 0.9]]))
ENGINE = torch.log(torch.tensor([[0.25, 0.3], [0.4, 0.1]]))  # π/μ = [[2, 1], [0.5, —]]
MASK = torch.tensor([[True, True], [True, False]])


def test_truncated_weights_per_token():
    w, st = is_weights(fc.losses.tis(1.5), TRAINER, ENGINE, MASK)
    assert torch.allclose(w, torch.tensor([[1.5, 1.0], [0.5, 0.0]]))
    assert st["is_weight"] == pytest.approx((2 + 1 + 0.5) / 3)  # before truncation
    assert st["is_cut_frac"] == pytest.approx(1 / 3)


def test_masked_weights_drop_tokens_outside_cap_and_floor():
    w, st = is_weights(fc.losses.mis(1.5), TRAINER, ENGINE, MASK)
    assert torch.allclose(w, torch.tensor([[0.0, 1.0], [0.5, 0.0]]))
    w, st = is_weights(fc.losses.mis(1.5, floor=0.6), TRAINER, ENGINE, MASK)
    assert torch.allclose(w, torch.tensor([[0.0, 1.0], [0.0, 0.0]]))
    assert st["is_cut_frac"] == pytest.approx(2 / 3)


def test_sequence_level_weight_is_the_product_over_the_sequence():
    # sequence 0: 2·1 = 2 (padding never counts: sequence 1 is 0.5 whatever its padded token holds)
    w, _ = is_weights(fc.losses.tis(3.0, level="sequence"), TRAINER, ENGINE, MASK)
    assert torch.allclose(w, torch.tensor([[2.0, 2.0], [0.5, 0.0]]))
    w, _ = is_weights(fc.losses.mis(1.5, level="sequence"), TRAINER, ENGINE, MASK)
    assert torch.allclose(w, torch.tensor([[0.0, 0.0], [0.5, 0.0]]))


def test_mismatch_is_k3_and_mean_absolute_log_ratio():
    st = mismatch(TRAINER, ENGINE, MASK)
    k3 = [2 - 1 - math.log(2), 0.0, 0.5 - 1 - math.log(0.5)]
    assert st["mismatch_kl"] == pytest.approx(sum(k3) / 3, rel=1e-5)
    assert st["mismatch_abs"] == pytest.approx((math.log(2) + 0 + math.log(2)) / 3, rel=1e-5)
    assert mismatch(TRAINER, TRAINER, MASK) == {"mismatch_kl": 0.0, "mismatch_abs": 0.0}


def test_policy_gradient_with_truncation_weighs_each_token():
    logp = TRAINER.clone().requires_grad_(True)
    adv = torch.tensor([1.0, -2.0])
    spec = fc.losses.policy_gradient(correction=fc.losses.tis(1.5))
    loss, st = policy_loss(spec, logp, None, adv, MASK, behaviour_logp=ENGINE)
    # token-mean over 3 tokens of -A·logp·w, w = [[1.5, 1], [0.5, —]]
    want = -(1.5 * math.log(0.5) + 1.0 * math.log(0.3) + (-2.0) * 0.5 * math.log(0.2)) / 3
    assert float(loss.detach()) == pytest.approx(want, rel=1e-5)
    loss.backward()  # the weights are constants: d/dlogp = -A·w / 3
    assert torch.allclose(logp.grad, torch.tensor([[-1.5, -1.0], [1.0, 0.0]]) / 3)
    assert st["is_cut_frac"] == pytest.approx(1 / 3)


def test_decoupled_ppo_clips_against_the_proximal_policy_and_weighs_by_behaviour():
    prox = TRAINER
    logp = (TRAINER + torch.log(torch.tensor([[1.5, 1.0], [1.0, 1.0]]))).requires_grad_(True)  # first token: ratio 1.5
    adv = torch.tensor([1.0, 1.0])
    spec = fc.losses.decoupled_ppo(0.2, cap=5.0)
    loss, st = policy_loss(spec, logp, prox, adv, MASK, behaviour_logp=ENGINE)
    # token 0: clipped ratio 1.2 × behaviour weight 2; token 1: ratio 1 × weight 1; token 2: 1 × 0.5
    assert float(loss.detach()) == pytest.approx(-(1.2 * 2 + 1.0 + 0.5) / 3, rel=1e-5)
    assert st["clip_frac"] == pytest.approx(1 / 3)
    assert spec == fc.losses.ppo_clip(0.2, correction=fc.losses.mis(5.0))


def test_without_correction_the_loss_ignores_the_engine():
    logp = TRAINER.clone()
    adv = torch.tensor([1.0, -1.0])
    a, _ = policy_loss(fc.losses.ppo_clip(), logp, None, adv, MASK, behaviour_logp=ENGINE)
    b, _ = policy_loss(fc.losses.ppo_clip(), logp, None, adv, MASK)
    assert float(a) == float(b)


def test_correction_specs_validate_and_round_trip():
    with pytest.raises(ValidationError, match="floor"):
        ISCorrection(kind="tis", floor=0.5)
    with pytest.raises(ValidationError):
        fc.losses.tis(1.0)  # a cap at or below 1 truncates every up-weighted token
    spec = fc.losses.ppo_clip(0.2, correction=fc.losses.mis(3.0, level="sequence"))
    assert LOSS_ADAPTER.validate_python(spec.model_dump()) == spec
    assert str(spec) == "ppo_clip(correction=mis(cap=3.0, level=sequence))"
    with pytest.raises(ValueError, match="no rollout log-probabilities"):
        policy_loss(spec, TRAINER, None, torch.ones(2), MASK)


def test_plain_sampling():
    assert SamplingParams().plain and SamplingParams(greedy=True).plain and SamplingParams(temperature=0.0).plain
    assert not SamplingParams(temperature=0.7).plain and not SamplingParams(top_p=0.9).plain
    assert not SamplingParams(top_k=20).plain and not SamplingParams(min_p=0.1).plain


FLOW = """
import flowc as fc

@fc.flow
def corrected(prompts: fc.Prompts, actor: fc.Policy, reward: fc.Reward, *, n: int = 4):
    rollout = actor.generate(prompts, n=n)
    old = actor.logprobs(rollout)
    adv = fc.ops.group_normalize(reward(rollout), group_size=n)
    actor.update(rollout, advantages=adv, old_logprobs=old, loss=fc.losses.decoupled_ppo(0.2))
"""


def test_a_correction_under_processed_sampling_is_refused(tmp_path):
    path = tmp_path / "corrected.py"
    path.write_text(FLOW)
    g = load_flow(str(path)).trace()
    cl = ClusterSpec.parse("1x8xH100")
    m = ModelSpec.resolve("qwen2.5-7b")
    plan, _, _ = make_plan(
        g,
        {"actor": m},
        cl,
        WorkloadSpec(prompts=64),
        runtime_pins(cl.profile.kind),
        target=run_target(cl, RunConfig(), None, here=False),
    )
    prog = lower(plan)
    assert behaviour_comparable(prog, RunConfig()) is True
    with pytest.raises(SpecError, match="temperature") as e:
        behaviour_comparable(prog, RunConfig(sampling=SamplingParams(temperature=0.7)))
    assert "sample at temperature 1" in e.value.fix


def test_a_generate_step_samples_with_the_config_under_the_flows_keywords():
    from types import SimpleNamespace

    from flowc.runtime.run_checks import sampling_of

    st = SimpleNamespace(args={"n": 4, "temperature": 0.0, "max_tokens": 8})
    sp = sampling_of(st, RunConfig(sampling=SamplingParams(top_p=0.9)))
    assert sp.greedy and sp.top_p == 0.9 and sp.max_tokens == 8  # temperature 0 is greedy wherever it is given
    warm = sampling_of(SimpleNamespace(args={"temperature": 0.8}), RunConfig(sampling=SamplingParams(temperature=0.0)))
    assert not warm.greedy and warm.temperature == 0.8  # the flow's temperature wins over the config's greedy


def test_the_sync_check_fails_an_engine_off_the_trainer_or_unchanged_while_the_trainer_moved():
    from flowc.errors import RuntimeFailure
    from flowc.runtime.sync_check import SyncCheck

    check = SyncCheck("actor", tol=0.1, dtype="bfloat16")
    assert check(0, [-1.0, -2.0], [-1.05, -2.0]) == pytest.approx(0.025)  # within bf16's tolerance
    assert check(1, [-1.2, -2.1], [-1.22, -2.12]) == pytest.approx(0.02)
    with pytest.raises(RuntimeFailure, match="kept its old weights"):  # within 0.1, but bit for bit the old scores
        check(2, [-1.25, -2.15], [-1.22, -2.12])
    fresh = SyncCheck("actor", tol=1e-3, dtype="float32")
    with pytest.raises(RuntimeFailure, match=r"differ from the trainer's by 0\.5 per token"):
        fresh(0, [-1.0, -2.0], [-1.5, -2.5])
    with pytest.raises(RuntimeFailure, match="returned no probe from the generation engine"):
        fresh(0, [-1.0], None)
    quiet = SyncCheck("actor", tol=0.1, dtype="bfloat16")
    quiet(0, [-1.0], [-1.0])
    assert quiet(1, [-1.00001], [-1.0]) < 1e-4  # the trainer barely moved: an unchanged engine is no evidence


def test_the_probe_fits_the_rollout_engines_context():
    """vLLM refuses a sequence longer than its max_model_len (the workload's prompt + response:
    14 tokens for the built-in task), so the probe is cut to it."""
    from transformers import AutoTokenizer

    from flowc.runtime.sync_check import probe_rollout
    from flowc.tasks.arithmetic import asset_dir

    tok = AutoTokenizer.from_pretrained(str(asset_dir()))
    full = probe_rollout(tok, 10_000)
    assert full.prompt_ids.shape[1] + full.response_ids.shape[1] > 14
    cut = probe_rollout(tok, 14)
    assert cut.prompt_ids.shape[1] + cut.response_ids.shape[1] == 14 and cut.response_ids.shape[1] >= 1
