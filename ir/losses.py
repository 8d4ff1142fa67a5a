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

from collections.abc import Mapping
from typing import Annotated, Any, Literal, Union

import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, TypeAdapter, model_validator

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


class ISCorrection(BaseModel):
    """An importance-sampling correction of the rollout/trainer mismatch (off-policy data).

    The rollout engine samples from its own policy ``μ`` (its weights, kernels,
    dtype, or an older weight version); the trainer scores the tokens under
    ``π_old`` (``old_logprobs``, or the current policy without them). Each
    token's weight is ``w = π_old/μ`` (``level="sequence"``: one weight per
    sequence, ``exp(Σ_t log π_old − log μ)``), detached, and multiplies the
    per-token policy loss:

    ``tis``  truncated importance sampling (Yao et al., 2025): ``min(w, cap)``.
    ``mis``  masked importance sampling: ``w`` where ``floor ≤ w ≤ cap``, else the
             token (or the whole sequence) is left out of the loss (weight 0).
             With a PPO loss whose ``old_logprobs`` are the trainer's own (the
             proximal policy), this is AReaL's decoupled PPO
             (:func:`decoupled_ppo`).
    """

    model_config = _SPEC
    kind: Literal["tis", "mis"] = "tis"
    cap: float = Field(2.0, gt=1.0)
    floor: float | None = Field(None, ge=0.0, lt=1.0)
    level: Literal["token", "sequence"] = "token"

    @model_validator(mode="after")
    def _floor_masks(self) -> ISCorrection:
        if self.floor is not None and self.kind != "mis":
            raise ValueError("floor= applies to masked importance sampling (fc.losses.mis); truncation has only a cap")
        return self

    def __str__(self) -> str:
        return _fmt(self)


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
    correction: ISCorrection | None = None

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
    """Plain policy gradient ``-A·logp`` (REINFORCE) with no ratio or clip. It assumes
    on-policy samples: with a ``correction`` each token's loss is weighted by
    ``π/μ`` (truncated or masked; see :class:`ISCorrection`)."""

    model_config = _SPEC
    kind: Literal["policy_gradient"] = "policy_gradient"
    agg: AggMode = "token-mean"
    correction: ISCorrection | None = None

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
    fields = type(spec).model_fields
    parts = [f"{k}={getattr(spec, k)}" for k in fields if k != "kind" and getattr(spec, k) != fields[k].default]
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


def idle_without_advantage(loss: object, *, kl_coef: float, entropy_coef: float, ref_logprobs: bool) -> bool:
    """Whether an update with ``loss`` may leave out the rows whose advantages are zero on every
    response token (a GRPO group whose rewards are all equal) and get the same gradient: every term
    of a policy loss is a token's advantage times a factor (:func:`policy_loss`: the clipped
    surrogate, dual clip, GSPO's ratio and the importance weights included), so such a row adds
    zero to the objective and to its gradient — unless the objective also has an entropy bonus
    (``entropy_coef``) or a KL term (``kl_coef`` with ``ref_logprobs``), which every row adds to.
    The denominators stay those of every row (the runtime counts them before it leaves any out)."""
    if not isinstance(loss, (PPOClip, PolicyGradient)):
        return False
    return entropy_coef == 0.0 and not (kl_coef and ref_logprobs)


def update_skips_idle(kwargs: Mapping[str, Any]) -> bool:
    """:func:`idle_without_advantage` for an ``update`` op's keyword arguments (the IR node's): the
    one decision the planner prices and the runtime carries out."""
    return idle_without_advantage(
        kwargs.get("loss"),
        kl_coef=float(kwargs.get("kl_coef", 0.0)),
        entropy_coef=float(kwargs.get("entropy_coef", 0.0)),
        ref_logprobs="ref_logprobs" in kwargs,
    )


def idle_rows(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool: the rows whose advantages (per sequence ``[N]`` or per token ``[N, R]``) are
    exactly zero on every response token under ``mask``."""
    if adv.dim() == 2:
        adv = adv[:, : mask.shape[1]]
    live = (broadcast_advantages(adv, mask) != 0) & mask.bool()
    return ~live.any(-1)


def denominator_kind(mode: str) -> str:
    """What ``aggregate``'s denominator counts for ``mode``: tokens or sequences."""
    return "tokens" if _AGG_ALIASES.get(mode, mode) == "token-mean" else "sequences"


def broadcast_advantages(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence advantages ``[N]`` become per-token ``[N, R]``; per-token
    advantages are used as they are."""
    if adv.dim() == 1:
        return adv.unsqueeze(-1).expand_as(mask).to(torch.float32)
    return adv


def is_weights(
    spec: ISCorrection, trainer_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """The detached per-token weights ``[N, R]`` of ``spec`` (see :class:`ISCorrection`) for
    tokens sampled under ``behaviour_logp`` and scored under ``trainer_logp``, and their
    statistics: ``is_weight`` (the mean weight before truncation or masking) and
    ``is_cut_frac`` (the fraction of tokens truncated or masked)."""
    m = mask.bool()
    log_w = ((trainer_logp - behaviour_logp) * m).detach()
    if spec.level == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand_as(log_w)
    w = torch.exp(log_w.clamp(-20.0, 20.0))
    if spec.kind == "tis":
        cut = w > spec.cap
        out = w.clamp(max=spec.cap)
    else:
        cut = (w > spec.cap) | (w < (spec.floor or 0.0))
        out = torch.where(cut, torch.zeros_like(w), w)
    f = m.to(w.dtype)
    n = f.sum().clamp(min=1)
    stats = {"is_weight": float((w * f).sum() / n), "is_cut_frac": float(((cut & m).to(w.dtype)).sum() / n)}
    return out * f, stats


def mismatch(trainer_logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the rollout engine's policy ``μ`` is from the trainer's ``π`` on the sampled tokens:
    ``mismatch_kl``, the k3 estimate of KL(μ‖π) (mean of ``ρ − 1 − log ρ``, ``ρ = π/μ``; ≥ 0,
    0 when they agree), and ``mismatch_abs``, the mean ``|log π − log μ|``."""
    f = mask.to(torch.float64)
    d = (trainer_logp.detach().double() - behaviour_logp.double()) * f
    n = f.sum().clamp(min=1)
    k3 = (torch.expm1(d.clamp(-20.0, 20.0)) - d).clamp(min=0.0) * f  # ≥ 0; expm1 keeps tiny differences exact
    return {"mismatch_kl": float(k3.sum() / n), "mismatch_abs": float(d.abs().sum() / n)}


def policy_loss(
    spec: BaseModel,
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    denom: float | None = None,
    max_len: int | None = None,
    behaviour_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss of ``spec`` and its statistics (clip fraction, ratio; with a
    correction, the importance weights'). ``behaviour_logp``: the rollout engine's
    log-probabilities of the sampled tokens, which a correction weighs against
    ``old_logp`` (or, without it, the current policy)."""
    adv = broadcast_advantages(adv, mask)
    m = mask.to(logp.dtype)
    correction = getattr(spec, "correction", None)
    weight, wstats = None, {}
    if correction is not None:
        if behaviour_logp is None:
            raise ValueError(f"{spec} corrects for the rollout engine's policy but got no rollout log-probabilities")
        weight, wstats = is_weights(correction, logp.detach() if old_logp is None else old_logp, behaviour_logp, mask)
    if isinstance(spec, PolicyGradient):
        per_tok = -adv * logp
        if weight is not None:
            per_tok = per_tok * weight
        return aggregate(per_tok, mask, spec.agg, denom=denom, max_len=max_len), wstats
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
    if weight is not None:
        per_tok = per_tok * weight
    clipped = ((surr2 < surr1) & mask.bool()).to(logp.dtype)
    stats = {
        "clip_frac": float((clipped.sum() / m.sum().clamp(min=1)).detach()),
        "ratio_mean": float(((ratio * m).sum() / m.sum().clamp(min=1)).detach()),
        **wstats,
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
    correction: ISCorrection | None = None,
) -> PPOClip:
    """PPO's clipped surrogate (see :class:`PPOClip`); ``correction``: :func:`tis` or :func:`mis`."""
    return PPOClip(clip=clip, clip_high=clip_high, dual_clip=dual_clip, ratio=ratio, agg=agg, correction=correction)  # type: ignore[arg-type]


def tis(cap: float = 2.0, *, level: Literal["token", "sequence"] = "token") -> ISCorrection:
    """Truncated importance sampling of the rollout/trainer mismatch: each token's loss × ``min(π/μ, cap)``."""
    return ISCorrection(kind="tis", cap=cap, level=level)


def mis(cap: float = 2.0, *, floor: float | None = None, level: Literal["token", "sequence"] = "token") -> ISCorrection:
    """Masked importance sampling: each token's loss × ``π/μ``, tokens (or sequences) whose weight
    is above ``cap`` (or below ``floor``) left out of the loss."""
    return ISCorrection(kind="mis", cap=cap, floor=floor, level=level)


def decoupled_ppo(clip: float = 0.2, clip_high: float | None = None, *, cap: float = 5.0, agg: str = "token-mean") -> PPOClip:
    """AReaL's decoupled PPO (Fu et al., 2025): the clipped ratio is taken against the trainer's
    own log-probabilities before the update (the proximal policy, ``old_logprobs=`` — required),
    and each token is weighted by proximal/behaviour ``π_prox/μ`` from the rollout engine's
    log-probabilities, tokens above ``cap`` masked out. The same as
    ``ppo_clip(clip, correction=mis(cap))`` with ``old_logprobs`` given."""
    return ppo_clip(clip, clip_high, agg=agg, correction=mis(cap))


def dpo(beta: float = 0.1, *, label_smoothing: float = 0.0) -> DPO:
    """DPO's pairwise loss (see :class:`DPO`); the update needs ``ref_logprobs``."""
    return DPO(beta=beta, label_smoothing=label_smoothing)


def value_clip(clip: float = 0.2, *, agg: str = "token-mean") -> ValueClip:
    """The critic's clipped value loss (see :class:`ValueClip`)."""
    return ValueClip(clip=clip, agg=agg)  # type: ignore[arg-type]


def policy_gradient(*, agg: str = "token-mean", correction: ISCorrection | None = None) -> PolicyGradient:
    """REINFORCE's ``-A·logp`` (see :class:`PolicyGradient`); ``correction``: :func:`tis` or :func:`mis`."""
    return PolicyGradient(agg=agg, correction=correction)  # type: ignore[arg-type]
