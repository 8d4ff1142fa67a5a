"""Megatron-core models for flowc's roles: a GPTModel built from an HF config,
the rollout's rows laid out for it, and log-probabilities over a vocabulary
split by tensor parallelism.

Megatron's rotary embedding numbers positions 0..S-1 and ignores position ids,
so rows are packed left-aligned (prompt tokens, then response tokens, then
padding on the right) rather than left-padded as the ``fsdp2`` backend feeds
HF models. Under a causal mask right padding is never attended to by a real
token, so both layouts give the same numbers (tests check this).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flowc.errors import SpecError
from flowc.ir.models import ModelSpec
from flowc.runtime.megatron_weights import Degrees, padded_vocab


def transformer_config(hf: Any, arch: ModelSpec, d: Degrees, *, dtype: torch.dtype, cuda: bool, recompute: bool = False) -> Any:
    """Megatron's TransformerConfig for an HF config and the plan's degrees (``recompute``:
    the layout's activation checkpointing, as full recomputation of every layer)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise SpecError(
            f"the megatron backend maps default RoPE only, not {rope.get('rope_type')!r}", fix="train this model with fsdp2"
        )
    moe: dict[str, Any] = {}
    if arch.num_experts:
        moe = dict(
            num_moe_experts=arch.num_experts,
            moe_ffn_hidden_size=arch.moe_intermediate_size,
            moe_router_topk=getattr(hf, "num_experts_per_tok", 2),
            # top-k of the logits then a softmax over them = HF's softmax, top-k, renormalise
            moe_router_pre_softmax=False,
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_grouped_gemm=False,
            moe_token_dispatcher_type="alltoall" if cuda else "allgather",
        )
        if getattr(hf, "model_type", "") == "qwen3_moe" and not getattr(hf, "norm_topk_prob", True):
            raise SpecError("Qwen3-MoE without norm_topk_prob is not mapped", fix="train it with fsdp2")
    # activation checkpointing as the cost model prices it: every layer's activations recomputed in backward
    recompute_kw: dict[str, Any] = (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}
    )
    # a pipeline whose depth does not divide the layers: the split the planner priced (stage_split)
    split = arch.stages(d.pp)
    uneven: dict[str, Any] = {}
    if d.pp > 1 and len(set(split)) > 1:
        uneven = dict(num_layers_in_first_pipeline_stage=split[0], num_layers_in_last_pipeline_stage=split[-1])
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=getattr(hf, "rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.attention_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=d.tp,
        pipeline_model_parallel_size=d.pp,
        expert_model_parallel_size=d.ep,
        expert_tensor_parallel_size=1,
        sequence_parallel=False,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=True,  # weights are loaded from the checkpoint, then moved
        **moe,
        **recompute_kw,
        **uneven,
    )


class ValueHead(nn.Module):
    """A critic's or reward model's scalar head in place of Megatron's output layer (replicated
    over tp; no bias, as transformers' sequence classifiers, whose ``score`` it loads)."""

    def __init__(self, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, 1, bias=False, dtype=dtype)
        nn.init.zeros_(self.linear.weight)

    def forward(self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None):
        return self.linear(hidden), None


def build_model(
    hf: Any, arch: ModelSpec, d: Degrees, *, dtype: torch.dtype, value_head: bool, cuda: bool, recompute: bool = False
) -> nn.Module:
    """This rank's GPTModel: its pipeline stage, its tp/ep shard (weights uninitialised until loaded)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cfg = transformer_config(hf, arch, d, dtype=dtype, cuda=cuda, recompute=recompute)
    if arch.num_experts:
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):  # megatron-core 0.16's router names it only when TE imports
            moe_utils.te_general_gemm = None
    spec = get_gpt_layer_local_spec(
        num_experts=arch.num_experts or None, moe_grouped_gemm=False, qk_layernorm=arch.qk_norm, normalization="RMSNorm"
    )
    rope = getattr(hf, "rope_parameters", None) or {}
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab(arch, d.tp),
        max_sequence_length=getattr(hf, "max_position_embeddings", 4096),
        pre_process=d.pp_rank == 0,
        post_process=d.pp_rank == d.pp - 1,
        share_embeddings_and_output_weights=arch.tie_word_embeddings and not value_head,
        position_embedding_type="rope",
        rotary_base=int(rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))),
    )
    if value_head and d.pp_rank == d.pp - 1:
        model.output_layer = ValueHead(arch.hidden_size, dtype)
    return model


# --------------------------------------------------------------- the rows
@dataclass
class Packed:
    """Rows left-aligned for Megatron: ``ids [N, S]`` and where each row's response starts."""

    ids: torch.Tensor
    positions: torch.Tensor  # [N, R]: the position whose output predicts response token j
    causal: torch.Tensor  # [1, 1, S, S], True where attention is masked


def pack(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor, pad_to: int = 0) -> Packed:
    """Each row's real prompt tokens followed by its response columns, padded on the right."""
    n, p = prompt_ids.shape
    r = response_ids.shape[1]
    plen = prompt_mask.long().sum(-1)
    s = max(int(plen.max().item()) + r if n else r, pad_to)
    ids = torch.zeros((n, s), dtype=prompt_ids.dtype)
    for i in range(n):
        k = int(plen[i])
        ids[i, :k] = prompt_ids[i, p - k :]
        ids[i, k : k + r] = response_ids[i]
    positions = (plen.unsqueeze(-1) - 1 + torch.arange(r)).clamp(min=0)
    causal = torch.ones((1, 1, s, s), dtype=torch.bool).triu(1)
    return Packed(ids, positions, causal)


def at_responses(out: torch.Tensor, packed: Packed, *, at_tokens: bool = False) -> torch.Tensor:
    """``out [N, S, ...]`` at the positions that predict each response token: ``[N, R, ...]``
    (``at_tokens``: at each response token itself, where a reward model scores)."""
    idx = packed.positions.to(out.device) + (1 if at_tokens else 0)
    if out.dim() == 2:
        return out.gather(1, idx)
    return out.gather(1, idx.unsqueeze(-1).expand(*idx.shape, out.shape[-1]))


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, vocab: int, *, with_entropy: bool = False):
    """log softmax(logits)[targets] (and the entropy) when each tp rank holds a
    slice of the (padded) vocabulary; padded entries never count. Computed in
    fp32; the sums cross ranks by Megatron's all-reduce whose backward is the
    identity, so gradients are those of the whole-vocabulary softmax."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    logits = logits.float()
    local = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * local
    pad = (torch.arange(local, device=logits.device) + start) >= vocab
    logits = logits.masked_fill(pad, float("-inf"))
    top = logits.detach().max(-1).values
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    z = logits - top.unsqueeze(-1)
    lse = reduce_from_tensor_model_parallel_region(z.exp().sum(-1)).log()
    t = targets.to(logits.device) - start
    inside = (t >= 0) & (t < local)
    picked = torch.where(inside, z.gather(-1, t.clamp(0, local - 1).unsqueeze(-1)).squeeze(-1), 0.0)
    logp = reduce_from_tensor_model_parallel_region(picked) - lse
    if not with_entropy:
        return logp
    prob = (z - lse.unsqueeze(-1)).exp()
    mean_z = reduce_from_tensor_model_parallel_region((prob * z.masked_fill(pad, 0.0)).sum(-1))
    return logp, lse - mean_z
