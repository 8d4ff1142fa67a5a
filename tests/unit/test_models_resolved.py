"""Models are what the user named, or the run is refused: hub ids resolve through the
Hugging Face cache (never to a random model), random weights only when asked for, and a
reward model scores with its checkpoint's head — exactly transformers' scores."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from flowc.errors import SpecError
from flowc.inputs import materialize_model, model_sources
from flowc.ir.functional import Rollout
from flowc.ir.models import ModelSpec
from flowc.loader import load_flow
from flowc.tasks.arithmetic import asset_dir, reward_model_dir

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def fake_hub_cache(root: Path, repo_id: str, model: Path) -> Path:
    """``repo_id`` in a Hugging Face cache at ``root``, as ``hf download`` lays it out."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    rev = "0123456789abcdef0123456789abcdef01234567"
    snap = repo / "snapshots" / rev
    shutil.copytree(model, snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    return snap


@pytest.fixture
def hub(tmp_path, monkeypatch):
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_an_uncached_hub_id_is_refused_offline_never_random(hub, tmp_path):
    # Qwen/Qwen2.5-0.5B is also a catalogue entry's hub id: it used to become a random model
    with pytest.raises(SpecError) as e:
        materialize_model("Qwen/Qwen2.5-0.5B", tmp_path / "run")
    assert "Qwen/Qwen2.5-0.5B" in e.value.what and "HF_HUB_OFFLINE" in e.value.what
    assert "hf download Qwen/Qwen2.5-0.5B" in (e.value.fix or "")
    assert not (tmp_path / "run" / "models").exists()


def test_a_cached_hub_id_resolves_to_its_snapshot(hub, tmp_path):
    snap = fake_hub_cache(hub, "acme/arith-tiny-instruct", asset_dir())
    path, note = materialize_model("acme/arith-tiny-instruct", tmp_path)
    assert Path(path) == snap and note is None
    assert ModelSpec.resolve("acme/arith-tiny-instruct").hidden_size == 128  # plans read its own config


def test_a_fine_tune_plans_as_its_base_architecture():
    assert ModelSpec.resolve("Qwen/Qwen2.5-7B-Instruct").hidden_size == ModelSpec.resolve("qwen2.5-7b").hidden_size


def test_a_catalogue_name_runs_only_with_init_random(tmp_path):
    from safetensors.torch import load_file

    with pytest.raises(SpecError) as e:
        materialize_model("qwen2.5-0.5b", tmp_path)
    assert "catalogue" in e.value.what and "--init random" in (e.value.fix or "")
    shipped = load_file(str(asset_dir() / "model.safetensors"))["model.embed_tokens.weight"]
    # asked for: the catalogue architecture with the built-in tokenizer, said out loud
    path, note = materialize_model("flowc-tiny", tmp_path, init="random")
    assert note is not None and "random weights" in note and "built-in arithmetic tokenizer" in note
    assert not torch.equal(load_file(str(Path(path) / "model.safetensors"))["model.embed_tokens.weight"], shipped)
    # a model directory with --init random: its own config and tokenizer, fresh weights
    path, note = materialize_model(str(asset_dir()), tmp_path, init="random")
    assert note is not None and "its own tokenizer" in note
    assert not torch.equal(load_file(str(Path(path) / "model.safetensors"))["model.embed_tokens.weight"], shipped)


def test_roles_get_checkpoints_that_fit_them(tmp_path):
    ppo = load_flow(str(EXAMPLES / "ppo.py")).trace()
    # the built-in default: the reward model is the shipped sequence classifier
    sources, _, notes = model_sources(ppo, {}, tmp_path)
    assert sources["rm"] == str(reward_model_dir()) and sources["actor"] == str(asset_dir())
    assert any("critic" in n and "zero" in n for n in notes)  # a critic from a causal LM says its head is fresh
    # a reward model given a causal LM would score 0.0: refused before anything starts
    with pytest.raises(SpecError, match=r"score every response 0\.0"):
        model_sources(ppo, {"actor": str(asset_dir()), "rm": str(asset_dir())}, tmp_path)
    # a user's policy with no reward model given: refused, naming the role
    user = tmp_path / "policy"
    shutil.copytree(asset_dir(), user)
    with pytest.raises(SpecError, match="no model given for reward model role 'rm'"):
        model_sources(ppo, {"actor": str(user)}, tmp_path)
    # a policy given a reward model's checkpoint: refused (it has no LM head)
    with pytest.raises(SpecError, match="sequence-classification"):
        model_sources(ppo, {"actor": str(reward_model_dir()), "rm": str(reward_model_dir())}, tmp_path)


def _rows() -> Rollout:
    """Arithmetic prompts (left padded) with right and wrong answers (right padded, EOS-ended)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(asset_dir()))
    prompts, answers = ["12+34=", "7-9=", "99+1=", "12+34="], ["46", "-2", "100", "9"]
    p = tok(prompts, padding=True, return_tensors="pt")
    r = [tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for a in answers]
    width = max(map(len, r)) + 1
    rids = torch.full((len(r), width), tok.pad_token_id)
    rmask = torch.zeros((len(r), width), dtype=torch.bool)
    for i, t in enumerate(r):
        rids[i, : len(t)], rmask[i, : len(t)] = torch.tensor(t), True
    return Rollout(p["input_ids"], p["attention_mask"].bool(), rids, rmask, torch.zeros(rids.shape))


def hf_scores(source: str, r: Rollout) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(source).eval()
    with torch.no_grad():
        return torch.stack(
            [
                model(
                    input_ids=torch.cat([r.prompt_ids[i][r.prompt_mask[i]], r.response_ids[i][r.response_mask[i]]])[None]
                ).logits[0, 0]
                for i in range(r.prompt_ids.shape[0])
            ]
        )


def _fsdp2(kind: str, source: str, optim=None):
    from flowc.ir.plan import Layout
    from flowc.runtime.backends import EngineInit
    from flowc.runtime.backends.fsdp2 import Fsdp2Trainer
    from flowc.runtime.backends.training import TrainEngine

    return TrainEngine(
        Fsdp2Trainer(EngineInit(role=kind, kind=kind, source=source, layout=Layout(), dtype="float32", seed=0, optim=optim))
    )


def test_reward_model_scores_equal_transformers_and_export_round_trips(tmp_path):
    r = _rows()
    want = hf_scores(str(reward_model_dir()), r)
    assert want.abs().max() > 0.5 and want[0] > want[3]  # a trained head: the right answer scores higher
    rm = _fsdp2("reward_model", str(reward_model_dir()))
    got = rm.forward(r, micro=2)
    assert torch.allclose(got, want, atol=1e-5), (got, want)
    # a critic initialised from the reward model starts from its head
    critic = _fsdp2("critic", str(reward_model_dir()))
    assert torch.equal(critic.b.model.head.weight, rm.b.model.head.weight) and critic.b.model.head.weight.abs().sum() > 0
    # exported as a sequence classifier that transformers (and flowc) load back with the same scores
    critic.b.export_hf(str(tmp_path / "exported"), str(asset_dir()))
    assert torch.allclose(hf_scores(str(tmp_path / "exported"), r), want, atol=1e-5)


def test_flowc_run_refuses_an_uncached_hub_id_before_anything_starts(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty-cache")}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "flowc.cli",
            "run",
            str(EXAMPLES / "grpo.py"),
            "--model",
            "actor=Qwen/Qwen2.5-0.5B",
            "--out",
            str(tmp_path / "run"),
            "-q",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode != 0
    assert "Qwen/Qwen2.5-0.5B" in r.stderr and "hf download" in r.stderr, r.stderr
    assert "Started a local Ray instance" not in r.stderr and not (tmp_path / "run" / "models").exists()
