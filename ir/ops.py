"""The closed set of IR operations — each defined here, once.

A :class:`~flowc.ir.graph.Node` has an ``op`` from this set, a ``role`` (the
name of the model role it runs on, or ``None`` for controller-side compute),
``args``/``kwargs`` that mix :class:`~flowc.ir.graph.ValueRef` references to
earlier nodes' outputs with constants, and an output ``type``.

``input``
    A batch from a data source: ``kwargs["source"]`` names the flow parameter
    (e.g. ``prompts``), ``kwargs["kind"]`` its kind (``prompts``). Output:
    ``Prompts[B]`` with ``input_ids``/``attention_mask`` ``[B, P]``. Role: none.

``generate``
    Sample responses from a policy. ``args[0]`` refers to the prompts;
    ``kwargs`` hold ``n`` (samples per prompt) and the sampling parameters
    (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``greedy``,
    ``max_tokens``, ``stop``). Output: ``Rollout[B*n]`` (see
    :func:`flowc.ir.types.rollout_type`). Role kinds: policy.

``logprobs``
    Teacher-forced log-probabilities of a rollout's response tokens.
    ``args[0]`` refers to a rollout. Output: ``f32[B*n, R]``. Role kinds:
    policy, reference.

``values``
    A critic's value estimate per response token. ``args[0]`` a rollout.
    Output: ``f32[B*n, R]``. Role kinds: critic.

``score``
    A reward model's score per sequence. ``args[0]`` a rollout. Output:
    ``f32[B*n]``. Role kinds: reward_model.

``reward``
    A user's Python scoring function over decoded rollouts, run on the
    controller or a worker. ``args[0]`` a rollout. Output: ``f32[B*n]``.
    Role kinds: reward.

``compute``
    Tensor math on the controller. ``target`` is the qualified name of a
    function (``flowc.ir.functional.gae``, ``torch.exp``, ``operator.sub``)
    or ``Tensor.<method>`` for a tensor method; ``args``/``kwargs`` are its
    arguments. Output: inferred by shape propagation. Role: none.

``filter``
    Dynamic sampling (DAPO): keep the prompt groups whose scores vary and
    generate again until the batch is full. ``args`` = (rollout, scores
    ``[B*n]``); ``kwargs``: ``group_size``, ``max_rounds`` (generation rounds
    at most) and ``expected_keep`` (the fraction of groups expected to vary:
    the planner prices ``min(1/expected_keep, max_rounds)`` rounds of the ops
    the filter depends on). Output: ``(Rollout[B*n], f32[B*n])`` — the same
    shapes, holding only kept groups unless ``max_rounds`` ran out. The
    runtime owns the loop: it re-runs the filter's ancestors (input,
    generate, reward, compute) on fresh prompts. Ops after the filter must
    read its outputs, not the values it filtered. Role: none.

``update``
    One training step of a role (one or more optimizer updates over the
    rollout). ``args[0]`` a rollout; ``kwargs`` the named tensors
    (``advantages``, ``old_logprobs``, ``ref_logprobs``, ``returns``,
    ``old_values``), ``loss`` (a loss spec from :mod:`flowc.ir.losses`) and
    coefficients (``kl_coef``, ``entropy_coef``). Output: ``Stats``.
    Role kinds: policy, critic. Every ``update`` of role R has loop-carried
    weight edges to the ops of R that read its weights in the next iteration.

``weight_sync``
    Move a role's weights from its training layout to the layout of another
    phase (inserted by the reshard pass in place of a weight edge).
    ``kwargs["method"]`` names the reshard method. Role kinds: policy, critic.
"""

from __future__ import annotations

from enum import Enum


class _Name(str, Enum):
    """An enum whose members are their names as strings: equal to, hashed as and
    printed as the plain string, so tables keyed by members answer plain-string
    lookups and the IR's text and JSON forms are unchanged."""

    def __str__(self) -> str:
        return str.__str__(self.value)

    def __format__(self, spec: str) -> str:
        return str.__format__(self.value, spec)


class Op(_Name):
    """The closed set of operations (each defined in this module's docstring)."""

    INPUT = "input"
    GENERATE = "generate"
    LOGPROBS = "logprobs"
    VALUES = "values"
    SCORE = "score"
    REWARD = "reward"
    COMPUTE = "compute"
    FILTER = "filter"
    UPDATE = "update"
    WEIGHT_SYNC = "weight_sync"


class RoleKind(_Name):
    """What a role is, by what it can do (``fc.Policy``, ``fc.Critic``, …)."""

    POLICY = "policy"
    CRITIC = "critic"
    REFERENCE = "reference"
    REWARD_MODEL = "reward_model"
    REWARD = "reward"
    ENVIRONMENT = "environment"


PYTHON_KINDS: frozenset[RoleKind] = frozenset({RoleKind.REWARD, RoleKind.ENVIRONMENT})
"""Role kinds bound to user Python at run time, not to a model (they take no devices)."""


OPS: tuple[Op, ...] = tuple(Op)

OP_ROLE_KINDS: dict[Op, frozenset[RoleKind]] = {
    Op.INPUT: frozenset(),
    Op.GENERATE: frozenset({RoleKind.POLICY}),
    Op.LOGPROBS: frozenset({RoleKind.POLICY, RoleKind.REFERENCE}),
    Op.VALUES: frozenset({RoleKind.CRITIC}),
    Op.SCORE: frozenset({RoleKind.REWARD_MODEL}),
    Op.REWARD: frozenset({RoleKind.REWARD}),
    Op.COMPUTE: frozenset(),
    Op.FILTER: frozenset(),
    Op.UPDATE: frozenset({RoleKind.POLICY, RoleKind.CRITIC}),
    Op.WEIGHT_SYNC: frozenset({RoleKind.POLICY, RoleKind.CRITIC}),
}
"""Which role kinds may run each op (empty: the op has no role)."""

MODEL_OPS: frozenset[Op] = frozenset({Op.GENERATE, Op.LOGPROBS, Op.VALUES, Op.SCORE, Op.UPDATE})
"""Ops that run a model on devices (the ones the planner places)."""

WEIGHT_READERS: frozenset[Op] = frozenset({Op.GENERATE, Op.LOGPROBS, Op.VALUES})
"""Ops that read a trainable role's weights and so receive weight edges."""

TRAINABLE_KINDS: frozenset[RoleKind] = frozenset({RoleKind.POLICY, RoleKind.CRITIC})

LM_KINDS: frozenset[RoleKind] = frozenset({RoleKind.POLICY, RoleKind.REFERENCE})
"""Role kinds whose model ends in a language-model head (log-probabilities);
the others that run a model (critic, reward model) end in a scalar head."""

PHASE_OF_OP: dict[Op, str] = {
    Op.GENERATE: "generate",
    Op.LOGPROBS: "forward",
    Op.VALUES: "forward",
    Op.SCORE: "forward",
    Op.UPDATE: "train",
}
"""The device phase each model op runs in: a role has at most three layouts
(train, forward, generate); forward ops share the role's training layout
unless the planner chooses otherwise."""


def weight_sync_id(role: str) -> str:
    """The node id of ``role``'s ``weight_sync`` (one per trained role that generates)."""
    return f"{role}.weight_sync"
