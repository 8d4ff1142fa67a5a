"""Runtime pieces that need no cluster: lowering, rows, data, rewards, sampling."""

from __future__ import annotations

import pytest
import torch
from helpers import EXAMPLES

from flowc.errors import DataError, PlanError
from flowc.ir.cluster import ClusterSpec
from flowc.ir.models import ModelSpec
from flowc.ir.plan import Plan
from flowc.ir.sampling import SamplingParams
from flowc.ir.workload import WorkloadSpec
from flowc.loader import load_flow
from flowc.passes.pins import pins_from_plan
from flowc.passes.pipeline import make_plan
from flowc.runtime.batches import Sharded, cat_rows, even_split, repeat_rows, slice_rows
from flowc.runtime.data import Records, call_reward, tokenize_prompts
from flowc.runtime.program import lower
from flowc.runtime.sampling import process_logits
from flowc.tasks import arithmetic as arith


def planned(flow: str, cluster: str = "1x8xH100", model: str = "qwen2.5-7b"):
    g = load_flow(str(EXAMPLES / f"{flow}.py")).trace()
    m = ModelSpec.resolve(model)
    plan, pg, _ = make_plan(
        g, {r: m for r, i in g.roles.items() if i.kind != "reward"}, ClusterSpec.parse(cluster), WorkloadSpec(prompts=64)
    )
    return g, plan, pg


def test_lowering_lists_groups_engines_and_steps():
    _, plan, pg = planned("ppo", "2x8xH100")
    prog = lower(plan, pg)
    ops = [s.op for s in prog.steps]
    assert ops.count("update") == 2 and "weight_sync" in ops and ops[0] == "input"
    assert sum(gr.size for gr in prog.groups) == 16
    engines = {(e.role, e.engine) for gr in prog.groups for e in gr.engines}
    assert {("actor", "train"), ("actor", "rollout"), ("critic", "train"), ("ref", "forward"), ("rm", "forward")} <= engines
    for s in prog.steps:
        assert (s.group is None) == (s.op in ("input", "reward", "compute"))
    text = str(prog)
    assert "program ppo" in text and "weight_sync" in text


def test_saved_plan_relowers_to_the_same_program():
    g, plan, pg = planned("grpo")
    again = Plan.from_json(plan.to_json())
    assert again == plan
    # a saved plan, re-planned with its decisions pinned, lowers to the same program
    replan, pg2, _ = make_plan(
        g,
        {r: ModelSpec.resolve("qwen2.5-7b") for r in ("actor", "ref")},
        ClusterSpec.parse("1x8xH100"),
        WorkloadSpec(prompts=64),
        pins_from_plan(again),
    )
    assert str(lower(again, pg2)) == str(lower(plan, pg)) == str(lower(replan, pg2))


def test_lowering_needs_the_planned_graph():
    g, plan, _ = planned("grpo")
    with pytest.raises(PlanError, match="planned graph"):
        lower(plan, g)


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


def test_the_rollout_backend_is_vllm_where_installed_and_rollout_overrides(monkeypatch):
    import importlib.util

    from flowc.errors import SpecError
    from flowc.loader import load_flow
    from flowc.run import rollout_backend, runtime_pins
    from flowc.runtime.vllm_rollout import request_seed

    real = importlib.util.find_spec

    def without_vllm(name, *a):
        return None if name == "vllm" else real(name, *a)

    g = load_flow(str(EXAMPLES / "grpo.py")).trace()
    monkeypatch.setattr(importlib.util, "find_spec", without_vllm)
    assert rollout_backend(None, "cpu") == "hf"
    assert rollout_backend(None, "H100") == "vllm"  # GPUs always generate with vLLM
    with pytest.raises(SpecError, match="not installed"):
        rollout_backend("vllm", "cpu")
    with pytest.raises(SpecError, match="not a rollout backend"):
        rollout_backend("sglang", "cpu")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "vllm" else real(name, *a))
    assert rollout_backend(None, "cpu") == "vllm"
    assert rollout_backend("hf", "cpu") == "hf"
    pins = runtime_pins(g, None, "cpu").roles["actor"]["generate"]
    assert pins.backend == "vllm" and pins.tp == 1  # vLLM on CPU: replicas only
    assert runtime_pins(g, None, "H100").roles["actor"]["generate"].tp is None  # on GPUs the planner picks tp
    # per-request seeds: stable, and different for every sample of every row
    seeds = {request_seed(0, 3, r, i, j) for r in range(2) for i in range(16) for j in range(8)}
    assert len(seeds) == 2 * 16 * 8 and request_seed(0, 3, 1, 2, 3) == request_seed(0, 3, 1, 2, 3)


@pytest.mark.parametrize(
    "flow,models,cluster",
    [
        ("ppo.py", ["actor", "critic", "ref", "rm"], "4x8xH100"),  # 70B PPO: four 70B roles
        ("grpo.py", ["actor", "ref"], "2x8xH100"),  # MoE GRPO
    ],
)
def test_runtime_accepts_the_megatron_plans_of_large_models(flow, models, cluster):
    """`flowc plan` picks megatron for these; planned within the runtime's limits
    the plan keeps it, lowers, and every megatron engine's degrees pass the
    backend's own checks (they cover the pool and split the model)."""
    from flowc.ir.cluster import ClusterSpec
    from flowc.ir.models import ModelSpec
    from flowc.ir.workload import WorkloadSpec
    from flowc.loader import load_flow
    from flowc.passes.pipeline import make_plan
    from flowc.run import runtime_pins
    from flowc.runtime.megatron_engine import check_layout
    from flowc.runtime.megatron_weights import megatron_spec
    from flowc.runtime.program import lower
    from flowc.runtime.ranks import output_ranks, replica_of

    name = "llama-3.1-70b" if flow == "ppo.py" else "qwen3-30b-a3b"
    g = load_flow(str(EXAMPLES / flow)).trace()
    specs = {r: ModelSpec.resolve(name) for r in models}
    cl, wl = ClusterSpec.parse(cluster), WorkloadSpec()
    free, _, _ = make_plan(g, specs, cl, wl, None)
    plan, planned, _ = make_plan(g, specs, cl, wl, runtime_pins(g, "vllm", cl.device))
    for p in (free, plan):
        assert p.roles["actor"].phases["train"].layout.backend == "megatron"

    def layouts(p):
        return {(r, ph): x.layout for r, rp in p.roles.items() for ph, x in rp.phases.items()}

    assert layouts(free) == layouts(plan)  # the runtime's limits keep every role's layout
    # ... and only the weight-sync methods the runtime implements (whole tensors into vLLM's reload)
    assert {r.method for r in plan.reshards} <= {"in_place", "full_allgather", "broadcast", "micro_dp_allgather"}
    from flowc.ir.models import catalogue

    arch = megatron_spec(catalogue()[name])
    program = lower(plan, planned)
    seen = 0
    for group in program.groups:
        for e in group.engines:
            if e.backend != "megatron":
                continue
            seen += 1
            check_layout(arch, e.layout, group.size)
            replicas = replica_of(e.layout)
            assert sorted(set(replicas)) == list(range(e.layout.dp))
            assert all(replicas[r] == i for i, r in enumerate(output_ranks(e.layout)))
    assert seen >= 2
