"""flowc: a compiler and runtime for reinforcement learning of language models.

Write one training iteration as an ``@fc.flow`` function; flowc traces it into
a dataflow IR, plans where every role runs, and executes the plan.

Everything here is re-exported lazily so that importing a lower layer
(``flowc.ir``, ``flowc.passes``, ``flowc.runtime``) does not load the front
end, and ``import flowc`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from flowc._version import __version__

_LAZY: dict[str, tuple[str, str | None]] = {
    "flow": ("flowc.flows", "flow"),
    "Flow": ("flowc.flows", "Flow"),
    "Prompts": ("flowc.roles", "Prompts"),
    "Preferences": ("flowc.roles", "Preferences"),
    "Policy": ("flowc.roles", "Policy"),
    "Critic": ("flowc.roles", "Critic"),
    "Reference": ("flowc.roles", "Reference"),
    "RewardModel": ("flowc.roles", "RewardModel"),
    "Reward": ("flowc.roles", "Reward"),
    "Environment": ("flowc.roles", "Environment"),
    "envs": ("flowc.envs", None),
    "ops": ("flowc.ops", None),
    "losses": ("flowc.losses", None),
    "errors": ("flowc.errors", None),
    "FlowcError": ("flowc.errors", "FlowcError"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'flowc' has no attribute {name!r}") from None
    mod = importlib.import_module(module)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # pragma: no cover
    from flowc import envs, errors, losses, ops
    from flowc.errors import FlowcError
    from flowc.flows import Flow, flow
    from flowc.roles import Critic, Environment, Policy, Preferences, Prompts, Reference, Reward, RewardModel
