"""``fc.losses``: the losses ``update(loss=…)`` accepts.

Constructors return frozen specs that the IR stores; their math and the
aggregation modes (``token-mean``, ``seq-mean-token-mean`` a.k.a.
``sequence-mean``, ``seq-mean-token-sum``, ``seq-mean-token-sum-norm``) are
defined in :mod:`flowc.ir.losses`. ``dpo(beta)`` is the pairwise loss of
offline preference training (a flow over ``fc.Preferences``).

Off-policy corrections (the rollout engine's policy ``μ`` against the
trainer's ``π``): ``ppo_clip(clip, correction=tis(cap))`` (truncated importance
sampling), ``correction=mis(cap)`` (masked), and ``decoupled_ppo(clip, cap=…)``
(AReaL's decoupled PPO). See docs/async.md.
"""

from flowc.ir.losses import (
    AGG_MODES,
    DPO,
    ISCorrection,
    PolicyGradient,
    PPOClip,
    ValueClip,
    decoupled_ppo,
    dpo,
    mis,
    policy_gradient,
    ppo_clip,
    tis,
    value_clip,
)

__all__ = [
    "AGG_MODES",
    "DPO",
    "ISCorrection",
    "PPOClip",
    "PolicyGradient",
    "ValueClip",
    "decoupled_ppo",
    "dpo",
    "mis",
    "policy_gradient",
    "ppo_clip",
    "tis",
    "value_clip",
]


def __getattr__(name: str) -> object:
    from flowc.roles import suggest

    raise AttributeError(f"fc.losses has no {name!r}{suggest(name, __all__)}; it has {', '.join(__all__)}")
