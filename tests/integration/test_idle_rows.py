"""Rows an update need not compute (``RunConfig.skip_idle_rows``): a row whose advantages are all
zero — a GRPO group whose rewards are all equal — adds nothing to a policy loss or its gradient,
so the shared training loop leaves it out where the objective has no entropy bonus or KL term.
The update must be the same: the parameters and the optimizer's state after several steps
(AdamW with weight decay, which a skipped optimizer step would not apply), one process and two
FSDP2 ranks of which one has no live row at all (its collectives must stay in step)."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import fsdp2_engine
from test_shared_prompts import grouped

from flowc.ir.losses import idle_rows, idle_without_advantage, policy_gradient, ppo_clip, tis, value_clip
from flowc.ir.plan import Layout


# ------------------------------------------------------------------ which rows, which losses
def test_a_row_is_idle_when_every_response_token_has_zero_advantage():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    assert idle_rows(torch.tensor([0.0, 1.0, -0.0, 2.0]), mask).tolist() == [True, False, True, True]
    per_token = torch.tensor([[0.0, 0.0, 5.0], [0.0, 0.1, 0.0], [0.0, 3.0, 3.0], [0.0, 0.0, 0.0]])
    assert idle_rows(per_token, mask).tolist() == [True, False, True, True]  # past the mask does not count
    assert idle_rows(torch.tensor([float("nan"), 0.0, 0.0, 0.0]), mask).tolist() == [False, True, True, True]


def test_only_a_loss_made_of_advantage_terms_lets_rows_idle():
    for loss in (ppo_clip(0.2), ppo_clip(0.2, correction=tis(2.0)), policy_gradient(), ppo_clip(0.2, ratio="sequence")):
        assert idle_without_advantage(loss, kl_coef=0.0, entropy_coef=0.0, ref_logprobs=False)
        assert idle_without_advantage(loss, kl_coef=0.1, entropy_coef=0.0, ref_logprobs=False)  # no KL without them
        assert not idle_without_advantage(loss, kl_coef=0.1, entropy_coef=0.0, ref_logprobs=True)
        assert not idle_without_advantage(loss, kl_coef=0.0, entropy_coef=0.01, ref_logprobs=False)
    assert not idle_without_advantage(value_clip(0.2), kl_coef=0.0, entropy_coef=0.0, ref_logprobs=False)


# ------------------------------------------------------------------ one process
def _batch() -> tuple:
    """16 rows, 4 prompts × 4 samples; groups 0 and 2 all-equal (zero advantages)."""
    r = grouped([8, 3, 5, 6], 4, [10, 1, 2, 9, 0, 3, 10, 1, 4, 4, 7, 10, 2, 6, 8, 5], seed=1)
    g = torch.Generator().manual_seed(2)
    adv = torch.randn(16, generator=g)
    adv[0:4] = 0.0
    adv[8:12] = 0.0
    return r, adv, torch.randn(16, 10, generator=g) * 0.1 - 2.0


def _update(eng, r, adv, old, skip: bool, mini: list[int], **micro) -> dict[str, float]:
    return eng.update(
        r,
        {"advantages": adv, "old_logprobs": old},
        loss=ppo_clip(0.2),
        kl_coef=0.0,
        kl_kind="k1",
        entropy_coef=0.0,
        mini_sizes=mini,
        epochs=2,
        skip_idle=skip,
        **micro,
    )


def _state(eng) -> dict[str, torch.Tensor]:
    out = {f"p.{k}": v.detach().clone() for k, v in eng.b.model.named_parameters()}
    for i, st in enumerate(eng.b.opt.state.values()):
        out |= {f"s{i}.{k}": v.detach().clone() for k, v in st.items() if torch.is_tensor(v)}
    return out


@pytest.mark.parametrize("pack,tokens", [(False, 0), (True, 0), (True, 40)])
def test_leaving_idle_rows_out_gives_the_same_update(pack, tokens):
    """Mini-batch 1 (rows 0–3) has no live row: it runs one zero-weighted row and still steps the
    optimizer (momentum and weight decay move the weights); mini-batch 2 computes 8 of its 12."""
    r, adv, old = _batch()
    lay = Layout(pack_sequences=pack)
    full, lean = fsdp2_engine(lay, lr=1e-2, weight_decay=0.1), fsdp2_engine(lay, lr=1e-2, weight_decay=0.1)
    micro = dict(micro=4, micro_tokens=tokens, pack_sequences=pack)
    for call in range(2):
        a = _update(full, r, adv, old, False, [4, 12], **micro)
        b = _update(lean, r, adv, old, True, [4, 12], **micro)
        # groups 0 and 2, and row 4, which has no response token: 9 of 16
        assert "idle_rows" not in a and b["idle_rows"] == pytest.approx(9 / 16)
        assert b["pg_loss"] == pytest.approx(a["pg_loss"], rel=1e-4, abs=1e-7)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        if call == 0:  # the last mini-batch's gradients, to float rounding
            for (k, x), y in zip(full.b.model.named_parameters(), lean.b.model.parameters(), strict=True):
                err = (x.grad - y.grad).abs().max() / x.grad.abs().max().clamp(min=1e-12)
                assert err < 1e-4, (k, float(err))
    assert full.updates == lean.updates == 8
    want, got = _state(full), _state(lean)
    assert want.keys() == got.keys()
    # after 8 AdamW steps at lr 1e-2 (rounding in near-zero gradients grows by Adam's 1/√v): within
    # a tenth of one step's size, where a skipped step or a wrong denominator moves whole steps
    for k in want:
        err = (want[k] - got[k]).abs().max()
        assert err < 1e-3 if k.startswith("p.") else err / want[k].abs().max().clamp(min=1e-12) < 1e-3, (k, float(err))
    assert any((v != 0).any() for k, v in _state(fsdp2_engine(lay)).items() if k.startswith("p."))


def test_no_live_row_anywhere_still_steps_the_optimizer():
    r, adv, old = _batch()
    adv = torch.zeros_like(adv)
    full, lean = fsdp2_engine(lr=1e-2, weight_decay=0.1), fsdp2_engine(lr=1e-2, weight_decay=0.1)
    _update(full, r, adv, old, False, [16], micro=16)
    got = _update(lean, r, adv, old, True, [16], micro=16)
    assert got["idle_rows"] == 1.0 and lean.micro_batches == 1
    assert got["entropy"] > 0.0 and got["pg_loss"] == 0.0  # the padding row's statistics keep the step's metrics
    before = dict(fsdp2_engine().b.model.named_parameters())
    moved = False
    for (k, a), b in zip(full.b.model.named_parameters(), lean.b.model.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-7), k
        moved |= bool((a != before[k]).any())
    assert moved  # weight decay applied on both sides: the step was taken, with zero gradients


# ------------------------------------------------------------------ two ranks
def _worker(rank: int, world: int, init: str | None, skip: bool, out) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    eng = fsdp2_engine(Layout(dp=world, fsdp=world > 1), weight_decay=0.1)
    r, adv, old = _batch()
    # rank 0 holds only idle rows (groups 0 and 2), rank 1 the live ones
    idx = (
        torch.arange(16)
        if world == 1
        else torch.tensor([0, 1, 2, 3, 8, 9, 10, 11] if rank == 0 else [4, 5, 6, 7, 12, 13, 14, 15])
    )
    from flowc.runtime.batches import take_rows

    stats = _update(eng, take_rows(r, idx), adv[idx], old[idx], skip, [len(idx)], micro=2)
    params, _ = eng.b.full_params()
    out[(world, rank, "idle")] = stats.get("idle_rows")
    out[(world, rank, "norm")] = stats["grad_norm"]  # before Adam, which hides a gradient's scale
    if rank == 0:
        out[world] = {k: v.clone() for k, v in params.items()}
    if world > 1:
        dist.destroy_process_group()


def test_two_fsdp2_ranks_one_with_no_live_row_equal_one_process():
    with mp.Manager() as m:
        out = m.dict()
        _worker(0, 1, None, False, out)
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_worker, args=(2, f"file://{d}/rdv", True, out), nprocs=2, join=True)
        one, two = out[1], out[2]
        idle = (out[(2, 0, "idle")], out[(2, 1, "idle")])
        norms = [out[(1, 0, "norm")], out[(2, 0, "norm")], out[(2, 1, "norm")]]
    assert idle == (1.0, 1 / 8)  # rank 1's row 4 has no response token
    assert norms[1] == norms[2] == pytest.approx(norms[0], rel=1e-5)
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-5
