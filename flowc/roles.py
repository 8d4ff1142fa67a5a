"""Role types: what a flow's parameters are annotated with.

A role type says what a model can do in the algorithm. While a flow is traced
each role parameter is bound to an instance of its type whose methods record
IR nodes (see :mod:`flowc.tracing`); which model a role is, and where it runs,
is decided later — never in the algorithm file.

=================  ==========================================  ===============
type               methods                                     trainable
=================  ==========================================  ===============
``Policy``         ``generate``, ``logprobs``, ``update``      yes
``Critic``         ``values``, ``update``                      yes
``Reference``      ``logprobs``                                no (frozen)
``RewardModel``    ``score``                                   no
``Reward``         called like a function: ``reward(rollout)`` no (Python)
``Environment``    passed to ``generate(..., env=...)``         no (Python)
``Prompts``        the batch of prompts (a data parameter)     —
``Preferences``    preference pairs (a data parameter; DPO)    —
=================  ==========================================  ===============
"""

from __future__ import annotations

import difflib
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

from flowc.errors import RoleUsageError, SignatureError
from flowc.ir.losses import POLICY_LOSSES, PREFERENCE_LOSSES, VALUE_LOSSES, ppo_clip, value_clip
from flowc.ir.sampling import SAMPLING_KEYS, SamplingParams

if TYPE_CHECKING:
    from flowc.tracing import TraceContext


class Prompts:
    """Annotation for the flow's batch of prompts (``B`` prompts per step)."""

    kind: ClassVar[str] = "prompts"


class Preferences:
    """Annotation for a batch of ``B`` preference pairs (offline training, e.g. DPO).

    Traced as a rollout of ``2*B`` sequences: row ``2i`` is prompt ``i`` with
    its chosen response, row ``2i+1`` the same prompt with the rejected one.
    Pass it wherever a rollout goes (``ref.logprobs(pairs)``,
    ``actor.update(pairs, …, loss=fc.losses.dpo(beta))``); the data holds
    ``prompt``, ``chosen`` and ``rejected`` columns."""

    kind: ClassVar[str] = "preferences"


def suggest(word: str, choices: list[str] | tuple[str, ...]) -> str:
    """``" (did you mean 'x'?)"`` when a close match exists, else ``""``."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class Role:
    """Base of the role types; an instance is a role bound during tracing."""

    kind: ClassVar[str] = ""
    title: ClassVar[str] = ""
    methods: ClassVar[tuple[str, ...]] = ()

    def __init__(self, name: str, ctx: TraceContext) -> None:
        self.name = name
        self._ctx = ctx

    def __repr__(self) -> str:
        return f"<{self.title} role {self.name!r}>"

    def __getattr__(self, item: str) -> NoReturn:
        if item.startswith("__"):
            raise AttributeError(item)
        hint = suggest(item, self.methods)
        fix = f"a {self.title} can {', '.join(self.methods)}"
        if item == "update" and self.kind == "reference":
            fix = "a Reference is frozen; to train this model declare the parameter as fc.Policy"
        elif item in ("generate", "logprobs", "values", "score", "update"):
            owner = {
                "generate": "fc.Policy",
                "logprobs": "fc.Policy or fc.Reference",
                "values": "fc.Critic",
                "score": "fc.RewardModel",
                "update": "fc.Policy or fc.Critic",
            }[item]
            fix = f"{fix}; {item!r} belongs to {owner}"
        raise RoleUsageError(f"{self.title} role {self.name!r} has no method {item!r}{hint}", fix=fix)

    def _check_kwargs(self, method: str, given: dict[str, Any], allowed: tuple[str, ...]) -> None:
        for k in given:
            if k not in allowed:
                raise SignatureError(
                    f"{self.name}.{method}() got an unexpected keyword {k!r}{suggest(k, allowed)}",
                    fix=f"{self.name}.{method} takes {', '.join(allowed)}",
                )

    def _coef(self, method: str, key: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SignatureError(
                f"{self.name}.{method}({key}=...) must be a number known when the flow is traced, got {type(value).__name__}",
                fix="pass a hyperparameter or a literal, e.g. kl_coef=kl",
            )
        return float(value)


class Policy(Role):
    """A trainable language model that generates: ``generate``, ``logprobs``, ``update``."""

    kind = "policy"
    title = "Policy"
    methods = ("generate", "logprobs", "update")

    def generate(
        self, prompts: Any, *, n: int = 1, env: Environment | None = None, max_turns: int | None = None, **sampling: Any
    ) -> Any:
        """Sample ``n`` responses per prompt; returns a rollout of ``B*n``
        sequences. Sampling keywords: see :class:`flowc.ir.sampling.SamplingParams`
        (``greedy=True`` for a greedy sample); those left out come from the
        run's configuration.

        With ``env`` (an ``fc.Environment`` parameter of the flow) each sample is a multi-turn
        trajectory: the policy's turn ends at EOS or at one of the environment's stop strings,
        the environment answers with an observation, and the policy continues, for at most
        ``max_turns`` turns (default: the environment's ``max_turns``). The rollout's response is
        the whole trajectory after the prompt; ``response_mask`` marks the policy's tokens (the
        only ones trained on), ``env_mask`` the environment's, ``env_reward`` the environment's
        rewards summed over the turns and ``turns`` the policy's turns (see docs/agents.md)."""
        self._check_kwargs("generate", sampling, SAMPLING_KEYS)
        agent: dict[str, Any] = {}
        if env is not None:
            if not isinstance(env, Environment):
                raise SignatureError(
                    f"{self.name}.generate(env={env!r}): env must be an environment role of the flow",
                    fix="declare a parameter `env: fc.Environment` and pass it: actor.generate(prompts, env=env)",
                )
            if max_turns is not None and (isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1):
                raise SignatureError(
                    f"{self.name}.generate(max_turns={max_turns!r}): max_turns must be a positive integer known when the flow is traced",
                    fix="pass a positive integer (a literal or a hyperparameter whose value is one, e.g. max_turns=3)",
                )
            agent = {"env": env.name, **({"max_turns": max_turns} if max_turns is not None else {})}
        elif max_turns is not None:
            raise SignatureError(
                f"{self.name}.generate(max_turns={max_turns}) without env=: turns are an environment's",
                fix="pass the environment role too: actor.generate(prompts, env=env, max_turns=...)",
            )
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise SignatureError(
                f"{self.name}.generate(n={n!r}): n must be a positive integer known when the flow is traced",
                fix="use a literal or a hyperparameter, e.g. n=n",
            )
        try:
            SamplingParams(**sampling)
        except Exception as e:  # pydantic.ValidationError
            raise SignatureError(f"{self.name}.generate(): invalid sampling parameters: {_first_error(e)}") from e
        static = {"n": n, **{k: (tuple(v) if isinstance(v, list) else v) for k, v in sampling.items()}, **agent}
        return self._ctx.role_call(self, "generate", {"prompts": (prompts, "prompts")}, static)

    def logprobs(self, rollout: Any) -> Any:
        """Log-probabilities ``[B*n, R]`` of the rollout's response tokens under this policy."""
        return self._ctx.role_call(self, "logprobs", {"rollout": (rollout, "rollout")}, {})

    _UPDATE_KEYS = ("advantages", "old_logprobs", "ref_logprobs", "loss", "kl_coef", "kl_kind", "entropy_coef")

    def update(self, rollout: Any, **kwargs: Any) -> Any:
        """One training step on the rollout.

        Keywords: ``advantages`` ([B*n] per sequence — broadcast over the
        response — or [B*n, R] per token; required), ``old_logprobs``,
        ``ref_logprobs`` (required when ``kl_coef > 0``), ``loss`` (default
        ``fc.losses.ppo_clip()``), ``kl_coef``, ``kl_kind`` (default
        ``low_var_kl``), ``entropy_coef``.
        """
        self._check_kwargs("update", kwargs, self._UPDATE_KEYS)
        loss = kwargs.get("loss", ppo_clip())
        if isinstance(loss, PREFERENCE_LOSSES):
            if "ref_logprobs" not in kwargs:
                raise SignatureError(
                    f"{self.name}.update(loss={loss}) needs ref_logprobs=",
                    fix="pass ref_logprobs=ref.logprobs(pairs): the frozen reference's log-probabilities of the pairs",
                )
        elif "advantages" not in kwargs:
            raise SignatureError(
                f"{self.name}.update() needs advantages=",
                fix="compute advantages in the flow (e.g. fc.ops.group_normalize(scores, n)) and pass advantages=adv",
            )
        if not isinstance(loss, POLICY_LOSSES):
            raise SignatureError(
                f"{self.name}.update(loss={loss}) is not a policy loss",
                fix="use fc.losses.ppo_clip(...), fc.losses.policy_gradient() or fc.losses.dpo(beta)",
            )
        static: dict[str, Any] = {"loss": loss}
        for key in ("kl_coef", "entropy_coef"):
            if key in kwargs:
                static[key] = self._coef("update", key, kwargs[key])
        if static.get("kl_coef", 0.0) > 0:
            if "ref_logprobs" not in kwargs:
                raise SignatureError(
                    f"{self.name}.update(kl_coef={static['kl_coef']}) needs ref_logprobs=",
                    fix="pass ref_logprobs=ref.logprobs(rollout), or set kl_coef=0",
                )
            from flowc.ir.functional import DEFAULT_KL_KIND

            static["kl_kind"] = kwargs.get("kl_kind", DEFAULT_KL_KIND)
        elif "kl_kind" in kwargs:
            static["kl_kind"] = kwargs["kl_kind"]
        if "kl_kind" in static:
            from flowc.ir.functional import KL_KINDS

            if static["kl_kind"] not in KL_KINDS:
                raise SignatureError(
                    f"{self.name}.update(kl_kind={static['kl_kind']!r}) is not a KL estimator{suggest(str(static['kl_kind']), KL_KINDS)}",
                    fix=f"use one of {', '.join(KL_KINDS)}",
                )
        tensors = {k: (kwargs[k], "tensor") for k in ("advantages", "old_logprobs", "ref_logprobs") if k in kwargs}
        return self._ctx.role_call(self, "update", {"rollout": (rollout, "rollout"), **tensors}, static)


class Critic(Role):
    """A trainable value model: ``values``, ``update``."""

    kind = "critic"
    title = "Critic"
    methods = ("values", "update")

    def values(self, rollout: Any) -> Any:
        """Value estimates ``[B*n, R]`` for each response token."""
        return self._ctx.role_call(self, "values", {"rollout": (rollout, "rollout")}, {})

    _UPDATE_KEYS = ("returns", "old_values", "loss")

    def update(self, rollout: Any, **kwargs: Any) -> Any:
        """One training step of the critic: ``returns`` (required),
        ``old_values`` (for value clipping), ``loss`` (default
        ``fc.losses.value_clip()``)."""
        self._check_kwargs("update", kwargs, self._UPDATE_KEYS)
        if "returns" not in kwargs:
            raise SignatureError(
                f"{self.name}.update() needs returns=",
                fix="compute returns in the flow, e.g. adv, ret = fc.ops.gae(...), and pass returns=ret",
            )
        loss = kwargs.get("loss", value_clip())
        if not isinstance(loss, VALUE_LOSSES):
            raise SignatureError(f"{self.name}.update(loss={loss}) is not a value loss", fix="use fc.losses.value_clip(...)")
        tensors = {k: (kwargs[k], "tensor") for k in ("returns", "old_values") if k in kwargs}
        return self._ctx.role_call(self, "update", {"rollout": (rollout, "rollout"), **tensors}, {"loss": loss})


class Reference(Role):
    """A frozen copy of a policy (by default its initial weights): ``logprobs``."""

    kind = "reference"
    title = "Reference"
    methods = ("logprobs",)

    def logprobs(self, rollout: Any) -> Any:
        """Log-probabilities ``[B*n, R]`` of the rollout's response tokens."""
        return self._ctx.role_call(self, "logprobs", {"rollout": (rollout, "rollout")}, {})


class RewardModel(Role):
    """A learned reward model: ``score``."""

    kind = "reward_model"
    title = "RewardModel"
    methods = ("score",)

    def score(self, rollout: Any) -> Any:
        """One score per sequence, ``[B*n]``."""
        return self._ctx.role_call(self, "score", {"rollout": (rollout, "rollout")}, {})


class Reward(Role):
    """A Python scoring function bound at run time (``--reward``); call it on a rollout."""

    kind = "reward"
    title = "Reward"
    methods = ("__call__",)

    def __call__(self, rollout: Any) -> Any:
        """One score per sequence, ``[B*n]``."""
        return self._ctx.role_call(self, "reward", {"rollout": (rollout, "rollout")}, {})


class Environment(Role):
    """User Python the policy acts in over several turns (a tool, a sandbox, a game), bound at run
    time (``--env ROLE=module:Class``; a flow run on the built-in task gets the calculator).
    It has no methods of its own in a flow: pass it to ``actor.generate(prompts, env=env)``.
    The class implements the protocol of :mod:`flowc.envs` (``reset``, ``step``, ``stop``)."""

    kind = "environment"
    title = "Environment"
    methods = ()


ROLE_TYPES: dict[type, str] = {
    Policy: "policy",
    Critic: "critic",
    Reference: "reference",
    RewardModel: "reward_model",
    Reward: "reward",
    Environment: "environment",
}


def _first_error(e: Exception) -> str:
    errors = getattr(e, "errors", None)
    if callable(errors):
        err = errors()[0]
        loc = ".".join(str(p) for p in err.get("loc", ()))
        return f"{loc}: {err.get('msg')}" if loc else str(err.get("msg"))
    return str(e)
