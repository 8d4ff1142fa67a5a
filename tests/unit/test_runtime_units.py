"""Runtime pieces that need no cluster: lowering, rows, data, rewards, sampling."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from helpers import EXAMPLES

from flowc.errors import DataError, IRError, PlanError, VerificationError
from flowc.ir.cluster import ClusterSpec
from flowc.ir.models import ModelSpec
from flowc.ir.ops import Op
from flowc.ir.plan import Plan
from flowc.ir.run_config import RunConfig
from flowc.ir.sampling import SamplingParams
from flowc.ir.workload import WorkloadSpec
from flowc.loader import load_flow
from flowc.passes.costs import Hw
from flowc.passes.pins import Pins, parse_pins, pins_from_plan
from flowc.passes.pipeline import make_plan
from flowc.planning import run_target, runtime_pins
from flowc.runtime.batches import INLINE_BYTES, Inline, Sharded, assemble, cat_rows, even_split, nbytes, repeat_rows, slice_rows
from flowc.runtime.data import Records, call_reward, tokenize_prompts
from flowc.runtime.program import lower
from flowc.runtime.sampling import process_logits
from flowc.tasks import arithmetic as arith


def planned(flow: str, cluster: str = "1x8xH100", model: str = "qwen2.5-7b", pins: Pins | None = None):
    """A plan within what the runtime executes (as flowc run plans)."""
    g = load_flow(str(EXAMPLES / f"{flow}.py")).trace()
    m = ModelSpec.resolve(model)
    cl = ClusterSpec.parse(cluster)
    plan, pg, _ = make_plan(
        g,
        {r: m for r, i in g.roles.items() if i.kind not in ("reward", "environment")},
        cl,
        WorkloadSpec(prompts=64),
        runtime_pins(cl.profile.kind).merged(pins or Pins()),
        target=run_target(cl, RunConfig(), None, here=False),
    )
    return g, plan, pg


def test_lowering_lists_groups_engines_and_steps():
    _, plan, pg = planned("ppo", "2x8xH100")
    prog = lower(plan)
    assert prog.graph == pg and prog.target == plan.target and prog.workload.prompts == 64
    ops = [s.op for s in prog.steps]
    assert ops.count("update") == 2 and "weight_sync" in ops and ops[0] == "input"
    assert sum(gr.size for gr in prog.groups) == 16
    engines = {(e.role, e.key.kind) for gr in prog.groups for e in gr.engines}
    assert {("actor", "train"), ("actor", "rollout"), ("critic", "train"), ("ref", "forward"), ("rm", "forward")} <= engines
    for s in prog.steps:
        assert (s.group is None) == (s.op in ("input", "reward", "compute"))
        assert (s.engine is None) == (s.group is None)
    (sync,) = prog.steps_of(Op.WEIGHT_SYNC)
    r = plan.generation_sync("actor")
    assert sync.args["method"] == r.method and sync.args["bytes_predicted"] == r.bytes_per_device
    text = str(prog)
    assert "program ppo" in text and "weight_sync" in text and "target gpu bfloat16 nccl" in text


def test_saved_plan_relowers_to_the_same_program():
    g, plan, _pg = planned("grpo")
    again = Plan.from_json(plan.to_json())
    assert again == plan
    # a saved plan, re-planned with its decisions pinned, lowers to the same program
    replan, _pg2, _ = make_plan(
        g,
        {r: ModelSpec.resolve("qwen2.5-7b") for r in ("actor", "ref")},
        ClusterSpec.parse("1x8xH100"),
        WorkloadSpec(prompts=64),
        pins_from_plan(again),
        target=again.target,
    )
    assert str(lower(again)) == str(lower(plan)) == str(lower(replan))


def test_lowering_verifies_the_plan_and_refuses_what_the_runtime_does_not_execute():
    """lower() runs the plan's verifier and checks every decision against the backend registry:
    a decision it cannot honour fails up front, naming it, instead of running something else."""
    _, plan, _ = planned("grpo", "2x8xH100", pins=parse_pins(["colocate=actor.train,ref;actor.gen"]))
    d = json.loads(plan.to_json())
    assert plan.generation_sync("actor").method == "broadcast"

    def edited(change) -> Plan:
        x = copy.deepcopy(d)
        change(x)
        return Plan.model_validate(x)

    def p2p(x):  # the planner's unrestricted choice for separate pools: not implemented by the runtime
        x["reshards"][0]["method"] = "p2p"
        next(n for n in x["graph"]["nodes"] if n["op"] == "weight_sync")["kwargs"]["method"] = "p2p"

    with pytest.raises(PlanError, match="does not implement"):
        lower(edited(p2p))

    def gen_pp(x):
        for ph in ("generate",):
            lay = x["roles"]["actor"]["phases"][ph]
            lay["pp"], lay["dp"], lay["layout"]["pp"], lay["layout"]["dp"] = 2, lay["dp"] // 2, 2, lay["layout"]["dp"] // 2

    with pytest.raises(PlanError, match="pp=1"):
        lower(edited(gen_pp))

    def fsdp_tp(x):
        lay = x["roles"]["ref"]["phases"]["forward"]
        lay["layout"].update(backend="fsdp2", tp=2, dp=lay["dp"] // 2, pp=1, fsdp=True)
        lay.update(tp=2, dp=lay["dp"] // 2, pp=1)

    with pytest.raises(PlanError, match="fsdp2 backend executes"):
        lower(edited(fsdp_tp))

    def gen_on_trainer(x):
        x["roles"]["actor"]["phases"]["generate"]["layout"]["backend"] = "fsdp2"

    with pytest.raises(PlanError, match="needs a rollout backend"):
        lower(edited(gen_on_trainer))

    def unsynced(x):  # the traced graph instead of the planned one: a trained policy without its weight_sync
        x["graph"]["nodes"] = [n for n in x["graph"]["nodes"] if n["op"] != "weight_sync"]
        x["graph"]["edges"] = [e for e in x["graph"]["edges"] if e["src"] != "actor.weight_sync"]

    with pytest.raises(IRError):
        lower(edited(unsynced))

    def degrees(x):
        x["roles"]["ref"]["phases"]["forward"]["layout"]["dp"] += 1

    with pytest.raises(VerificationError, match="degrees"):
        lower(edited(degrees))

    def asleep(x):  # the planner's swap of co-located training state: not done by the runtime
        x["roles"]["actor"]["phases"]["generate"]["sleeps_colocated"] = True

    with pytest.raises(PlanError, match="asleep in host memory"):
        lower(edited(asleep))

    def optimizer_only_offload(x):  # FSDP2's CPUOffloadPolicy has no optimizer-only mode
        for ph in ("train", "forward"):  # a trained role's forward runs on its training engine: the same layout
            phase = x["roles"]["actor"]["phases"][ph]
            phase.update(tp=1, pp=1, cp=1, ep=1, dp=8)
            phase["layout"].update(
                backend="fsdp2", tp=1, pp=1, cp=1, ep=1, dp=8, fsdp=True, offload_optimizer=True, offload_params=False
            )

    if d["roles"]["actor"]["phases"]["train"]["device_count"] == 8:
        with pytest.raises(PlanError, match="only together with the parameters"):
            lower(edited(optimizer_only_offload))


def test_a_trained_roles_forward_phase_must_run_on_its_training_engine():
    _, plan, _ = planned("ppo", "2x8xH100")
    d = json.loads(plan.to_json())
    fw, tr = d["roles"]["critic"]["phases"]["forward"], d["roles"]["critic"]["phases"]["train"]
    assert fw["layout"] == tr["layout"] and fw["pool"] == tr["pool"]
    fw["layout"]["micro_batch"] = tr["layout"]["micro_batch"] * 2
    with pytest.raises(PlanError, match=r"critic\.forward is planned"):
        lower(Plan.model_validate(d))


def test_the_runtime_plans_never_sleep_colocated_state_and_fsdp2_offloads_all_or_nothing():
    """Within the runtime's pins the planner does not offer what the runtime does not execute."""
    g, plan, _ = planned("grpo", "1x8xH100", model="qwen2.5-72b")
    c, m = ClusterSpec.parse("1x8xH100"), ModelSpec.resolve("qwen2.5-14b")
    w = WorkloadSpec.parse("prompts=256,response_len=4096")  # a KV cache that wants the whole device
    free, _, _ = make_plan(g, {"actor": m, "ref": m}, c, w, Pins(), target=plan.target)
    assert free.phase("actor", "generate").sleeps_colocated  # unrestricted, the planner swaps the training state out
    within, _, _ = make_plan(g, {"actor": m, "ref": m}, c, w, runtime_pins("gpu"), target=plan.target)
    assert not within.phase("actor", "generate").sleeps_colocated
    for flow, model in (("grpo", "qwen2.5-72b"), ("ppo", "qwen2.5-32b")):
        _, plan, _ = planned(flow, "1x8xH100", model=model)
        for rp in plan.roles.values():
            for ph in rp.phases.values():
                assert not ph.sleeps_colocated
                if ph.layout.backend == "fsdp2":
                    assert ph.layout.offload_params or not ph.layout.offload_optimizer
        lower(plan)


def test_a_rollout_engine_gets_the_plans_share_of_the_device():
    _, plan, _ = planned("grpo", "1x8xH100")
    prog = lower(plan)
    ge = plan.phase("actor", "generate")
    (rollout,) = [e for g in prog.groups for e in g.engines if e.key.kind == "rollout"]
    own = ge.memory.total - ge.memory.other_roles
    assert 0.05 <= rollout.memory_fraction <= 0.95 and not ge.gpu_memory_utilization_pinned
    assert rollout.memory_fraction == ge.gpu_memory_utilization  # the plan's, as the runtime passes it to vLLM
    assert rollout.memory_fraction == pytest.approx(min(0.95, max(0.05, own / ge.capacity_gb)), abs=1e-3)
    assert all(e.memory_fraction == 0.0 for g in prog.groups for e in g.engines if e.key.kind != "rollout")
    # and the batch the plan priced: vLLM's max_num_seqs from the profile (the HF loop's padded waves have none)
    assert ge.max_num_seqs == rollout.max_num_seqs == Hw.of(ClusterSpec.parse("1x8xH100")).rollout_cost("vllm").max_seqs == 1024
    assert all(e.max_num_seqs == 0 for g in prog.groups for e in g.engines if e.key.kind != "rollout")
    _, hf, _ = planned("grpo", "1x8xH100", pins=parse_pins(["actor.generate.backend=hf"]))
    assert hf.phase("actor", "generate").max_num_seqs == 0
    # pinned, the engine gets the pinned share, and a re-plan from the saved plan keeps the pin
    _, pinned, _ = planned("grpo", "1x8xH100", pins=parse_pins(["actor.generate.gpu_memory_utilization=0.4"]))
    gp = pinned.phase("actor", "generate")
    assert gp.gpu_memory_utilization == 0.4 and gp.gpu_memory_utilization_pinned
    assert [e.memory_fraction for g in lower(pinned).groups for e in g.engines if e.key.kind == "rollout"] == [0.4]
    assert pins_from_plan(pinned).phase("actor", "generate").gpu_memory_utilization == 0.4
    assert pins_from_plan(plan).phase("actor", "generate").gpu_memory_utilization is None  # planned: re-planned
    # a plan saved before it had the field: the share is what the plan gives the engine
    old = Plan.model_validate(json.loads(plan.model_dump_json()))
    body = old.model_dump()
    body["roles"]["actor"]["phases"]["generate"].pop("gpu_memory_utilization")
    body["roles"]["actor"]["phases"]["generate"].pop("gpu_memory_utilization_pinned")
    (legacy,) = [e for g in lower(Plan.model_validate(body)).groups for e in g.engines if e.key.kind == "rollout"]
    assert legacy.memory_fraction == rollout.memory_fraction


def test_a_plan_for_a_remote_cluster_lowers_without_its_backends_installed_here(monkeypatch):
    import importlib.util

    _, plan, _ = planned("grpo", "1x8xH100")
    assert plan.phase("actor", "generate").layout.backend == "vllm"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(PlanError, match="not installed here"):
        lower(plan)
    lower(plan, here=False)  # its workers import vllm themselves


def test_generation_longer_than_the_plan_is_refused():
    from flowc.errors import SpecError
    from flowc.runtime.run_checks import check_response_lengths

    _, plan, _ = planned("grpo", "1x8xH100")
    prog = lower(plan)
    check_response_lengths(prog, RunConfig())
    too_long = RunConfig(sampling=SamplingParams(max_tokens=prog.workload.response_len + 1))
    with pytest.raises(SpecError, match="response_len"):
        check_response_lengths(prog, too_long)


def test_rows_slice_join_repeat():
    x = torch.arange(12).view(6, 2)
    assert torch.equal(cat_rows([slice_rows(x, 0, 2), slice_rows(x, 2, 6)]), x)
    assert even_split(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert repeat_rows(["a", "b"], 2) == ["a", "a", "b", "b"]
    s = Sharded(("r0", "r1"), (3, 4))
    pieces = s.pieces(2, 5)
    assert [(p.ref, p.lo, p.hi) for p in pieces] == [("r0", 2, 3), ("r1", 0, 2)]
    assert s.project("response_mask").pieces(0, 1)[0].path == ("response_mask",)


def test_records_are_deterministic_per_step():
    rows = [{"prompt": str(i)} for i in range(10)]
    r = Records(rows)
    assert r.batch(3, 4, seed=1) == r.batch(3, 4, seed=1)
    first_epoch = [x["prompt"] for s in range(5) for x in r.batch(s, 2, seed=1)]
    assert sorted(first_epoch) == sorted(x["prompt"] for x in rows)  # an epoch visits every row once
    with pytest.raises(DataError, match="no 'prompt' column"):
        Records([{"question": "1+1="}])


def test_prompts_too_long_are_an_error():
    tok = arith.build_tokenizer()
    pb = tokenize_prompts(tok, ["1+2=", "12+34="], 8)
    assert pb.input_ids.shape == (2, 8) and not bool(pb.attention_mask[0, 0])
    with pytest.raises(DataError, match="longer than the workload's prompt_len"):
        tokenize_prompts(tok, ["12+34="], 4)


def test_reward_functions_are_checked():
    assert call_reward(arith.exact_match, "em", ["1+1="], ["2"], {"answer": ["2"]}).tolist() == [1.0]

    def raises(prompts, responses):
        raise KeyError("answer")

    with pytest.raises(DataError, match="reward function bad raised KeyError"):
        call_reward(raises, "bad", ["p"], ["r"], {})
    with pytest.raises(DataError, match="returned \\(2,\\) scores for 1 responses"):
        call_reward(lambda p, r: [1.0, 2.0], "two", ["p"], ["r"], {})
    with pytest.raises(DataError, match="not a sequence of numbers"):
        call_reward(lambda p, r: None, "none", ["p"], ["r"], {})


def test_sampling_filters():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    top1 = process_logits(logits, SamplingParams(top_k=1))
    assert torch.isinf(top1[0, 1:]).all() and torch.isfinite(top1[0, 0])
    nucleus = process_logits(logits, SamplingParams(top_p=0.7))
    assert torch.isfinite(nucleus[0, :2]).all() and torch.isinf(nucleus[0, 2:]).all()
    hot = process_logits(logits, SamplingParams(temperature=2.0))
    assert torch.allclose(hot, logits / 2)


def test_task_split_is_disjoint_and_fixed():
    train, held = arith.split()
    assert len(held) == 1000 and len(train) + len(held) == 20000
    assert not {p.prompt for p in train} & {p.prompt for p in held}
    assert arith.split()[1] == held


def test_preference_pairs_tokenize_as_interleaved_rows():
    from flowc.runtime.data import tokenize_pairs
    from flowc.tasks.arithmetic import build_tokenizer

    tok = build_tokenizer()
    r = tokenize_pairs(tok, ["1+2=", "9-9="], ["3", "0"], ["4", "-1"], prompt_len=6, response_len=4)
    assert r.response_ids.shape == (4, 4) and r.prompt_ids.shape == (4, 6)
    texts = [tok.decode(ids[m]) for ids, m in zip(r.response_ids, r.response_mask, strict=True)]
    assert texts == ["3</s>", "4</s>", "0</s>", "-1</s>"]
    assert torch.equal(r.prompt_ids[0], r.prompt_ids[1]) and not torch.equal(r.prompt_ids[1], r.prompt_ids[2])
    with pytest.raises(DataError, match="response_len"):
        tokenize_pairs(tok, ["1+2="], ["3"], ["12345"], prompt_len=6, response_len=4)


def test_minibatches_never_split_a_pair():
    from flowc.runtime.batches import minibatch_rows

    for n, mb, ranks in [(16, 2, 3), (10, 3, 2), (2, 1, 4)]:
        ranges = minibatch_rows(n, mb, ranks, unit=2)
        covered = sorted(i for per in ranges for lo, hi in per for i in range(lo, hi))
        assert covered == list(range(n))
        assert all(lo % 2 == 0 and hi % 2 == 0 for per in ranges for lo, hi in per)


def test_the_rollout_backend_comes_from_the_registry_and_rollout_overrides(monkeypatch):
    """The planner chooses among the rollout backends of the target (installed here, in the
    registry's order of preference); --rollout narrows it to one; the plan records the choice."""
    import importlib.util

    from flowc.errors import SpecError
    from flowc.runtime.backends.rollout import request_seed

    real = importlib.util.find_spec

    def without_vllm(name, *a):
        return None if name == "vllm" else real(name, *a)

    cpu, gpu, cfg = ClusterSpec.parse("local:2"), ClusterSpec.parse("8xH100"), RunConfig()
    monkeypatch.setattr(importlib.util, "find_spec", without_vllm)
    assert run_target(cpu, cfg, None).rollout_backends == ("hf",)
    assert run_target(gpu, cfg, None, here=False).rollout_backends == ("vllm", "hf")  # a cluster elsewhere: every backend
    with pytest.raises(SpecError, match="not installed"):
        run_target(cpu, cfg, "vllm")
    with pytest.raises(SpecError, match="not a rollout backend"):
        run_target(cpu, cfg, "sglang")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    assert run_target(cpu, cfg, None).rollout_backends == ("vllm", "hf")
    assert run_target(cpu, cfg, "hf").rollout_backends == ("hf",)
    pins = runtime_pins("cpu")
    assert pins.limits["vllm"].tp == 1 and pins.limits["fsdp2"].tp == 1  # vLLM on CPU: replicas only
    assert "megatron" not in pins.backends  # Megatron's optimizer needs CUDA
    assert runtime_pins("gpu").limits["vllm"].tp is None and "megatron" in runtime_pins("gpu").backends
    # per-sample seeds: stable, and different for every sample of every row of every round
    seeds = {request_seed(0, 3, k, i, j) for k in range(2) for i in range(16) for j in range(8)}
    assert len(seeds) == 2 * 16 * 8 and request_seed(0, 3, 1, 2, 3) == request_seed(0, 3, 1, 2, 3)


@pytest.mark.parametrize(
    "flow,models,cluster",
    [
        ("ppo.py", ["actor", "critic", "ref", "rm"], "4x8xH100"),  # 70B PPO: four 70B roles
        ("grpo.py", ["actor", "ref"], "2x8xH100"),  # MoE GRPO
    ],
)
def test_runtime_accepts_the_megatron_plans_of_large_models(flow, models, cluster):
    """The actor trained on megatron (pinned: with its slowest pipeline stage priced the free plan
    may prefer fsdp2 for the 70B), planned within the runtime's limits: the plan lowers, and every
    megatron engine's degrees pass the backend's own checks (they cover the pool and split the model)."""
    from flowc.ir.cluster import ClusterSpec
    from flowc.ir.models import ModelSpec
    from flowc.ir.workload import WorkloadSpec
    from flowc.loader import load_flow
    from flowc.passes.pipeline import make_plan
    from flowc.runtime.backends.megatron import check_layout
    from flowc.runtime.megatron_weights import megatron_spec
    from flowc.runtime.program import lower
    from flowc.runtime.ranks import output_ranks, replica_of

    name = "llama-3.1-70b" if flow == "ppo.py" else "qwen3-30b-a3b"
    g = load_flow(str(EXAMPLES / flow)).trace()
    specs = {r: ModelSpec.resolve(name) for r in models}
    cl, wl = ClusterSpec.parse(cluster), WorkloadSpec()
    from flowc.passes.pins import PhasePin

    # the free plan, but without context parallelism (the megatron runtime's own limit, cp = 1)
    mega = {"actor": {"train": PhasePin(backend="megatron")}}
    free, _, _ = make_plan(g, specs, cl, wl, Pins(limits={"megatron": PhasePin(cp=1)}, roles=mega))
    pins = runtime_pins("gpu").model_copy(update={"roles": mega})
    plan, _planned, _ = make_plan(g, specs, cl, wl, pins, target=run_target(cl, RunConfig(), None, here=False))
    for p in (free, plan):
        assert p.roles["actor"].phases["train"].layout.backend == "megatron"

    def layouts(p):
        return {(r, ph): x.layout for r, rp in p.roles.items() for ph, x in rp.phases.items()}

    sleeps = any(ph.sleeps_colocated for rp in free.roles.values() for ph in rp.phases.values())
    if sleeps:  # the runtime cannot sleep a co-located state yet: the engine must fit beside it
        assert not any(ph.sleeps_colocated for rp in plan.roles.values() for ph in rp.phases.values())
    else:
        assert layouts(free) == layouts(plan)  # the runtime's limits keep every role's layout
    # ... and only the weight-sync methods the runtime implements (whole tensors into vLLM's reload)
    assert {r.method for r in plan.reshards} <= {"in_place", "full_allgather", "broadcast", "micro_dp_allgather"}
    from flowc.ir.models import catalogue

    arch = megatron_spec(catalogue()[name])
    program = lower(plan)
    seen = 0
    for group in program.groups:
        for e in group.engines:
            if e.layout.backend != "megatron":
                continue
            seen += 1
            check_layout(arch, e.layout, group.size)
            replicas = replica_of(e.layout)
            assert sorted(set(replicas)) == list(range(e.layout.dp))
            assert all(replicas[r] == i for i, r in enumerate(output_ranks(e.layout)))
    assert seen >= 2


def _node(gpus: int = 0, kind: str | None = None, cpus: int = 16, alive: bool = True) -> dict:
    res = {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **({f"accelerator_type:{kind}": 1} if kind else {})}
    return {"Alive": alive, "Resources": res}


def test_a_ray_clusters_gpu_type_is_read_never_assumed():
    """GPU nodes are counted (a CPU-only head holds none), their type is Ray's accelerator type or
    --device; an unknown or undetected type is refused with the fix, never planned as an H100."""
    from flowc.clusters import cluster_of
    from flowc.errors import SpecError

    head = _node(cpus=8)
    c, gpus = cluster_of([head, _node(8, "H200"), _node(8, "H200"), _node(8, "H200", alive=False)], "ray://x")
    assert gpus and (c.device, c.nodes, c.devices_per_node) == ("H200", 2, 8)
    assert cluster_of([_node(8, "A100")], "x")[0].device == "A100-80GB"
    with pytest.raises(SpecError, match="did not detect") as e:
        cluster_of([head, _node(4)], "x")
    assert "--device" in e.value.fix
    assert cluster_of([head, _node(4)], "x", device="H20")[0].device == "H20"
    with pytest.raises(SpecError, match="mixes GPU types"):
        cluster_of([_node(8, "H100"), _node(8, "H200")], "x")
    with pytest.raises(SpecError, match="no hardware profile"):
        cluster_of([_node(8, "L4")], "x")
    c, gpus = cluster_of([_node(cpus=4), _node(cpus=8)], "x")
    assert not gpus and (c.device, c.nodes, c.devices_per_node) == ("cpu", 2, 4)
    with pytest.raises(SpecError, match="no GPUs"):
        cluster_of([_node(cpus=4)], "x", device="H100")
    with pytest.raises(SpecError, match="no live nodes"):
        cluster_of([_node(8, "H100", alive=False)], "x")


def test_hf_samples_are_a_function_of_each_rows_seed():
    """The hf backend draws token t of row k from a uniform that hashes (seeds[k], t): a row samples
    the same tokens whatever rows share its batch (so on any number of replicas), as vLLM's
    per-request seeds do; the uniforms are uniform."""
    from flowc.runtime.modeling import load_causal_lm
    from flowc.runtime.sampling import sample, uniforms

    m = load_causal_lm(str(arith.asset_dir())).eval()
    ids = torch.randint(3, 16, (8, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(8, 5, dtype=torch.bool)
    seeds = torch.arange(100, 108)
    sp = SamplingParams(temperature=1.5)

    def draw(rows, s):
        return sample(m, ids[rows], mask[rows], sp, max_tokens=6, eos_id=2, pad_id=0, seeds=s).response_ids

    whole = draw(slice(0, 8), seeds)
    assert torch.equal(torch.cat([draw(slice(0, 3), seeds[:3]), draw(slice(3, 8), seeds[3:])]), whole)
    other = seeds.clone()
    other[5] = 999
    changed = draw(slice(0, 8), other)
    same = [i for i in range(8) if torch.equal(changed[i], whole[i])]
    assert set(same) >= set(range(8)) - {5}
    u = uniforms(torch.arange(20_000), 3)
    assert 0 < float(u.min()) and float(u.max()) < 1
    counts = torch.histc(u.float(), bins=10, min=0, max=1)
    chi2 = float(((counts - 2000) ** 2 / 2000).sum())
    assert chi2 < 30  # 9 degrees of freedom: p ≈ 0.0005 at 30


def test_a_cpu_vllm_engine_allocates_the_plans_kv_cache():
    """The plan's KV figure with a 10 % margin; never less than one sequence of max_model_len
    tokens in whole 128-token blocks (vLLM's CPU block) plus vLLM's null block; 1 GiB when the
    plan gave none."""
    from flowc.ir.plan import Layout
    from flowc.runtime.backends import EngineInit
    from flowc.runtime.backends.vllm import cpu_kv_cache_bytes

    base = dict(role="actor", kind="policy", source=str(arith.asset_dir()), layout=Layout(backend="vllm"), seed=0)
    per_token = 2 * 2 * 32 * 2  # k and v × kv heads × head dim × layers of the shipped model, per dtype byte
    planned = EngineInit(**base, dtype="float32", max_model_len=40, kv_cache_bytes=10_000_000)
    assert cpu_kv_cache_bytes(planned) == 11_000_000
    tiny = EngineInit(**base, dtype="bfloat16", max_model_len=200, kv_cache_bytes=1000)
    assert cpu_kv_cache_bytes(tiny) == (256 + 128) * per_token * 2  # a 200-token sequence: two blocks, + the null one
    few = EngineInit(**base, dtype="float32", max_model_len=40, kv_cache_bytes=3 * 128 * per_token * 4)
    assert cpu_kv_cache_bytes(few) == 4 * 128 * per_token * 4  # 3 blocks + 10 % is not a 4th block: one is added
    assert cpu_kv_cache_bytes(EngineInit(**base, dtype="float32", max_model_len=40)) == 2**30


def test_small_values_travel_inline_and_bulk_ones_by_reference():
    """A piece may hold its value (Inline) or a reference; assembling fetches only the references,
    in one call, and joins the rows in order."""
    small = torch.arange(6.0).reshape(3, 2)
    bulk = torch.zeros(INLINE_BYTES // 4 + 1)
    assert nbytes(small) == 24 and nbytes(bulk) > INLINE_BYTES
    assert nbytes(["ab", "c"]) == 3 and nbytes([object()]) > INLINE_BYTES  # unknown sizes count as large
    assert nbytes(bulk[:2]) > INLINE_BYTES  # a view pickles its whole storage
    store = {"r1": torch.full((2, 2), 7.0)}
    fetched: list[list[str]] = []

    def fetch(refs):
        fetched.append(list(refs))
        return [store[r] for r in refs]

    v = Sharded((Inline(small), "r1"), (3, 2))
    got = assemble(v.pieces(1, 5), fetch)
    assert fetched == [["r1"]] and torch.equal(got, torch.cat([small[1:], store["r1"]]))
    fetched.clear()
    assert torch.equal(assemble(Sharded((Inline(small),), (3,)).pieces(0, 3), fetch), small) and fetched == []


def test_a_lean_head_puts_rays_start_methods_back_even_when_init_fails(monkeypatch):
    """While a local head starts, the autoscaler monitor and the API server are not started; the
    methods are Ray's again afterwards, also when ray.init raised; FLOWC_RAY_FULL_HEAD=1 keeps them."""
    import ray

    from flowc.runtime import ray_session

    class FakeNode:
        def start_monitor(self):
            return "monitor"

        def start_api_server(self, **kw):
            return "api"

    monkeypatch.setattr(ray._private.node, "Node", FakeNode)
    with pytest.raises(RuntimeError), ray_session._lean_head():
        assert FakeNode().start_monitor() is None and FakeNode().start_api_server(include_dashboard=False) is None
        raise RuntimeError("ray.init failed")
    assert FakeNode().start_monitor() == "monitor" and FakeNode().start_api_server() == "api"
    monkeypatch.setenv("FLOWC_RAY_FULL_HEAD", "1")
    with ray_session._lean_head():
        assert FakeNode().start_monitor() == "monitor"
