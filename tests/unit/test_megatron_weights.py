"""HF ↔ Megatron weight mapping (runtime.megatron_weights): every rank's shard
from HF and back is bit-identical, for dense (Qwen2 with qkv bias and tied
embeddings, Llama with GQA and an untied head) and MoE (Qwen3-MoE with q/k
norms) models, and checkpoints read lazily give the same shards."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowc.errors import SpecError
from flowc.runtime.megatron_weights import (
    Degrees,
    HFCheckpoint,
    fuse_experts,
    megatron_spec,
    state_getter,
    to_hf,
    to_megatron,
)


def _model(kind: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3MoeConfig

    torch.manual_seed(0)
    if kind == "qwen2":
        cfg = Qwen2Config(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=300,
            tie_word_embeddings=True,
        )
    elif kind == "llama":
        cfg = LlamaConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=97,
            tie_word_embeddings=False,
        )
    else:
        cfg = Qwen3MoeConfig(
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=50,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    return AutoModelForCausalLM.from_config(cfg)


MODELS = {k: _model(k) for k in ("qwen2", "llama", "qwen3_moe")}


def _hf_state(model) -> dict[str, torch.Tensor]:
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


def _round_trip(kind: str, tp: int, pp: int, ep: int) -> None:
    model = MODELS[kind]
    arch = megatron_spec(model.config)
    state = _hf_state(model)
    d = Degrees(tp=tp, pp=pp, ep=ep)
    shards = {
        (t, p, e): to_megatron(state_getter(state), arch, d.at(t, p, e))
        for t, p, e in itertools.product(range(tp), range(pp), range(ep))
    }
    back = fuse_experts(to_hf(shards, arch, d))
    assert back.keys() == state.keys()
    for name, t in state.items():
        assert torch.equal(back[name], t), name


@pytest.mark.parametrize(
    "kind,tp,pp,ep",
    [("qwen2", 2, 2, 1), ("llama", 2, 2, 1), ("llama", 4, 1, 1), ("qwen3_moe", 2, 2, 2), ("qwen2", 1, 3, 1), ("llama", 2, 3, 1)],
)
def test_hf_to_megatron_and_back_is_bit_identical(kind, tp, pp, ep):
    _round_trip(kind, tp, pp, ep)


@settings(max_examples=15, deadline=None)
@given(
    kind=st.sampled_from(["qwen2", "llama", "qwen3_moe"]),
    tp=st.sampled_from([1, 2]),
    pp=st.sampled_from([1, 2]),
    ep=st.sampled_from([1, 2, 4]),
)
def test_round_trip_for_any_degrees_that_divide_the_model(kind, tp, pp, ep):
    if kind != "qwen3_moe":
        ep = 1
    _round_trip(kind, tp, pp, ep)


def test_shards_have_megatron_layouts():
    arch = megatron_spec(MODELS["qwen2"].config)
    s = to_megatron(state_getter(_hf_state(MODELS["qwen2"])), arch, Degrees(tp=2, pp=2, pp_rank=1, tp_rank=1))
    # 2 groups of (2 q heads + k + v) x 16 dims, one group per tp rank
    assert s["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (64, 64)
    assert s["decoder.layers.0.self_attention.linear_qkv.bias"].shape == (64,)
    assert s["decoder.layers.0.mlp.linear_fc1.weight"].shape == (96, 64)  # [gate_t; up_t]
    assert s["decoder.layers.0.mlp.linear_fc2.weight"].shape == (64, 48)
    assert s["output_layer.weight"].shape == (256, 64)  # 300 rows padded to 512 (a multiple of 128·tp), split over 2
    assert "embedding.word_embeddings.weight" not in s  # the last stage of two
    assert not any(k.startswith("decoder.layers.2") for k in s)  # layers 2, 3 are numbered 0, 1 here


def test_checkpoint_read_lazily_gives_the_same_shards(tmp_path):
    model = MODELS["qwen3_moe"]
    model.save_pretrained(tmp_path, safe_serialization=True)
    arch = megatron_spec(model.config)
    d = Degrees(tp=2, pp=1, ep=2, tp_rank=1, ep_rank=1)
    from_disk = to_megatron(HFCheckpoint(tmp_path), arch, d)
    in_memory = to_megatron(state_getter(_hf_state(model)), arch, d)
    assert from_disk.keys() == in_memory.keys()
    for k in in_memory:
        assert torch.equal(from_disk[k], in_memory[k]), k


def test_checkpoint_with_per_expert_tensors(tmp_path):
    """The Hub's Qwen3-MoE files name each expert's gate/up/down projections."""
    from safetensors.torch import save_file

    state = _hf_state(MODELS["qwen3_moe"])
    legacy = {}
    for k, v in state.items():
        if k.endswith("experts.gate_up_proj"):
            for e in range(v.shape[0]):
                gate, up = v[e].chunk(2)
                legacy[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate.contiguous()
                legacy[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = up.contiguous()
        elif k.endswith("experts.down_proj"):
            for e in range(v.shape[0]):
                legacy[k.replace("down_proj", f"{e}.down_proj.weight")] = v[e].contiguous()
        else:
            legacy[k] = v.contiguous()
    save_file(legacy, str(tmp_path / "model.safetensors"))
    arch = megatron_spec(MODELS["qwen3_moe"].config)
    d = Degrees(ep=2, ep_rank=1)
    got = to_megatron(HFCheckpoint(tmp_path), arch, d)
    want = to_megatron(state_getter(state), arch, d)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_degrees_that_do_not_divide_the_model_are_named():
    arch = megatron_spec(MODELS["qwen2"].config)
    with pytest.raises(
        SpecError, match=r"tp=4 does not divide the 2 key/value heads.*pp=5 is more pipeline stages than the 4 layers"
    ):
        to_megatron(state_getter(_hf_state(MODELS["qwen2"])), arch, Degrees(tp=4, pp=5))


def test_a_pipeline_that_does_not_divide_the_layers_splits_them_unevenly_at_the_ends():
    """4 layers in 3 stages: 1, 2, 1 (stage_split, what Megatron builds from
    num_layers_in_first/last_pipeline_stage); each stage numbers its own layers from 0."""
    from flowc.runtime.megatron_weights import stage_layers

    arch = megatron_spec(MODELS["qwen2"].config)
    assert [list(stage_layers(arch, Degrees(pp=3, pp_rank=r))) for r in range(3)] == [[0], [1, 2], [3]]
    state = _hf_state(MODELS["qwen2"])
    mid = to_megatron(state_getter(state), arch, Degrees(pp=3, pp_rank=1))
    assert torch.equal(mid["decoder.layers.1.mlp.linear_fc2.weight"], state["model.layers.2.mlp.down_proj.weight"])
    assert not any(k.startswith("decoder.layers.2") for k in mid) and "output_layer.weight" not in mid


def test_unmapped_architectures_are_refused():
    from transformers import GPT2Config

    with pytest.raises(SpecError, match="no weight mapping for model_type 'gpt2'"):
        megatron_spec(GPT2Config())


@pytest.mark.parametrize("kind", ["qwen2", "llama", "qwen3_moe"])
def test_shapes_known_without_data_match_the_shards(kind):
    """A rank that receives a streamed parameter sizes its buffer from the arch alone."""
    from flowc.runtime.megatron_weights import rules, shard_shape

    model = MODELS[kind]
    arch = megatron_spec(model.config)
    state = _hf_state(model)
    for t, p, e in itertools.product(range(2), range(2), range(2 if arch.num_experts else 1)):
        d = Degrees(tp=2, pp=2, ep=2 if arch.num_experts else 1, tp_rank=t, pp_rank=p, ep_rank=e)
        shards = to_megatron(state_getter(state), arch, d)
        for rule in rules(arch, d):
            assert shard_shape(rule, arch, d) == tuple(shards[rule.megatron].shape), rule.megatron
