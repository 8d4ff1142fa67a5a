"""Loss specifications (what ``update(loss=…)`` stores) and their math.

A loss spec is a small frozen pydantic model: it is data in the IR and in
plans, and :func:`policy_loss` / :func:`value_loss` give it meaning. Users
reach the constructors as ``fc.losses.ppo_clip(…)`` and
``fc.losses.value_clip(…)``.

Aggregation (how per-token losses become one number), named as in verl:

``token-mean``
    sum over all response tokens of the batch / number of those tokens
    (DAPO's token-level loss).
``seq-mean-token-mean`` (alias ``sequence-mean``)
    each sequence's token mean, then the mean over sequences (GRPO).
``seq-mean-token-sum``
    each sequence's token sum, then the mean over sequences.
``seq-mean-token-sum-norm``
    each sequence's token sum divided by the response length limit ``R``,
    then the mean over sequences (Dr. GRPO).
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
_AGG_ALIASES = {
    "sequence-mean": "seq-mean-token-mean",
    "seq-mean": "seq-mean-token-mean",
    "token-sum-norm": "seq-mean-token-sum-norm",
}


def _agg(v: object) -> object:
    return _AGG_ALIASES.get(v, v) if isinstance(v, str) else v


AggMode = Annotated[
    Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"],
    BeforeValidator(_agg),
]

_SPEC = ConfigDict(frozen=True, extra="forbid")


class PPOClip(BaseModel):
    """Clipped surrogate objective: ``-min(r·A, clip(r, 1-clip, 1+clip_high)·A)``.

    ``clip_high`` defaults to ``clip`` (DAPO's clip-higher sets it larger);
    ``dual_clip`` (> 1) bounds the loss of negative advantages as in dual-clip
    PPO; ``ratio="sequence"`` uses GSPO's sequence-level ratio
    ``exp(mean_t(logp - old_logp))`` for every token of a sequence.
    """

    model_config = _SPEC
    kind: Literal["ppo_clip"] = "ppo_clip"
    clip: float = Field(0.2, gt=0)
    clip_high: float | None = Field(None, gt=0)
    dual_clip: float | None = Field(None, gt=1)
    ratio: Literal["token", "sequence"] = "token"
    agg: AggMode = "token-mean"

    @property
    def upper(self) -> float:
        return self.clip if self.clip_high is None else self.clip_high

    def __str__(self) -> str:
        return _fmt(self)


class ValueClip(BaseModel):
    """Clipped value loss: ``0.5·max((V-G)², (V_old + clip(V-V_old, ±clip) - G)²)``."""

    model_config = _SPEC
    kind: Literal["value_clip"] = "value_clip"
    clip: float = Field(0.2, gt=0)
    agg: AggMode = "token-mean"

    def __str__(self) -> str:
        return _fmt(self)


class PolicyGradient(BaseModel):
    """Plain policy gradient ``-A·logp`` (REINFORCE) with no ratio or clip."""

    model_config = _SPEC
    kind: Literal["policy_gradient"] = "policy_gradient"
    agg: AggMode = "token-mean"

    def __str__(self) -> str:
        return _fmt(self)


class DPO(BaseModel):
    """Direct preference optimisation (Rafailov et al., 2023) on preference pairs.

    With sequence log-probability sums of the policy (``π``) and the frozen
    reference (``ref``) for the chosen (``c``) and rejected (``r``) response,
    ``z = beta·((π_c - ref_c) - (π_r - ref_r))`` and the loss per pair is
    ``-(1-ε)·log σ(z) - ε·log σ(-z)`` (``ε = label_smoothing``, cDPO), averaged
    over pairs. The update's rollout holds the pairs as rows ``2i`` (chosen)
    and ``2i+1`` (rejected).
    """

    model_config = _SPEC
    kind: Literal["dpo"] = "dpo"
    beta: float = Field(0.1, gt=0)
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    agg: Literal["seq-mean-token-sum"] = "seq-mean-token-sum"  # pairs are counted, tokens summed

    def __str__(self) -> str:
        return _fmt(self)


def _fmt(spec: BaseModel) -> str:
    defaults = type(spec).model_fields
    parts = [f"{k}={v}" for k, v in spec.model_dump().items() if k != "kind" and v != defaults[k].default]
    return f"{spec.kind}({', '.join(parts)})"  # type: ignore[attr-defined]


LossSpec = Annotated[Union[PPOClip, ValueClip, PolicyGradient, DPO], Field(discriminator="kind")]
LOSS_TYPES: tuple[type[BaseModel], ...] = (PPOClip, ValueClip, PolicyGradient, DPO)
LOSS_ADAPTER: TypeAdapter[LossSpec] = TypeAdapter(LossSpec)
POLICY_LOSSES: tuple[type[BaseModel], ...] = (PPOClip, PolicyGradient, DPO)
PREFERENCE_LOSSES: tuple[type[BaseModel], ...] = (DPO,)
VALUE_LOSSES: tuple[type[BaseModel], ...] = (ValueClip,)


# ---------------------------------------------------------------- math
def aggregate(
    loss: torch.Tensor, mask: torch.Tensor, mode: str, *, max_len: int | None = None, denom: float | None = None
) -> torch.Tensor:
    """Reduce a per-token ``loss [N, R]`` under ``mask [N, R]`` as ``mode`` says.

    ``denom`` replaces the local count (tokens for ``token-mean``, sequences
    otherwise) — the runtime passes the count over the whole mini-batch, all
    data-parallel ranks and micro-batches included, so the sum of the pieces'
    gradients is the gradient of the whole."""
    m = mask.to(loss.dtype)
    mode = _AGG_ALIASES.get(mode, mode)
    if mode == "token-mean":
        return (loss * m).sum() / (denom if denom is not None else m.sum().clamp(min=1))
    per_seq_sum = (loss * m).sum(-1)
    n_seq = denom if denom is not None else loss.shape[0]
    if mode == "seq-mean-token-mean":
        return (per_seq_sum / m.sum(-1).clamp(min=1)).sum() / n_seq
    if mode == "seq-mean-token-sum":
        return per_seq_sum.sum() / n_seq
    if mode == "seq-mean-token-sum-norm":
        return (per_seq_sum / float(max_len or loss.shape[-1])).sum() / n_seq
    raise ValueError(f"unknown aggregation mode {mode!r}; use one of {', '.join(AGG_MODES)}")


def denominator_kind(mode: str) -> str:
    """What ``aggregate``'s denominator counts for ``mode``: tokens or sequences."""
    return "tokens" if _AGG_ALIASES.get(mode, mode) == "token-mean" else "sequences"


def broadcast_advantages(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence advantages ``[N]`` become per-token ``[N, R]``; per-token
    advantages are used as they are."""
    if adv.dim() == 1:
        return adv.unsqueeze(-1).expand_as(mask).to(torch.float32)
    return adv


def policy_loss(
    spec: BaseModel,
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    denom: float | None = None,
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss of ``spec`` and its statistics (clip fraction, ratio)."""
    adv = broadcast_advantages(adv, mask)
    m = mask.to(logp.dtype)
    if isinstance(spec, PolicyGradient):
        per_tok = -adv * logp
        return aggregate(per_tok, mask, spec.agg, denom=denom, max_len=max_len), {}
    if not isinstance(spec, PPOClip):
        raise TypeError(f"{spec} is not a policy loss")
    old = logp.detach() if old_logp is None else old_logp
    log_ratio = logp - old
    if spec.ratio == "sequence":
        seq = (log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1)
        # GSPO: the sequence ratio's value with each token's gradient path
        log_ratio = logp - logp.detach() + seq.detach().unsqueeze(-1)
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    surr1 = ratio * adv
    surr2 = ratio.clamp(1.0 - spec.clip, 1.0 + spec.upper) * adv
    per_tok = -torch.min(surr1, surr2)
    if spec.dual_clip is not None:
        per_tok = torch.where(adv < 0, torch.min(per_tok, -spec.dual_clip * adv), per_tok)
    clipped = ((surr2 < surr1) & mask.bool()).to(logp.dtype)
    stats = {
        "clip_frac": float((clipped.sum() / m.sum().clamp(min=1)).detach()),
        "ratio_mean": float(((ratio * m).sum() / m.sum().clamp(min=1)).detach()),
    }
    return aggregate(per_tok, mask, spec.agg, denom=denom, max_len=max_len), stats


def dpo_loss(
    spec: DPO, logp: torch.Tensor, ref_logp: torch.Tensor, mask: torch.Tensor, *, pairs: float | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPO's loss over rows ``2i`` (chosen) / ``2i+1`` (rejected) and its statistics.

    ``pairs`` replaces the local pair count as the denominator (the runtime
    passes the count over the whole mini-batch, all ranks included)."""
    if logp.shape[0] % 2:
        raise ValueError(f"DPO needs (chosen, rejected) row pairs, got {logp.shape[0]} rows")
    m = mask.to(logp.dtype)
    seq = ((logp - ref_logp) * m).sum(-1)  # log-ratio of each sequence against the reference
    chosen, rejected = seq[0::2], seq[1::2]
    z = spec.beta * (chosen - rejected)
    eps = spec.label_smoothing
    per_pair = -(1 - eps) * torch.nn.functional.logsigmoid(z) - eps * torch.nn.functional.logsigmoid(-z)
    n = pairs if pairs is not None else float(z.shape[0])
    reward_c, reward_r = spec.beta * chosen.detach(), spec.beta * rejected.detach()
    stats = {
        "dpo_loss": float(per_pair.detach().mean()),
        "dpo_margin": float((reward_c - reward_r).mean()),
        "dpo_accuracy": float((reward_c > reward_r).float().mean()),
        "chosen_reward": float(reward_c.mean()),
        "rejected_reward": float(reward_r.mean()),
    }
    return per_pair.sum() / n, stats


def value_loss(
    spec: BaseModel,
    values: torch.Tensor,
    old_values: torch.Tensor | None,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    denom: float | None = None,
    max_len: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The critic loss of ``spec`` and its statistics."""
    if not isinstance(spec, ValueClip):
        raise TypeError(f"{spec} is not a value loss")
    loss1 = (values - returns) ** 2
    if old_values is None:
        per_tok = 0.5 * loss1
        frac = 0.0
    else:
        clipped_v = old_values + (values - old_values).clamp(-spec.clip, spec.clip)
        loss2 = (clipped_v - returns) ** 2
        per_tok = 0.5 * torch.max(loss1, loss2)
        m = mask.to(values.dtype)
        frac = float((((loss2 > loss1).to(values.dtype) * m).sum() / m.sum().clamp(min=1)).detach())
    return aggregate(per_tok, mask, spec.agg, denom=denom, max_len=max_len), {"vf_clip_frac": frac}


# ------------------------------------------------------- user constructors
def ppo_clip(
    clip: float = 0.2,
    clip_high: float | None = None,
    *,
    dual_clip: float | None = None,
    ratio: Literal["token", "sequence"] = "token",
    agg: str = "token-mean",
) -> PPOClip:
    """PPO's clipped surrogate (see :class:`PPOClip`)."""
    return PPOClip(clip=clip, clip_high=clip_high, dual_clip=dual_clip, ratio=ratio, agg=agg)  # type: ignore[arg-type]


def dpo(beta: float = 0.1, *, label_smoothing: float = 0.0) -> DPO:
    """DPO's pairwise loss (see :class:`DPO`); the update needs ``ref_logprobs``."""
    return DPO(beta=beta, label_smoothing=label_smoothing)


def value_clip(clip: float = 0.2, *, agg: str = "token-mean") -> ValueClip:
    """The critic's clipped value loss (see :class:`ValueClip`)."""
    return ValueClip(clip=clip, agg=agg)  # type: ignore[arg-type]


def policy_gradient(*, agg: str = "token-mean") -> PolicyGradient:
    """REINFORCE's ``-A·logp`` (see :class:`PolicyGradient`)."""
    return PolicyGradient(agg=agg)  # type: ignore[arg-type]
