"""The controller-side tensor ops of flows (users call them as ``fc.ops.*``).

Each op is a plain function of tensors. Inside a ``@flow`` it is *traced*:
called with a traced value it records one ``compute`` node whose target is
the op's qualified name (``flowc.ir.functional.gae``) instead of running, so
a graph shows ``gae`` rather than its thirty internal steps. The runtime runs
the same functions on real tensors, and shape inference runs them on meta
tensors — one definition serves all three.

Shapes: ``N`` sequences (``B*n``), ``R`` response tokens. ``mask`` is the
rollout's ``response_mask`` (bool or 0/1), True on response tokens.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
import torch.fx

F = TypeVar("F", bound=Callable[..., Any])

OPS_REGISTRY: dict[str, Callable[..., Any]] = {}
"""Traceable ops by short name (``gae``) — the public ``fc.ops`` surface."""


@dataclass
class PromptBatch:
    """A batch of prompts: ``input_ids``/``attention_mask`` ``[B, P]`` (left-padded)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor


@dataclass
class Rollout:
    """What ``generate`` returns: ``N`` sequences (prompt + response).

    A multi-turn trajectory (``generate(..., env=...)``) is one sequence too: its response is
    every token after the prompt, the policy's turns and the environment's observations in the
    order they happened. ``response_mask`` is True on the policy's tokens only (what the loss,
    the KL and every flow op count), ``env_mask`` on the environment's (seen by the model, never
    trained on); ``present`` is both, what a forward pass attends to. Single-turn rollouts have no
    ``env_mask``, and the agent fields are None."""

    prompt_ids: torch.Tensor  # [N, P]
    prompt_mask: torch.Tensor  # [N, P]
    response_ids: torch.Tensor  # [N, R]
    response_mask: torch.Tensor  # [N, R] the policy's tokens
    logprobs: torch.Tensor  # [N, R] sampler log-probabilities (0 off the policy's tokens)
    env_mask: torch.Tensor | None = None  # [N, R] the environment's tokens (agent rollouts)
    env_reward: torch.Tensor | None = None  # [N] the environment's rewards, summed over the turns
    turns: torch.Tensor | None = None  # [N] the policy's turns

    @property
    def present(self) -> torch.Tensor:
        """``[N, R]`` True on every token of the response (the policy's and the environment's)."""
        return self.response_mask if self.env_mask is None else self.response_mask | self.env_mask


def _find_proxy(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.fx.Proxy | None:
    found: list[torch.fx.Proxy] = []
    torch.fx.node.map_aggregate((args, kwargs), lambda x: found.append(x) if isinstance(x, torch.fx.Proxy) else None)
    return found[0] if found else None


def traceable(fn: F) -> F:
    """Make ``fn`` record a single ``compute`` node when traced.

    The arguments are checked against ``fn``'s signature at trace time, so a
    misspelt keyword fails where the user wrote it.
    """
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        proxy = _find_proxy(args, kwargs)
        if proxy is None:
            return fn(*args, **kwargs)
        sig.bind(*args, **kwargs)  # TypeError on a bad keyword; the tracer reports it
        return proxy.tracer.create_proxy("call_function", wrapper, args, kwargs)

    wrapper.__flowc_op__ = fn.__name__  # type: ignore[attr-defined]
    wrapper.__signature__ = sig  # type: ignore[attr-defined]
    OPS_REGISTRY[fn.__name__] = wrapper
    return wrapper  # type: ignore[return-value]


def _group(x: torch.Tensor, group_size: int, op: str) -> torch.Tensor:
    if group_size < 2:
        raise ValueError(f"{op} needs group_size >= 2 (got {group_size}): a group of one has no baseline")
    return x.reshape(-1, group_size)


@traceable
def group_normalize(scores: torch.Tensor, group_size: int, *, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO's advantage: each score minus its group's mean, divided by the
    group's standard deviation (unless ``scale=False``, as in Dr. GRPO).

    ``scores [N]`` holds ``N/group_size`` consecutive groups. Returns ``[N]``.
    """
    g = _group(scores, group_size, "group_normalize")
    out = g - g.mean(-1, keepdim=True)
    if scale:
        out = out / (g.std(-1, keepdim=True) + eps)
    return out.reshape(scores.shape)


@traceable
def rloo_baseline(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO's leave-one-out baseline: for each sample, the mean score of the
    *other* samples of its group. Advantage = ``scores - rloo_baseline(...)``."""
    g = _group(scores, group_size, "rloo_baseline")
    return ((g.sum(-1, keepdim=True) - g) / (group_size - 1)).reshape(scores.shape)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


@traceable
def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``x`` over the True entries of ``mask`` (over ``dim`` if given)."""
    m = mask.to(x.dtype)
    if dim is None:
        return (x * m).sum() / m.sum().clamp(min=1)
    return (x * m).sum(dim) / m.sum(dim).clamp(min=1)


@traceable
def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``x`` over the True entries of ``mask`` (over ``dim`` if given)."""
    m = mask.to(x.dtype)
    return (x * m).sum() if dim is None else (x * m).sum(dim)


@traceable
def whiten(x: torch.Tensor, mask: torch.Tensor | None = None, *, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """Normalise ``x`` to zero mean and unit variance over the batch (masked
    entries only; REINFORCE++'s global normalisation, PPO's advantage
    whitening). With ``shift_mean=False`` the mean is kept."""
    m = torch.ones_like(x, dtype=torch.bool) if mask is None else mask.bool()
    mean = _masked_mean(x, m)
    centred = x - mean
    count = m.to(x.dtype).sum()
    var = _masked_mean(centred**2, m) * count / (count - 1).clamp(min=1)
    out = centred * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * m.to(x.dtype)


@traceable
def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over response tokens.

    ``token_rewards``, ``values``, ``mask``: ``[N, R]``. Tokens after a
    sequence's last response token are terminal (their value counts 0).
    Returns ``(advantages, returns)``, both ``[N, R]`` and zero off the mask;
    ``returns = advantages + values``. With ``gamma = lam = 1`` the advantage
    is the reward-to-go minus the value. In a multi-turn trajectory the mask
    (the policy's tokens) has holes where observations are: the recurrence runs
    over the policy's tokens alone, each bootstrapping from the next one.
    """
    idx = _packed(mask)
    adv, ret = _gae_prefix(token_rewards.gather(1, idx), values.gather(1, idx), mask.gather(1, idx), gamma, lam)
    return _unpack(adv, idx), _unpack(ret, idx)


def _packed(mask: torch.Tensor) -> torch.Tensor:
    """The gather index that moves each row's masked positions to its front, in order (a mask with
    holes — a trajectory's policy tokens between observations — becomes a prefix; a prefix mask is
    left as it is)."""
    return torch.argsort((~mask.bool()).to(torch.int8), dim=-1, stable=True)


def _unpack(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x`` (packed by ``idx``) back at the positions it came from."""
    return torch.zeros_like(x).scatter(1, idx, x)


def _gae_prefix(
    token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    m = mask.to(values.dtype)
    r_len = token_rewards.shape[-1]
    last = torch.zeros_like(values[:, 0])
    out = []
    for t in reversed(range(r_len)):
        if t + 1 < r_len:
            m_next = m[:, t + 1]
            v_next = values[:, t + 1] * m_next
        else:
            m_next = torch.zeros_like(last)
            v_next = torch.zeros_like(last)
        delta = token_rewards[:, t] + gamma * v_next - values[:, t]
        last = delta + gamma * lam * m_next * last
        out.append(last)
    adv = torch.stack(out[::-1], dim=-1) * m
    return adv, (adv + values) * m


@traceable
def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Reward-to-go per token: ``G_t = r_t + gamma * G_{t+1}`` within each
    sequence's response (REINFORCE++'s return). ``[N, R]`` in and out. Over a
    multi-turn trajectory's policy tokens alone (the observations between them
    are not steps)."""
    idx = _packed(mask)
    r, m = token_rewards.gather(1, idx), mask.gather(1, idx).to(token_rewards.dtype)
    running = torch.zeros_like(r[:, 0])
    out = []
    for t in reversed(range(r.shape[-1])):
        running = r[:, t] * m[:, t] + gamma * running * m[:, t]
        out.append(running)
    return _unpack(torch.stack(out[::-1], dim=-1), idx)


@traceable
def token_level(scores: torch.Tensor, rollout: Rollout) -> torch.Tensor:
    """Place each sequence's score ``[N]`` on its last response token,
    zero elsewhere: ``[N, R]`` token rewards."""
    mask = rollout.response_mask.bool()
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.zeros_like(positions)).amax(-1)
    out = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    return out.scatter(1, last.unsqueeze(-1), scores.unsqueeze(-1)) * mask.to(scores.dtype)


@traceable
def overlong_penalty(rollout: Rollout, cache: float, max_len: int | None = None) -> torch.Tensor:
    """DAPO's soft overlong punishment ``[N]``, added to the reward.

    With ``L = max_len`` (default: the rollout's response length limit ``R``),
    a punishment band of ``C = cache`` tokens (a ``cache`` below 1 is a
    fraction of ``L``: DAPO's 4096 of 20480 is ``0.2``; at least one token) and
    a response of ``|y|`` tokens: 0 while ``|y| <= L - C``, then falling
    linearly, ``(L - C - |y|) / C``, to -1 at ``|y| = L``.
    """
    limit = rollout.response_ids.shape[-1] if max_len is None else max_len
    band = max(1, round(cache * limit)) if 0 < cache < 1 else cache
    if not 0 < band <= limit:
        raise ValueError(f"overlong_penalty needs 0 < cache <= max_len (got cache={cache}, max_len={limit})")
    length = rollout.response_mask.to(torch.float32).sum(-1)
    return ((limit - band - length) / band).clamp(-1.0, 0.0)


def varied_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """Which groups of ``scores [N]`` (``N/group_size`` consecutive groups) hold
    differing scores: ``bool [N/group_size]`` (DAPO's dynamic-sampling test; a
    group whose samples all score alike has zero advantage everywhere)."""
    g = _group(scores, group_size, "filter_groups")
    return (g.amax(-1) - g.amin(-1)) > 0


KLKind = Literal["k1", "k2", "k3", "low_var_kl", "abs", "mse"]
KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3", "low_var_kl", "abs", "mse")
DEFAULT_KL_KIND = "low_var_kl"  # update(ref_logprobs=…) without kl_kind


@traceable
def kl(logp: torch.Tensor, ref_logp: torch.Tensor, kind: KLKind = "k1") -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference.

    ``k1``: ``logp - ref``; ``k2``/``mse``: ``½(logp - ref)²``; ``k3``:
    ``exp(ref - logp) - (ref - logp) - 1`` (unbiased, non-negative);
    ``low_var_kl``: ``k3`` clamped to ``[-10, 10]`` as in verl/GRPO;
    ``abs``: ``|logp - ref|``.
    """
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind in ("k2", "mse"):
        return 0.5 * d * d
    if kind in ("k3", "low_var_kl"):
        r = -d
        out = torch.exp(r) - r - 1
        return out.clamp(-10.0, 10.0) if kind == "low_var_kl" else out
    if kind == "abs":
        return d.abs()
    raise ValueError(f"unknown KL kind {kind!r}; use one of {', '.join(KL_KINDS)}")
