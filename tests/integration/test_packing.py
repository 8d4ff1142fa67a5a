"""Packed sequences (``Layout.pack_sequences``): a micro-batch's rows without their padding, end to
end in lines, each attending only to itself — and, where rows share a prompt, that prompt once in
the line with every row's response after it, each response attending to the prompt and itself.
Either must compute what the padded rows compute: the same log-probabilities, entropies, values
and gradients (to float rounding), for any lengths (a property), through the shared training loop
on one process and on two FSDP2 ranks that pack differently; a model that would pack wrongly is
caught by the check the engine runs once; and the token budget counts what the lines compute."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import fsdp2_engine
from hypothesis import given, settings
from hypothesis import strategies as st
from test_shared_prompts import _batch, _grads, _update, grouped

from flowc.ir.functional import Rollout
from flowc.ir.plan import Layout
from flowc.runtime.backends.micro_batches import packs_rows, token_bins, trim
from flowc.runtime.modeling import (
    ValueModel,
    can_share_prompts,
    load_causal_lm,
    prompt_groups,
    response_logprobs,
    response_values,
)
from flowc.runtime.packing import first_fit, line_capacity, pack, packing_support, shared_lines_pay
from flowc.tasks.arithmetic import asset_dir


# ------------------------------------------------------------------ the lines
def test_first_fit_places_longest_first_into_the_first_line_with_room():
    assert first_fit([5, 3, 4, 2, 1], 7) == [[0, 3], [2, 1], [4]]
    assert first_fit([9, 2], 4) == [[0], [1]]  # a row wider than the line gets one of its own


def test_line_capacity_trades_line_tails_against_dense_attention():
    lengths = [30, 7, 7, 7, 7, 20, 12, 5]  # 95 tokens
    assert line_capacity(lengths, 1.0) == 32  # attention dear: lines as narrow as the widest row's power of two
    assert line_capacity([30, 30, 30, 5], 0.0) == 32  # three full lines and one of 5 (128) beat 64 + 64 (128): the first
    assert line_capacity([40, 40, 40], 0.0) == 128  # one line of 128 against three of 64 (192)
    for ratio in (0.0, 2.4e-4, 1e-2):  # always a power of two the widest row fits
        c = line_capacity(lengths, ratio)
        assert c & (c - 1) == 0 and 32 <= c <= 128


def test_pack_maps_every_slot_and_shares_a_prompt_once():
    # rows 0 and 2 share a prompt (left-padded differently in ids, the same tokens); row 1 its own
    pid = torch.tensor([[0, 7, 8], [5, 6, 9], [0, 7, 8]])
    pm = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1]])
    rid = torch.tensor([[11, 12, 0], [13, 0, 0], [14, 15, 16]])
    rm = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    plain = pack(pid, pm, rid, rm, 0.0, capacity=32)
    assert plain.mask is None and plain.ids.shape == (1, 32)
    real = torch.cat([pm, rm], 1).bool()
    assert (plain.index[real] >= 0).all() and (plain.index[~real] == -1).all()
    joined = torch.cat([pid, rid], 1)
    assert torch.equal(plain.ids.view(-1)[plain.where][plain.index[real]], joined[real])  # each slot's own token
    tree = pack(pid, pm, rid, rm, 0.0, groups=prompt_groups(pid, pm), capacity=32)
    assert tree.where.numel() == real.sum() - 2  # the shared prompt's 2 tokens once
    assert torch.equal(tree.index[0, 1:3], tree.index[2, 1:3])
    assert torch.equal(tree.ids.view(-1)[tree.where][tree.index[real]], joined[real])
    # the mask: row 2's first response token sees the prompt and itself, not row 0's response
    line = tree.ids[0].tolist()
    allowed = tree.mask[0, 0]
    q, k0, p0 = line.index(14), line.index(11), line.index(7)
    assert allowed[q, p0] and allowed[q, q] and not allowed[q, k0]
    assert not allowed[p0, q]  # the prompt sees nothing after it


def test_a_prompt_is_shared_in_a_line_only_where_that_computes_less():
    r = grouped([8, 8], 4, [10, 10, 10, 10, 1, 1, 1, 1])
    groups = prompt_groups(r.prompt_ids, r.prompt_mask)
    # attention free: the prompts saved are all there is (pieces of 48 and 12 in one line of 64, rows in 4 of 32)
    assert shared_lines_pay(r.prompt_mask, r.present, groups, 0.0)
    # attention dear: a piece of a prompt and its 4 rows' 30-token responses needs a line of 128, rows of 38 fit 64
    long = grouped([8, 8], 4, [30, 30, 30, 30, 1, 1, 1, 1], r=30)
    assert not shared_lines_pay(long.prompt_mask, long.present, prompt_groups(long.prompt_ids, long.prompt_mask), 1.0)


def test_packs_rows_only_where_a_micro_batch_has_padding():
    assert packs_rows(trim(grouped([8, 3], 2, [10, 1, 4, 10])))
    assert not packs_rows(trim(grouped([8, 8], 2, [10, 10, 10, 10])))  # nothing to remove


# --------------------------------------------------------- the model's outputs
def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], tol: float = 1e-4) -> None:
    """Gradients equal to ``tol`` of the largest one (a parameter whose gradient is zero in
    theory, as a lone query's — its softmax has one key — gets rounding noise either way)."""
    assert a.keys() == b.keys()
    scale = max(float(v.abs().max()) for v in a.values())
    for k in a:
        assert float((a[k] - b[k]).abs().max()) <= tol * max(scale, 1e-12), k


def _equal_to_padded(model, r: Rollout, *, shared: bool, entropy: bool = True) -> None:
    args = (r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask)
    groups = prompt_groups(r.prompt_ids, r.prompt_mask) if shared else None
    lp, ent = response_logprobs(model, *args, with_entropy=True)
    (lp * r.response_mask).sum().backward()
    want = _grads(model)
    plp, pent = response_logprobs(model, *args, with_entropy=True, packed=True, groups=groups)
    (plp * r.response_mask).sum().backward()
    m = r.response_mask
    assert torch.allclose(lp[m], plp[m], atol=1e-5, rtol=0)
    if entropy:
        assert torch.allclose(ent[m], pent[m], atol=1e-5, rtol=0)
    _close(want, _grads(model))


@pytest.mark.parametrize("shared", [False, True])
def test_packed_log_probs_entropy_and_gradients_equal_padded(lm, shared):
    assert packing_support(lm, value=False, vocab=lm.config.vocab_size) == (True, True)
    _equal_to_padded(lm, grouped([8, 3, 5], 4, [10, 1, 4, 7, 2, 10, 9, 3, 6, 1, 10, 5]), shared=shared)


@settings(max_examples=25, deadline=None)
@given(
    prompts=st.lists(st.integers(1, 8), min_size=1, max_size=4),
    n=st.integers(1, 4),
    data=st.data(),
    shared=st.booleans(),
)
def test_packed_equals_padded_for_any_lengths(lm, prompts, n, data, shared):
    rows = len(prompts) * n
    lens = data.draw(st.lists(st.integers(0, 10), min_size=rows, max_size=rows))
    r = trim(grouped(prompts, n, lens, seed=data.draw(st.integers(0, 99))))
    _equal_to_padded(lm, r, shared=shared, entropy=False)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("at_tokens", [False, True])
def test_packed_values_equal_padded(shared, at_tokens):
    torch.manual_seed(0)
    critic = ValueModel(load_causal_lm(str(asset_dir()), dtype=torch.float32))
    assert packing_support(critic, value=True, vocab=critic.config.vocab_size) == (True, True)
    torch.nn.init.normal_(critic.head.weight, std=0.5)
    r = grouped([7, 2], 3, [10, 4, 1, 8, 8, 3])
    args = (r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask)
    groups = prompt_groups(r.prompt_ids, r.prompt_mask) if shared else None
    v = response_values(critic, *args, at_tokens=at_tokens)
    (v * r.response_mask).sum().backward()
    want = _grads(critic)
    pv = response_values(critic, *args, at_tokens=at_tokens, packed=True, groups=groups)
    (pv * r.response_mask).sum().backward()
    assert (v - pv)[r.response_mask].abs().max() < 1e-5
    _close(want, _grads(critic))


def test_eager_attention_takes_an_additive_mask(lm):
    lm.set_attn_implementation("eager")
    try:
        assert packing_support(lm, value=False, vocab=lm.config.vocab_size) == (True, True)
        _equal_to_padded(lm, grouped([6, 4], 3, [5, 2, 9, 1, 7, 3]), shared=True)
    finally:
        lm.set_attn_implementation("sdpa")


def test_packing_under_activation_checkpointing_and_lora():
    from flowc.ir.lora import LoraConfig
    from flowc.runtime.lora import add_adapters

    torch.manual_seed(0)
    model = add_adapters(load_causal_lm(str(asset_dir()), dtype=torch.float32), LoraConfig(rank=4, alpha=8), seed=0, role="actor")
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()  # frozen embeddings: checkpointed layers still need a grad path
    model.train()
    assert not can_share_prompts(model)  # the KV-cache sharing cannot run here; packed lines can
    assert packing_support(model, value=False, vocab=32) == (True, True)
    _equal_to_padded(model, grouped([6, 4], 3, [5, 2, 9, 1, 7, 3]), shared=True, entropy=False)


def test_a_model_that_would_attend_across_rows_is_caught(lm, monkeypatch):
    """Were a model's mask code to ignore the position restarts, rows packed together would see
    each other: the engine's check finds that and packs nothing."""
    import transformers.masking_utils as mu

    monkeypatch.setattr(mu, "find_packed_sequence_indices", lambda position_ids: None)
    assert packing_support(lm, value=False, vocab=lm.config.vocab_size) == (False, False)


def test_flash_attention_is_not_packed(lm, monkeypatch):
    """Flash attention reads position restarts only in a batch of one line: rows in several
    lines would attend across each other there, so such a model is not packed at all."""
    monkeypatch.setattr(lm.config, "_attn_implementation", "flash_attention_2", raising=False)
    assert packing_support(lm, value=False, vocab=lm.config.vocab_size) == (False, False)


def test_a_sliding_window_model_packs_rows_but_never_shares_a_prompt_in_them(lm):
    lm.config.sliding_window, lm.config.use_sliding_window = 4096, True
    try:  # an explicit mask would drop the window; position restarts keep it
        assert packing_support(lm, value=False, vocab=lm.config.vocab_size) == (True, False)
    finally:
        lm.config.use_sliding_window, lm.config.sliding_window = False, None


# ------------------------------------------------------------------ the cuts
def test_a_packed_budget_counts_real_tokens_and_a_shared_prompt_once():
    r = grouped([8, 8], 4, [10, 10, 10, 10, 1, 1, 1, 1])  # 8 rows: 18 × 4 + 9 × 4 = 108 real tokens, 144 padded
    assert [len(b) for b in token_bins(r, 108, 1, pack=True)] == [8]
    assert [len(b) for b in token_bins(r, 107, 1, pack=True)] == [7, 1]
    assert [len(b) for b in token_bins(r, 108, 1)] == [6, 2]  # padded, every row 18 wide: 6 fit
    # computing each prompt once: 2 × 8 + 44 = 60 tokens; a prompt's rows stay together
    bins = token_bins(r, 60, 1, share=True, pack=True)
    assert [sorted(b.tolist()) for b in bins] == [list(range(8))]
    assert sorted(sorted(b.tolist()) for b in token_bins(r, 59, 1, share=True, pack=True)) == [[0, 1, 2, 3], [4, 5, 6, 7]]


# ------------------------------------------------------------- the loop, one process
@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("tokens", [0, 90])
def test_packed_update_and_forward_equal_padded(share, tokens):
    r, adv, old = _batch()
    plain, packed = fsdp2_engine(), fsdp2_engine(Layout(pack_sequences=True))
    assert packed.packs and not plain.packs
    s_plain = _update(plain, r, adv, old, micro=16, micro_tokens=tokens)
    s_packed = _update(packed, r, adv, old, micro=16, micro_tokens=tokens, pack_sequences=True, share_prompts=share)
    assert plain.packed == 0 and packed.packed >= 1 and packed.describe()["packed"] == packed.packed
    assert (packed.shared_prompts >= 1) == share
    for (name, a), b in zip(plain.b.model.named_parameters(), packed.b.model.parameters(), strict=True):
        err = (a.grad - b.grad).abs().max() / a.grad.abs().max().clamp(min=1e-12)
        assert err < 1e-4, (name, float(err))
    for k in ("pg_loss", "entropy", "grad_norm"):
        assert s_packed[k] == pytest.approx(s_plain[k], rel=1e-4, abs=1e-7), k
    want = plain.forward(r, 16, tokens)
    got = packed.forward(r, 16, tokens, share_prompts=share, pack_sequences=True)
    assert (want - got)[r.response_mask].abs().max() < 1e-4


def test_a_layout_that_does_not_pack_runs_padded():
    eng = fsdp2_engine()
    r, adv, old = _batch()
    _update(eng, r, adv, old, micro=16, pack_sequences=True)  # an op asks, the engine was not built to: no check ran
    assert not eng.packs and eng.packed == 0


# ------------------------------------------------------------------ two ranks
ROWS = ([0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14], [3, 7, 11, 15])  # rank 1 holds one row of each prompt


def _worker(rank: int, world: int, init: str | None, out) -> None:
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    eng = fsdp2_engine(Layout(dp=world, fsdp=True, pack_sequences=world > 1))
    r, adv, old = _batch()
    idx = torch.tensor(list(range(16)) if world == 1 else ROWS[rank])
    from flowc.runtime.batches import take_rows

    _update(eng, take_rows(r, idx), adv[idx], old[idx], micro=16, share_prompts=world > 1, pack_sequences=world > 1)
    params, _ = eng.b.full_params()
    out[(world, rank, "shared")] = eng.shared_prompts
    if rank == 0:
        out[world] = {k: v.clone() for k, v in params.items()}
    if world > 1:
        dist.destroy_process_group()


def test_two_fsdp2_ranks_pack_on_their_own_and_equal_one_process():
    """Rank 0's rows share prompts and its line computes each once; rank 1's share none. A
    packed micro-batch is one pass either way, so the ranks need not agree (the KV-cache
    sharing must), and the update equals one process's padded one."""
    with mp.Manager() as m:
        out = m.dict()
        _worker(0, 1, None, out)
        with tempfile.TemporaryDirectory() as d:
            mp.spawn(_worker, args=(2, f"file://{d}/rdv", out), nprocs=2, join=True)
        one, two = out[1], out[2]
        got = (out[(2, 0, "shared")], out[(2, 1, "shared")])
    assert got == (1, 0)
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-5
