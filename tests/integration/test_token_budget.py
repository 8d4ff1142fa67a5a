"""Token-budget micro-batches in the shared training loop (``backends.training``): rows
binned by length into micro-batches of at most a token budget compute exactly what one
micro-batch of every row computes — the same log-probabilities in the same row order, the
same loss, gradients and updated weights, for every aggregation — on one process and on two
ranks whose bins differ in number."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import fsdp2_engine
from hypothesis import given, settings
from hypothesis import strategies as st

from flowc.ir.functional import Rollout
from flowc.ir.losses import ppo_clip
from flowc.ir.plan import Layout
from flowc.runtime.backends.micro_batches import token_bins


def rollout(prompt_lens: list[int], response_lens: list[int], p: int = 8, r: int = 10, seed: int = 0) -> Rollout:
    """Left-padded prompts and right-padded responses of the given real lengths."""
    g = torch.Generator().manual_seed(seed)
    n = len(prompt_lens)
    ids = torch.randint(3, 16, (n, p), generator=g)
    rids = torch.randint(3, 16, (n, r), generator=g)
    pmask = torch.zeros(n, p, dtype=torch.bool)
    rmask = torch.zeros(n, r, dtype=torch.bool)
    for i, (a, b) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        pmask[i, p - a :] = True
        rmask[i, :b] = True
    return Rollout(ids.masked_fill(~pmask, 0), pmask, rids, rmask, torch.zeros(n, r))


# ------------------------------------------------------------------ the bins
@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.tuples(st.integers(1, 8), st.integers(0, 10)), min_size=1, max_size=24),
    budget=st.integers(1, 200),
    unit=st.sampled_from([1, 2]),
    overhead=st.sampled_from([0.0, 0.5, 12.0, 1e9]),
)
def test_bins_hold_every_row_once_within_the_budget(lengths, budget, unit, overhead):
    if len(lengths) % unit:
        lengths = lengths[: len(lengths) - len(lengths) % unit] or lengths[:0] + [lengths[0]] * unit
    r = rollout([a for a, _ in lengths], [b for _, b in lengths])
    bins = token_bins(r, budget, unit, overhead)
    rows = torch.cat(bins).tolist()
    assert sorted(rows) == list(range(len(lengths)))  # every row exactly once
    p = r.prompt_mask.sum(-1).clamp(min=1)
    q = r.response_mask.sum(-1).clamp(min=1)
    for b in bins:
        assert b.tolist() == sorted(b.tolist())  # original order inside a micro-batch
        assert all(b[i].item() // unit == b[i + 1].item() // unit for i in range(0, len(b), unit) if unit == 2)
        padded = len(b) * int(p[b].max() + q[b].max())
        assert padded <= budget or len(b) == unit  # only a unit wider than the budget exceeds it, alone
    # longest responses first: the micro-batches' widest responses never grow
    widths = [int(q[b].max()) for b in bins]
    assert widths == sorted(widths, reverse=True)
    if overhead:  # the cheapest cuts: never dearer than filling each micro-batch, and as few with a huge overhead

        def cost(bs):
            return sum(overhead + len(b) * int(p[b].max() + q[b].max()) for b in bs)

        filled = token_bins(r, budget, unit)
        assert cost(bins) <= cost(filled) + 1e-6
        if overhead == 1e9:
            assert len(bins) == len(filled)


def test_a_micro_batchs_fixed_cost_decides_how_far_rows_are_split():
    """Two long rows and six short ones within one budget: split apart when a micro-batch
    costs less than the padding it saves (6 rows × 9 tokens), kept together otherwise."""
    r = rollout([4] * 8, [10, 10, 1, 1, 1, 1, 1, 1])
    assert len(token_bins(r, 1000, 1)) == 1  # filled up to the budget
    assert [b.tolist() for b in token_bins(r, 1000, 1, overhead=20.0)] == [[0, 1], [2, 3, 4, 5, 6, 7]]
    assert len(token_bins(r, 1000, 1, overhead=100.0)) == 1


def test_short_rows_share_a_micro_batch_and_padding_shrinks():
    r = rollout([4] * 8, [10, 10, 1, 1, 1, 1, 1, 1])
    bins = token_bins(r, 40, 1)
    assert [b.tolist() for b in bins] == [[0, 1], [2, 3, 4, 4 + 1, 6, 7]]
    padded = sum(len(b) * int(r.prompt_mask[b].sum(-1).max() + r.response_mask[b].sum(-1).max()) for b in bins)
    assert padded == 2 * 14 + 6 * 5 < 8 * 14  # 58 tokens computed instead of 112


# ----------------------------------------------------- the loop, one process
def _engine(layout: Layout | None = None, lr: float = 1e-4):
    return fsdp2_engine(layout, lr)


def _batch():
    r = rollout([8, 3, 5, 8, 2, 6, 4, 7], [10, 1, 2, 9, 0, 3, 10, 1], seed=1)
    g = torch.Generator().manual_seed(2)
    return r, torch.randn(8, generator=g), torch.randn(8, 10, generator=g) * 0.1 - 2.0


def _update(eng, r, adv, old, agg, **micro):
    return eng.update(
        r,
        {"advantages": adv, "old_logprobs": old},
        loss=ppo_clip(0.2, agg=agg),
        kl_coef=0.0,
        kl_kind="k1",
        entropy_coef=0.01,
        mini_sizes=[r.prompt_ids.shape[0]],
        epochs=1,
        **micro,
    )


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_binned_update_equals_one_micro_batch(agg):
    r, adv, old = _batch()
    one = _engine()
    s_one = _update(one, r, adv, old, agg, micro=8)
    assert one.micro_batches == 1
    binned = _engine()
    s_bin = _update(binned, r, adv, old, agg, micro=8, micro_tokens=40)
    assert binned.micro_batches >= 3  # the budget split the rows
    rows = _engine()
    s_rows = _update(rows, r, adv, old, agg, micro=1)  # each row trimmed to its own width
    for other, stats in ((binned, s_bin), (rows, s_rows)):
        # the gradients the step took (Adam's first step moves every weight by ±lr, so compare what it was given)
        for (name, a), b in zip(one.b.model.named_parameters(), other.b.model.parameters(), strict=True):
            err = (a.grad - b.grad).abs().max() / a.grad.abs().max().clamp(min=1e-12)
            assert err < 1e-4, (agg, name, float(err))
        for k in ("pg_loss", "entropy", "grad_norm"):
            assert stats[k] == pytest.approx(s_one[k], rel=1e-4, abs=1e-7), (agg, k)


def test_binned_forward_returns_rows_in_their_order():
    r, _, _ = _batch()
    eng = _engine()
    whole = eng.forward(r, 8)
    binned = eng.forward(r, 8, tokens=30)
    assert eng.micro_batches >= 3
    cut = eng.forward(r, 8, tokens=1000, overhead=8.0)  # one budget for all, cut where padding costs more
    assert eng.micro_batches >= 2
    assert torch.allclose(cut * r.response_mask, whole * r.response_mask, atol=1e-5)
    assert binned.shape == whole.shape == (8, 10)
    assert torch.allclose(binned * r.response_mask, whole * r.response_mask, atol=1e-5)


# ------------------------------------------------------------ two ranks
def _worker(rank: int, world: int, init: str | None, out) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    eng = _engine(Layout(dp=world, fsdp=True))
    r, adv, old = _batch()
    # rank 0 holds the four long rows (several micro-batches), rank 1 the four short ones (one)
    mine = [0, 3, 5, 6] if world == 1 or rank == 0 else [1, 2, 4, 7]
    if world == 1:
        mine = list(range(8))
    idx = torch.tensor(mine)
    from flowc.runtime.batches import take_rows

    stats = _update(eng, take_rows(r, idx), adv[idx], old[idx], "token-mean", micro=8, micro_tokens=40 if world > 1 else 0)
    params, _ = eng.b.full_params()
    out[(world, rank, "pg_loss")] = stats["pg_loss"]  # the controller reports the mean over the ranks
    if rank == 0:
        out[world] = ({k: v.clone() for k, v in params.items()}, stats["grad_norm"], eng.micro_batches)
    if world > 1:
        dist.destroy_process_group()


def test_two_ranks_with_different_bins_equal_one_process():
    with mp.Manager() as m:
        out = m.dict()
        _worker(0, 1, None, out)
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_worker, args=(2, f"file://{d}/rdv", out), nprocs=2, join=True)
        one, grad_one, _ = out[1]
        two, grad_two, agreed = out[2]
        loss_one = out[(1, 0, "pg_loss")]
        loss_two = (out[(2, 0, "pg_loss")] + out[(2, 1, "pg_loss")]) / 2
    assert agreed >= 2  # rank 1 ran padding micro-batches to keep FSDP's collectives in step
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-5
    # the loss the run reports: the padding micro-batches (a real row re-run) add nothing to it
    assert loss_two == pytest.approx(loss_one, rel=1e-4)
    assert grad_one == pytest.approx(grad_two, rel=1e-4)
