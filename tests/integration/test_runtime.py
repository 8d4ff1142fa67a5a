"""The runtime for real: Ray actors, torch.distributed (gloo), FSDP2, HF generation.

They share one local Ray cluster (see conftest.py)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import ray
from helpers import EXAMPLES, FLOWS, request

from flowc.errors import DataError, SpecError, WorkerError
from flowc.ir.run_config import RunConfig
from flowc.loader import load_flow
from flowc.run import prepare, run
from flowc.runtime.controller import Controller


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_default_grpo_runs_and_writes_the_run_directory(ray_cluster, tmp_path):
    out = run(request(tmp_path), progress=False)
    for name in ("plan.json", "plan.html", "program.txt", "metrics.jsonl"):
        assert (out / name).exists(), name
    rows = metrics(out)
    steps = [r for r in rows if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    last = steps[-1]
    for key in (
        "reward",
        "reward_std",
        "accuracy",
        "actor/kl_loss",
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/entropy",
        "response_length/mean",
        "response_length/clip_ratio",
        "prompt_length/mean",
        "critic/score/mean",
        "critic/advantages/mean",
        "timing_s/step",
        "timing_s/actor.generate",
        "tokens_per_s",
        "step_s",
        "eval/accuracy",
    ):
        assert key in last, key
    assert set(last["measured_s"]) == set(last["predicted_s"])
    # the controller's overhead: the step outside every op and reward call (so no op's span counts toward it)
    assert 0.0 <= last["perf/controller_s"] <= last["step_s"] - max(last["measured_s"].values()) + 1e-3
    assert last["perf/controller_fraction"] == pytest.approx(last["perf/controller_s"] / last["step_s"])
    # the bytes each rank gathered to sync the rollout engine are what the plan priced
    plan = json.loads((out / "plan.json").read_text())
    (sync,) = [r for r in plan["reshards"] if r["role"] == "actor" and r["dst_phase"] == "generate"]
    assert last["actor/sync_bytes_per_device"] == pytest.approx(sync["bytes_per_device"], rel=0.05, abs=1.0)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    tok = AutoTokenizer.from_pretrained(out / "final")
    assert model.config.hidden_size == 128 and tok.eos_token == "</s>"
    from flowc.report import draw

    assert draw(out).stat().st_size > 10_000


@pytest.mark.parametrize("flow", [f for f in FLOWS if f != "grpo"])  # grpo: the default-run test above
def test_every_example_runs(ray_cluster, tmp_path, flow):
    ahead = 1 if flow == "grpo_async" else 0  # the example whose loss lets its rollouts lag the trainer
    cfg = RunConfig(steps=2, eval_every=0, checkpoint_every=0, staleness=ahead)
    wl = "prompts=8,prompt_len=8,response_len=" + ("20" if flow == "grpo_tool" else "6")  # a tool call and its answer
    out = run(request(tmp_path, flow=flow, steps=2, config=cfg, workload=wl), progress=False)
    rows = [r for r in metrics(out) if "step_s" in r]
    assert [r["step"] for r in rows] == [1, 2]
    if ahead:
        assert [r["rollout/staleness"] for r in rows] == [0, 1]
        assert rows[-1]["actor/mismatch_kl"] > 0 and "actor/is_cut_frac" in rows[-1]
    assert ("actor/dpo_loss" if flow == "dpo" else "actor/pg_loss") in rows[-1]
    if flow == "ppo":
        assert "critic/vf_loss" in rows[-1]
        assert rows[-1]["rm.score/std"] > 0  # the shipped reward model scores; a zero head would give 0.0
        from transformers import AutoModelForSequenceClassification

        critic = AutoModelForSequenceClassification.from_pretrained(out / "final" / "critic")  # exported with its head
        assert critic.config.num_labels == 1 and critic.score.weight.abs().sum() > 0
    if flow == "grpo_tool":  # the built-in calculator task: trajectories with the tool's answers masked out
        assert rows[-1]["agent/turns"] >= 1 and "agent/info/tool_calls" in rows[-1] and "reward" in rows[-1]
    if flow == "dapo":  # dynamic sampling refilled the batch, or ran out of rounds
        last = rows[-1]
        assert last["filter_groups/kept_groups"] == 1.0 or last["filter_groups/rounds"] == 4
        assert 1 <= last["filter_groups/rounds"] <= 4


def test_dynamic_sampling_tops_up_when_the_rounds_run_out(ray_cluster, tmp_path):
    """A reward that never varies: every round keeps no group, so after max_rounds the batch is
    filled with non-varying groups and the update still sees a full batch."""
    (tmp_path / "const_reward.py").write_text("def zero(prompts, responses, **_):\n    return [0.0] * len(responses)\n")
    flow = tmp_path / "dyn.py"
    flow.write_text(
        "import flowc as fc\n\n\n"
        "@fc.flow\n"
        "def dyn(prompts: fc.Prompts, actor: fc.Policy, reward: fc.Reward, *, n: int = 4):\n"
        "    rollout = actor.generate(prompts, n=n)\n"
        "    rollout, scores = fc.ops.filter_groups(rollout, reward(rollout), group_size=n, max_rounds=2)\n"
        "    actor.update(rollout, advantages=fc.ops.group_normalize(scores, n), old_logprobs=actor.logprobs(rollout))\n"
    )
    cfg = RunConfig(steps=1, eval_every=0, checkpoint_every=0)
    req = request(tmp_path, steps=1, config=cfg, workload="prompts=4,prompt_len=8,response_len=6")
    req.flow, req.rewards = load_flow(str(flow)), {"reward": f"{tmp_path / 'const_reward.py'}:zero"}
    (row,) = [r for r in metrics(run(req, progress=False)) if "step_s" in r]
    assert row["filter_groups/rounds"] == 2
    assert row["filter_groups/first_round_kept"] == 0.0 and row["filter_groups/kept_groups"] == 0.0
    assert row["actor/pg_loss"] == 0.0  # all advantages are zero: nothing varies
    assert row["gen_tokens"] > 0 and row["measured_s"]["actor.generate"] > 0


@pytest.mark.parametrize("fsdp", [False, True], ids=["replicated", "fsdp"])
def test_rollout_engine_matches_the_trainer_after_sync(ray_cluster, tmp_path, fsdp):
    prep = prepare(request(tmp_path, cluster="local:2", pins=[f"actor.train.fsdp={str(fsdp).lower()}"]))
    spec = prep.run
    (sync,) = [r for r in prep.plan.reshards if r.role == "actor" and r.dst_phase == "generate"]
    assert (sync.bytes_per_device > 0) == fsdp  # sharded weights are gathered; replicas already hold them
    ctl = Controller(spec)
    try:
        ctl.start()
        for s in range(2):
            got = ctl.run_step(s)
        assert got["actor/sync_bytes_per_device"] == pytest.approx(sync.bytes_per_device, rel=0.05, abs=1.0)
        assert ctl.sync_error("actor") < 1e-5
    finally:
        ctl.shutdown()


def test_resume_continues_as_if_never_interrupted(ray_cluster, tmp_path):
    cfg = RunConfig(steps=4, eval_every=0, checkpoint_every=2, seed=3)
    whole = run(request(tmp_path / "a", steps=4, config=cfg, out=str(tmp_path / "a")), progress=False)
    half = run(request(tmp_path / "b", steps=2, config=cfg, out=str(tmp_path / "b")), progress=False)
    assert (half / "checkpoints" / "latest").read_text().strip() == "step-000002"
    resumed = run(request(tmp_path / "b", steps=4, config=cfg, resume=str(half), out=None), progress=False)
    a = [r for r in metrics(whole) if "reward" in r]
    b = [r for r in metrics(resumed) if "reward" in r]
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a, b, strict=True):
        assert x["reward"] == y["reward"]
        assert x["actor/pg_loss"] == pytest.approx(y["actor/pg_loss"], abs=1e-6)
        assert x["actor/kl_loss"] == pytest.approx(y["actor/kl_loss"], abs=1e-6)


def test_a_crash_during_a_save_leaves_the_previous_checkpoint(ray_cluster, tmp_path, monkeypatch):
    prep = prepare(request(tmp_path))
    spec = prep.run
    ctl = Controller(spec)
    try:
        ctl.start()
        ctl.run_step(0)
        first = ctl.save(1, {})
        ctl.run_step(1)
        real = Path.write_text

        def crash(self, text, *a, **k):
            if self.name == "controller.json":
                raise OSError("disk full")
            return real(self, text, *a, **k)

        monkeypatch.setattr(Path, "write_text", crash)
        with pytest.raises(DataError, match=r"checkpoint of step 2 .* failed \(OSError: disk full\)") as e:
            ctl.save(2, {})
        assert "free space" in e.value.fix
        monkeypatch.undo()
        root = spec.out_dir / "checkpoints"
        assert not list(root.glob(".tmp-*"))  # the half-written checkpoint is gone
        assert (root / "latest").read_text().strip() == first.name
        assert not (root / "step-000002").exists()
        assert ctl.restore(spec.out_dir)["step"] == 1
    finally:
        ctl.shutdown()


@pytest.mark.slow
def test_ctrl_c_stops_cleanly_and_the_checkpoint_resumes(tmp_path):
    import os
    import signal
    import subprocess
    import time

    from helpers import ROOT, flowc_cmd

    out = tmp_path / "run"
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("checkpoint_every: 2\neval_every: 0\n")
    grpo = str(EXAMPLES / "grpo.py")
    cmd = flowc_cmd("run", grpo, "--steps", "400", "--out", str(out), "--config", str(cfg), "--rollout", "hf", "-q")
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    latest = out / "checkpoints" / "latest"
    deadline = time.time() + 300
    while not latest.exists() and time.time() < deadline and p.poll() is None:
        time.sleep(0.5)
    assert latest.exists(), p.stderr.read() if p.poll() is not None else "no checkpoint in time"
    p.send_signal(signal.SIGINT)
    try:  # generous: on a loaded 2-core machine tearing Ray down takes a while
        _, err = p.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGUSR1)  # the run's faulthandler prints every thread's stack to stderr
        time.sleep(3)
        p.kill()
        _, err = p.communicate()
        raise AssertionError(f"the run did not stop within 300 s of Ctrl-C; its stderr:\n{err[-3000:]}") from None
    # exit 130, after a checkpoint of the step it stopped at, which the message names
    assert p.returncode == 130 and "stopped by SIGINT after step" in err and f"flowc run --resume {out}" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    step = int(latest.read_text().strip().split("-")[1])
    assert f"checkpoint {out}/checkpoints/step-{step:06d} written" in err, err[-3000:]
    r = subprocess.run(  # the printed command, plus a length: run.json holds the rest
        flowc_cmd("run", "--resume", str(out), "--steps", str(step + 1), "-q"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == step + 1


def test_a_killed_worker_is_a_typed_error(ray_cluster, tmp_path):
    prep = prepare(request(tmp_path))
    spec = prep.run
    ctl = Controller(spec)
    try:
        ctl.start()
        ctl.run_step(0)
        group = next(iter(ctl.groups.values()))
        ray.kill(group.workers[1])
        with pytest.raises(WorkerError) as info:
            ctl.run_step(1)
        assert "died" in info.value.what and "actor" in info.value.what
    finally:
        ctl.shutdown()
    assert not ctl.groups


@ray.remote(num_cpus=0)
class _Peer:
    def collective_fails(self) -> None:
        time.sleep(0.2)  # what a survivor's all_reduce raises when its peer's process is gone
        raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:9654: Connection reset by peer")

    def dies(self) -> None:
        time.sleep(1.5)
        os._exit(1)


def test_a_peer_that_died_is_named_over_the_collective_error_it_caused(ray_cluster):
    """A SIGKILLed rank shows first as a collective error on the survivors; the error names the death."""
    from types import SimpleNamespace

    from flowc.runtime.worker import WorkerGroup

    survivor, victim = _Peer.remote(), _Peer.remote()
    group = SimpleNamespace(name="actor.train", roles="actor/train", timeout=30.0, size=2, workers=[survivor, victim])
    refs = [survivor.collective_fails.remote(), victim.dies.remote()]
    with pytest.raises(WorkerError) as info:
        WorkerGroup.get(group, refs, "update actor.update")
    what = info.value.what
    assert "died during update actor.update, rank 1" in what, what
    assert "then update actor.update failed, rank 0: RuntimeError" in what and "Connection reset" in what, what
    # a rank that fails on its own (no peer died) is still reported as its own failure
    refs = [survivor.collective_fails.remote(), survivor.collective_fails.remote()]
    with pytest.raises(WorkerError, match=r"update failed on worker group actor\.train \(actor/train\), rank 0: RuntimeError"):
        WorkerGroup.get(SimpleNamespace(**{**vars(group), "workers": [survivor, survivor]}), refs, "update")


def test_bad_inputs_fail_with_a_clear_error(ray_cluster, tmp_path):
    with pytest.raises(SpecError, match=r"no config\.json"):
        prepare(request(tmp_path, models={"actor": str(tmp_path)}))
    with pytest.raises(SpecError, match=r"actor\.train pinned to backend=megatron, which runs on GPUs only, not CPUs"):
        prepare(request(tmp_path, pins=["actor.train.backend=megatron"]))
    small = tmp_path / "small-vocab"
    small.mkdir()
    from flowc.tasks.arithmetic import asset_dir

    cfg = json.loads((asset_dir() / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**cfg, "vocab_size": 8}))
    with pytest.raises(SpecError, match="has no tokenizer files"):
        prepare(request(tmp_path, models={"actor": str(small)}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (small / f).write_text((asset_dir() / f).read_text())
    with pytest.raises(SpecError, match=r"has \d+ tokens but actor's model .* vocabulary of 8"):
        prepare(request(tmp_path, models={"actor": str(small)}))
    bad = tmp_path / "data.jsonl"
    bad.write_text('{"question": "1+1=", "answer": "2"}\n')
    with pytest.raises(DataError, match="no 'prompt' column"):
        prepare(request(tmp_path, data=str(bad), rewards={"reward": "flowc.tasks.arithmetic:exact_match"}))
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(20)))
    with pytest.raises(SpecError, match="has no function"):
        prepare(request(tmp_path, data=str(good)))
    rewards = tmp_path / "my_rewards.py"
    rewards.write_text(
        "def boom(prompts, responses, answer):\n    raise ValueError('no')\n\ndef short(prompts, responses, **kw):\n    return [1.0]\n"
    )
    with pytest.raises(DataError, match="raised ValueError"):
        run(request(tmp_path, data=str(good), rewards={"reward": f"{rewards}:boom"}, steps=1), progress=False)
    with pytest.raises(DataError, match="returned \\(1,\\) scores for 128 responses"):
        run(request(tmp_path, data=str(good), rewards={"reward": f"{rewards}:short"}, steps=1), progress=False)
