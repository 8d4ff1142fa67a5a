"""Packed sequences: a micro-batch's rows without their padding, laid end to end in a few
lines, each row attending only to itself.

A padded micro-batch computes every row as wide as its widest: with responses of 1 to 24
tokens, a third of what it computes can be padding. Packed, the rows' real tokens (prompt
then response, padding dropped) are placed first-fit-decreasing into lines of ``capacity``
tokens; each row's position ids restart at 0 and transformers (5.x) builds the block-causal
mask from those restarts when no attention mask is given (``find_packed_sequence_indices``),
with a model's sliding windows (SDPA and eager attention: flash attention reads the restarts
only for a batch of one line, so models run with it are not packed). The outputs are the
padded pass's, token for token (rotary positions and the attended keys are the same), so the
loss and its gradients are too; a line's unused tail is a sequence of its own whose outputs
are dropped.

The cost of a line is its tokens and its attention, which an attention kernel with a mask
computes densely (``capacity²``); :func:`line_capacity` takes the capacity that minimises
both. Whether a model packs correctly is not assumed: :func:`packs_correctly` compares a
packed and a padded pass once (a model whose mask code ignores the restarts would silently
attend across rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from flowc.runtime.modeling import join, one_prefix_safe, prompt_groups

# a line is at most this many times the narrowest width tried (more lines of that width cost little more)
MAX_WIDTHS = 16


@dataclass(frozen=True)
class Lines:
    """Where each real token of a micro-batch sits in its packed lines."""

    ids: torch.Tensor  # [L, C] token ids of the lines
    positions: torch.Tensor  # [L, C] each row's positions, from 0; a line's tail continues as a row of its own
    where: torch.Tensor  # [S] flat index (line × C + column) of each token computed
    index: torch.Tensor  # [N, P + R] each joined slot's token number, −1 at padding
    mask: torch.Tensor | None = None  # [L, 1, C, C] who attends to whom, where prompts are shared


def first_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows (by index) in lines of at most ``capacity`` tokens: longest first, each into the
    first line with room (a row longer than ``capacity`` gets a line of its own)."""
    lines: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        for j, left in enumerate(room):
            if n <= left:
                lines[j].append(i)
                room[j] -= n
                break
        else:
            lines.append([i])
            room.append(capacity - n)
    return lines


def attention_ratio(model: nn.Module) -> float:
    """A token's attention FLOPs per key it attends to, over its FLOPs in the weights:
    ``4·h·layers / 2·params`` (QKᵀ and the weighted values, against a multiply-add per weight)."""
    cfg = getattr(model, "config", None)
    text = cfg.get_text_config(decoder=True) if cfg is not None and hasattr(cfg, "get_text_config") else cfg
    hidden = getattr(text, "hidden_size", 0) or 0
    layers = getattr(text, "num_hidden_layers", 0) or 0
    params = sum(p.numel() for p in model.parameters())
    return 2.0 * hidden * layers / params if params and hidden and layers else 0.0


def line_capacity(lengths: list[int], ratio: float) -> int:
    """The line width that computes least: lines × width in the weights plus each line's
    dense attention (``ratio`` × width² per line). Tried: the power of two the widest row
    fits, and twice that, … up to all the tokens in one line (``MAX_WIDTHS`` doublings)."""
    return _best_lines(lengths, ratio)[0]


def _best_lines(lengths: list[int], ratio: float) -> tuple[int, float]:
    """:func:`line_capacity` and what its lines compute (in tokens of weights' compute). Widths
    are powers of two: each new shape of a micro-batch costs the kernels' caches (oneDNN keeps
    a primitive per matmul shape: 60 steps of the tiny model in bf16 grew 0.68 → 0.81 GB with
    any width), and first-fit fills a wider line's tail with other rows."""
    widest, total = max(lengths), sum(lengths)
    c = 1 << max(widest - 1, 0).bit_length()
    best, best_cost = c, float("inf")
    for _ in range(MAX_WIDTHS.bit_length()):
        lines = len(first_fit(lengths, c))
        cost = lines * c * (1.0 + ratio * c)
        if cost < best_cost:
            best, best_cost = c, cost
        if c >= total:
            break
        c *= 2
    return best, best_cost


def shared_lines_pay(prompt_mask: torch.Tensor, present: torch.Tensor, groups: torch.Tensor, ratio: float) -> bool:
    """Whether lines that compute each prompt once cost less than lines of whole rows: a
    prompt's piece holds all its rows' responses, so where responses are long a piece is
    wide and its dense attention can outweigh the prompt tokens saved."""
    pieces, plen, rlen = _segments(prompt_mask.bool(), present.bool(), groups)
    tree = [max(plen[rows[0]] + sum(rlen[i] for i in rows), 1) for rows in pieces]
    plain = [max(a + b, 1) for a, b in zip(plen, rlen, strict=True)]
    # lines of powers of two can cost the same either way: then the fewer real tokens (less attention)
    return (_best_lines(tree, ratio)[1], sum(tree)) < (_best_lines(plain, ratio)[1], sum(plain))


def _segments(prompt_mask: torch.Tensor, present: torch.Tensor, groups: torch.Tensor | None):
    """The pieces that go into lines: each row's prompt then response (``groups`` None), or one
    piece per prompt group — its prompt once, then each of its rows' responses. Returns per
    piece its rows, and the prompt and response lengths of each row."""
    plen, rlen = prompt_mask.sum(-1).tolist(), present.sum(-1).tolist()
    if groups is None:
        return [[i] for i in range(len(plen))], plen, rlen
    pieces: dict[int, list[int]] = {}
    for i, g in enumerate(groups.tolist()):
        pieces.setdefault(g, []).append(i)
    return list(pieces.values()), plen, rlen


def pack(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    present: torch.Tensor,
    ratio: float,
    *,
    groups: torch.Tensor | None = None,
    capacity: int = 0,
    float_mask: torch.dtype | None = None,
) -> Lines:
    """The real tokens of the rows (left-padded prompts, right-padded responses), in lines
    (see :func:`line_capacity`). With ``groups`` (rows numbered by their prompt, as
    :func:`~flowc.runtime.modeling.prompt_groups` does) each prompt is computed once: its
    rows' responses follow it in one piece of a line, each attending to the prompt and to
    itself, which needs an explicit mask (``Lines.mask``: boolean, or additive in
    ``float_mask`` for attention that adds its mask); without, position restarts mark the
    rows. ``Lines.index`` maps every joined ``[prompt | response]`` slot of a row to its token
    (a shared prompt's slots of all its rows to the same tokens)."""
    pm, rm = prompt_mask.bool().cpu(), present.bool().cpu()
    n, width_p = pm.shape
    pieces, plen, rlen = _segments(pm, rm, groups)
    sizes = [max(plen[rows[0]] + sum(rlen[i] for i in rows), 1) for rows in pieces]
    cap = capacity or line_capacity(sizes, ratio)
    lines = first_fit(sizes, cap)
    width = max(cap, max(sizes))
    ids_p, ids_r = prompt_ids.cpu(), response_ids.cpu()
    tok = torch.zeros((len(lines), width), dtype=prompt_ids.dtype)
    pos = torch.zeros((len(lines), width), dtype=torch.long)
    seg = torch.full((len(lines), width), -1, dtype=torch.long)
    owner = torch.full((len(lines), width), -2, dtype=torch.long)  # −1: a shared prompt's, else the row's
    index = torch.full((n, width_p + ids_r.shape[1]), -1, dtype=torch.long)
    where: list[torch.Tensor] = []
    count = 0
    for j, members in enumerate(lines):
        col = 0
        for k in members:
            rows = pieces[k]
            p = plen[rows[0]]
            # the prompt (once for the piece's rows)
            tok[j, col : col + p] = ids_p[rows[0], pm[rows[0]]]
            pos[j, col : col + p] = torch.arange(p)
            seg[j, col : col + p] = k
            owner[j, col : col + p] = -1
            prompt_tokens = torch.arange(count, count + p)
            where.append(torch.arange(j * width + col, j * width + col + p))
            count, col = count + p, col + p
            for i in rows:
                q = rlen[i]
                tok[j, col : col + q] = ids_r[i, rm[i]]
                pos[j, col : col + q] = torch.arange(p, p + q)
                seg[j, col : col + q] = k
                owner[j, col : col + q] = i
                index[i, pm[i].nonzero().squeeze(-1)] = prompt_tokens
                index[i, width_p + rm[i].nonzero().squeeze(-1)] = torch.arange(count, count + q)
                where.append(torch.arange(j * width + col, j * width + col + q))
                count, col = count + q, col + q
        pos[j, col:] = torch.arange(width - col)  # the tail: a sequence of its own
        seg[j, col:] = len(pieces) + j
    dev = prompt_ids.device
    pos = pos.to(dev)
    mask = None
    if groups is not None:  # built where it is used ([L, 1, C, C]: query row, key column)
        seg, owner = seg.to(dev), owner.to(dev)
        same = seg.unsqueeze(2) == seg.unsqueeze(1)
        before = pos.unsqueeze(2) >= pos.unsqueeze(1)
        visible = (owner.unsqueeze(1) == -1) | (owner.unsqueeze(1) == owner.unsqueeze(2))
        mask = (same & before & visible).unsqueeze(1)
        if float_mask is not None:
            mask = torch.zeros(mask.shape, dtype=float_mask, device=dev).masked_fill(~mask, torch.finfo(float_mask).min)
    return Lines(tok.to(dev), pos, torch.cat(where).to(dev), index.to(dev), mask)


def at_slots(out: torch.Tensor, lines: Lines, index: torch.Tensor) -> torch.Tensor:
    """The lines' output ``out [L·C, …]`` (flattened) at the padded slots ``index [N, W]``
    (token numbers, −1: padding, which gets zeros): ``[N, W, …]``, gathered once (a model's
    logits are not copied whole on the way)."""
    res = out.new_zeros((*index.shape, *out.shape[1:]))
    ok = index >= 0
    res[ok] = out[lines.where[index[ok]]]
    return res


def packed_forward(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    response_ids: torch.Tensor,
    present: torch.Tensor,
    *,
    value: bool,
    groups: torch.Tensor | None = None,
    capacity: int = 0,
    hidden: bool = False,
) -> tuple[torch.Tensor, Lines]:
    """``model`` over the rows packed in lines (:func:`pack`; ``groups``: each prompt once):
    its output over the lines, flattened ``[L·C, …]`` (logits, or with ``value`` the head's
    values, or with ``hidden`` a value model's last hidden states), and the :class:`Lines`
    that place them (:func:`at_slots`)."""
    lines = pack(
        prompt_ids,
        prompt_mask,
        response_ids,
        present,
        attention_ratio(model),
        groups=groups,
        capacity=capacity,
        float_mask=additive_mask(model),
    )
    kw = dict(input_ids=lines.ids, attention_mask=lines.mask, position_ids=lines.positions)
    if value:
        out = model(**kw, hidden=True) if hidden else model(**kw)
    else:
        out = model(**kw, use_cache=False).logits
    return out.reshape(-1, *out.shape[2:]), lines


def attention_kind(model: nn.Module) -> str:
    """The attention implementation the model's layers run (``sdpa``, ``eager``,
    ``flash_attention_2``, …; empty when the model does not say)."""
    cfg = getattr(model, "config", None)
    return str(getattr(cfg, "_attn_implementation", None) or "")


def additive_mask(model: nn.Module) -> torch.dtype | None:
    """An explicit mask's form for this model's attention: boolean for SDPA (and the kernels
    that take one), additive in the weights' dtype for eager attention, which adds it."""
    if attention_kind(model) != "eager":
        return None
    return next(model.parameters()).dtype


# attention implementations that packed lines run on: they take the mask transformers builds from the
# position restarts of several lines, and an explicit [L, 1, C, C] mask (flash attention reads restarts
# only in a batch of one line, and takes no mask)
PACKED_KERNELS = ("sdpa", "eager")


@torch.no_grad()
def packing_support(model: nn.Module, *, value: bool, vocab: int, compute: torch.dtype | None = None) -> tuple[bool, bool]:
    """Whether ``model`` computes packed lines as the padded rows they hold: plain rows (by
    their position restarts), and rows sharing a prompt (by an explicit mask). Checked on a
    small batch — a row of its own prompt, and two rows of another prompt with responses of
    different lengths, left-padded as rollouts are — in two lines, against the padded pass,
    on the outputs' inputs (logits; a critic's head is zero at the start, so its trunk's last
    hidden state). A model whose mask code ignored the restarts or the mask would let a row
    attend to another's tokens and differ by far more than rounding. ``compute``: the dtype
    the model will run in (rounding grows in 16 bits). Run it on the whole model in one
    process (before sharding: no collectives, the same answer on every rank)."""
    if attention_kind(model) not in PACKED_KERNELS:
        return False, False
    was = model.training
    model.eval()
    try:
        param = next(model.parameters())
        dev = param.device
        g = torch.Generator().manual_seed(0)
        prompt_ids = torch.randint(1, max(vocab, 2), (3, 5), generator=g)
        prompt_ids[2] = prompt_ids[1]
        prompt_mask = torch.ones(3, 5, dtype=torch.long)
        prompt_mask[0, :2] = 0
        response_ids = torch.randint(1, max(vocab, 2), (3, 4), generator=g)
        present = torch.ones(3, 4, dtype=torch.long)
        present[1, 3:] = 0
        present[2, 1:] = 0
        args = [t.to(dev) for t in (prompt_ids, prompt_mask, response_ids, present)]
        ids, mask, pos = join(*args)
        if value:
            padded = model(input_ids=ids, attention_mask=mask, position_ids=pos, hidden=True)
        else:
            padded = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        tol = 1e-3 if param.dtype == torch.float32 and compute in (None, torch.float32) else 5e-2

        def same(groups: torch.Tensor | None, capacity: int) -> bool:
            out, lines = packed_forward(model, *args, value=value, groups=groups, capacity=capacity, hidden=value)
            if lines.ids.shape[0] != 2:  # rows of one line beside a line of its own: both ways lines meet
                return False
            a = padded[mask.bool()].float()
            b = out[lines.where[lines.index[mask.bool()]]].float()
            return bool(((a - b).norm() / a.norm().clamp(min=1e-12)).item() < tol)

        # rows 8, 6 and 7 tokens long: two lines of 14; the shared piece (5 + 3 + 1) and the row of 7: lines of 9
        plain = same(None, 14)
        shared = one_prefix_safe(model) and same(prompt_groups(args[0], args[1]), 9)
        return plain, plain and shared
    finally:
        model.train(was)
