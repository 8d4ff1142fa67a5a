"""``fc.losses``: the losses ``update(loss=…)`` accepts.

Constructors return frozen specs that the IR stores; their math and the
aggregation modes (``token-mean``, ``seq-mean-token-mean`` a.k.a.
``sequence-mean``, ``seq-mean-token-sum``, ``seq-mean-token-sum-norm``) are
defined in :mod:`flowc.ir.losses`. ``dpo(beta)`` is the pairwise loss of
offline preference training (a flow over ``fc.Preferences``).
"""

from flowc.ir.losses import AGG_MODES, DPO, PolicyGradient, PPOClip, ValueClip, dpo, policy_gradient, ppo_clip, value_clip

__all__ = ["AGG_MODES", "DPO", "PPOClip", "PolicyGradient", "ValueClip", "dpo", "policy_gradient", "ppo_clip", "value_clip"]


def __getattr__(name: str) -> object:
    from flowc.roles import suggest

    raise AttributeError(f"fc.losses has no {name!r}{suggest(name, __all__)}; it has {', '.join(__all__)}")
