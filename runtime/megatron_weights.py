"""HF ↔ Megatron-core weights: one rank's shard from an HF checkpoint, and HF
tensors back from the shards, one parameter at a time.

Written here rather than taken from megatron-bridge: the bridge pins
``transformers<5`` and Transformer Engine's CUDA wheels, so it installs neither
beside flowc's transformers 5 nor on a CPU machine, and flowc needs only the
dense Llama/Qwen2/Qwen3 and the Qwen3-MoE/Mixtral layouts. The rules below are
the whole mapping; ``tests/unit/test_megatron_weights.py`` round-trips them
bit-exactly for tp=2, pp=2, ep=2.

Megatron's layout (the local layer spec, no Transformer Engine fusion):

- ``linear_qkv`` fuses q, k, v per query group: group g holds its
  ``heads/kv_heads`` query heads, then its key head, then its value head;
  tensor parallelism splits whole groups.
- ``linear_fc1`` fuses gate and up: shard t is ``[gate_t; up_t]``.
- ``linear_proj`` (o_proj) and ``linear_fc2`` (down_proj) split their input dim.
- The embedding and output layer split the vocabulary, padded to a multiple
  of ``128·tp`` as Megatron pads it; padded rows are zero and never sampled.
- Pipeline stage p holds layers ``[p·L/pp, (p+1)·L/pp)``, numbered from 0
  inside the stage; the first stage holds the embedding, the last the final
  norm and output layer (with tied embeddings, a copy of the embedding).
- Experts are split whole over expert parallelism (expert tensor parallelism
  1): expert e lives on ep rank ``e // (E/ep)`` as local expert ``e % (E/ep)``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from flowc.errors import SpecError
from flowc.ir.models import ModelSpec, stage_split
from flowc.runtime.modeling import SCORE_HEAD

VOCAB_MULTIPLE = 128  # Megatron's make_vocab_size_divisible_by

Getter = Callable[[str], torch.Tensor]


MAPPED = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")


def megatron_spec(cfg: Any) -> ModelSpec:
    """The model's ``ModelSpec`` (an HF config object or dict), checked to be one
    this mapping covers."""
    c = cfg if isinstance(cfg, dict) else cfg.to_dict()
    kind = c.get("model_type", "")
    if kind not in MAPPED:
        raise SpecError(
            f"the megatron backend has no weight mapping for model_type {kind!r}",
            fix="use a Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE or Mixtral model, or train it with backend=fsdp2",
        )
    if kind == "qwen3_moe" and (c.get("mlp_only_layers") or c.get("decoder_sparse_step", 1) != 1):
        raise SpecError("Qwen3-MoE with dense layers between the MoE layers is not mapped", fix="train it with fsdp2")
    return ModelSpec.from_hf_config(c, c.get("_name_or_path") or kind)


def padded_vocab(arch: ModelSpec, tp: int) -> int:
    """The vocabulary as Megatron pads it: a multiple of 128·tp."""
    step = VOCAB_MULTIPLE * tp
    return -(-arch.vocab_size // step) * step


@dataclass(frozen=True)
class Degrees:
    """Megatron's parallel degrees and one rank's coordinates in them."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    ep_rank: int = 0

    def at(self, tp_rank: int, pp_rank: int, ep_rank: int) -> Degrees:
        return Degrees(self.tp, self.pp, self.ep, tp_rank, pp_rank, ep_rank)


def check_degrees(arch: ModelSpec, d: Degrees) -> None:
    """The degrees split this model evenly, or an error that says which does not."""
    problems = []
    if arch.num_kv_heads % d.tp:
        problems.append(f"tp={d.tp} does not divide the {arch.num_kv_heads} key/value heads")
    if not arch.num_experts and arch.intermediate_size % d.tp:
        problems.append(f"tp={d.tp} does not divide the MLP width {arch.intermediate_size}")
    if stage_split(arch.num_layers, d.pp) is None:
        problems.append(f"pp={d.pp} is more pipeline stages than the {arch.num_layers} layers")
    if d.ep > 1 and (not arch.num_experts or arch.num_experts % d.ep):
        problems.append(f"ep={d.ep} does not divide the {arch.num_experts} experts")
    if problems:
        raise SpecError("; ".join(problems), fix="pin degrees that divide the model (e.g. critic.train.tp=2)")


def stage_layers(arch: ModelSpec, d: Degrees) -> range:
    """The model's layers that pipeline stage ``d.pp_rank`` holds (:func:`stage_split`: the
    split Megatron builds, uneven at the ends where ``pp`` does not divide the layers)."""
    split = arch.stages(d.pp)
    start = sum(split[: d.pp_rank])
    return range(start, start + split[d.pp_rank])


# ----------------------------------------------------------------- the rules
# Each rule maps a Megatron parameter (local name) to HF names and a split kind.
@dataclass(frozen=True)
class Rule:
    megatron: str
    hf: tuple[str, ...]
    kind: str  # rep | qkv | fc1 | row | vocab | expert_fc1 | expert_fc2


def rules(arch: ModelSpec, d: Degrees, *, lm_head: bool = True) -> list[Rule]:
    """The parameters rank ``d`` holds, in the order the model declares them
    (``lm_head=False``: a critic or reward model, whose last stage has a scalar head
    instead, ``score.weight`` in HF's sequence-classification checkpoints)."""
    out: list[Rule] = []
    first, last = d.pp_rank == 0, d.pp_rank == d.pp - 1
    if first:
        out.append(Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"))
    for j, i in enumerate(stage_layers(arch, d)):
        m, h = f"decoder.layers.{j}.", f"model.layers.{i}."
        att = h + "self_attn."
        out.append(Rule(m + "input_layernorm.weight", (h + "input_layernorm.weight",), "rep"))
        out.append(Rule(m + "self_attention.linear_proj.weight", (att + "o_proj.weight",), "row"))
        out.append(
            Rule(m + "self_attention.linear_qkv.weight", tuple(att + f"{x}_proj.weight" for x in "qkv"), "qkv"),
        )
        if arch.attention_bias:
            out.append(Rule(m + "self_attention.linear_qkv.bias", tuple(att + f"{x}_proj.bias" for x in "qkv"), "qkv"))
        if arch.qk_norm:
            out.append(Rule(m + "self_attention.q_layernorm.weight", (att + "q_norm.weight",), "rep"))
            out.append(Rule(m + "self_attention.k_layernorm.weight", (att + "k_norm.weight",), "rep"))
        out.append(Rule(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), "rep"))
        if arch.num_experts:
            out.append(Rule(m + "mlp.router.weight", (h + "mlp.gate.weight",), "rep"))
            per = arch.num_experts // d.ep
            for k in range(per):
                e = d.ep_rank * per + k
                x = f"{m}mlp.experts.local_experts.{k}."
                y = f"{h}mlp.experts.{e}."
                out.append(Rule(x + "linear_fc1.weight", (y + "gate_proj.weight", y + "up_proj.weight"), "expert_fc1"))
                out.append(Rule(x + "linear_fc2.weight", (y + "down_proj.weight",), "expert_fc2"))
        else:
            out.append(Rule(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), "fc1"))
            out.append(Rule(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "row"))
    if last:
        out.append(Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "rep"))
        if lm_head and (not arch.tie_word_embeddings or d.pp > 1):  # tied: the last stage keeps its own copy of the embedding
            out.append(
                Rule(
                    "output_layer.weight",
                    ("model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight",),
                    "vocab",
                )
            )
        elif not lm_head:  # the scalar head, named as a sequence classifier's
            out.append(Rule("output_layer.linear.weight", (SCORE_HEAD,), "rep"))
    return out


def hf_shape(name: str, arch: ModelSpec) -> tuple[int, ...]:
    """The shape of an HF tensor named by a rule."""
    h, hd = arch.hidden_size, arch.head_dim
    last = name.rsplit(".", 2)[-2] if name.count(".") > 1 else ""
    if name == SCORE_HEAD:
        return (1, h)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (arch.vocab_size, h)
    if ".experts." in name:
        return (h, arch.moe_intermediate_size) if last == "down_proj" else (arch.moe_intermediate_size, h)
    rows = {"q_proj": arch.num_heads * hd, "k_proj": arch.num_kv_heads * hd, "v_proj": arch.num_kv_heads * hd}
    if last in rows:
        return (rows[last], h) if name.endswith("weight") else (rows[last],)
    if last == "o_proj":
        return (h, arch.num_heads * hd)
    if last in ("q_norm", "k_norm"):
        return (hd,)
    if last in ("gate_proj", "up_proj"):
        return (arch.intermediate_size, h)
    if last == "down_proj":
        return (h, arch.intermediate_size)
    if last == "gate":
        return (arch.num_experts, h)
    return (h,)  # the norms


def shard_shape(rule: Rule, arch: ModelSpec, d: Degrees) -> tuple[int, ...]:
    """The shape of rank ``d``'s Megatron tensor for ``rule``, without any data."""
    metas = [torch.empty(hf_shape(n, arch), device="meta") for n in rule.hf]
    return tuple(split(rule, metas, arch, d).shape)


def _qkv_groups(arch: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[groups, (q_per_group + 2)·head_dim, ...] from HF's q, k, v."""
    g, hd = arch.num_kv_heads, arch.head_dim
    tail = q.shape[1:]
    qg = q.reshape(g, (arch.num_heads // g) * hd, *tail)
    return torch.cat([qg, k.reshape(g, hd, *tail), v.reshape(g, hd, *tail)], dim=1)


def split(rule: Rule, hf: list[torch.Tensor], arch: ModelSpec, d: Degrees) -> torch.Tensor:
    """Rank ``d``'s Megatron tensor from the rule's HF tensors."""
    t, tp = d.tp_rank, d.tp
    if rule.kind in ("rep", "expert_fc2"):
        return hf[0].clone()
    if rule.kind == "expert_fc1":
        return torch.cat(hf, dim=0)
    if rule.kind == "row":
        return hf[0].chunk(tp, dim=1)[t].clone()
    if rule.kind == "fc1":
        gate, up = hf
        return torch.cat([gate.chunk(tp, dim=0)[t], up.chunk(tp, dim=0)[t]], dim=0)
    if rule.kind == "qkv":
        fused = _qkv_groups(arch, *hf)
        return fused.chunk(tp, dim=0)[t].reshape(-1, *fused.shape[2:]).clone()
    if rule.kind == "vocab":
        w = hf[0]
        pad = padded_vocab(arch, tp) - w.shape[0]
        if pad:
            w = torch.cat([w, w.new_zeros(pad, *w.shape[1:])])
        return w.chunk(tp, dim=0)[t].clone()
    raise AssertionError(rule.kind)


def merge(rule: Rule, shards: list[torch.Tensor], arch: ModelSpec) -> list[torch.Tensor]:
    """The rule's HF tensors from the Megatron tensors of every tp rank (in tp order)."""
    if rule.kind in ("rep", "expert_fc2"):
        return [shards[0]]
    if rule.kind == "expert_fc1":
        return list(shards[0].chunk(2, dim=0))
    if rule.kind == "row":
        return [torch.cat(shards, dim=1)]
    if rule.kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([g for g, _ in halves]), torch.cat([u for _, u in halves])]
    if rule.kind == "qkv":
        g, hd, qpg = arch.num_kv_heads, arch.head_dim, arch.num_heads // arch.num_kv_heads
        fused = torch.cat(shards, dim=0)
        tail = fused.shape[1:]
        grouped = fused.reshape(g, (qpg + 2) * hd, *tail)
        q, k, v = grouped.split([qpg * hd, hd, hd], dim=1)
        return [q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)]
    if rule.kind == "vocab":
        return [torch.cat(shards, dim=0)[: arch.vocab_size]]
    raise AssertionError(rule.kind)


# --------------------------------------------------------------- HF sources
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _expert(name: str, has: Callable[[str], bool], raw: Getter) -> torch.Tensor:
    """One expert's projection from a store that keeps experts fused
    (transformers 5: ``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``)."""
    m = _EXPERT.match(name)
    if m is None or has(name):
        return raw(name)
    base, e, proj = m.group(1), int(m.group(2)), m.group(3)
    if proj == "down_proj":
        return raw(base + ".down_proj")[e]
    gate, up = raw(base + ".gate_up_proj")[e].chunk(2, dim=0)
    return gate if proj == "gate_proj" else up


class HFCheckpoint:
    """Tensors of an HF checkpoint directory read one at a time (safetensors,
    sharded or not), so a rank reads only what its shard needs. Experts are
    named per expert (``…mlp.experts.{e}.gate_proj.weight``, the Hub's and
    vLLM's layout) whether the file stores them so or fused."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open

        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            where = json.loads(index.read_text())["weight_map"]
        elif (self.path / "model.safetensors").exists():
            where = None
        else:
            raise SpecError(f"{self.path} has no safetensors weights", fix="save the model with safe_serialization=True")
        files = sorted(set(where.values())) if where else ["model.safetensors"]
        self._open = {f: safe_open(str(self.path / f), framework="pt") for f in files}
        self._where = where or {k: "model.safetensors" for k in self._open["model.safetensors"].keys()}

    def names(self) -> list[str]:
        return list(self._where)

    def _raw(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise SpecError(f"{self.path} has no tensor {name}", fix="check the checkpoint matches its config.json")
        return self._open[self._where[name]].get_tensor(name)

    def __call__(self, name: str) -> torch.Tensor:
        return _expert(name, self._where.__contains__, self._raw)


def state_getter(state: Mapping[str, torch.Tensor]) -> Getter:
    """A getter over an in-memory HF state dict (fused or per-expert experts)."""
    return lambda name: _expert(name, state.__contains__, state.__getitem__)


def fuse_experts(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors stacked into transformers 5's fused layout (what its modules load)."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in state.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = t
        else:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
    for base, by_e in experts.items():
        order = sorted(by_e)
        out[base + ".gate_up_proj"] = torch.stack([torch.cat([by_e[e]["gate_proj"], by_e[e]["up_proj"]]) for e in order])
        out[base + ".down_proj"] = torch.stack([by_e[e]["down_proj"] for e in order])
    return out


# ---------------------------------------------------------------- both ways
def to_megatron(get: Getter, arch: ModelSpec, d: Degrees, *, lm_head: bool = True) -> dict[str, torch.Tensor]:
    """Rank ``d``'s Megatron state dict, reading only the HF tensors it needs."""
    check_degrees(arch, d)
    return {r.megatron: split(r, [get(n) for n in r.hf], arch, d) for r in rules(arch, d, lm_head=lm_head)}


def hf_params(
    arch: ModelSpec,
    d: Degrees,
    gather: Callable[[Rule], list[torch.Tensor]],
    *,
    lm_head: bool = True,
    experts_only: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF (name, tensor) pairs of pipeline stage ``d.pp_rank`` and expert rank
    ``d.ep_rank``, one parameter at a time: ``gather(rule)`` returns that
    parameter's Megatron tensor from every tp rank (one tensor for replicated
    parameters and experts). Experts come out per expert, as checkpoints and
    vLLM name them; the tied output layer's copy is skipped; ``experts_only``
    skips what every expert rank holds alike."""
    for rule in rules(arch, d, lm_head=lm_head):
        if rule.megatron == "output_layer.weight" and arch.tie_word_embeddings:
            continue
        if experts_only and not rule.kind.startswith("expert"):
            continue
        yield from zip(rule.hf, merge(rule, gather(rule), arch), strict=True)


def to_hf(
    shards: Mapping[tuple[int, int, int], Mapping[str, torch.Tensor]], arch: ModelSpec, d: Degrees
) -> dict[str, torch.Tensor]:
    """The HF checkpoint's tensors (experts per expert) from every rank's
    Megatron state, keyed by (tp, pp, ep) rank."""
    out: dict[str, torch.Tensor] = {}
    for p in range(d.pp):
        for e in range(d.ep):
            at = d.at(0, p, e)
            gather = lambda r, p=p, e=e: [shards[(t, p, e)][r.megatron] for t in range(d.tp)]  # noqa: E731
            out.update(hf_params(arch, at, gather, experts_only=e > 0))
    return out
