"""The Plan: the IR after the passes — where and how every role runs.

A plan is a frozen pydantic model that round-trips through JSON, and it is the
one compiled artifact the runtime executes: besides the placement (roles,
pools, reshards, schedule) it holds the planned graph (``graph``, with its
``weight_sync`` nodes) and every runtime decision made when it was compiled
(``target``: dtype, collective backend, timeouts, sync buckets, the rollout
backends it chose among). ``flowc.runtime.program.lower`` takes a Plan and
nothing else. Automatic and manual plans are the same type; ``Pins`` (a
partial plan, in ``flowc.passes``) lets a user fix any decision and have the
search fill in the rest.

Phases: every model role has up to three device phases — ``train``
(``update``), ``forward`` (``logprobs``/``values``/``score``) and
``generate``. A phase's :class:`Layout` gives its parallel degrees, in the
order they are applied: ``world = dp × tp × pp × cp`` devices; experts are
spread over ``ep`` ranks carved out of the ``tp × dp × cp`` ranks of a pipeline
stage (expert tensor parallelism 1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flowc.errors import SpecError
from flowc.ir.lora import LoraConfig

if TYPE_CHECKING:
    from flowc.ir.cluster import ClusterSpec
    from flowc.ir.graph import FlowGraph

SCHEMA_VERSION = 2

Phase = Literal["train", "forward", "generate"]
PHASES: tuple[Phase, ...] = ("train", "forward", "generate")
Backend = Literal["fsdp2", "megatron", "vllm", "hf"]
ROLLOUT_BACKENDS: tuple[Backend, ...] = ("vllm", "hf")
# rollout backends that decode a wave as one padded batch: every row computes until the wave's
# longest response ends (vLLM batches continuously: a finished sequence leaves the batch)
STATIC_BATCH_BACKENDS: frozenset[str] = frozenset({"hf"})
# A paged KV cache (vLLM's) hands a sequence whole blocks of this many tokens: vLLM's defaults,
# 16 on GPUs and 128 on CPUs (its CPU platform), so a 40-token sequence holds 128 tokens there.
KV_BLOCK_TOKENS = {"gpu": 16, "cpu": 128}


def kv_tokens_held(tokens: int, backend: str, kind: str) -> int:
    """The KV-cache tokens a sequence of ``tokens`` holds in a rollout engine: whole blocks in a
    paged cache (:data:`KV_BLOCK_TOKENS`), exactly ``tokens`` in the ``hf`` loop's own cache."""
    if backend in STATIC_BATCH_BACKENDS:
        return tokens
    block = KV_BLOCK_TOKENS[kind]
    return -(-tokens // block) * block


ReshardMethod = Literal["in_place", "micro_dp_allgather", "full_allgather", "broadcast", "p2p"]
DType = Literal["float32", "bfloat16"]

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
        micro_batch: sequences per device per micro-step (of the workload's longest length,
            when ``micro_tokens`` bounds the micro-batches).
        micro_tokens: token budget of one micro-batch (rows × their padded width, per
            device); 0: micro-batches of ``micro_batch`` rows. With a budget the runtime
            sorts a replica's rows by length and fills each micro-batch up to it, so short
            rows share one and padding stays within rows of similar length.
        share_prompts: rows with the same prompt (the ``n`` samples of a generate, DPO's
            pairs) compute it once in a micro-batch: a pass over each distinct prompt, then the
            rows' responses on its KV cache (fsdp2; the runtime does it in a micro-batch where
            the prompt tokens saved exceed a pass's fixed cost).
        pack_sequences: a micro-batch's rows run without their padding, laid end to end in
            a few packed lines, each row attending only to itself (fsdp2, HF models whose mask
            code honours the position restarts: checked once when the engine starts; the
            runtime packs a micro-batch that has padding or rows sharing a prompt, which it
            then computes once in the line, where that is cheaper). A token budget then
            counts the tokens computed.
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
    micro_tokens: int = Field(0, ge=0)
    share_prompts: bool = False
    pack_sequences: bool = False

    @property
    def micro_label(self) -> str:
        """The micro-batch as ``why`` and the plan text show it: ``mb≤4096tok`` (a token
        budget) or ``mb8`` (rows)."""
        return f"mb≤{self.micro_tokens}tok" if self.micro_tokens else f"mb{self.micro_batch}"

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

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
        if self.share_prompts:
            flags.append("shared-prompts")
        if self.pack_sequences:
            flags.append("packed")
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
    # generation: the co-located training state sleeps in host memory while this phase
    # generates (its memory is not counted here; the round trip is in time_s)
    sleeps_colocated: bool = False
    # training and forward phases: a micro-batch's fixed cost (dispatch, launches, per-micro-batch
    # collectives) in padded tokens of compute, as the cost model prices it; under a token budget the
    # runtime splits rows of very different lengths apart only where that saves more padding than this
    micro_overhead_tokens: float = Field(0.0, ge=0)
    # generation: the share of each device the engine may take — its weights, KV cache and buffers
    # (vLLM's gpu_memory_utilization; the runtime passes it on GPUs); planned from the cache's peak
    # demand, or pinned (ROLE.generate.gpu_memory_utilization); 0: not a generation phase
    gpu_memory_utilization: float = Field(0.0, ge=0, le=1)
    gpu_memory_utilization_pinned: bool = False
    # generation with a continuously batching engine (vLLM): the most sequences it decodes at once,
    # as the plan priced it (the hardware profile's rollout.vllm.max_seqs); the runtime passes it as
    # vLLM's max_num_seqs, so the engine batches as priced whatever its version's default (0: not
    # such a phase, or the profile names none: the engine's default)
    max_num_seqs: int = Field(0, ge=0)
    # generation with an environment (generate(env=…)): environment processes per replica, sized so
    # their work fits in the generation's time (0: no environment, or no environment latency in the
    # workload to size them by: the run config's env_workers)
    env_workers: int = Field(0, ge=0)


class RolePlan(BaseModel):
    model_config = _FROZEN
    kind: str
    model: str
    params_b: float  # billions, 6 significant digits
    active_params_b: float
    phases: dict[Phase, PhasePlan]
    # the LoRA adapters the role trains (None: every weight), as priced; the training engine builds these
    lora: LoraConfig | None = None


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
    """The step as the cost model predicts it. With staleness ≥ 1, ``step_time_s`` is the pipelined
    loop's mean period over the step-to-step variation of generation time, ``steady_step_s`` the
    period at the mean lengths (where the drawn steady-state step ends; the difference is what the
    variation costs the loop at this staleness) and ``iteration_s`` one iteration's span (the
    lock-step step on the same placement)."""

    model_config = _FROZEN
    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_device: float
    tokens_per_step: float
    mfu: float
    iteration_s: float | None = None
    steady_step_s: float | None = None


class Alternative(BaseModel):
    model_config = _FROZEN
    summary: str
    step_time_s: float | None
    tokens_per_s: float | None
    rejected_because: str


class Target(BaseModel):
    """How a plan runs: the runtime decisions made when it was compiled, so that
    a saved plan runs the same on any machine (the runtime never re-decides them).

    Attributes:
        kind: the devices' kind, from the cluster's hardware profile.
        collective: torch.distributed backend of every pool (nccl on GPUs, gloo on CPUs).
        dtype: the compute dtype of training and generation, and of the weights a sync moves
            (FSDP2 keeps fp32 master weights under it; the dtype the cost model prices models in).
        cpus_per_worker: CPUs each worker reserves, and its thread count.
        timeout_s: the longest any remote call may take before the run fails.
        sync_bucket_bytes: size of the object-store buckets of a weight sync between pools.
        rollout_backends: the rollout backends the planner could choose among (those
            installed where it was compiled), in order of preference.
    """

    model_config = _FROZEN
    kind: Literal["cpu", "gpu"]
    collective: Literal["gloo", "nccl"]
    dtype: DType
    cpus_per_worker: float = Field(1.0, gt=0)
    timeout_s: float = Field(600.0, gt=0)
    sync_bucket_bytes: int = Field(64_000_000, ge=1)
    rollout_backends: tuple[Backend, ...] = Field(("hf",), min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> Target:
        want = "nccl" if self.kind == "gpu" else "gloo"
        if self.collective != want:
            raise SpecError(f"target: {self.kind} devices use the {want} collective backend, not {self.collective}")
        bad = [b for b in self.rollout_backends if b not in ROLLOUT_BACKENDS]
        if bad:
            raise SpecError(f"target: {', '.join(bad)} is not a rollout backend", fix=f"use {', '.join(ROLLOUT_BACKENDS)}")
        return self

    @classmethod
    def of(
        cls,
        cluster: ClusterSpec,
        *,
        dtype: str = "auto",
        cpus_per_worker: float | None = None,
        timeout_s: float = 600.0,
        rollout_backends: tuple[str, ...] | None = None,
    ) -> Target:
        """The target of ``cluster``: ``auto`` dtype resolved (bfloat16 on GPUs, float32 on
        CPUs), a CPU worker's share of the cores, and the rollout backends always there
        (vLLM on GPUs, flowc's own ``hf`` loop on CPUs) unless given."""
        kind = cluster.profile.kind
        gpu = kind == "gpu"
        return cls(
            kind=kind,
            collective="nccl" if gpu else "gloo",
            dtype=compute_dtype(dtype, kind),
            cpus_per_worker=cpus_per_worker if cpus_per_worker is not None else (1.0 if gpu else float(cluster.cores_per_device)),
            timeout_s=timeout_s,
            rollout_backends=tuple(rollout_backends) if rollout_backends else (("vllm",) if gpu else ("hf",)),
        )


def compute_dtype(dtype: str, kind: str) -> DType:
    """``auto`` resolved: bfloat16 on GPUs, float32 on CPUs (whose bf16 kernels are slow or missing).
    The planner prices models in this dtype, so a plan's bytes are the bytes the run moves."""
    if dtype != "auto":
        return dtype  # type: ignore[return-value]
    return "bfloat16" if kind == "gpu" else "float32"


class Plan(BaseModel):
    """The full placement of one flow on one cluster for one workload, and
    everything the runtime needs to execute it (see the module docstring)."""

    model_config = _FROZEN
    schema_version: int = SCHEMA_VERSION
    flow: str
    hyperparams: dict[str, object] = {}
    cluster: dict[str, object]
    workload: dict[str, object]
    target: Target
    graph: dict[str, Any]  # the planned FlowGraph in its JSON form (flowc.ir.serialize)
    predicted: Predicted
    roles: dict[str, RolePlan]
    pools: list[PoolPlan]
    reshards: list[ReshardPlan]
    schedule: list[ScheduleEntry]
    alternatives: list[Alternative]
    why: list[str]
    pins: dict[str, object] = {}
    search: dict[str, object] = {}
    staleness: int = 0  # weight versions the rollouts may lag the trainer (0: lock-step); the runtime's RunConfig.staleness
    # with staleness ≥ 1: one step of the pipelined loop's steady state, from its start (the ahead
    # generates of a later step first, then this step's other ops and syncs); it ends at the period
    steady_state: list[ScheduleEntry] = []

    @model_validator(mode="before")
    @classmethod
    def _version(cls, data: Any) -> Any:
        v = data.get("schema_version", SCHEMA_VERSION) if isinstance(data, dict) else SCHEMA_VERSION
        if v != SCHEMA_VERSION:
            raise SpecError(
                f"plan schema_version {v} is not supported (this flowc reads {SCHEMA_VERSION})",
                fix="plan the flow again with this flowc (flowc plan FILE … -o plan.json)",
            )
        return data

    def cluster_spec(self) -> ClusterSpec:
        from flowc.ir.cluster import ClusterSpec

        return ClusterSpec(**{k: v for k, v in self.cluster.items() if k != "world_size"})

    def flow_graph(self) -> FlowGraph:
        """The planned graph (with its ``weight_sync`` nodes), decoded."""
        from flowc.ir.serialize import from_dict

        return from_dict(self.graph)

    def phase(self, role: str, phase: str) -> PhasePlan:
        try:
            return self.roles[role].phases[phase]  # type: ignore[index]
        except KeyError:
            raise SpecError(f"the plan has no {phase} phase for role {role!r}") from None

    def generation_sync(self, role: str) -> ReshardPlan | None:
        """The reshard that brings ``role``'s trained weights to its generation engine:
        the first weight edge into a generate (a second generate of the role, as in
        ReMax, reads the same engine and moves nothing)."""
        return next((r for r in self.reshards if r.role == role and r.dst_phase == "generate"), None)

    def to_json(self, indent: int | None = 2) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.model_validate_json(text)
