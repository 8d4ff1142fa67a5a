"""Run settings: ``--set KEY=VALUE`` overrides on top of a config file (validated, the valid keys
and the closest one named), recorded in run.json so a resume reproduces them; learning-rate
schedules checked against hand-computed values."""

from __future__ import annotations

import math

import pytest

from flowc.errors import SpecError
from flowc.ir.run_config import OptimConfig, RunConfig, parse_set
from flowc.run_record import RunRecord
from tests.helpers import EXAMPLES


# ----------------------------------------------------------- LR schedules
def lrs(cfg: OptimConfig, total: int) -> list[float]:
    return [cfg.lr_at(u, total) for u in range(total)]


def test_constant_with_warmup():
    assert lrs(OptimConfig(lr=1.0, warmup_steps=2), 5) == [0.5, 1.0, 1.0, 1.0, 1.0]
    assert lrs(OptimConfig(lr=1.0), 3) == [1.0, 1.0, 1.0]


def test_linear_decays_to_min_lr_ratio():
    assert lrs(OptimConfig(lr=1.0, lr_scheduler="linear"), 5) == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    # warm-up 1, then 4 updates from 1.0 down to 0.2: progress 0, 1/3, 2/3, 1
    got = lrs(OptimConfig(lr=1.0, lr_scheduler="linear", warmup_steps=1, min_lr_ratio=0.2), 5)
    assert got == pytest.approx([1.0, 1.0, 0.2 + 0.8 * 2 / 3, 0.2 + 0.8 / 3, 0.2])


def test_cosine_with_warmup():
    # lr 2, warm-up 2 (1.0, 2.0), then half a cosine over 4 updates: factors 1, 0.75, 0.25, 0
    got = lrs(OptimConfig(lr=2.0, lr_scheduler="cosine", warmup_steps=2), 6)
    assert got == pytest.approx([1.0, 2.0, 2.0, 1.5, 0.5, 0.0])
    floor = lrs(OptimConfig(lr=1.0, lr_scheduler="cosine", min_lr_ratio=0.1), 3)
    assert floor == pytest.approx([1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)), 0.1])


def test_warmup_ratio_and_pinned_total():
    cfg = OptimConfig(lr=1.0, lr_scheduler="linear", warmup_ratio=0.25)  # 2 of 8 updates
    assert lrs(cfg, 8)[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert lrs(cfg, 8)[-1] == pytest.approx(0.0)
    pinned = OptimConfig(lr=1.0, lr_scheduler="linear", total_updates=5)  # the run's own total is ignored
    assert [pinned.lr_at(u, 1000) for u in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert pinned.lr_at(9, 1000) == 0.0  # past the end: stays at the floor


def test_training_loop_uses_the_schedule():
    from flowc.runtime.backends.training import lr_at

    assert lr_at(OptimConfig(lr=1.0, lr_scheduler="linear"), 2, 5) == pytest.approx(0.5)


def test_total_updates_are_steps_times_epochs_times_mini_batches(tmp_path):
    """The controller derives each trained role's total from the program (no Ray needed)."""
    from flowc.run import prepare
    from flowc.runtime.controller import Controller
    from tests.helpers import request

    req = request(tmp_path, steps=3, workload="prompts=8,prompt_len=8,response_len=6,mini_batches=2,epochs=2")
    p = prepare(req, dry_run=True)
    assert Controller(p.run)._total_updates("actor") == 3 * 2 * 2
    assert Controller(p.run)._total_updates("ref") == 1  # frozen: no updates


# ------------------------------------------------------------- overrides
def test_set_values_are_yaml_scalars():
    assert parse_set("optim.actor.lr=1e-5") == (["optim", "actor", "lr"], 1e-5)
    assert parse_set("eval_every=5") == (["eval_every"], 5)
    assert parse_set("report_to=[wandb, mlflow]") == (["report_to"], ["wandb", "mlflow"])
    assert parse_set("data=my.jsonl") == (["data"], "my.jsonl")
    with pytest.raises(SpecError, match="not KEY=VALUE"):
        parse_set("eval_every")


def test_sets_override_the_config_file(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text(
        "steps: 10\neval_every: 2\ndefault_optim:\n  lr: 0.001\n  warmup_steps: 3\nworkload: prompts=16,response_len=32\n"
    )
    sets = ["optim.actor.lr=1e-5", "default_optim.lr=2e-5", "eval_every=5", "default_optim.lr_scheduler=cosine"]
    sets += ["workload.prompts=64", "model.actor=Qwen/Qwen2.5-0.5B", "hyperparams.n=4", "data=d.jsonl"]
    cfg, front = RunConfig.load(f, sets)
    assert cfg.steps == 10 and cfg.eval_every == 5
    assert cfg.optim["actor"].lr == 1e-5 and cfg.optim_for("critic").lr == 2e-5
    assert cfg.default_optim.warmup_steps == 3 and cfg.default_optim.lr_scheduler == "cosine"  # the file's, kept
    assert front == {
        "workload": "response_len=32,prompts=64",
        "model": {"actor": "Qwen/Qwen2.5-0.5B"},
        "hyperparams": {"n": 4},
        "data": "d.jsonl",
    }


@pytest.mark.parametrize(
    ("word", "said"),
    [
        ("optm.actor.lr=1", "did you mean 'optim'"),
        ("default_optim.lrr=1", "did you mean 'lr'"),
        ("optim.actor.lr_schedule=cosine", "did you mean 'lr_scheduler'"),
        ("workload.promts=3", "did you mean 'prompts'"),
        ("sampling.temprature=0.5", "did you mean 'temperature'"),
        ("steps.x=1", "steps is a single value"),
        ("data.x=1", "data is a single value"),
    ],
)
def test_a_wrong_key_names_the_valid_ones(word, said):
    with pytest.raises(SpecError) as e:
        RunConfig.load(None, [word])
    assert said in e.value.what
    assert "valid keys" in e.value.fix or "workload keys" in e.value.fix or "--set" in e.value.fix


def test_a_wrong_value_is_refused_with_the_settings():
    with pytest.raises(SpecError) as e:
        RunConfig.load(None, ["default_optim.lr_scheduler=exponential"])
    assert "default_optim.lr_scheduler" in e.value.what and "settings:" in e.value.fix
    with pytest.raises(SpecError, match="eval_every"):
        RunConfig.load(None, ["eval_every=often"])


def test_sets_are_recorded_and_a_resume_reproduces_them(tmp_path):
    from flowc.loader import load_flow
    from flowc.run import given_options, record_of
    from tests.helpers import request

    cfg, _ = RunConfig.load(None, ["default_optim.lr=2e-5", "default_optim.lr_scheduler=linear"])
    rec = record_of(request(tmp_path, config=cfg), cfg)
    rec.write(tmp_path)
    back = RunRecord.read(tmp_path)
    assert back.run_config().default_optim.lr == 2e-5 and back.run_config().default_optim.lr_scheduler == "linear"
    flow = load_flow(str(EXAMPLES / "grpo.py"))
    same, _ = back.run_config_with(["default_optim.lr=2e-5"])  # agrees with the run
    assert back.contradictions(given_options(flow=flow, config=same)) == []
    other, _ = back.run_config_with(["default_optim.lr=3e-5"])
    wrong = back.contradictions(given_options(flow=flow, config=other))
    assert len(wrong) == 1 and "--config" in wrong[0] and "3e-05" in wrong[0]


def test_a_resume_may_change_the_trackers(tmp_path):
    from flowc.loader import load_flow
    from flowc.run import given_options, record_of
    from tests.helpers import request

    cfg, _ = RunConfig.load(None, ["default_optim.lr=2e-5"])
    record_of(request(tmp_path, config=cfg), cfg).write(tmp_path)
    back = RunRecord.read(tmp_path)
    trackers, _ = back.run_config_with(["report_to=[wandb]"])
    assert back.contradictions(given_options(flow=load_flow(str(EXAMPLES / "grpo.py")), config=trackers)) == []


def test_the_training_loop_steps_the_optimizer_at_the_scheduled_rates():
    """A real (one-process fsdp2) trainer: each optimizer update gets the rate of its place in the run."""
    import torch

    from flowc.ir.functional import Rollout
    from flowc.ir.losses import ppo_clip
    from flowc.ir.plan import Layout
    from flowc.runtime.backends import EngineInit
    from flowc.runtime.backends.fsdp2 import Fsdp2Trainer
    from flowc.runtime.backends.training import TrainEngine
    from flowc.tasks.arithmetic import asset_dir

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    ids, rids = torch.randint(3, 16, (8, 6), generator=g), torch.randint(3, 16, (8, 4), generator=g)
    r = Rollout(ids, torch.ones(8, 6, dtype=torch.bool), rids, torch.ones(8, 4, dtype=torch.bool), torch.zeros(8, 4))
    adv = torch.randn(8, generator=g)
    optim = OptimConfig(lr=1e-3, lr_scheduler="linear", warmup_steps=1)
    init = EngineInit(
        role="actor", kind="policy", source=str(asset_dir()), layout=Layout(dp=1), dtype="float32", seed=0, optim=optim,
        total_updates=4,
    )  # fmt: skip
    eng = TrainEngine(Fsdp2Trainer(init))
    used: list[float] = []
    step = eng.b.step
    eng.b.step = lambda lr: (used.append(lr), step(lr))[1]  # type: ignore[method-assign]
    args = dict(loss=ppo_clip(), kl_coef=0.0, kl_kind="k1", entropy_coef=0.0, mini_sizes=[4, 4], epochs=1, micro=1)
    first = eng.update(r, {"advantages": adv}, **args)
    second = eng.update(r, {"advantages": adv}, **args)
    # warm-up 1 (1e-3), then linear over updates 1..3: 1e-3, 5e-4, 0
    assert used == pytest.approx([1e-3, 1e-3, 5e-4, 0.0])
    assert (first["lr"], second["lr"]) == pytest.approx((1e-3, 0.0))
