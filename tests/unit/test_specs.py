"""ModelSpec, ClusterSpec, WorkloadSpec and hardware profiles."""

from __future__ import annotations

import json

import pytest

from flowc.errors import SpecError
from flowc.ir.cluster import ClusterSpec
from flowc.ir.hardware import get_profile, profiles
from flowc.ir.models import ModelSpec, catalogue
from flowc.ir.workload import WorkloadSpec

# Published totals (model cards / papers), in billions.
PUBLISHED = {
    "qwen2.5-0.5b": (0.49, None),
    "qwen2.5-1.5b": (1.54, None),
    "qwen2.5-3b": (3.09, None),
    "qwen2.5-7b": (7.61, None),
    "qwen2.5-14b": (14.7, None),
    "qwen2.5-32b": (32.5, None),
    "qwen2.5-72b": (72.7, None),
    "llama-3.1-8b": (8.03, None),
    "llama-3.1-70b": (70.6, None),
    "llama-3.1-405b": (405.0, None),
    "mixtral-8x7b": (46.7, 12.9),
    "qwen3-30b-a3b": (30.5, 3.3),
    "qwen3-32b": (32.8, None),
    "qwen3-235b-a22b": (235.0, 22.0),
    "deepseek-v3": (671.0, 37.0),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_published_totals(name):
    m = ModelSpec.resolve(name)
    total, active = PUBLISHED[name]
    assert m.params_total / 1e9 == pytest.approx(total, rel=0.01)
    if active is not None:
        assert m.params_active / 1e9 == pytest.approx(active, rel=0.03)
    else:
        assert m.params_active == m.params_total


def test_every_catalogue_entry_has_a_published_total():
    assert {k for k in catalogue() if not k.startswith("flowc-")} == set(PUBLISHED)


def test_qwen25_7b_counted_by_hand():
    m = ModelSpec.resolve("qwen2.5-7b")
    h, i, layers, v = 3584, 18944, 28, 152064
    d = h // 28
    attn = h * h + 2 * h * 4 * d + h * h + (h + 2 * 4 * d)  # q, k, v, o, qkv biases
    per_layer = attn + 3 * h * i + 2 * h
    assert m.params_total == layers * per_layer + 2 * v * h + h


def test_qwen3_moe_counted_by_hand():
    m = ModelSpec.resolve("qwen3-30b-a3b")
    h, d, layers, e, k, mi, v = 2048, 128, 48, 128, 8, 768, 151936
    attn = h * 32 * d + 2 * h * 4 * d + 32 * d * h + 2 * d  # q, k, v, o, q/k norms
    expert = 3 * h * mi
    router = h * e
    per_layer_total = attn + e * expert + router + 2 * h
    per_layer_active = attn + k * expert + router + 2 * h
    assert m.params_total == layers * per_layer_total + 2 * v * h + h
    assert m.params_active == layers * per_layer_active + 2 * v * h + h


def test_model_from_hf_id_config_file_and_directory(tmp_path):
    assert ModelSpec.resolve("Qwen/Qwen2.5-7B").name == "qwen2.5-7b"
    cfg = dict(catalogue()["llama-3.1-8b"])
    f = tmp_path / "config.json"
    f.write_text(json.dumps(cfg))
    from_file = ModelSpec.resolve(str(f))
    from_dir = ModelSpec.resolve(str(tmp_path))
    assert from_file.params_total == from_dir.params_total == ModelSpec.resolve("llama-3.1-8b").params_total


def test_unknown_model_suggests():
    with pytest.raises(SpecError) as info:
        ModelSpec.resolve("qwen2.5-8b")
    assert "qwen2.5-7b" in info.value.fix


def test_model_spec_rejects_unknown_keys():
    with pytest.raises(Exception, match="extra"):
        ModelSpec(name="x", hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2, vocab_size=10, colour="red")


def test_kv_bytes_per_token():
    m = ModelSpec.resolve("llama-3.1-70b")
    assert m.kv_bytes_per_token == 2 * 8 * 128 * 80 * 2


@pytest.mark.parametrize(
    "text,nodes,per,device",
    [
        ("16x8xA100-80GB", 16, 8, "A100-80GB"),
        ("2x8xH100", 2, 8, "H100-80GB"),
        ("8xH200", 1, 8, "H200"),
        ("1x8xh800", 1, 8, "H800"),
        ("4x8xH20", 4, 8, "H20"),
    ],
)
def test_cluster_shorthand(text, nodes, per, device):
    c = ClusterSpec.parse(text)
    assert (c.nodes, c.devices_per_node, c.device) == (nodes, per, device)
    assert c.world_size == nodes * per


def test_cluster_local_is_this_machine():
    import os

    c = ClusterSpec.parse("local")
    assert c.device == "cpu" and c.world_size == os.cpu_count()


def test_cluster_yaml_with_overrides(tmp_path):
    f = tmp_path / "hybridflow.yaml"
    f.write_text("device: A100\nnodes: 16\ndevices_per_node: 8\ninter_node_gb_s: 25\n")
    c = ClusterSpec.parse(str(f))
    assert c.world_size == 128 and c.profile.inter_node_gb_s == 25 and c.profile.peak_tflops == 312


def test_cluster_yaml_unknown_key(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("device: A100\nnodes: 2\ndevices_per_node: 8\ngpus: 3\n")
    with pytest.raises(SpecError, match="gpus"):
        ClusterSpec.parse(str(f))


@pytest.mark.parametrize("bad", ["16x8", "lots of gpus", "0x8xH100", "2x8xB300"])
def test_cluster_errors(bad):
    with pytest.raises(SpecError):
        ClusterSpec.parse(bad)


def test_hardware_profiles_cover_the_required_devices():
    names = set(profiles())
    assert {"A100-80GB", "H100-80GB", "H800", "H200", "H20", "cpu"} <= names
    for p in profiles().values():
        assert p.sources, f"{p.name} cites no sources"
    assert get_profile("h100").name == "H100-80GB"
    assert get_profile("H200").memory_gb == 141


def test_workload_parse_and_env():
    w = WorkloadSpec.parse("prompts=256,prompt_len=512,response_len=1024")
    assert w.env({"n": 5}) == {"B": 256, "P": 512, "R": 1024, "n": 5}
    with pytest.raises(SpecError, match="promts"):
        WorkloadSpec.parse("promts=3")
    with pytest.raises(SpecError, match="key=value"):
        WorkloadSpec.parse("prompts")
    with pytest.raises(SpecError):
        WorkloadSpec.parse("prompts=-1")
