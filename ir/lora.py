"""LoRA: low-rank adapters a trained role learns instead of its whole weights.

A user writes a :class:`LoraConfig` under a role's optimizer (``optim.actor.lora.rank=8``,
see :class:`flowc.ir.run_config.OptimConfig`). The planner prices it (only the adapters have
gradients and Adam moments; the frozen base keeps its weights in the compute dtype), the plan
records it per role, and the ``fsdp2`` backend injects the adapters with ``peft``. Weight syncs
and exports carry the adapters merged into the base weights (``W + alpha/rank · B·A``), so a
rollout engine runs exactly the trained model (docs/backends.md, "LoRA").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field, field_validator

from flowc.errors import SpecError

if TYPE_CHECKING:
    from flowc.ir.models import ModelSpec

# the linear layers of a decoder layer, by their HF names (Llama, Mistral, Qwen2/3, their MoEs)
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LINEAR_MODULES = ATTENTION_MODULES + MLP_MODULES
ALL_LINEAR = "all-linear"


class LoraConfig(BaseModel):
    """LoRA adapters of one trained role (peft's ``LoraConfig``; field names as verl's).

    Attributes:
        rank: the adapters' rank r; 0 switches LoRA off (the role trains every weight).
        alpha: the adapters' scale is ``alpha / rank`` (peft's ``lora_alpha``).
        dropout: dropout on the adapters' input while training (peft's ``lora_dropout``).
        target_modules: the decoder's linear layers that get adapters, by name (``q_proj``,
            ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``), or
            ``all-linear`` for all seven. Embeddings and the LM head stay frozen; a critic's
            value head is trained whole.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    rank: int = Field(0, ge=0)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: tuple[str, ...] = (ALL_LINEAR,)

    @field_validator("target_modules", mode="before")
    @classmethod
    def _targets(cls, v: object) -> object:
        names = [v] if isinstance(v, str) else list(v)  # type: ignore[call-overload]
        names = [w.strip() for n in names for w in str(n).split(",") if w.strip()]
        bad = [n for n in names if n not in (*LINEAR_MODULES, ALL_LINEAR)]
        if bad or not names:
            raise SpecError(
                f"lora.target_modules: {', '.join(bad) or '(none)'} is not a decoder linear layer",
                fix=f"name some of {', '.join(LINEAR_MODULES)}, or {ALL_LINEAR}",
            )
        return tuple(names)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def modules(self) -> tuple[str, ...]:
        """The target layers, ``all-linear`` spelled out, in the decoder's order."""
        if ALL_LINEAR in self.target_modules:
            return LINEAR_MODULES
        return tuple(n for n in LINEAR_MODULES if n in self.target_modules)

    @property
    def scaling(self) -> float:
        """What ``B·A`` is multiplied by in the forward pass and in the merged weight."""
        return self.alpha / self.rank if self.rank else 0.0

    def short(self) -> str:
        """``r8 α16 q_proj,v_proj`` (the plan's text)."""
        mods = ALL_LINEAR if self.modules == LINEAR_MODULES else ",".join(self.modules)
        return f"r{self.rank} α{self.alpha:g} {mods}"


def linear_shapes(m: ModelSpec) -> dict[str, tuple[int, int, int]]:
    """(in features, out features, how many in the model) of each target layer of a dense
    decoder ``m`` (see :func:`refusal` for the models LoRA is not offered on)."""
    h, layers = m.hidden_size, m.num_layers
    qd, kvd, i = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.intermediate_size
    return {
        "q_proj": (h, qd, layers),
        "k_proj": (h, kvd, layers),
        "v_proj": (h, kvd, layers),
        "o_proj": (qd, h, layers),
        "gate_proj": (h, i, m.dense_layers),
        "up_proj": (h, i, m.dense_layers),
        "down_proj": (i, h, m.dense_layers),
    }


def refusal(m: ModelSpec, lora: LoraConfig) -> str | None:
    """What LoRA cannot do on ``m`` (None: it can): multi-head latent attention has other
    projections, and the MLPs of mixture-of-experts layers are fused expert tensors, which the
    merged weight sync does not handle."""
    if m.is_mla:
        return f"{m.name} uses multi-head latent attention, whose projections LoRA here does not adapt"
    mlp = [n for n in lora.modules if n in MLP_MODULES]
    if m.is_moe and mlp:
        return f"{m.name}'s MLPs are mixture-of-experts layers ({', '.join(mlp)}), which LoRA here does not adapt"
    return None


def adapter_params(m: ModelSpec, lora: LoraConfig) -> int:
    """Parameters of the adapters (``A``: r × in, ``B``: out × r per target layer) — the only
    weights with gradients and optimizer state under LoRA."""
    if not lora.enabled:
        return 0
    shapes = linear_shapes(m)
    return sum(shapes[n][2] * lora.rank * (shapes[n][0] + shapes[n][1]) for n in lora.modules)


def check_lora_backend(role: str, lora: LoraConfig | None, backend: str) -> None:
    """LoRA is trained by the ``fsdp2`` backend only; anything else is refused with the fix."""
    if lora is not None and lora.enabled and backend != "fsdp2":
        raise SpecError(
            f"{role} trains LoRA adapters ({lora.short()}), which the {backend} backend does not do",
            fix=f"train {role} with fsdp2 (--pin {role}.train.backend=fsdp2), or drop optim.{role}.lora",
        )
