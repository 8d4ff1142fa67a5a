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

from typing import Literal

OpName = Literal["input", "generate", "logprobs", "values", "score", "reward", "compute", "filter", "update", "weight_sync"]
OPS: tuple[str, ...] = (
    "input",
    "generate",
    "logprobs",
    "values",
    "score",
    "reward",
    "compute",
    "filter",
    "update",
    "weight_sync",
)

RoleKind = Literal["policy", "critic", "reference", "reward_model", "reward"]
ROLE_KINDS: tuple[str, ...] = ("policy", "critic", "reference", "reward_model", "reward")

OP_ROLE_KINDS: dict[str, frozenset[str]] = {
    "input": frozenset(),
    "generate": frozenset({"policy"}),
    "logprobs": frozenset({"policy", "reference"}),
    "values": frozenset({"critic"}),
    "score": frozenset({"reward_model"}),
    "reward": frozenset({"reward"}),
    "compute": frozenset(),
    "filter": frozenset(),
    "update": frozenset({"policy", "critic"}),
    "weight_sync": frozenset({"policy", "critic"}),
}
"""Which role kinds may run each op (empty: the op has no role)."""

MODEL_OPS: frozenset[str] = frozenset({"generate", "logprobs", "values", "score", "update"})
"""Ops that run a model on devices (the ones the planner places)."""

WEIGHT_READERS: frozenset[str] = frozenset({"generate", "logprobs", "values"})
"""Ops that read a trainable role's weights and so receive weight edges."""

TRAINABLE_KINDS: frozenset[str] = frozenset({"policy", "critic"})

PHASE_OF_OP: dict[str, str] = {
    "generate": "generate",
    "logprobs": "forward",
    "values": "forward",
    "score": "forward",
    "update": "train",
}
"""The device phase each model op runs in: a role has at most three layouts
(train, forward, generate); forward ops share the role's training layout
unless the planner chooses otherwise."""
