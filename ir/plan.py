"""The Plan: the IR after the passes — where and how every role runs.

A plan is a frozen pydantic model that round-trips through JSON. Automatic and
manual plans are the same type; :class:`Pins` (a partial plan) lets a user fix
any decision and have the search fill in the rest.

Phases: every model role has up to three device phases — ``train``
(``update``), ``forward`` (``logprobs``/``values``/``score``) and
``generate``. A phase's :class:`Layout` gives its parallel degrees, in the
order they are applied: ``world = dp × tp × pp × cp`` devices; experts are
spread over ``ep`` ranks carved out of the ``tp × dp × cp`` ranks of a pipeline
stage (expert tensor parallelism 1).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flowc.errors import SpecError

SCHEMA_VERSION = 1

Phase = Literal["train", "forward", "generate"]
PHASES: tuple[str, ...] = ("train", "forward", "generate")
Backend = Literal["fsdp2", "megatron", "vllm", "hf"]
ReshardMethod = Literal["in_place", "micro_dp_allgather", "full_allgather", "broadcast", "p2p"]

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class Layout(BaseModel):
    """Parallel degrees and memory options of one role in one phase.

    Attributes:
        dp: data-parallel replicas (FSDP shards parameters over them when ``fsdp``).
        tp: tensor-parallel degree (inside a node).
        pp: pipeline stages.
        cp: context-parallel degree (sequence split for long contexts).
        ep: expert-parallel degree (MoE only).
        backend: fsdp2 / megatron (training, forward), vllm / hf (generation).
        fsdp: parameters, gradients and optimizer states sharded over dp (ZeRO-3).
        offload_params: parameters live in host memory between uses.
        offload_optimizer: optimizer states (and the step) live in host memory.
        activation_checkpointing: recompute activations in the backward pass.
        micro_batch: sequences per device per micro-step.
    """

    model_config = _FROZEN
    dp: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    cp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    backend: Backend = "fsdp2"
    fsdp: bool = False
    offload_params: bool = False
    offload_optimizer: bool = False
    activation_checkpointing: bool = False
    micro_batch: int = Field(1, ge=1)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def shard(self) -> int:
        """Into how many pieces one device's parameter share divides the model
        (tp × pp, times dp with FSDP)."""
        return self.tp * self.pp * (self.dp * self.cp if self.fsdp else 1)

    def check_world(self, devices: int, where: str = "") -> None:
        """Raise a SpecError spelling every factor when the degrees do not
        multiply to ``devices`` (torchtitan's ParallelDims style)."""
        if self.world != devices:
            raise SpecError(
                f"{where + ': ' if where else ''}dp({self.dp})*tp({self.tp})*pp({self.pp})*cp({self.cp}) = {self.world} != devices({devices})",
                fix="choose degrees whose product is the number of devices of the phase",
            )

    def short(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
        if self.cp > 1:
            parts.append(f"cp{self.cp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        flags = []
        if self.fsdp:
            flags.append("fsdp")
        if self.offload_params:
            flags.append("offload-params")
        if self.offload_optimizer:
            flags.append("offload-opt")
        if self.activation_checkpointing:
            flags.append("ckpt")
        return " ".join(parts) + (f" [{', '.join(flags)}]" if flags else "")


class Memory(BaseModel):
    """Bytes per device by category (GB, 1e9 bytes), at the phase's peak."""

    model_config = _FROZEN
    weights: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    kv_cache: float = 0.0
    buffers: float = 0.0
    other_roles: float = 0.0

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.kv_cache + self.buffers + self.other_roles


class PhasePlan(BaseModel):
    """One role in one phase."""

    model_config = _FROZEN
    pool: str
    device_count: int = Field(ge=1)
    devices: str  # e.g. "0-63" (global device ids, node-major)
    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    layout: Layout
    memory: Memory
    memory_gb_per_device: float
    capacity_gb: float
    time_s: float
    ops: list[str]
    waves: int = 1  # generation: how many waves the KV cache forces
    mfu: float = 0.0


class RolePlan(BaseModel):
    model_config = _FROZEN
    kind: str
    model: str
    params_b: float  # billions, 6 significant digits
    active_params_b: float
    phases: dict[str, PhasePlan]


class PoolPlan(BaseModel):
    model_config = _FROZEN
    name: str
    device_count: int
    devices: str
    nodes: int
    roles: list[str]
    units: list[str]
    busy_s: float
    idle_fraction: float


class ReshardPlan(BaseModel):
    """How one weight edge moves weights from the training layout to another phase."""

    model_config = _FROZEN
    role: str
    src: str  # node id of the update
    dst: str  # node id of the reader
    src_phase: str
    dst_phase: str
    method: ReshardMethod
    bytes_per_device: float
    lower_bound_bytes: float
    total_bytes: float
    time_s: float
    link: str  # "none", "intra-node", "inter-node"


class ScheduleEntry(BaseModel):
    model_config = _FROZEN
    op: str
    role: str | None
    phase: str | None
    pool: str | None
    start_s: float
    end_s: float


class Predicted(BaseModel):
    model_config = _FROZEN
    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_device: float
    tokens_per_step: float
    mfu: float


class Alternative(BaseModel):
    model_config = _FROZEN
    summary: str
    step_time_s: float | None
    tokens_per_s: float | None
    rejected_because: str


class Plan(BaseModel):
    """The full placement of one flow on one cluster for one workload."""

    model_config = _FROZEN
    schema_version: int = SCHEMA_VERSION
    flow: str
    hyperparams: dict[str, object] = {}
    cluster: dict[str, object]
    workload: dict[str, object]
    predicted: Predicted
    roles: dict[str, RolePlan]
    pools: list[PoolPlan]
    reshards: list[ReshardPlan]
    schedule: list[ScheduleEntry]
    alternatives: list[Alternative]
    why: list[str]
    pins: dict[str, object] = {}
    search: dict[str, object] = {}

    @model_validator(mode="after")
    def _version(self) -> Plan:
        if self.schema_version != SCHEMA_VERSION:
            raise SpecError(f"plan schema_version {self.schema_version} is not supported (this flowc reads {SCHEMA_VERSION})")
        return self

    def to_json(self, indent: int | None = 2) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.model_validate_json(text)
