"""Shared prompts (``Layout.share_prompts``): a micro-batch whose rows share prompts (GRPO's n
samples, DPO's pairs) computes each distinct prompt once and then every response on that
prompt's KV cache. It must compute what one pass over every ``prompt + response`` row computes:
the same log-probabilities, entropies, values and gradients (to float rounding), through the
shared training loop, on one process and on two FSDP2 ranks whose micro-batches would decide
differently; and the cuts weigh the prompts it saves."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import fsdp2_engine

from flowc.ir.functional import Rollout
from flowc.ir.losses import ppo_clip
from flowc.ir.plan import Layout
from flowc.runtime.backends.micro_batches import shares_prompt, token_bins, trim
from flowc.runtime.modeling import (
    ValueModel,
    can_share_prompts,
    first_rows,
    load_causal_lm,
    prompt_groups,
    response_logprobs,
    response_values,
)
from flowc.tasks.arithmetic import asset_dir


def grouped(prompt_lens: list[int], n: int, response_lens: list[int], p: int = 8, r: int = 10, seed: int = 0) -> Rollout:
    """``n`` samples of each prompt (left-padded to ``p``), responses of the given lengths (right-padded)."""
    g = torch.Generator().manual_seed(seed)
    k = len(prompt_lens)
    pmask = torch.zeros(k, p, dtype=torch.bool)
    for i, a in enumerate(prompt_lens):
        pmask[i, p - a :] = True
    ids = torch.randint(3, 30, (k, p), generator=g).masked_fill(~pmask, 0)
    ids, pmask = ids.repeat_interleave(n, 0), pmask.repeat_interleave(n, 0)
    rows = k * n
    rmask = torch.zeros(rows, r, dtype=torch.bool)
    for i, b in enumerate(response_lens):
        rmask[i, :b] = True
    return Rollout(ids, pmask, torch.randint(3, 30, (rows, r), generator=g), rmask, torch.zeros(rows, r))


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = 1e-4) -> None:
    assert a.keys() == b.keys()
    for k in a:
        err = (a[k] - b[k]).abs().max() / a[k].abs().max().clamp(min=1e-12)
        assert err < tol, (k, float(err))


# ----------------------------------------------------------------- the groups
def test_prompt_groups_ignore_padding_and_number_each_distinct_prompt():
    ids = torch.tensor([[0, 5, 6], [9, 5, 6], [0, 5, 6], [7, 7, 7], [0, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1], [0, 1, 1], [1, 1, 1], [0, 1, 1]])
    g = prompt_groups(ids, mask)
    assert g[0] == g[1] == g[2] == g[4] != g[3]  # a padded position's id does not matter
    assert first_rows(g)[g[0]] == 0 and first_rows(g)[g[3]] == 3
    assert prompt_groups(ids[:0], mask[:0]).numel() == 0


def test_shares_only_where_the_prompts_saved_exceed_a_pass():
    r = trim(grouped([6, 4], 4, [3] * 8))  # 8 rows, 2 prompts 6 wide once trimmed: (8 − 2) × 6 = 36 tokens saved
    assert shares_prompt(r, overhead=35.0) is not None
    assert shares_prompt(r, overhead=36.0) is None
    distinct = grouped([6] * 8, 1, [3] * 8)  # every row its own prompt: nothing to save
    assert shares_prompt(distinct, overhead=0.0) is None


# --------------------------------------------------------- the model's outputs
def test_shared_log_probs_entropy_and_gradients_equal_one_pass(lm):
    r = grouped([8, 3, 5], 4, [10, 1, 4, 7, 2, 10, 9, 3, 6, 1, 10, 5])
    args = (r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask)
    assert can_share_prompts(lm)
    lp, ent = response_logprobs(lm, *args, with_entropy=True)
    (lp * r.response_mask).sum().backward()
    want = _grads(lm)
    slp, sent = response_logprobs(lm, *args, with_entropy=True, groups=prompt_groups(r.prompt_ids, r.prompt_mask))
    (slp * r.response_mask).sum().backward()
    got = _grads(lm)
    m = r.response_mask
    assert (lp - slp)[m].abs().max() < 1e-5 and (ent - sent)[m].abs().max() < 1e-5
    _close(want, got)


@pytest.mark.parametrize("at_tokens", [False, True])
def test_shared_values_equal_one_pass(at_tokens):
    torch.manual_seed(0)
    critic = ValueModel(load_causal_lm(str(asset_dir()), dtype=torch.float32))
    torch.nn.init.normal_(critic.head.weight, std=0.5)
    r = grouped([7, 2], 3, [10, 4, 1, 8, 8, 3])
    args = (r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask)
    v = response_values(critic, *args, at_tokens=at_tokens)
    (v * r.response_mask).sum().backward()
    want = _grads(critic)
    sv = response_values(critic, *args, at_tokens=at_tokens, groups=prompt_groups(r.prompt_ids, r.prompt_mask))
    (sv * r.response_mask).sum().backward()
    assert (v - sv)[r.response_mask].abs().max() < 1e-5
    _close(want, _grads(critic))


def test_shared_prompts_through_lora_adapters_equal_one_pass():
    from flowc.ir.lora import LoraConfig
    from flowc.runtime.lora import add_adapters

    torch.manual_seed(0)
    model = add_adapters(load_causal_lm(str(asset_dir()), dtype=torch.float32), LoraConfig(rank=4, alpha=8), seed=0, role="actor")
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B starts at zero: give the adapters something to say
            torch.nn.init.normal_(p, std=0.1)
    r = grouped([6, 4], 3, [5, 2, 9, 1, 7, 3])
    args = (r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask)
    assert can_share_prompts(model)
    lp = response_logprobs(model, *args)
    (lp * r.response_mask).sum().backward()
    want = _grads(model)
    slp = response_logprobs(model, *args, groups=prompt_groups(r.prompt_ids, r.prompt_mask))
    (slp * r.response_mask).sum().backward()
    assert (lp - slp)[r.response_mask].abs().max() < 1e-5
    _close(want, _grads(model))


def test_models_that_cannot_share_say_so(lm):
    lm.gradient_checkpointing_enable()
    try:
        assert not can_share_prompts(lm)  # HF turns the KV cache off under activation checkpointing
    finally:
        lm.gradient_checkpointing_disable()
    assert can_share_prompts(lm)


# ------------------------------------------------------------------ the cuts
def test_cuts_weigh_the_prompts_sharing_saves():
    # two prompts of 8 tokens × 4 samples; responses 10, 10, 10, 10 | 1, 1, 1, 1 (one prompt each)
    r = grouped([8, 8], 4, [10, 10, 10, 10, 1, 1, 1, 1])
    plain = token_bins(r, 1000, 1, overhead=20.0)
    shared = token_bins(r, 1000, 1, overhead=20.0, share=True)
    # one pass each: cutting the short responses off pays (8·18 + 20 = 164 against 4·18 + 4·9 + 40 = 148);
    # computing each prompt once, one micro-batch is cheaper (8·10 + 2·8 + 20 + 20 = 136) than two
    # that each share their prompt (4·10 + 8 + 20 + 20 = 88, and 4·1 + 8 + 20 + 20 = 52: 140)
    assert [b.tolist() for b in plain] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [b.tolist() for b in shared] == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert shares_prompt(r, overhead=20.0) is not None


def test_cuts_keep_the_budget_for_a_micro_batch_that_runs_unshared():
    # 8 samples of one 8-token prompt, responses of 2: shared, all 8 rows would cost 8·2 + 8 + 1 = 25
    # tokens of compute, but a micro-batch may still run unshared (its ranks must agree), 80 tokens
    r = grouped([8], 8, [2] * 8)
    for bins in (token_bins(r, 40, 1, overhead=1.0), token_bins(r, 40, 1, overhead=1.0, share=True)):
        assert [len(b) for b in bins] == [4, 4]


def test_without_a_fixed_cost_sharing_leaves_the_bins_alone():
    r = grouped([8] * 8, 1, [1, 2, 3, 4, 5, 6, 7, 8])  # the sync check's probe passes no fixed cost
    assert [b.tolist() for b in token_bins(r, 1000, 1, share=True)] == [b.tolist() for b in token_bins(r, 1000, 1)]


# ------------------------------------------------------------- the loop, one process
def _engine(layout: Layout | None = None, lr: float = 1e-4):
    return fsdp2_engine(layout, lr)


def _batch() -> tuple[Rollout, torch.Tensor, torch.Tensor]:
    r = grouped([8, 3, 5, 6], 4, [10, 1, 2, 9, 0, 3, 10, 1, 4, 4, 7, 10, 2, 6, 8, 5], seed=1)
    g = torch.Generator().manual_seed(2)
    return r, torch.randn(16, generator=g), torch.randn(16, 10, generator=g) * 0.1 - 2.0


def _update(eng, r, adv, old, **micro):
    return eng.update(
        r,
        {"advantages": adv, "old_logprobs": old},
        loss=ppo_clip(0.2),
        kl_coef=0.0,
        kl_kind="k1",
        entropy_coef=0.01,
        mini_sizes=[r.prompt_ids.shape[0]],
        epochs=1,
        **micro,
    )


def test_a_resumed_optimizer_keeps_the_fused_kernel():
    eng = _engine()
    r, adv, old = _batch()
    _update(eng, r, adv, old, micro=16)
    assert all(g["fused"] for g in eng.b.opt.param_groups)
    state = eng.b.state()
    for g in state["optim"]["param_groups"]:  # as a checkpoint written before the fused kernel was chosen
        g["fused"] = g["foreach"] = None
    again = _engine()
    again.b.load_state(state)
    assert all(g["fused"] for g in again.b.opt.param_groups)


@pytest.mark.parametrize("tokens", [0, 90])
def test_shared_update_and_forward_equal_one_pass(tokens):
    r, adv, old = _batch()
    plain, shared = _engine(), _engine()
    s_plain = _update(plain, r, adv, old, micro=16, micro_tokens=tokens)
    s_shared = _update(shared, r, adv, old, micro=16, micro_tokens=tokens, share_prompts=True)
    assert plain.shared_prompts == 0 and shared.shared_prompts >= 1
    assert shared.describe()["shared_prompts"] == shared.shared_prompts
    for (name, a), b in zip(plain.b.model.named_parameters(), shared.b.model.parameters(), strict=True):
        err = (a.grad - b.grad).abs().max() / a.grad.abs().max().clamp(min=1e-12)
        assert err < 1e-4, (name, float(err))
    for k in ("pg_loss", "entropy", "grad_norm"):
        assert s_shared[k] == pytest.approx(s_plain[k], rel=1e-4, abs=1e-7), k
    want = plain.forward(r, 16, tokens)
    got = shared.forward(r, 16, tokens, share_prompts=True)
    assert shared.shared_prompts >= 1
    assert (want - got)[r.response_mask].abs().max() < 1e-4


# ------------------------------------------------------------------ two ranks
ROWS = {  # each rank's rows of the batch (4 prompts × 4 samples)
    "both": ([0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]),  # two prompts' samples each: both share
    "one": ([0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14], [3, 7, 11, 15]),  # rank 1 holds one row of each prompt
}


def _worker(rank: int, world: int, init: str | None, split: str, out) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    eng = _engine(Layout(dp=world, fsdp=True))
    r, adv, old = _batch()
    idx = torch.tensor(list(range(16)) if world == 1 else ROWS[split][rank])
    from flowc.runtime.batches import take_rows

    stats = _update(eng, take_rows(r, idx), adv[idx], old[idx], micro=16, share_prompts=world > 1)
    params, _ = eng.b.full_params()
    out[(world, rank, "pg_loss")] = stats["pg_loss"]
    out[(world, rank, "shared")] = eng.shared_prompts
    if rank == 0:
        out[world] = {k: v.clone() for k, v in params.items()}
    if world > 1:
        dist.destroy_process_group()


@pytest.mark.parametrize("split,shared", [("both", (1, 1)), ("one", (0, 0))])
def test_two_fsdp2_ranks_share_together_and_equal_one_process(split, shared):
    """Each rank's micro-batch shares its prompts when both would ("both"); when one would not
    ("one"), neither does: FSDP2 gathers a layer once per pass, so the ranks run the same
    passes. Either way the update equals one process's without sharing."""
    with mp.Manager() as m:
        out = m.dict()
        _worker(0, 1, None, split, out)
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_worker, args=(2, f"file://{d}/rdv", split, out), nprocs=2, join=True)
        one, two = out[1], out[2]
        got = (out[(2, 0, "shared")], out[(2, 1, "shared")])
    assert got == shared
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-5
