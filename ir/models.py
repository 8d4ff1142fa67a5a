"""ModelSpec: what the planner and runtime need to know about a model.

A spec comes from a catalogue name (``qwen2.5-7b``; the HF id
``Qwen/Qwen2.5-7B`` works too), from a path to an HF ``config.json``, or from
an HF model directory. Parameter counts are computed from the architecture
fields and checked in tests against the published totals.

Architecture covered: decoder-only transformers with grouped-query attention
(optionally with q/k/v biases and per-head q/k norms), a gated (SwiGLU) MLP,
RMSNorm, and mixture-of-experts layers (routed experts, optional shared
experts, optionally only from layer ``first_dense_layers`` on), and
multi-head latent attention (DeepSeek-V3's MLA) when ``kv_lora_rank`` is set.
"""

from __future__ import annotations

import json
from functools import cached_property, lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flowc.errors import SpecError
from flowc.ir.lora import LoraConfig, adapter_params

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}


@lru_cache(maxsize=4096)
def stage_split(layers: int, pp: int) -> tuple[int, ...] | None:
    """Transformer layers in each of ``pp`` pipeline stages, as the runtime has Megatron-core
    build them: ``L/pp`` each where ``pp`` divides ``L``; otherwise the middle stages all alike
    and the first and last the rest (Megatron's ``num_layers_in_first/last_pipeline_stage``),
    the last, which also holds the LM head, the smaller half. The middle stages take ``⌈L/pp⌉``
    where that leaves each end a layer (61 layers in 16 stages: 3, 4 × 14, 2), else ``⌊L/pp⌋``
    (61 in 12: 6, 5 × 10, 5). None when ``pp`` is more stages than layers."""
    if pp <= 1:
        return (layers,)
    if layers < pp:
        return None
    if layers % pp == 0:
        return (layers // pp,) * pp
    k = -(-layers // pp)
    if layers - (pp - 2) * k < 2:
        k = layers // pp
    rest = layers - (pp - 2) * k
    first = -(-rest // 2)
    return (first, *([k] * (pp - 2)), rest - first)


class ModelSpec(BaseModel):
    """A model's architecture. Unknown keys are errors.

    Attributes:
        name: catalogue name or the path it was read from.
        model_type: HF ``model_type`` (``qwen2``, ``llama``, ``qwen3_moe``, …).
        hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads,
        head_dim, vocab_size: the usual transformer fields (HF names in
            brackets where they differ: num_hidden_layers, num_attention_heads,
            num_key_value_heads).
        tie_word_embeddings: the LM head shares the embedding matrix.
        attention_bias: q/k/v projections have biases (Qwen2).
        qk_norm: per-head RMSNorm on q and k (Qwen3).
        num_experts: routed experts per MoE layer (0: dense model).
        experts_per_token: routed experts each token uses.
        moe_intermediate_size: hidden size of one expert's MLP.
        shared_experts: always-active experts per MoE layer (each of
            ``moe_intermediate_size``), as in DeepSeek.
        first_dense_layers: the first k layers are dense (DeepSeek's
            ``first_k_dense_replace``).
        q_lora_rank, kv_lora_rank, qk_rope_head_dim, v_head_dim: MLA fields
            (``kv_lora_rank`` > 0 switches MLA on); ``head_dim`` is then the
            non-rotary q/k head dim.
        dtype: parameter dtype for training and generation.
        hf_id: the Hugging Face id, when known.
        lora: the LoRA adapters the role of this model trains (None: every weight); set by
            `flowc run` from the role's ``optim.ROLE.lora`` so the planner prices them.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    model_type: str = "llama"
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_layers: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(0, ge=0)
    head_dim: int = Field(0, ge=0)
    vocab_size: int = Field(gt=0)
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    num_experts: int = Field(0, ge=0)
    experts_per_token: int = Field(0, ge=0)
    moe_intermediate_size: int = Field(0, ge=0)
    shared_experts: int = Field(0, ge=0)
    first_dense_layers: int = Field(0, ge=0)
    q_lora_rank: int = Field(0, ge=0)
    kv_lora_rank: int = Field(0, ge=0)
    qk_rope_head_dim: int = Field(0, ge=0)
    v_head_dim: int = Field(0, ge=0)
    dtype: str = "bfloat16"
    hf_id: str | None = None
    lora: LoraConfig | None = None

    @model_validator(mode="after")
    def _fill(self) -> ModelSpec:
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise SpecError(
                f"model {self.name}: num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.num_experts:
            if not 0 < self.experts_per_token <= self.num_experts:
                raise SpecError(f"model {self.name}: experts_per_token must be in 1..num_experts ({self.num_experts})")
            if self.moe_intermediate_size == 0:
                object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)
        if self.dtype not in DTYPE_BYTES:
            raise SpecError(f"model {self.name}: dtype {self.dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        return self

    # --------------------------------------------------------------- counts
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def moe_layers(self) -> int:
        return max(self.num_layers - self.first_dense_layers, 0) if self.is_moe else 0

    @property
    def dense_layers(self) -> int:
        return self.num_layers - self.moe_layers

    @cached_property
    def attention_params(self) -> int:
        """Parameters of one attention block (projections, biases, q/k norms)."""
        h, d = self.hidden_size, self.head_dim
        if self.is_mla:
            rope, v = self.qk_rope_head_dim, self.v_head_dim or d
            qk = d + rope
            q = (
                (h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.num_heads * qk)
                if self.q_lora_rank
                else h * self.num_heads * qk
            )
            kv = h * (self.kv_lora_rank + rope) + self.kv_lora_rank + self.kv_lora_rank * self.num_heads * (d + v)
            o = self.num_heads * v * h
            return q + kv + o
        q = h * self.num_heads * d
        kv = 2 * h * self.num_kv_heads * d
        o = self.num_heads * d * h
        bias = (self.num_heads + 2 * self.num_kv_heads) * d if self.attention_bias else 0
        norm = 2 * d if self.qk_norm else 0
        return q + kv + o + bias + norm

    @cached_property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    @cached_property
    def expert_params(self) -> int:
        """Parameters of one routed expert."""
        return 3 * self.hidden_size * self.moe_intermediate_size if self.is_moe else 0

    @cached_property
    def expert_params_total(self) -> int:
        """Parameters of all routed experts of all MoE layers."""
        return self.moe_layers * self.num_experts * self.expert_params

    @cached_property
    def moe_layer_mlp_params(self) -> tuple[int, int]:
        """(total, active) MLP parameters of one MoE layer (router included)."""
        router = self.hidden_size * self.num_experts
        shared = self.shared_experts * self.expert_params
        total = self.num_experts * self.expert_params + shared + router
        active = self.experts_per_token * self.expert_params + shared + router
        return total, active

    @cached_property
    def embedding_params(self) -> int:
        """Input embedding plus the LM head when untied."""
        e = self.vocab_size * self.hidden_size
        return e if self.tie_word_embeddings else 2 * e

    def _total(self, active: bool) -> int:
        norms = 2 * self.hidden_size
        per_dense = self.attention_params + self.dense_mlp_params + norms
        moe_total, moe_active = self.moe_layer_mlp_params
        per_moe = self.attention_params + (moe_active if active else moe_total) + norms
        return self.dense_layers * per_dense + self.moe_layers * per_moe + self.embedding_params + self.hidden_size

    @cached_property
    def params_total(self) -> int:
        """All parameters."""
        return self._total(active=False)

    def largest_stage(self, pp: int) -> tuple[float, float]:
        """(dense, routed-expert) parameters of the fullest of ``pp`` pipeline stages
        (:func:`stage_split`), an upper bound by parts: the dense part of the fullest of the first
        stage (its layers and the embedding), a middle one and the last (its layers, the LM head
        with the final norm; with tied embeddings a copy of the embedding, as Megatron has), and
        the experts of the stage with the most layers, spread evenly over the MoE layers and its
        layers taken as all MoE where the model has dense ones first (a few percent over, e.g.
        DeepSeek-V3's 3 dense layers). The whole model's for ``pp`` = 1."""
        dense, experts, layers, ends = self._stage_parts
        if pp <= 1:
            return dense, experts
        split = self.stages(pp)
        per = layers / self.num_layers
        # the first stage holds the embedding, the last the head with the final norm
        first, last = split[0] * per + self.vocab_size * self.hidden_size, split[-1] * per + ends
        middle = max(split[1:-1], default=0) * per
        k = max(split)
        moe = min(k, self.moe_layers) / self.moe_layers if self.moe_layers else 0.0
        return max(first, middle, last), experts * moe

    def stages(self, pp: int) -> tuple[int, ...]:
        """Layers of each of ``pp`` pipeline stages (:func:`stage_split`, what the runtime builds);
        more stages than layers is an error."""
        split = stage_split(self.num_layers, pp)
        if split is None:
            raise SpecError(
                f"pp={pp} is more pipeline stages than {self.name}'s {self.num_layers} layers",
                fix=f"pin a pipeline depth of at most {self.num_layers}",
            )
        return split

    @cached_property
    def _stage_parts(self) -> tuple[float, float, float, float]:
        """(dense, routed-expert, every layer's dense part, an end stage's embedding or head with the
        final norm) parameters: what :meth:`largest_stage` splits (the planner asks it per layout)."""
        experts = float(self.expert_params_total)
        dense = float(self.params_total) - experts
        layers = dense - self.embedding_params - self.hidden_size
        return dense, experts, layers, float(self.vocab_size * self.hidden_size + self.hidden_size)

    @cached_property
    def attention_width(self) -> int:
        """Σ over layers of the heads' query·key and value widths: one token attending to one key
        costs ``2 ×`` this many FLOPs in the forward pass (MLA: its q/k with the rotary part)."""
        if self.is_mla:
            d_qk, d_v = self.head_dim + self.qk_rope_head_dim, self.v_head_dim or self.head_dim
        else:
            d_qk = d_v = self.head_dim
        return self.num_heads * (d_qk + d_v) * self.num_layers

    @cached_property
    def params_active(self) -> int:
        """Parameters one token uses (equals the total for dense models)."""
        return self._total(active=True)

    @property
    def trained_params(self) -> int:
        """Parameters with gradients and optimizer state when the role trains: its LoRA
        adapters, or every parameter (a critic's value head, ``hidden_size`` more, is not counted)."""
        if self.lora is None or not self.lora.enabled:
            return self.params_total
        return adapter_params(self, self.lora)

    @property
    def params_b(self) -> float:
        return self.params_total / 1e9

    @property
    def bytes_per_param(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def weight_bytes(self) -> int:
        return self.params_total * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token over all layers (MLA caches the latent)."""
        if self.is_mla:
            per_layer = self.kv_lora_rank + self.qk_rope_head_dim
        else:
            per_layer = 2 * self.num_kv_heads * self.head_dim
        return per_layer * self.num_layers * self.bytes_per_param

    def describe(self) -> str:
        if self.is_moe:
            return f"{self.name} ({self.params_total / 1e9:.1f}B total, {self.params_active / 1e9:.1f}B active)"
        return f"{self.name} ({self.params_total / 1e9:.2f}B)"

    # ---------------------------------------------------------- construction
    @classmethod
    def from_hf_config(cls, config: dict[str, Any], name: str) -> ModelSpec:
        """Read the fields flowc needs from an HF ``config.json`` dict (other
        keys of HF's format are ignored)."""
        c = dict(config)
        mt = c.get("model_type", "llama")
        try:
            fields: dict[str, Any] = {
                "name": name,
                "model_type": mt,
                "hidden_size": c["hidden_size"],
                "intermediate_size": c.get("intermediate_size") or 4 * c["hidden_size"],
                "num_layers": c["num_hidden_layers"],
                "num_heads": c["num_attention_heads"],
                "num_kv_heads": c.get("num_key_value_heads") or c["num_attention_heads"],
                "vocab_size": c["vocab_size"],
                "tie_word_embeddings": bool(c.get("tie_word_embeddings", False)),
                "attention_bias": bool(c.get("attention_bias", mt in ("qwen2", "qwen2_moe"))),
                "qk_norm": mt in ("qwen3", "qwen3_moe"),
                "hf_id": c.get("hf_id") or c.get("_name_or_path") or None,
            }
        except KeyError as e:
            raise SpecError(f"model config {name} lacks the field {e.args[0]!r}", fix="give a complete HF config.json") from None
        if c.get("head_dim") or c.get("qk_nope_head_dim"):
            fields["head_dim"] = c.get("qk_nope_head_dim") or c["head_dim"]
        experts = c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts") or 0
        if experts:
            fields["num_experts"] = experts
            fields["experts_per_token"] = c.get("num_experts_per_tok", 2)
            fields["moe_intermediate_size"] = c.get("moe_intermediate_size") or c.get("intermediate_size")
            shared = c.get("n_shared_experts") or 0
            if not shared and c.get("shared_expert_intermediate_size"):
                # Qwen2-MoE: one shared expert of its own width → count in expert units
                shared = max(1, round(c["shared_expert_intermediate_size"] / fields["moe_intermediate_size"]))
            fields["shared_experts"] = shared
            fields["first_dense_layers"] = c.get("first_k_dense_replace", 0)
        if c.get("kv_lora_rank"):
            fields.update(
                q_lora_rank=c.get("q_lora_rank") or 0,
                kv_lora_rank=c["kv_lora_rank"],
                qk_rope_head_dim=c.get("qk_rope_head_dim", 64),
                v_head_dim=c.get("v_head_dim", 128),
            )
        dt = str(c.get("torch_dtype") or c.get("dtype") or "bfloat16").removeprefix("torch.")
        fields["dtype"] = dt if dt in DTYPE_BYTES else "bfloat16"
        return cls(**fields)

    @classmethod
    def resolve(cls, ref: str) -> ModelSpec:
        """A spec from a catalogue name, an HF id, a ``config.json`` path, or
        an HF model directory."""
        p = Path(ref).expanduser()
        if p.is_dir():
            cfg = p / "config.json"
            if not cfg.exists():
                raise SpecError(
                    f"model directory {ref} has no config.json", fix="point at an HF model directory or its config.json"
                )
            return cls.from_hf_config(_read_json(cfg), name=str(p))
        if p.is_file():
            return cls.from_hf_config(_read_json(p), name=str(p))
        from flowc.ir.hub import cached_snapshot, is_hub_id

        if is_hub_id(ref) and (snap := cached_snapshot(ref)) is not None:  # the model's own config, when cached
            return cls.from_hf_config(_read_json(snap / "config.json"), name=ref)
        key = catalogue_key(ref)
        cat = catalogue()
        if key in cat:
            return cls.from_hf_config(cat[key], name=key)
        import difflib

        close = difflib.get_close_matches(key, list(cat), n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise SpecError(
            f"unknown model {ref!r}: not a catalogue name, nor a path to a config.json or an HF model directory",
            fix=f"{hint}catalogue: {', '.join(sorted(cat))}",
        )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SpecError(f"cannot read model config {path}: {e}") from e


def catalogue_key(ref: str) -> str:
    """Normalise a name: lower case, HF org prefix dropped, and a fine-tune's ``-instruct``,
    ``-chat`` or ``-base`` suffix dropped when only its base model is in the catalogue."""
    key = ref.strip().lower()
    cat = catalogue()
    if key in cat:
        return key
    by_hf = {str(v.get("hf_id", "")).lower(): k for k, v in cat.items()}
    if key in by_hf:
        return by_hf[key]
    key = key.rsplit("/", 1)[-1]
    for suffix in ("-instruct", "-chat", "-base"):  # fine-tunes have their base model's architecture
        if key.endswith(suffix) and key.removesuffix(suffix) in cat:
            return key.removesuffix(suffix)
    return key


_CATALOGUE: dict[str, dict[str, Any]] | None = None


def catalogue() -> dict[str, dict[str, Any]]:
    """The built-in catalogue: name → HF config fields (package data)."""
    global _CATALOGUE
    if _CATALOGUE is None:
        out = {}
        for f in resources.files("flowc.ir").joinpath("catalogue").iterdir():
            if f.name.endswith(".json"):
                out[f.name[: -len(".json")]] = json.loads(f.read_text())
        _CATALOGUE = dict(sorted(out.items()))
    return _CATALOGUE
