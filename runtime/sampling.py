"""Batched sampling with a KV cache: the ``hf`` rollout backend's decode loop.

One prefill over the left-padded prompts, then one forward per token over the
still-running sequences' last tokens. Temperature, top-k, top-p, min-p and
greedy decoding; EOS or the length limit ends a sequence. Returns the
response ids (right-padded to ``max_tokens``), the response mask (True up to
and including EOS) and the sampler's log-probabilities of its choices.

Each sequence draws from its own seed: token ``t`` of sequence ``k`` is the
inverse CDF of the processed distribution at a uniform that is a hash of
``(seeds[k], t)``. So a sequence's tokens depend on its seed and the weights
only — not on which rows share its batch, or on how many replicas split the
batch — as with vLLM's per-request seeds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flowc.ir.sampling import SamplingParams
from flowc.runtime.modeling import cache_kwarg, cache_of, positions


@dataclass
class Sampled:
    """``N`` sampled responses."""

    response_ids: torch.Tensor  # [N, R], right-padded
    response_mask: torch.Tensor  # [N, R] bool, True up to and including EOS
    logprobs: torch.Tensor  # [N, R] float32, the sampler's (processed) log-probabilities


_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # a 32-bit mixing constant below 2**31: x * _MIX never overflows int64 for x < 2**32
_GOLDEN = 0x9E3779B9


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 tensors holding values in [0, 2**32)."""
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    return (x >> 16) ^ x


def uniforms(seeds: torch.Tensor, t: int) -> torch.Tensor:
    """One uniform in (0, 1) per seed for draw ``t`` (float64), a pure function of (seed, t)."""
    h = _mix32(seeds.long() & _MASK32)
    h = _mix32((h + (t + 1) * _GOLDEN) & _MASK32)
    return (h.double() + 0.5) / 2.0**32


def draw(logp: torch.Tensor, seeds: torch.Tensor, t: int) -> torch.Tensor:
    """A token per row of ``logp [N, V]`` by inverse CDF at :func:`uniforms`; a token of
    probability 0 is never drawn."""
    cdf = logp.double().exp().cumsum(-1)
    u = (uniforms(seeds.to(logp.device), t) * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, u).squeeze(-1).clamp(max=logp.shape[-1] - 1)


def process_logits(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p applied to ``[N, V]`` logits (fp32)."""
    logits = logits.float()
    if sp.greedy:
        return logits
    logits = logits / max(sp.temperature, 1e-6)
    if sp.top_k > 0 and sp.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sp.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sp.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < sp.min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    if sp.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True, dim=-1)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > sp.top_p  # keep the smallest prefix reaching top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)
    return logits


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    sp: SamplingParams,
    *,
    max_tokens: int,
    eos_id: int,
    pad_id: int,
    seeds: torch.Tensor | None = None,
    stop_ids: tuple[int, ...] = (),
) -> Sampled:
    """Sample one response per row of ``prompt_ids`` (repeat rows for n > 1), row ``k`` with
    ``seeds[k]`` (greedy decoding needs none); a row ends at EOS or at any of ``stop_ids``
    (kept, as EOS is)."""
    if seeds is None and not sp.greedy:
        raise ValueError("sampling needs a seed per row")
    n = prompt_ids.shape[0]
    mask = prompt_mask.long()
    out = model(input_ids=prompt_ids, attention_mask=mask, position_ids=positions(mask), use_cache=True)
    cache = cache_of(out)
    logits = out.logits[:, -1].float()  # sampled in fp32 whatever the model computes in
    next_pos = mask.sum(-1, keepdim=True)
    dev = prompt_ids.device
    ids = torch.full((n, max_tokens), pad_id, dtype=torch.long, device=dev)
    lps = torch.zeros((n, max_tokens), dtype=torch.float32, device=dev)
    done = torch.zeros(n, dtype=torch.bool, device=dev)
    resp_mask = torch.zeros((n, max_tokens), dtype=torch.bool, device=dev)
    ends = torch.tensor([eos_id, *stop_ids], dtype=torch.long, device=dev)
    for t in range(max_tokens):
        proc = process_logits(logits, sp)
        logp = F.log_softmax(proc, dim=-1)
        tok = proc.argmax(-1) if sp.greedy else draw(logp, seeds, t)
        live = ~done
        ids[:, t] = torch.where(live, tok, torch.full_like(tok, pad_id))
        lps[:, t] = torch.where(live, logp.gather(-1, tok.unsqueeze(-1)).squeeze(-1), torch.zeros_like(lps[:, t]))
        resp_mask[:, t] = live
        done = done | torch.isin(tok, ends)
        if bool(done.all()) or t == max_tokens - 1:
            break
        mask = torch.cat([mask, live.long().unsqueeze(-1)], dim=-1)
        out = model(
            input_ids=ids[:, t : t + 1], attention_mask=mask, position_ids=next_pos, use_cache=True, **{cache_kwarg(model): cache}
        )
        cache = cache_of(out)
        logits = out.logits[:, -1].float()  # sampled in fp32 whatever the model computes in
        next_pos = next_pos + 1
    return Sampled(ids, resp_mask, lps)
