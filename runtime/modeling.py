"""Models for the backends: HF causal LMs from a directory or a ModelSpec, a
value head for critics, and teacher-forced log-probabilities.

Sequences are laid out as the rollout holds them: left-padded prompts
``[N, P]`` followed by right-padded responses ``[N, R]``; position ids count
real tokens only, so left padding does not shift them.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from flowc.errors import SpecError
from flowc.ir.models import ModelSpec


def rollout_tokenizer(path: str, vocab_size: int):
    """The policy's tokenizer for a rollout engine, checked against the model: it must
    have EOS (ends responses) and PAD (fills rows), and fit the model's vocabulary."""
    from transformers import AutoTokenizer

    from flowc.errors import DataError

    tok = AutoTokenizer.from_pretrained(path)
    if tok.eos_token_id is None or tok.pad_token_id is None:
        raise DataError(f"the tokenizer in {path} has no EOS or PAD token", fix="give a tokenizer with eos_token and pad_token")
    if len(tok) > vocab_size:
        raise DataError(
            f"the tokenizer in {path} has {len(tok)} tokens but the model's vocabulary has {vocab_size}",
            fix="use the tokenizer that was trained with this model",
        )
    return tok


def hf_config(spec: ModelSpec):
    """An HF config with ``spec``'s architecture (dense Llama/Qwen2 families, Qwen3-MoE)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3MoeConfig

    if spec.model_type == "qwen3_moe" and not spec.shared_experts:
        return Qwen3MoeConfig(
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            moe_intermediate_size=spec.moe_intermediate_size,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.experts_per_token,
            num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_heads,
            num_key_value_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            vocab_size=spec.vocab_size,
            tie_word_embeddings=spec.tie_word_embeddings,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            max_position_embeddings=4096,
        )
    if spec.is_moe or spec.is_mla:
        raise SpecError(
            f"random initialisation of {spec.name} ({spec.model_type}) is not supported", fix="give an HF model directory"
        )
    common = dict(
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        vocab_size=spec.vocab_size,
        tie_word_embeddings=spec.tie_word_embeddings,
        max_position_embeddings=4096,
    )
    if spec.model_type == "qwen2":
        return Qwen2Config(**common)
    return LlamaConfig(**common, attention_bias=spec.attention_bias, head_dim=spec.head_dim)


def load_causal_lm(source: str | Path | ModelSpec, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """A causal LM from an HF directory, or randomly initialised from a spec."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if isinstance(source, ModelSpec):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config(source), dtype=dtype)
    else:
        path = Path(source)
        if not (path / "config.json").exists():
            raise SpecError(
                f"model directory {path} has no config.json", fix="give an HF model directory (config.json + weights)"
            )
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        except Exception as e:
            raise SpecError(f"cannot load the model in {path}: {type(e).__name__}: {e}") from e
    model.config.use_cache = True
    return model


def save_hf(source: str, state: dict[str, torch.Tensor], path: str, tokenizer: str | None, *, trunk: bool, what: str) -> None:
    """Write trained weights in HF format beside ``source``'s config (and ``tokenizer``'s files):
    ``state`` holds the whole LM's parameters, or with ``trunk`` only its trunk's (a critic
    or reward model, whose scalar head the LM does not have)."""
    from flowc.errors import DataError

    lm = load_causal_lm(source, dtype=next(iter(state.values())).dtype)
    target = lm.model if trunk else lm
    missing, unexpected = target.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(lm.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise DataError(f"exporting {what}: weights do not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    lm.save_pretrained(path, safe_serialization=True)
    if tokenizer:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer).save_pretrained(path)


class ValueModel(nn.Module):
    """A critic: the LM's trunk and a scalar head on every position."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.trunk = lm.model
        self.config = lm.config
        self.head = nn.Linear(lm.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        h = self.trunk(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
        return self.head(h).squeeze(-1)


def cache_kwarg(model: nn.Module) -> str:
    """The keyword a model's forward takes its KV cache by (``cache`` in
    transformers 5, ``past_key_values`` before)."""
    import inspect

    params = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_of(out) -> object:
    return out.cache if getattr(out, "cache", None) is not None else out.past_key_values


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count real tokens only (left padding gets 0)."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def join(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, response_ids: torch.Tensor, response_mask: torch.Tensor):
    ids = torch.cat([prompt_ids, response_ids], dim=1)
    mask = torch.cat([prompt_mask.long(), response_mask.long()], dim=1)
    return ids, mask, positions(mask)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[targets], computed in fp32."""
    return torch.gather(F.log_softmax(logits.float(), dim=-1), -1, targets.unsqueeze(-1)).squeeze(-1)


def response_logprobs(model: nn.Module, prompt_ids, prompt_mask, response_ids, response_mask, *, with_entropy: bool = False):
    """Teacher-forced log-probabilities ``[N, R]`` of the response tokens (and
    their per-token entropy when asked)."""
    ids, mask, pos = join(prompt_ids, prompt_mask, response_ids, response_mask)
    p, r = prompt_ids.shape[1], response_ids.shape[1]
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    logits = logits[:, p - 1 : p + r - 1]
    lp = token_logprobs(logits, response_ids)
    if not with_entropy:
        return lp
    logp_all = F.log_softmax(logits.float(), dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return lp, entropy


def response_values(model: ValueModel, prompt_ids, prompt_mask, response_ids, response_mask) -> torch.Tensor:
    """Value estimates ``[N, R]``: the value of the state before each response token."""
    ids, mask, pos = join(prompt_ids, prompt_mask, response_ids, response_mask)
    p, r = prompt_ids.shape[1], response_ids.shape[1]
    v = model(input_ids=ids, attention_mask=mask, position_ids=pos)
    return v[:, p - 1 : p + r - 1].float()
