"""Types of the values that flow along IR edges.

Every node output has a type; every edge's type is the projection of its
source's output type along the edge's path (``rollout.response_mask`` moves
only the mask). Types carry symbolic shapes (see :mod:`flowc.ir.shapes`) so
that :func:`nbytes` can price any edge once the workload binds the symbols.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from flowc.errors import IRError
from flowc.ir.shapes import UNKNOWN, numel

DTYPE_BYTES: dict[str, int] = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
}

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class TensorType(BaseModel):
    """A tensor with a symbolic shape, e.g. ``f32[B*n, R]``."""

    model_config = _FROZEN
    kind: Literal["tensor"] = "tensor"
    shape: tuple[str, ...]
    dtype: str

    def __str__(self) -> str:
        short = {
            "float32": "f32",
            "float64": "f64",
            "bfloat16": "bf16",
            "float16": "f16",
            "int64": "i64",
            "int32": "i32",
            "bool": "bool",
        }
        return f"{short.get(self.dtype, self.dtype)}[{', '.join(self.shape)}]"


class BundleType(BaseModel):
    """A named group of tensors that share a batch dimension.

    ``kind="prompts"`` is a batch of prompts as the data loader yields it;
    ``kind="rollout"`` is what ``generate`` returns (see :func:`rollout_type`).
    """

    model_config = _FROZEN
    kind: Literal["prompts", "rollout"]
    batch: str
    fields: dict[str, TensorType]

    def __str__(self) -> str:
        name = "Prompts" if self.kind == "prompts" else ("Trajectory" if "env_mask" in self.fields else "Rollout")
        return f"{name}[{self.batch}]"


class TupleType(BaseModel):
    """Several values returned by one op (e.g. ``gae`` → advantages, returns)."""

    model_config = _FROZEN
    kind: Literal["tuple"] = "tuple"
    items: tuple[ValueType, ...]

    def __str__(self) -> str:
        return "(" + ", ".join(str(i) for i in self.items) + ")"


class StatsType(BaseModel):
    """The scalar statistics an ``update`` returns (losses, grad norm, …)."""

    model_config = _FROZEN
    kind: Literal["stats"] = "stats"

    def __str__(self) -> str:
        return "Stats"


class WeightsType(BaseModel):
    """The parameters of a role, moved along loop-carried weight edges."""

    model_config = _FROZEN
    kind: Literal["weights"] = "weights"
    role: str

    def __str__(self) -> str:
        return f"Weights[{self.role}]"


class PyType(BaseModel):
    """A small Python value computed on the controller (a size, a scalar)."""

    model_config = _FROZEN
    kind: Literal["python"] = "python"
    name: str = "object"

    def __str__(self) -> str:
        return self.name


ValueType = Annotated[
    Union[TensorType, BundleType, TupleType, StatsType, WeightsType, PyType],
    Field(discriminator="kind"),
]
TupleType.model_rebuild()


def prompts_type() -> BundleType:
    """The type of the prompt batch: ``B`` prompts left-padded to ``P`` tokens."""
    return BundleType(
        kind="prompts",
        batch="B",
        fields={
            "input_ids": TensorType(shape=("B", "P"), dtype="int64"),
            "attention_mask": TensorType(shape=("B", "P"), dtype="bool"),
        },
    )


def rollout_type(batch: str) -> BundleType:
    """The type of a rollout of ``batch`` sequences.

    Fields: ``prompt_ids``/``prompt_mask`` ``[batch, P]``, ``response_ids``
    ``[batch, R]``, ``response_mask`` ``[batch, R]`` (True on generated tokens
    up to and including EOS), ``logprobs`` ``[batch, R]`` (the sampler's
    log-probabilities of the generated tokens).
    """
    return BundleType(
        kind="rollout",
        batch=batch,
        fields={
            "prompt_ids": TensorType(shape=(batch, "P"), dtype="int64"),
            "prompt_mask": TensorType(shape=(batch, "P"), dtype="bool"),
            "response_ids": TensorType(shape=(batch, "R"), dtype="int64"),
            "response_mask": TensorType(shape=(batch, "R"), dtype="bool"),
            "logprobs": TensorType(shape=(batch, "R"), dtype="float32"),
        },
    )


def agent_rollout_type(batch: str) -> BundleType:
    """The type of ``generate(..., env=...)``: a rollout whose response is the whole trajectory
    after the prompt, with ``env_mask`` ``[batch, R]`` (the environment's tokens; ``response_mask``
    holds the policy's), ``env_reward`` ``[batch]`` (the environment's rewards, summed over the
    turns) and ``turns`` ``[batch]`` (the policy's turns)."""
    base = rollout_type(batch)
    return base.model_copy(
        update={
            "fields": {
                **base.fields,
                "env_mask": TensorType(shape=(batch, "R"), dtype="bool"),
                "env_reward": TensorType(shape=(batch,), dtype="float32"),
                "turns": TensorType(shape=(batch,), dtype="int64"),
            }
        }
    )


def project(t: ValueType, path: Sequence[str | int]) -> ValueType:
    """The type reached by following ``path`` (field names or tuple indices)."""
    for step in path:
        if isinstance(t, BundleType) and isinstance(step, str):
            if step not in t.fields:
                raise IRError(f"{t} has no field {step!r}", fix=f"use one of {', '.join(t.fields)}")
            t = t.fields[step]
        elif isinstance(t, TupleType) and isinstance(step, int):
            if not -len(t.items) <= step < len(t.items):
                raise IRError(f"{t} has {len(t.items)} items; index {step} is out of range")
            t = t.items[step]
        else:
            raise IRError(f"cannot take {step!r} of a value of type {t}")
    return t


def nbytes(t: ValueType, env: Mapping[str, int]) -> int:
    """Bytes of a value under symbol values ``env`` (weights are priced by the
    planner from the model spec, so they count 0 here; unknown dims count 0)."""
    if isinstance(t, TensorType):
        if UNKNOWN in t.shape:
            return 0
        return numel(t.shape, env) * DTYPE_BYTES.get(t.dtype, 4)
    if isinstance(t, BundleType):
        return sum(nbytes(f, env) for f in t.fields.values())
    if isinstance(t, TupleType):
        return sum(nbytes(i, env) for i in t.items)
    return 0
