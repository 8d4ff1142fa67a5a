"""The runtime honours every decision of the plan it is given.

A saved plan is edited — one decision at a time where decisions interact,
several at once where they do not — and run with ``flowc run --plan``; each
test then reads back what the workers actually built (backend, sharding,
dtype, micro-batches, threads, timeout, transport, buckets) and checks it is
what the edited plan says, not what the planner would have chosen."""

from __future__ import annotations

import json

import pytest
from helpers import request

from flowc.ir.run_config import RunConfig
from flowc.run import prepare
from flowc.runtime.backends import BACKENDS
from flowc.runtime.controller import Controller
from flowc.runtime.modeling import load_causal_lm
from flowc.tasks.arithmetic import asset_dir


def saved(tmp_path, **kw) -> dict:
    """The plan flowc run makes for the default GRPO on two CPU workers, as JSON."""
    return json.loads(prepare(request(tmp_path / "base", cluster="local:2", **kw)).plan.to_json())


def run_plan(tmp_path, plan: dict, **kw) -> tuple[dict, dict, Controller]:
    """Run one step of ``plan`` (saved to a file, as a user would) and read back what ran."""
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(plan))
    cfg = RunConfig(steps=1, eval_every=0, checkpoint_every=0)
    prep = prepare(request(tmp_path, plan_file=str(path), config=cfg, steps=1, rollout=None, **kw))
    assert json.loads(prep.plan.to_json()) == plan  # the plan runs unchanged: nothing re-decided
    ctl = Controller(prep.run)
    try:
        ctl.start()
        m = ctl.run_step(0)
        return m, ctl.describe(), ctl
    finally:
        ctl.shutdown()


def engines(described: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for workers in described.values():
        for w in workers:
            for key, e in w["engines"].items():
                out.setdefault(key, []).append(e)
    return out


def test_layouts_dtype_and_worker_settings_are_followed(ray_cluster, tmp_path):
    plan = saved(tmp_path)
    train, ref = plan["roles"]["actor"]["phases"]["train"], plan["roles"]["ref"]["phases"]["forward"]
    assert plan["target"]["dtype"] == "float32" and plan["target"]["cpus_per_worker"] == 1.0
    sharded = not train["layout"]["fsdp"]  # the other of what the planner chose
    for ph in ("train", "forward"):
        # 256 rows a rank in micro-batches of 64 rows: 4 micro-batches
        # each micro-batch (64 rows: 8 prompts × 8 samples) computes its prompts once wherever that saves anything
        # (padded rows: the prompts computed once on their KV cache)
        plan["roles"]["actor"]["phases"][ph]["layout"].update(
            fsdp=sharded, micro_batch=64, micro_tokens=0, share_prompts=True, pack_sequences=False
        )
        plan["roles"]["actor"]["phases"][ph]["micro_overhead_tokens"] = 0.0
    # a token budget the 256 rows fit in: one micro-batch, not 8, which computes its 32 prompts once, in packed lines
    ref["layout"].update(micro_batch=32, micro_tokens=10**6, share_prompts=True, pack_sequences=True)
    ref["micro_overhead_tokens"] = 0.0
    plan["target"].update(dtype="bfloat16", cpus_per_worker=2.0, timeout_s=321.0)
    # the weight sync of that layout: sharded weights are gathered whole, replicated ones are whole already
    method = "full_allgather" if sharded else "in_place"
    for r in plan["reshards"]:
        if r["dst_phase"] == "generate":
            r["method"] = method
    for n in plan["graph"]["nodes"]:
        if n["op"] == "weight_sync":
            n["kwargs"]["method"] = method
    m, described, _ = run_plan(tmp_path, plan)
    e = engines(described)
    for actor in e["actor/train"]:
        assert actor == {
            "backend": "fsdp2",
            "dtype": "bfloat16",  # computes in the plan's dtype over fp32 master weights (mixed precision)
            "master_dtype": "float32",
            "sharded": sharded,
            "trains": True,
            "micro_batches": 4,
            "shared_prompts": 4,
            "packed": 0,
        }
    for r in e["ref/forward"]:
        assert r["sharded"] == ref["layout"]["fsdp"] and r["dtype"] == "bfloat16" and r["micro_batches"] == 1
        assert r["shared_prompts"] == 1 and r["packed"] == 1  # a forward op shares too, in its packed lines
    assert all(x["dtype"] == "bfloat16" and x["backend"] == "hf" for x in e["actor/rollout"])
    workers = [w for ws in described.values() for w in ws]
    assert all(w["threads"] == 2 and w["timeout_s"] == 321.0 for w in workers)
    assert (m["actor/sync_bytes_per_device"] > 0) == sharded


@pytest.mark.skipif(not BACKENDS["vllm"].installed(), reason="vLLM is not installed")
def test_the_rollout_backend_is_the_plans(ray_cluster, tmp_path):
    plan = saved(tmp_path, rollout="hf")
    plan["roles"]["actor"]["phases"]["generate"]["layout"]["backend"] = "vllm"
    _, described, _ = run_plan(tmp_path, plan)
    assert {x["backend"] for x in engines(described)["actor/rollout"]} == {"vllm"}


def test_separate_pools_sync_through_the_object_store_in_the_plans_buckets(ray_cluster, tmp_path):
    plan = saved(tmp_path, pins=["colocate=actor.train,ref;actor.gen"])
    assert len(plan["pools"]) == 2 and plan["reshards"][0]["method"] == "broadcast"
    plan["target"]["sync_bucket_bytes"] = 100_000  # the tiny model's 2 MB in many buckets instead of one
    m, described, _ = run_plan(tmp_path, plan)
    assert {name: len(ws) for name, ws in described.items()} == {p["name"]: p["device_count"] for p in plan["pools"]}
    buckets, size = 0, 0
    for _, p in load_causal_lm(str(asset_dir())).named_parameters():  # the order the weights stream in
        size += p.numel() * p.element_size()
        if size >= 100_000:
            buckets, size = buckets + 1, 0
    assert m["actor/sync_buckets"] == buckets + (size > 0) > 5
    assert m["actor/sync_bytes_per_device"] == pytest.approx(plan["reshards"][0]["bytes_per_device"], rel=0.05)


def test_a_saved_plan_is_checked_against_the_flow_the_models_and_the_options(tmp_path):
    """Before anything starts: a plan of another flow, of other hyperparameters or other models, or
    options that contradict one of its decisions, fail with what differs and the fix."""

    from flowc.errors import SpecError

    plan = saved(tmp_path, rollout="hf")
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan))

    def check(match: str, **kw) -> None:
        with pytest.raises(SpecError, match=match):
            prepare(request(tmp_path / "x", plan_file=str(path), **{"rollout": None, **kw}))

    check("is a plan of flow 'grpo', not 'rloo'", flow="rloo")
    check("another version of flow 'grpo'", overrides={"n": 4})
    check(r"--workload prompts=8 \(the plan's", workload="prompts=8")
    check("a saved plan fixes every decision", pins=["actor.generate.tp=1"])
    check("the plan generates with hf", rollout="vllm")
    check(r"config timeout_s=5\.0 \(the plan's: 600\.0\)", config=RunConfig(steps=1, timeout_s=5.0))
    qwen = tmp_path / "other-model"
    from flowc.ir.models import ModelSpec
    from flowc.runtime.modeling import hf_config, load_causal_lm

    bigger = ModelSpec.resolve(str(asset_dir())).model_copy(update={"num_layers": 3, "name": "bigger"})
    load_causal_lm(bigger).save_pretrained(qwen)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (qwen / f).write_text((asset_dir() / f).read_text())
    assert hf_config(bigger).num_hidden_layers == 3
    check("plans actor as .* but its model is", models={"actor": str(qwen)})


def test_resume_runs_on_the_runs_own_plan(ray_cluster, tmp_path):
    """A run on one worker, resumed with the default options, stays on its one worker (re-planning
    for two would look for a second rank's checkpoint), and leaves its plan files as they were."""
    cfg = RunConfig(steps=2, eval_every=0, checkpoint_every=1)
    from flowc.run import run

    out = run(request(tmp_path, cluster="local:1", steps=1, config=cfg), progress=False)
    before = (out / "plan.json").read_text()
    assert json.loads(before)["cluster"]["devices_per_node"] == 1
    run(request(tmp_path, steps=2, config=cfg, resume=str(out), out=None), progress=False)
    assert (out / "plan.json").read_text() == before
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "step_s" in r] == [1, 2]
