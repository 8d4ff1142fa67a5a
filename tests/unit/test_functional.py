"""fc.ops and the loss math against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

import flowc as fc
from flowc.ir.functional import Rollout
from flowc.ir.losses import PPOClip, aggregate, policy_loss, value_loss


def test_group_normalize_by_hand():
    s = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 13.0])
    out = fc.ops.group_normalize(s, group_size=3)
    # group 1: mean 2, unbiased std 1 → (-1, 0, 1); group 2: mean 11, std sqrt(3)
    std2 = math.sqrt(((10 - 11) ** 2 * 2 + (13 - 11) ** 2) / 2)
    expected = torch.tensor([-1.0, 0.0, 1.0, -1 / std2, -1 / std2, 2 / std2])
    assert torch.allclose(out, expected, atol=1e-5)
    # Dr. GRPO: no division by the std
    assert torch.allclose(fc.ops.group_normalize(s, 3, scale=False), torch.tensor([-1.0, 0, 1, -1, -1, 2]))


def test_group_normalize_needs_groups_of_two():
    with pytest.raises(ValueError, match="group_size >= 2"):
        fc.ops.group_normalize(torch.ones(4), 1)


def test_rloo_baseline_by_hand():
    s = torch.tensor([1.0, 2.0, 6.0, 0.0, 4.0, 8.0])
    b = fc.ops.rloo_baseline(s, group_size=3)
    assert torch.allclose(b, torch.tensor([4.0, 3.5, 1.5, 6.0, 4.0, 2.0]))


def test_whiten_by_hand():
    x = torch.tensor([[1.0, 2.0, 99.0], [3.0, 4.0, 99.0]])
    m = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)
    out = fc.ops.whiten(x, m)
    # masked values 1,2,3,4: mean 2.5, unbiased var 5/3
    expected = (torch.tensor([[1.0, 2.0, 0], [3.0, 4.0, 0]]) - 2.5) / math.sqrt(5 / 3 + 1e-8)
    expected[:, 2] = 0
    assert torch.allclose(out, expected, atol=1e-6)
    kept = fc.ops.whiten(x, m, shift_mean=False)
    assert torch.allclose(kept[m].mean(), torch.tensor(2.5), atol=1e-6)


def test_gae_on_a_short_trajectory():
    # one sequence, 3 response tokens + 1 padding; gamma 0.9, lambda 0.8
    r = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    v = torch.tensor([[0.5, 0.6, 0.7, 9.0]])
    m = torch.tensor([[1, 1, 1, 0]])
    adv, ret = fc.ops.gae(r, v, m, gamma=0.9, lam=0.8)
    d2 = 1.0 - 0.7  # last token: next value 0 (terminal)
    d1 = 0.0 + 0.9 * 0.7 - 0.6
    d0 = 0.0 + 0.9 * 0.6 - 0.5
    a2 = d2
    a1 = d1 + 0.9 * 0.8 * a2
    a0 = d0 + 0.9 * 0.8 * a1
    assert torch.allclose(adv, torch.tensor([[a0, a1, a2, 0.0]]), atol=1e-6)
    assert torch.allclose(ret, torch.tensor([[a0 + 0.5, a1 + 0.6, a2 + 0.7, 0.0]]), atol=1e-6)


def test_discounted_returns_by_hand():
    r = torch.tensor([[1.0, 0.0, 2.0, 5.0]])
    m = torch.tensor([[1, 1, 1, 0]])
    g = fc.ops.discounted_returns(r, m, gamma=0.5)
    assert torch.allclose(g, torch.tensor([[1.5, 1.0, 2.0, 0.0]]))


def _rollout(mask):
    n, r = mask.shape
    return Rollout(
        prompt_ids=torch.zeros(n, 2, dtype=torch.long),
        prompt_mask=torch.ones(n, 2, dtype=torch.bool),
        response_ids=torch.zeros(n, r, dtype=torch.long),
        response_mask=mask,
        logprobs=torch.zeros(n, r),
    )


def test_token_level_puts_score_on_last_response_token():
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    out = fc.ops.token_level(torch.tensor([5.0, 7.0, 3.0]), _rollout(mask))
    assert torch.equal(out, torch.tensor([[0, 5.0, 0, 0], [0, 0, 0, 7.0], [0, 0, 0, 0]]))


def test_overlong_penalty_by_hand():
    # R = 8, cache = 4: no penalty up to 4 tokens, then -1/4 per token, -1 at 8
    lengths = [0, 3, 4, 5, 6, 8]
    mask = torch.tensor([[t < n for t in range(8)] for n in lengths])
    got = fc.ops.overlong_penalty(_rollout(mask), cache=4)
    assert torch.allclose(got, torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, -1.0]))
    # an explicit limit below the rollout width
    got = fc.ops.overlong_penalty(_rollout(mask), cache=2, max_len=6)
    assert torch.allclose(got, torch.tensor([0.0, 0.0, 0.0, -0.5, -1.0, -1.0]))
    # a fraction of the limit: 0.25 of 8 is a band of 2 tokens; a tiny fraction still punishes the last token
    assert torch.allclose(fc.ops.overlong_penalty(_rollout(mask), cache=0.25), torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, -1.0]))
    assert torch.allclose(fc.ops.overlong_penalty(_rollout(mask), cache=0.01), torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, -1.0]))
    with pytest.raises(ValueError, match="cache"):
        fc.ops.overlong_penalty(_rollout(mask), cache=9)


def test_filter_groups_keeps_the_groups_whose_scores_vary():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.0])  # groups of 2
    assert fc.ops.varied_groups(scores, 2).tolist() == [False, True, False, True]
    mask = torch.ones(8, 3, dtype=torch.bool)
    r = _rollout(mask)
    r.response_ids = torch.arange(8).unsqueeze(-1).expand(8, 3).clone()
    kept, kept_scores = fc.ops.filter_groups(r, scores, group_size=2)
    assert kept.response_ids[:, 0].tolist() == [2, 3, 6, 7]
    assert kept_scores.tolist() == [0.0, 1.0, 0.5, 0.0]


def test_dpo_loss_on_two_known_pairs():
    from flowc.ir.losses import DPO, dpo_loss

    # sequence log-ratios against the reference: pair 1 chosen +1.0, rejected -1.0; pair 2 chosen 0.0, rejected +0.5
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    ref = torch.zeros(4, 3)
    logp = torch.tensor([[0.5, 0.5, 9.0], [-1.0, 9.0, 9.0], [0.2, -0.1, -0.1], [0.5, 9.0, 9.0]])  # masked entries ignored
    loss, st = dpo_loss(DPO(beta=0.5), logp, ref, mask)
    z1, z2 = 0.5 * (1.0 - (-1.0)), 0.5 * (0.0 - 0.5)
    want = (math.log1p(math.exp(-z1)) + math.log1p(math.exp(-z2))) / 2  # -log σ(z) = log(1 + e^-z)
    assert loss.item() == pytest.approx(want, rel=1e-6)
    assert st["dpo_accuracy"] == 0.5 and st["dpo_margin"] == pytest.approx((1.0 - 0.25) / 2)
    smoothed, _ = dpo_loss(DPO(beta=0.5, label_smoothing=0.1), logp, ref, mask)
    want_s = sum(0.9 * math.log1p(math.exp(-z)) + 0.1 * math.log1p(math.exp(z)) for z in (z1, z2)) / 2
    assert smoothed.item() == pytest.approx(want_s, rel=1e-6)
    with pytest.raises(ValueError, match="pairs"):
        dpo_loss(DPO(), logp[:3], ref[:3], mask[:3])


def test_kl_estimators_by_hand():
    lp, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.0])
    d = lp - ref  # 0.5, -1.0
    assert torch.allclose(fc.ops.kl(lp, ref, "k1"), d)
    assert torch.allclose(fc.ops.kl(lp, ref, "k2"), 0.5 * d**2)
    k3 = torch.exp(-d) + d - 1
    assert torch.allclose(fc.ops.kl(lp, ref, "k3"), k3)
    assert torch.allclose(fc.ops.kl(lp, ref, "low_var_kl"), k3.clamp(-10, 10))
    assert torch.all(fc.ops.kl(torch.randn(100), torch.randn(100), "k3") >= 0)
    with pytest.raises(ValueError, match="unknown KL kind"):
        fc.ops.kl(lp, ref, "k9")


def test_aggregation_modes_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(loss, mask, "sequence-mean").item() == pytest.approx(3.0)
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx((6 / 3 + 4 / 3) / 2)


def test_ppo_clip_and_clip_higher_by_hand():
    mask = torch.ones(1, 2)
    old = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[1.5, 0.5]]))  # ratios 1.5, 0.5
    adv = torch.tensor([1.0])  # positive: upper clip matters
    loss, stats = policy_loss(PPOClip(clip=0.2), logp, old, adv, mask)
    # token 0: min(1.5, 1.2) = 1.2; token 1: min(0.5, 0.8) = 0.5 → -(1.2 + 0.5)/2
    assert loss.item() == pytest.approx(-(1.2 + 0.5) / 2)
    assert stats["clip_frac"] == pytest.approx(0.5)
    higher, _ = policy_loss(PPOClip(clip=0.2, clip_high=0.28), logp, old, adv, mask)
    assert higher.item() == pytest.approx(-(1.28 + 0.5) / 2)
    neg, _ = policy_loss(PPOClip(clip=0.2), logp, old, torch.tensor([-1.0]), mask)
    # negative advantage: -min(-1.5, -1.2) = 1.5 ; -min(-0.5, -0.8) = 0.8
    assert neg.item() == pytest.approx((1.5 + 0.8) / 2)


def test_gspo_sequence_ratio():
    mask = torch.ones(1, 2)
    logp = torch.tensor([[0.2, -0.1]], requires_grad=True)
    loss, stats = policy_loss(PPOClip(clip=0.5, ratio="sequence"), logp, torch.zeros(1, 2), torch.tensor([1.0]), mask)
    seq_ratio = math.exp(0.05)
    assert loss.item() == pytest.approx(-seq_ratio)
    assert stats["ratio_mean"] == pytest.approx(seq_ratio)
    loss.backward()
    assert logp.grad is not None and torch.all(logp.grad != 0)


def test_value_clip_by_hand():
    v = torch.tensor([[1.0, 0.0]])
    old = torch.tensor([[0.5, 0.5]])
    ret = torch.tensor([[2.0, 0.0]])
    loss, stats = value_loss(fc.losses.value_clip(0.2), v, old, ret, torch.ones(1, 2))
    # token 0: unclipped (1-2)² = 1, clipped v 0.7 → 1.69 → max 1.69
    # token 1: unclipped 0, clipped v 0.3 → 0.09 → max 0.09
    assert loss.item() == pytest.approx(0.5 * (1.69 + 0.09) / 2)
    assert stats["vf_clip_frac"] == pytest.approx(1.0)


def test_ops_are_traced_as_single_nodes_only_under_tracing():
    # called eagerly they compute; the decorator adds no node outside a trace
    assert fc.ops.masked_sum(torch.ones(2, 2), torch.ones(2, 2)).item() == 4


def test_returns_and_gae_carry_credit_across_a_trajectorys_observations():
    """A multi-turn trajectory's mask has holes where the environment's tokens are: the reward at
    the end reaches the first turn's tokens, and GAE bootstraps from the next *policy* token."""
    mask = torch.tensor([[1, 1, 1, 0, 0, 1, 1, 0]]).bool()  # turn 1, an observation, turn 2, padding
    r = torch.zeros(1, 8)
    r[0, 6] = 1.0
    assert fc.ops.discounted_returns(r, mask, gamma=0.5).tolist() == [[0.0625, 0.125, 0.25, 0, 0, 0.5, 1.0, 0]]
    values = torch.tensor([[0.1, 0.2, 0.3, 9.0, 9.0, 0.4, 0.5, 9.0]])  # the observations' values never count
    adv, ret = fc.ops.gae(r, values, mask, gamma=1.0, lam=1.0)
    assert adv[0].tolist() == pytest.approx([0.9, 0.8, 0.7, 0, 0, 0.6, 0.5, 0])
    assert ret[0].tolist() == pytest.approx([1.0, 1.0, 1.0, 0, 0, 1.0, 1.0, 0])
    # the same numbers as the policy's tokens packed together
    packed = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0]]).bool()
    rp, vp = torch.tensor([[0, 0, 0, 0, 1.0, 0, 0, 0]]), torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0, 0, 0]])
    ap, _ = fc.ops.gae(rp, vp, packed, gamma=0.9, lam=0.8)
    a2, _ = fc.ops.gae(r, values, mask, gamma=0.9, lam=0.8)
    assert a2[mask].tolist() == pytest.approx(ap[packed].tolist())
