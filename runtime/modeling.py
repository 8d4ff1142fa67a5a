"""Models for the backends: HF causal LMs from a directory or a ModelSpec, a
scalar head for critics and reward models (loaded from a sequence-classification
checkpoint's ``score`` head), and teacher-forced log-probabilities.

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


SCORE_HEAD = "score.weight"  # a sequence-classification checkpoint's head (transformers' name)


def checkpoint_head(path: str | Path) -> str:
    """What an HF checkpoint directory ends in: ``"lm"`` (a causal LM) or ``"score"``
    (``…ForSequenceClassification`` with one label: a reward model or critic)."""
    cfg = _config_json(Path(path))
    archs = [str(a) for a in cfg.get("architectures") or []]
    cls = next((a for a in archs if a.endswith("ForSequenceClassification")), None)
    if cls is None:
        return "lm"
    labels = len(cfg.get("id2label") or {}) or int(cfg.get("num_labels", 2))
    if labels != 1:
        raise SpecError(
            f"{path} is a {cls} with {labels} labels; a reward model or critic has one scalar output",
            fix="give a checkpoint trained with num_labels=1 (a reward model)",
        )
    return "score"


def has_score_head(path: str | Path, *, scores: bool) -> bool:
    """Whether the checkpoint a critic or reward model (``scores``) starts from has a score
    head; a reward model without one is refused (it would score every response 0.0)."""
    if checkpoint_head(path) == "score":
        return True
    if scores:
        raise SpecError(
            f"{path} is a causal LM with no score head: as a reward model it would score every response 0.0",
            fix="give the reward model a sequence-classification checkpoint "
            "(AutoModelForSequenceClassification with num_labels=1), or score with a Python function (fc.Reward)",
        )
    return False


def _config_json(path: Path) -> dict:
    import json

    if not (path / "config.json").exists():
        raise SpecError(f"model directory {path} has no config.json", fix="give an HF model directory (config.json + weights)")
    return json.loads((path / "config.json").read_text())


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_causal_lm(source: str | Path | ModelSpec, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """A causal LM from an HF directory, or randomly initialised from a spec. A
    sequence-classification checkpoint is refused: it has no LM head, and loading it as a
    causal LM would give a policy a random one without a word."""
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    if isinstance(source, ModelSpec):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config(source), dtype=dtype)
    else:
        path = Path(source)
        if checkpoint_head(path) == "score":
            raise SpecError(
                f"{path} is a sequence-classification checkpoint (a reward model): it has a score head, "
                "not the language-model head a policy or reference needs",
                fix="give a policy or reference a causal LM; use this checkpoint for a reward model or critic",
            )
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        except Exception as e:
            raise SpecError(f"cannot load the model in {path}: {type(e).__name__}: {e}") from e
    model.config.use_cache = True
    return model


def load_value_model(source: str | Path | ModelSpec, *, dtype: torch.dtype, scores: bool, seed: int = 0) -> ValueModel:
    """A critic (``scores=False``) or reward model (``scores=True``): an LM trunk and a scalar head.

    From a sequence-classification checkpoint both take its trunk and its ``score`` head (a
    critic initialised from a reward model starts from that head). A critic from a causal LM
    starts from a zero head, as peers' critics do; a reward model from a causal LM is refused,
    since with no trained head it would score every response 0.0."""
    if isinstance(source, ModelSpec):
        return ValueModel(load_causal_lm(source, dtype=dtype, seed=seed))
    path = Path(source)
    if not has_score_head(path, scores=scores):
        return ValueModel(load_causal_lm(path, dtype=dtype))
    from transformers import AutoModelForSequenceClassification

    _quiet_transformers()
    try:
        seq = AutoModelForSequenceClassification.from_pretrained(str(path), dtype=dtype)
    except Exception as e:
        raise SpecError(f"cannot load the reward model in {path}: {type(e).__name__}: {e}") from e
    model = ValueModel(seq)
    with torch.no_grad():
        model.head.weight.copy_(seq.score.weight)
    return model


def save_hf(source: str, state: dict[str, torch.Tensor], path: str, tokenizer: str | None, *, value: bool, what: str) -> None:
    """Write trained weights in HF format beside ``source``'s config (and ``tokenizer``'s files):
    ``state`` holds the causal LM's parameters, or with ``value`` a critic's or reward model's
    (the trunk's as ``model.…`` and the head as ``score.weight``), written as a
    ``…ForSequenceClassification`` checkpoint with one label that flowc and transformers load back."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from flowc.errors import DataError

    dtype = next(iter(state.values())).dtype
    if value:
        _quiet_transformers()
        cfg = AutoConfig.from_pretrained(source)
        cfg.num_labels = 1  # save_pretrained names the architecture after the class
        if getattr(cfg, "pad_token_id", None) is None and tokenizer:
            from transformers import AutoTokenizer

            cfg.pad_token_id = AutoTokenizer.from_pretrained(tokenizer).pad_token_id
        model = AutoModelForSequenceClassification.from_config(cfg, dtype=dtype)
        missing, unexpected = model.load_state_dict(state, strict=False)
        ignorable: set[str] = set()
    else:
        model = load_causal_lm(source, dtype=dtype)
        missing, unexpected = model.load_state_dict(state, strict=False)
        ignorable = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - ignorable:
        raise DataError(f"exporting {what}: weights do not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.save_pretrained(path, safe_serialization=True)
    if tokenizer:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer).save_pretrained(path)


def value_state(params: dict[str, torch.Tensor], prefix: str = "model") -> dict[str, torch.Tensor]:
    """A :class:`ValueModel`'s parameters (``trunk.…``, ``head.weight``) under the names a
    sequence-classification checkpoint gives them (``model.…``, ``score.weight``)."""
    out = {}
    for k, v in params.items():
        if k.startswith("trunk."):
            out[f"{prefix}.{k.removeprefix('trunk.')}"] = v
        elif k == "head.weight":
            out[SCORE_HEAD] = v
    return out


class ValueModel(nn.Module):
    """A critic or reward model: an LM's trunk and a scalar head (no bias, as transformers'
    sequence classifiers) on every position; the head starts at zero unless loaded."""

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.prefix = lm.base_model_prefix  # the trunk's name in an HF checkpoint
        self.trunk = getattr(lm, self.prefix)
        self.config = lm.config
        self.head = nn.Linear(lm.config.hidden_size, 1, bias=False)
        nn.init.zeros_(self.head.weight)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: object | None = None,
        keep_cache: bool = False,
        hidden: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, object]:
        """The head's output on every position; with ``keep_cache`` also the KV cache, which
        ``cache`` continues (a shared prompt's, see :func:`shared_prompt_pass`); with
        ``hidden`` the trunk's last hidden state instead (what the head reads)."""
        kw = {cache_kwarg(self.trunk): cache} if cache is not None else {}
        out = self.trunk(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=keep_cache, **kw
        )
        if hidden:
            return out.last_hidden_state
        v = self.head(out.last_hidden_state).squeeze(-1)
        return (v, cache_of(out)) if keep_cache else v


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


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
    """Each row's prompt, numbered ``0 … u-1``: rows with the same prompt tokens (padding
    ignored) get the same number — the ``n`` samples of one prompt, DPO's chosen and rejected."""
    if prompt_ids.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=prompt_ids.device)
    key = torch.where(prompt_mask.bool(), prompt_ids, torch.full_like(prompt_ids, -1))
    return torch.unique(key, dim=0, return_inverse=True)[1]


def first_rows(groups: torch.Tensor) -> torch.Tensor:
    """The first row of each group numbered by :func:`prompt_groups`."""
    rows = torch.arange(len(groups), device=groups.device)
    first = torch.full((int(groups.max()) + 1,), len(groups), dtype=torch.long, device=groups.device)
    return first.scatter_reduce(0, groups, rows, "amin")


def can_share_prompts(model: nn.Module) -> bool:
    """Whether :func:`shared_prompt_pass` can run ``model``: one prompt computation serves its
    rows (:func:`one_prefix_safe`), and no activation checkpointing (HF turns the cache off
    under it)."""
    lm = getattr(model, "trunk", model)
    return not getattr(lm, "is_gradient_checkpointing", False) and one_prefix_safe(model)


def one_prefix_safe(model: nn.Module) -> bool:
    """Whether a prompt computed once may serve every row that continues it: a decoder whose
    every layer attends to all earlier tokens (no sliding or chunked window, which a shared
    prefix's cache or an explicit packing mask would not apply), and no dropout."""
    lm = getattr(model, "trunk", model)
    cfg = getattr(lm, "config", None)
    if cfg is None:
        return False
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    types = set(getattr(text, "layer_types", None) or ["full_attention"])
    # a sliding window: Qwen2 says whether it uses its own; others (Mistral) use theirs whenever set
    window = getattr(text, "use_sliding_window", getattr(text, "sliding_window", None) is not None)
    chunked = getattr(text, "attention_chunk_size", None) is not None
    # dropout (the attention's, LoRA's) would draw one mask on a prompt for all its rows, not one per row
    dropout = float(getattr(text, "attention_dropout", 0.0) or 0.0) > 0 or any(
        isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()
    )
    return types == {"full_attention"} and not window and not chunked and not dropout


def _expand_cache(cache: object, rows: torch.Tensor) -> object:
    """The cache of each prompt repeated for the rows that share it (an index, so the rows'
    gradients add up on the prompt's keys and values)."""
    for layer in cache.layers:
        layer.batch_select_indices(rows)
    return cache


def shared_prompt_pass(
    model: nn.Module, prompt_ids, prompt_mask, response_ids, response_mask, groups: torch.Tensor, *, value: bool
):
    """The model over each distinct prompt once, then over every row's response on that prompt's
    KV cache: the same outputs as one pass over ``prompt + response`` rows, without computing
    a prompt again for every sample of it. Returns the output at the prompt's last position
    (each row's copy; ``[N, 1, …]``) and at every response position (``[N, R, …]``): logits,
    or with ``value`` the head's values."""
    first = first_rows(groups)
    pm = prompt_mask[first].long()
    head = dict(input_ids=prompt_ids[first], attention_mask=pm, position_ids=positions(pm))
    if value:
        v, cache = model(**head, keep_cache=True)
        last = v[:, -1:]
    else:
        out = model(**head, use_cache=True, logits_to_keep=1)
        last, cache = out.logits, cache_of(out)
    cache = _expand_cache(cache, groups)
    mask = torch.cat([prompt_mask.long(), response_mask.long()], dim=1)
    rest = dict(input_ids=response_ids, attention_mask=mask, position_ids=positions(mask)[:, prompt_ids.shape[1] :])
    if value:
        resp, _ = model(**rest, cache=cache, keep_cache=True)
    else:
        resp = model(**rest, use_cache=True, **{cache_kwarg(model): cache}).logits
    return last[groups], resp


def response_logprobs(
    model: nn.Module,
    prompt_ids,
    prompt_mask,
    response_ids,
    response_mask,
    *,
    with_entropy: bool = False,
    groups: torch.Tensor | None = None,
    packed: bool = False,
):
    """Teacher-forced log-probabilities ``[N, R]`` of the response tokens (and
    their per-token entropy when asked). With ``groups`` (:func:`prompt_groups`) each distinct
    prompt is computed once (:func:`shared_prompt_pass`); ``packed``: the rows without their
    padding, in packed lines (:mod:`flowc.runtime.packing`)."""
    p, r = prompt_ids.shape[1], response_ids.shape[1]
    if packed:
        from flowc.runtime.packing import at_slots, packed_forward

        out, lines = packed_forward(model, prompt_ids, prompt_mask, response_ids, response_mask, value=False, groups=groups)
        logits = at_slots(out, lines, lines.index[:, p - 1 : p + r - 1])
    elif groups is not None:
        last, resp = shared_prompt_pass(model, prompt_ids, prompt_mask, response_ids, response_mask, groups, value=False)
        logits = torch.cat([last, resp[:, : r - 1]], dim=1)
    else:
        ids, mask, pos = join(prompt_ids, prompt_mask, response_ids, response_mask)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        logits = logits[:, p - 1 : p + r - 1]
    lp = token_logprobs(logits, response_ids)
    if not with_entropy:
        return lp
    logp_all = F.log_softmax(logits.float(), dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return lp, entropy


def response_values(
    model: ValueModel,
    prompt_ids,
    prompt_mask,
    response_ids,
    response_mask,
    *,
    at_tokens: bool = False,
    groups: torch.Tensor | None = None,
    packed: bool = False,
) -> torch.Tensor:
    """Value estimates ``[N, R]``: a critic's value of the state before each response token, or
    with ``at_tokens`` the head's output at each response token itself (a reward model scores a
    sequence at its last token, as transformers' sequence classifiers do). With ``groups`` each
    distinct prompt is computed once (:func:`shared_prompt_pass`); ``packed``: the rows in
    packed lines (:mod:`flowc.runtime.packing`)."""
    p, r = prompt_ids.shape[1], response_ids.shape[1]
    shift = 0 if at_tokens else 1
    if packed:
        from flowc.runtime.packing import at_slots, packed_forward

        out, lines = packed_forward(model, prompt_ids, prompt_mask, response_ids, response_mask, value=True, groups=groups)
        return at_slots(out, lines, lines.index[:, p - shift : p + r - shift]).float()
    if groups is not None:
        last, resp = shared_prompt_pass(model, prompt_ids, prompt_mask, response_ids, response_mask, groups, value=True)
        return (resp if at_tokens else torch.cat([last, resp[:, : r - 1]], dim=1)).float()
    ids, mask, pos = join(prompt_ids, prompt_mask, response_ids, response_mask)
    v = model(input_ids=ids, attention_mask=mask, position_ids=pos)
    return v[:, p - shift : p + r - shift].float()
