"""`flowc plan` and `flowc export`: fields, explanations, pins, saved plans,
impossible requests, golden text and the HTML page in a real browser."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import EXAMPLES, FLOWS, ROOT, check_golden

from flowc.errors import InfeasibleError, SpecError
from flowc.ir.cluster import ClusterSpec
from flowc.ir.plan import Plan
from flowc.ir.plan_text import format_plan
from flowc.ir.plan_verify import verify_plan
from flowc.ir.workload import WorkloadSpec
from flowc.loader import load_flow
from flowc.passes.pins import Pins, parse_pin, parse_pins
from flowc.passes.pipeline import make_plan
from flowc.planning import resolve_models


def flowc(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flowc.cli", *args], capture_output=True, text=True, check=check, cwd=ROOT)


def plan_of(flow: str, model: str, cluster: str, workload: WorkloadSpec | None = None, pins: Pins | None = None):
    g = load_flow(str(EXAMPLES / f"{flow}.py")).trace()
    models, _ = resolve_models(g, {"actor": model})
    return make_plan(g, models, ClusterSpec.parse(cluster), workload or WorkloadSpec(), pins)


def test_plan_json_has_every_field():
    r = flowc("plan", "examples/ppo.py", "--model", "actor=llama-3.1-70b", "--cluster", "16x8xH100", "--json")
    d = json.loads(r.stdout)
    assert d["schema_version"] == 2
    assert {"step_time_s", "tokens_per_s"} <= set(d["predicted"])
    # the compiled artifact: the planned graph and the runtime decisions travel with the plan
    assert d["target"] == {
        "kind": "gpu",
        "collective": "nccl",
        "dtype": "bfloat16",
        "cpus_per_worker": 1.0,
        "timeout_s": 600.0,
        "sync_bucket_bytes": 64_000_000,
        "rollout_backends": ["vllm", "hf"],
    }
    assert d["graph"]["name"] == "ppo" and [n["op"] for n in d["graph"]["nodes"]].count("weight_sync") == 1
    assert d["cluster"]["world_size"] == 128
    for role in ("actor", "critic", "ref", "rm"):
        rp = d["roles"][role]
        assert rp["model"] == "llama-3.1-70b" and rp["params_b"] == pytest.approx(70.55, abs=0.01)
        for ph in rp["phases"].values():
            assert {"pool", "device_count", "dp", "tp", "pp", "cp", "ep", "memory_gb_per_device", "time_s"} <= set(ph)
            assert ph["dp"] * ph["tp"] * ph["pp"] * ph["cp"] == ph["device_count"]
    assert set(d["roles"]["actor"]["phases"]) == {"train", "forward", "generate"}
    for p in d["pools"]:
        assert {"name", "device_count", "roles"} <= set(p)
    assert sum(p["device_count"] for p in d["pools"]) == 128
    for rs in d["reshards"]:
        assert {"role", "method", "bytes_per_device", "time_s"} <= set(rs)
    assert d["alternatives"] and all({"summary", "step_time_s", "rejected_because"} <= set(a) for a in d["alternatives"])
    verify_plan(Plan.model_validate(d))


def test_plan_text_explains_itself():
    r = flowc("plan", "examples/ppo.py", "--model", "actor=llama-3.1-70b", "--cluster", "16x8xH100")
    out = r.stdout
    for section in ("predicted:", "pools", "roles (memory per device, GB)", "reshards", "schedule", "why", "alternatives"):
        assert section in out
    assert "slower" in out and "OOM: needs" in out
    assert "tokens/s" in out and "tokens/s/device" in out
    assert "planned in" in r.stderr


def test_hyperparameter_override_and_workload_reach_the_plan():
    plan, _, _ = plan_of("grpo", "qwen2.5-7b", "1x8xH100", WorkloadSpec.parse("prompts=64,prompt_len=256,response_len=512"))
    assert plan.predicted.tokens_per_step == 64 * 8 * (256 + 512)
    r = flowc(
        "plan",
        "examples/grpo.py",
        "n=4",
        "--model",
        "actor=qwen2.5-7b",
        "--cluster",
        "8xH100",
        "--workload",
        "prompts=64,prompt_len=256,response_len=512",
        "--json",
    )
    assert json.loads(r.stdout)["predicted"]["tokens_per_step"] == 64 * 4 * (256 + 512)


def test_pins_are_respected():
    pins = parse_pins(["actor.generate.tp=2", "colocate=actor;ref"])
    plan, _, _ = plan_of("grpo", "qwen2.5-7b", "1x8xH100", pins=pins)
    assert plan.roles["actor"].phases["generate"].tp == 2
    assert sorted(p.name for p in plan.pools) == ["actor.train+actor.gen", "ref"]
    plan, _, _ = plan_of("grpo", "qwen2.5-7b", "1x8xH100", pins=parse_pins(["actor.train.backend=megatron", "actor.train.pp=2"]))
    assert plan.roles["actor"].phases["train"].layout.backend == "megatron" and plan.roles["actor"].phases["train"].pp == 2


def test_pin_errors_name_the_problem():
    with pytest.raises(SpecError, match=r"unknown field 'tpp'.*did you mean 'tp'"):
        parse_pin("actor.generate.tpp=2")
    with pytest.raises(SpecError, match="unknown phase"):
        parse_pin("actor.gen.tp=2")
    with pytest.raises(SpecError, match="does not have"):
        plan_of("grpo", "qwen2.5-7b", "1x8xH100", pins=parse_pins(["actr.generate.tp=2"]))
    with pytest.raises(
        InfeasibleError, match=r"actor\.gen: no generation layout with tp=2 on 3 devices: tp=2 does not divide the 3 devices"
    ) as info:
        plan_of("grpo", "qwen2.5-7b", "1x8xH100", pins=parse_pins(["actor.generate.devices=3", "actor.generate.tp=2"]))
    assert "pins" in info.value.fix


def test_shared_prompts_are_planned_where_they_pay_and_pins_that_cannot_apply_are_refused():
    w = WorkloadSpec(prompts=64, prompt_len=2048, response_len=512)
    fsdp2 = ["actor.train.backend=fsdp2"]
    plan, _, _ = plan_of("grpo", "qwen2.5-1.5b", "1x8xH100", workload=w, pins=parse_pins(fsdp2))
    assert plan.phase("actor", "train").layout.share_prompts  # 2048-token prompts, 8 samples each
    assert any("each prompt computed once for the 8 rows" in line for line in plan.why)
    pins = parse_pins([*fsdp2, "actor.train.share_prompts=false"])
    off, _, _ = plan_of("grpo", "qwen2.5-1.5b", "1x8xH100", workload=w, pins=pins)
    assert off.predicted.step_time_s > plan.predicted.step_time_s
    assert not off.phase("actor", "train").layout.share_prompts
    with pytest.raises(SpecError, match="do not share prompts"):
        plan_of("ppo", "qwen2.5-1.5b", "1x8xH100", pins=parse_pins(["critic.train.share_prompts=true"]))


def test_a_pinned_gpu_memory_utilization_bounds_the_engine_and_its_cache():
    w = WorkloadSpec(prompts=64, response_len=2048, mean_response_len=600)
    free, _, _ = plan_of("grpo", "qwen2.5-7b", "1x8xH100", workload=w)
    gp = free.phase("actor", "generate")
    assert not gp.gpu_memory_utilization_pinned and gp.memory.kv_cache > 0
    # planned: the engine's weights, the cache's peak and buffers, as a share of the device
    own = gp.memory.total - gp.memory.other_roles
    assert gp.gpu_memory_utilization == pytest.approx(own / gp.capacity_gb, abs=1e-3)
    assert any("gpu_memory_utilization" in line and "(planned" in line for line in free.why)
    # pinned below that: the engine, cache included, stays within the share, and the cache runs out
    util = round(0.8 * gp.gpu_memory_utilization, 3)
    pinned, _, _ = plan_of(
        "grpo", "qwen2.5-7b", "1x8xH100", workload=w, pins=parse_pins([f"actor.generate.gpu_memory_utilization={util}"])
    )
    pp = pinned.phase("actor", "generate")
    assert pp.gpu_memory_utilization == util and pp.gpu_memory_utilization_pinned
    assert pp.memory.total - pp.memory.other_roles <= util * pp.capacity_gb + 1e-6
    assert pp.time_s > gp.time_s and any("(pinned)" in line and "preemptions" in line for line in pinned.why)
    with pytest.raises(InfeasibleError, match=r"the pinned gpu_memory_utilization=0.02 gives its engine 1.5 GB of 76.0 GB"):
        plan_of("grpo", "qwen2.5-7b", "1x8xH100", workload=w, pins=parse_pins(["actor.generate.gpu_memory_utilization=0.02"]))
    # vLLM takes its whole pinned share: a share that does not fit beside the state that stays is refused
    stays = Pins(sleep_colocated=False)  # as flowc run plans: the co-located state stays on the device
    together = ["colocate=actor.train,actor.gen,ref"]
    ok, _, _ = plan_of(
        "grpo",
        "qwen2.5-7b",
        "1x8xH100",
        workload=w,
        pins=parse_pins([*together, f"actor.generate.gpu_memory_utilization={util}"]).merged(stays),
    )
    assert ok.phase("actor", "generate").gpu_memory_utilization == util
    # (offloaded, the co-located roles would keep nothing on the device: the share would fit)
    resident = ["actor.train.offload_params=false", "ref.forward.offload_params=false"]
    with pytest.raises(InfeasibleError, match="no co-location fits on 8 devices"):
        plan_of(
            "grpo",
            "qwen2.5-7b",
            "1x8xH100",
            workload=w,
            pins=parse_pins([*together, *resident, "actor.generate.gpu_memory_utilization=0.95"]).merged(stays),
        )
    # an engine that takes no share of the device: refused with the reason, not shown as "(pinned)" and ignored
    with pytest.raises(
        InfeasibleError, match=r"the hf engine allocates as it goes: drop the pin, or pin actor.generate.backend=vllm"
    ):
        plan_of(
            "grpo",
            "qwen2.5-7b",
            "1x8xH100",
            pins=parse_pins(["actor.generate.backend=hf", f"actor.generate.gpu_memory_utilization={util}"]),
        )
    with pytest.raises(InfeasibleError, match=r"vLLM on CPUs is given its KV cache in bytes: drop the pin"):
        plan_of(
            "grpo",
            "flowc-tiny",
            "1x2xcpu",
            pins=parse_pins(["actor.generate.backend=vllm", "actor.generate.gpu_memory_utilization=0.5"]),
        )
    with pytest.raises(SpecError, match="only a generation engine has one"):
        parse_pin("actor.train.gpu_memory_utilization=0.5")
    with pytest.raises(SpecError, match="less than or equal to 1"):
        parse_pin("actor.generate.gpu_memory_utilization=1.5")


def test_yaml_fragment_pins(tmp_path):
    f = tmp_path / "pins.yaml"
    f.write_text("roles:\n  actor:\n    generate: {tp: 4}\ncolocate: [[actor.train, ref], [actor.gen]]\n")
    r = flowc("plan", "examples/grpo.py", "--model", "actor=qwen2.5-7b", "--cluster", "8xH100", "--pin", str(f), "--json")
    d = json.loads(r.stdout)
    assert d["roles"]["actor"]["phases"]["generate"]["tp"] == 4
    assert sorted(p["name"] for p in d["pools"]) == ["actor.gen", "actor.train+ref"]
    assert any(rs["method"] in ("p2p", "broadcast") for rs in d["reshards"])


def test_saved_plan_round_trips(tmp_path):
    out = tmp_path / "plan.json"
    flowc("plan", "examples/ppo.py", "--model", "actor=llama-3.1-70b", "--cluster", "16x8xA100", "--out", str(out))
    saved = out.read_text()
    assert Plan.from_json(saved).to_json() + "\n" == saved
    again = flowc("plan", "examples/ppo.py", "--plan", str(out), "--json").stdout
    assert json.loads(again) == json.loads(saved)


def test_impossible_request_says_what_and_what_would_fit():
    with pytest.raises(InfeasibleError) as info:
        plan_of("ppo", "llama-3.1-405b", "1x8xA100")
    e = info.value
    assert "actor.train" in e.what and "actor.gen" in e.what and "GB" in e.what
    assert "--cluster" in e.fix
    r = flowc(
        "plan",
        "examples/ppo.py",
        "--model",
        "actor=llama-3.1-70b",
        "--cluster",
        "1x8xA100",
        "--workload",
        "response_len=8192",
        check=False,
    )
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "does not fit" in r.stderr or "no co-location fits" in r.stderr
    assert "fix:" in r.stderr


def test_models_default_sensibly():
    g = load_flow(str(EXAMPLES / "ppo.py")).trace()
    models, notes = resolve_models(g, {"actor": "qwen2.5-7b", "rm": "qwen2.5-1.5b"})
    assert models["ref"].name == "qwen2.5-7b" and models["critic"].name == "qwen2.5-7b" and models["rm"].name == "qwen2.5-1.5b"
    assert any("ref" in n for n in notes)
    with pytest.raises(SpecError, match="no model given for policy role 'actor'"):
        resolve_models(g, {"critic": "qwen2.5-7b"})
    with pytest.raises(SpecError, match="did you mean 'actor'"):
        resolve_models(g, {"actr": "qwen2.5-7b"})


def test_moe_and_huge_models_use_expert_and_pipeline_parallelism():
    plan, _, _ = plan_of("grpo", "qwen3-30b-a3b", "2x8xH100")
    train = plan.roles["actor"].phases["train"]
    assert train.layout.backend == "megatron" or train.layout.fsdp
    plan, _, _ = plan_of("grpo", "deepseek-v3", "12x8xH800", WorkloadSpec(prompts=256, prompt_len=1024, response_len=2048))
    train = plan.roles["actor"].phases["train"]
    assert train.layout.backend == "megatron" and (train.pp > 1 or train.ep > 1)
    assert plan.roles["actor"].active_params_b < plan.roles["actor"].params_b / 10


GOLDEN = [
    ("grpo", "qwen2.5-7b", "1x8xH100", "prompts=256,prompt_len=512,response_len=1024"),
    ("ppo", "llama-3.1-70b", "16x8xA100", "prompts=1024,prompt_len=1024,response_len=1024"),
    ("rloo", "qwen2.5-1.5b", "1x4xA100", "prompts=128,prompt_len=256,response_len=512"),
    ("remax", "flowc-tiny", "1x2xcpu", "prompts=16,prompt_len=8,response_len=8"),
]


@pytest.mark.parametrize("flow", FLOWS)
def test_every_example_plans_on_a_gpu_node(flow):
    """Each algorithm's flow, with every role a 7B model, on one 8×H100 node (verl's 7B recipes)."""
    plan, _, _ = plan_of(flow, "qwen2.5-7b", "1x8xH100", WorkloadSpec(prompts=256, prompt_len=512, response_len=1024))
    verify_plan(plan)
    g = load_flow(str(EXAMPLES / f"{flow}.py")).trace()
    assert set(plan.roles) == {r for r, info in g.roles.items() if info.kind not in ("reward", "environment")}
    assert plan.predicted.step_time_s > 0 and all(p.layout.backend for r in plan.roles.values() for p in r.phases.values())


def test_dynamic_sampling_prices_the_expected_extra_generation():
    from flowc.passes.units import demands

    g = load_flow(str(EXAMPLES / "dapo.py")).trace()
    w = WorkloadSpec(prompts=64, prompt_len=256, response_len=512)
    d = demands(g, w)
    assert d["actor.generate"].sequences == 2 * 64 * 8  # expected_keep=0.5: two rounds
    assert d["actor.logprobs"].sequences == d["actor.update"].sequences == 64 * 8  # after the filter: one batch
    plan, _, _ = plan_of("dapo", "qwen2.5-7b", "1x8xH100", w)
    assert any("Dynamic sampling (filter_groups): actor.generate priced at 2 rounds" in line for line in plan.why)


@pytest.mark.parametrize("flow,model,cluster,workload", GOLDEN)
def test_golden_plans(flow, model, cluster, workload):
    # on CPUs the generation backend depends on whether vLLM is installed; the golden fixes it
    pins = parse_pins(["actor.generate.backend=hf"]) if cluster.endswith("cpu") else None
    plan, _, _ = plan_of(flow, model, cluster, WorkloadSpec.parse(workload), pins)
    verify_plan(plan)
    check_golden(f"{flow}.plan.txt", format_plan(plan))


def test_export_formats(tmp_path):
    dot = flowc("export", "examples/ppo.py", "--model", "actor=llama-3.1-70b", "--cluster", "16x8xA100", "--format", "dot").stdout
    assert dot.startswith('digraph "ppo"') and "cluster_" in dot and "weights" in dot
    mmd = flowc(
        "export", "examples/ppo.py", "--model", "actor=llama-3.1-70b", "--cluster", "16x8xA100", "--format", "mermaid"
    ).stdout
    assert mmd.startswith("flowchart TD") and "subgraph" in mmd
    svg = tmp_path / "p.svg"
    if shutil.which("dot"):
        flowc(
            "export",
            "examples/ppo.py",
            "--model",
            "actor=llama-3.1-70b",
            "--cluster",
            "16x8xA100",
            "--format",
            "svg",
            "-o",
            str(svg),
        )
        assert "<svg" in svg.read_text()
    env = {**os.environ, "PATH": str(tmp_path)}  # no Graphviz on this PATH
    r = subprocess.run(
        [sys.executable, "-m", "flowc.cli", "export", "examples/grpo.py", "--format", "svg", "-o", str(svg)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    assert r.returncode == 1 and "apt-get install graphviz" in r.stderr


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (.ci/run installs Debian's chromium)")
def test_html_export_opens_in_a_real_browser(tmp_path):
    page = tmp_path / "plan.html"
    flowc(
        "export",
        "examples/ppo.py",
        "--model",
        "actor=llama-3.1-70b",
        "--cluster",
        "16x8xH100",
        "--format",
        "html",
        "-o",
        str(page),
    )
    plan = json.loads(
        flowc("plan", "examples/ppo.py", "--model", "actor=llama-3.1-70b", "--cluster", "16x8xH100", "--json").stdout
    )
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
    ]
    r = subprocess.run([CHROMIUM, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    dom = r.stdout
    assert 'data-ready="ok"' in dom, "the page's script did not finish: " + r.stderr[-2000:]
    assert '<div id="errors"></div>' in dom, "the page reported a script error"
    for role in ("actor", "critic", "ref", "rm"):
        assert f"{role}.train" in dom or f"{role}.forward" in dom
    assert f"{plan['predicted']['step_time_s']:.2f} s" in dom
    assert f"{len(plan['alternatives'])} alternatives" in dom  # filled in by the script


def _plan_pinned(model: str, cluster: str, *pins: str):
    from flowc.ir.cluster import ClusterSpec
    from flowc.ir.models import ModelSpec
    from flowc.ir.workload import WorkloadSpec
    from flowc.passes.pins import parse_pins
    from flowc.passes.pipeline import make_plan

    g = load_flow(str(EXAMPLES / "grpo.py")).trace()
    m = ModelSpec.resolve(model)
    return make_plan(g, {"actor": m, "ref": m}, ClusterSpec.parse(cluster), WorkloadSpec(), parse_pins(list(pins)))[0]


def test_generation_tensor_parallelism_crosses_nodes():
    """verl and NeMo-RL generate 70B on H20 with tp 16 (two nodes): it can be pinned, and its
    weight sync is priced over the inter-node link (issue 14, defect 4)."""
    plan = _plan_pinned("llama-3.1-70b", "2x8xH20", "actor.generate.tp=16")
    gen = plan.roles["actor"].phases["generate"]
    assert gen.tp == 16 and gen.device_count == 16
    assert plan.generation_sync("actor").link == "inter-node"


@pytest.mark.parametrize(
    "cluster,pin,reason",
    [
        ("2x8xH20", "actor.generate.tp=12", "tp=12 does not divide the 16 devices"),
        ("3x8xH20", "actor.generate.tp=12", "tp=12 over nodes must be a whole number of nodes"),
        ("1x6xH20", "actor.generate.tp=3", "does not divide llama-3.1-70b's 64 attention heads"),
        ("1x8xH20", "actor.train.tp=16", "tp=16 does not divide the 8 devices"),
    ],
)
def test_a_refused_pin_names_the_constraint_that_failed(cluster, pin, reason):
    from flowc.errors import InfeasibleError

    with pytest.raises(InfeasibleError) as e:
        _plan_pinned("llama-3.1-70b", cluster, pin)
    assert reason in e.value.what, e.value.what
    assert "change or drop the pins" in (e.value.fix or "")


def test_the_fix_it_search_is_bounded_and_says_what_it_tried(monkeypatch):
    """An infeasible request on a large cluster answers in bounded time: the probes stop at the
    budget and the fix says so (issue 14, defect 6)."""
    from flowc.errors import InfeasibleError
    from flowc.passes import diagnose

    monkeypatch.setattr(diagnose, "BUDGET_S", 0.0)
    with pytest.raises(InfeasibleError) as e:
        _plan_pinned("llama-3.1-405b", "32x8xH100", "actor.train.tp=3")
    assert "stopped looking for a fix after 0 s" in (e.value.fix or ""), e.value.fix


def test_micro_batches_are_token_budgets_where_the_backend_bins_rows():
    """fsdp2 and Megatron without a pipeline cut micro-batches by tokens: ``micro_batch`` rows
    of the longest length (what memory is priced at), shown as a budget in ``why`` and the
    plan text; Megatron's pipeline pads every micro-batch to one shape, so it keeps rows. A
    pinned budget is honoured, and a pinned 0 keeps rows (issue 14)."""
    w = WorkloadSpec(prompts=64, prompt_len=512, response_len=2048, mean_response_len=600)
    plan, _, _ = plan_of("grpo", "qwen2.5-7b", "1x8xH100", w, parse_pins(["actor.train.backend=fsdp2"]))
    train = plan.roles["actor"].phases["train"].layout
    assert train.micro_tokens == train.micro_batch * (512 + 2048) // train.cp
    assert f"mb≤{train.micro_tokens}tok" in format_plan(plan)
    pinned, _, _ = plan_of(
        "grpo", "qwen2.5-7b", "1x8xH100", w, parse_pins(["actor.train.micro_tokens=8192", "actor.train.backend=fsdp2"])
    )
    lay = pinned.roles["actor"].phases["train"].layout
    assert (lay.micro_tokens, lay.micro_batch) == (8192, 3)
    rows, _, _ = plan_of("grpo", "qwen2.5-7b", "1x8xH100", w, parse_pins(["actor.train.micro_tokens=0"]))
    assert rows.roles["actor"].phases["train"].layout.micro_tokens == 0
    piped = _plan_pinned("qwen2.5-7b", "1x8xH100", "actor.train.backend=megatron", "actor.train.pp=2")
    assert piped.roles["actor"].phases["train"].layout.micro_tokens == 0


def test_a_token_budget_is_priced_faster_than_rows_when_responses_vary():
    """With responses far shorter than their limit on average, the same plan with row
    micro-batches pays for the padding; pinned rows are predicted slower (rows padded, not
    packed: packing removes the padding either way)."""
    w = WorkloadSpec(prompts=64, prompt_len=512, response_len=4096, mean_response_len=800)
    padded = ["actor.train.backend=fsdp2", "actor.train.pack_sequences=false"]
    budget, _, _ = plan_of("grpo", "qwen2.5-7b", "1x8xH100", w, parse_pins(padded))
    rows, _, _ = plan_of("grpo", "qwen2.5-7b", "1x8xH100", w, parse_pins([*padded, "actor.train.micro_tokens=0"]))
    t_budget = budget.roles["actor"].phases["train"].time_s
    t_rows = rows.roles["actor"].phases["train"].time_s
    assert t_budget < t_rows


def test_packed_rows_are_priced_without_padding_and_said_so():
    """fsdp2 packs its rows (no padding computed); the plan shows ``pk`` and why says what it
    saves; pinned off, the same layout pays for the padding; Megatron never packs."""
    w = WorkloadSpec(prompts=64, prompt_len=512, response_len=4096, mean_response_len=800)
    pins = ["actor.train.backend=fsdp2", "actor.train.share_prompts=false"]
    packed, _, _ = plan_of("grpo", "qwen2.5-7b", "1x8xH100", w, parse_pins(pins))
    padded, _, _ = plan_of("grpo", "qwen2.5-7b", "1x8xH100", w, parse_pins([*pins, "actor.train.pack_sequences=false"]))
    lay = packed.roles["actor"].phases["train"].layout
    assert lay.pack_sequences and not padded.roles["actor"].phases["train"].layout.pack_sequences
    assert packed.roles["actor"].phases["train"].time_s < padded.roles["actor"].phases["train"].time_s
    assert "[packed" in lay.short() or ", packed" in lay.short()
    assert any("packed sequences" in line and "padding not computed" in line for line in packed.why)
    mega, _, _ = plan_of("grpo", "qwen2.5-7b", "1x8xH100", w, parse_pins(["actor.train.backend=megatron"]))
    assert not mega.roles["actor"].phases["train"].layout.pack_sequences


def test_a_saved_plan_with_a_token_budget_replans_for_another_workload():
    """A saved plan pins its budget, not the rows it made of it: re-planned for shorter
    responses (``--plan saved.json --workload …``), its micro-batch rows follow."""
    from flowc.passes.pins import pins_from_plan

    w = WorkloadSpec(prompts=64, prompt_len=512, response_len=2048)
    saved, _, _ = plan_of("grpo", "qwen2.5-7b", "1x8xH100", w, parse_pins(["actor.train.backend=fsdp2"]))
    lay = saved.roles["actor"].phases["train"].layout
    assert lay.micro_tokens > 0
    shorter = WorkloadSpec(prompts=64, prompt_len=512, response_len=1024)
    again, _, _ = plan_of("grpo", "qwen2.5-7b", "1x8xH100", shorter, pins_from_plan(saved))
    got = again.roles["actor"].phases["train"].layout
    assert got.micro_tokens == lay.micro_tokens and got.micro_batch == lay.micro_tokens // (512 + 1024)
