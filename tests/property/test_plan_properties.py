"""Hypothesis over random models, clusters and workloads: every plan the
planner returns verifies, moves every weight shard exactly once to each
generation device that needs it, never below the analytic lower bound, and
the same inputs give the same plan. When nothing fits, the error says which
role and phase."""

from __future__ import annotations

import functools
import itertools
from fractions import Fraction

import pytest
from helpers import EXAMPLES, FLOWS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flowc.errors import InfeasibleError
from flowc.ir.cluster import ClusterSpec
from flowc.ir.models import ModelSpec
from flowc.ir.plan import Layout
from flowc.ir.plan_verify import device_ids, verify_plan
from flowc.ir.verify import verify
from flowc.ir.workload import WorkloadSpec
from flowc.loader import load_flow
from flowc.passes.costs import Hw
from flowc.passes.degrees import divisors
from flowc.passes.flops import Demand
from flowc.passes.fronts import FRONT_LIMIT, UnitOption, pareto
from flowc.passes.generation_costs import generation_weights_gb
from flowc.passes.options import OptionTable
from flowc.passes.pins import Pins
from flowc.passes.pipeline import make_plan
from flowc.passes.reshard import _cut, deliveries, gen_shards, part_bytes
from flowc.passes.train_costs import forward_cost
from flowc.passes.units import demands, units_of


@functools.cache
def graph(name: str, **hyper):
    return load_flow(str(EXAMPLES / f"{name}.py")).trace(**hyper)


@st.composite
def models(draw):
    if draw(st.booleans()):
        return ModelSpec.resolve(
            draw(st.sampled_from(["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "llama-3.1-8b", "qwen3-30b-a3b", "mixtral-8x7b"]))
        )
    heads = draw(st.sampled_from([8, 16, 32]))
    kv = draw(st.sampled_from([h for h in (1, 2, 4, 8) if heads % h == 0]))
    head_dim = draw(st.sampled_from([64, 128]))
    hidden = heads * head_dim
    moe = draw(st.booleans())
    fields = dict(
        name="random",
        hidden_size=hidden,
        intermediate_size=hidden * draw(st.sampled_from([2, 3, 4])),
        num_layers=draw(st.integers(2, 40)),
        num_heads=heads,
        num_kv_heads=kv,
        vocab_size=draw(st.sampled_from([32000, 128256, 151936])),
        tie_word_embeddings=draw(st.booleans()),
    )
    if moe:
        e = draw(st.sampled_from([8, 16, 64]))
        fields.update(num_experts=e, experts_per_token=draw(st.sampled_from([1, 2, 4])), moe_intermediate_size=hidden // 2)
    return ModelSpec(**fields)


clusters = st.builds(
    lambda n, d, dev: ClusterSpec(device=dev, nodes=n, devices_per_node=d),
    st.integers(1, 3),
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from(["A100-80GB", "H100-80GB", "H800", "H200", "H20"]),
)
workloads = st.builds(
    WorkloadSpec,
    prompts=st.sampled_from([8, 64, 256, 1024]),
    prompt_len=st.sampled_from([64, 512, 2048]),
    response_len=st.sampled_from([64, 1024, 4096]),
    mini_batches=st.sampled_from([1, 2, 8]),
)
flows = st.sampled_from(FLOWS)


def check_deliveries(plan, model):
    parts = tuple(part_bytes(model))
    for r in plan.reshards:
        if r.dst_phase != "generate" or (r.method == "in_place" and r.bytes_per_device == 0 and r.lower_bound_bytes == 0):
            continue
        rp = plan.roles[r.role]
        train, gen = rp.phases["train"], rp.phases["generate"]
        if train.device_count * gen.device_count > 4096:
            continue
        t_dev, g_dev = sorted(device_ids(train.devices)), sorted(device_ids(gen.devices))
        got = deliveries(r.method, train.layout, gen.layout, t_dev, g_dev, parts)
        for part in parts:
            s_g = gen_shards(gen.layout, part)
            for dev in g_dev:
                mine = [d for d in got if d.dst == dev and d.part == part]
                for a, b in itertools.combinations(mine, 2):
                    assert _cut(a.rect, b.rect) is None, f"{r.method}: a piece of the {part} reaches device {dev} twice"
                total = sum((d.area for d in mine), Fraction(0))
                assert total >= Fraction(1, s_g), f"{r.method}: device {dev} misses part of its {part} shard"


def check_memory(plan, model):
    """No role's weights show as 0 GB on a device that runs it, a generation engine shows at least
    its whole weight shard (held, or shared with the co-located training state), and no category
    is negative (sharing never takes more from the other roles than they hold)."""
    for role, rp in plan.roles.items():
        for phase, ph in rp.phases.items():
            mem = ph.memory
            # (offloaded parameters live in host memory; the device holds a layer at a time, in buffers)
            assert mem.weights > 0 or ph.layout.offload_params, f"{role}.{phase} shows 0 GB of weights"
            assert min(mem.weights, mem.gradients, mem.optimizer, mem.kv_cache, mem.other_roles) >= -1e-9, (role, phase, mem)
            if phase == "generate":
                floor = generation_weights_gb(model, ph.layout)
                assert mem.weights >= floor - 1e-3, f"{role}.generate shows {mem.weights} GB of a {floor} GB shard"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(flows, models(), clusters, workloads)
def test_random_plans_verify(flow, model, cluster, workload):
    g = graph(flow)
    roles = {r: model for r in g.roles if g.roles[r].kind not in ("reward", "environment")}
    try:
        plan, planned, _ = make_plan(g, roles, cluster, workload)
    except InfeasibleError as e:
        assert any(u in e.what for u in ("train", "gen", "ref", "rm", "critic", "actor", "co-location")), e.what
        assert e.fix
        return
    verify_plan(plan)
    verify(planned, "planned")
    check_deliveries(plan, model)
    check_memory(plan, model)
    for r in plan.reshards:
        assert r.bytes_per_device + 1 >= r.lower_bound_bytes
    again, _, _ = make_plan(g, roles, cluster, workload)
    assert again.to_json() == plan.to_json()


pin_sets = st.sampled_from(
    [
        Pins(),
        Pins(whole_tensor_sync=True),  # what flowc run plans with: only whole-tensor sync methods are open
        Pins(colocate=[["actor.train"], ["actor.gen"]], whole_tensor_sync=True),
        Pins(colocate=[["actor.train"], ["actor.gen"]]),
        Pins(colocate=[["actor.train"], ["actor.gen"]], reshard={"actor": "broadcast"}),
        Pins(colocate=[["actor.train"], ["actor.gen"]], reshard={"actor": "p2p"}),
        Pins(reshard={"actor": "full_allgather"}),
    ]
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.sampled_from(["grpo", "ppo", "remax", "rloo"]), models(), clusters, workloads, pin_sets)
def test_the_plan_the_search_ranks_is_the_plan_emitted(flow, model, cluster, workload, pins):
    """The search scores candidates with one sync cost function and one schedule; the
    plan built from its winner must predict exactly the step time it was ranked at,
    every op and sync at the time the search priced (pins and runtime limits included)."""
    g = graph(flow)
    roles = {r: model for r in g.roles if g.roles[r].kind not in ("reward", "environment")}
    if any(item not in ("actor.train", "actor.gen") for grp in (pins.colocate or []) for item in grp) or flow == "ppo":
        pins = pins.model_copy(update={"colocate": None})
    try:
        plan, _, ctx = make_plan(g, roles, cluster, workload, pins)
    except InfeasibleError:
        return
    check_memory(plan, model)
    best = ctx.search.ranked[0]
    assert plan.predicted.step_time_s == pytest.approx(best.step, rel=1e-6, abs=1e-6)
    ranked = {op: t for ch in best.choices for op, t in ch.op_times.items()}
    for e in plan.schedule:
        if e.op in ranked:
            assert e.end_s - e.start_s == pytest.approx(ranked[e.op], rel=1e-5, abs=2e-6), e.op
    for role in ("actor", "critic"):
        r = plan.generation_sync(role)
        if r is None:
            continue
        if pins.reshard.get(role):
            assert r.method == pins.reshard[role]
        if pins.whole_tensor_sync:
            assert r.method in ("full_allgather", "broadcast") or plan.roles[role].phases["generate"].tp == 1


@pytest.mark.parametrize(
    "flow,model,cluster",
    [
        ("grpo", "qwen2.5-7b", "1x8xH100"),  # verl's canonical 7B GRPO recipe runs on 8 GPUs
        ("grpo", "qwen3-30b-a3b", "1x8xH100"),  # verl reports MoE GRPO on 8 GPUs
        ("ppo", "llama-3.1-70b", "16x8xA100"),  # HybridFlow's 70B PPO testbed
        ("grpo", "deepseek-v3", "12x8xH800"),  # verl's 671B GRPO on 96 GPUs
    ],
)
def test_published_runs_are_feasible(flow, model, cluster):
    g = graph(flow)
    m = ModelSpec.resolve(model)
    w = (
        WorkloadSpec(prompts=256, prompt_len=1024, response_len=2048)
        if model == "deepseek-v3"
        else WorkloadSpec(prompts=1024, prompt_len=512, response_len=1024)
    )
    plan, planned, _ = make_plan(
        g, {r: m for r in g.roles if g.roles[r].kind not in ("reward", "environment")}, ClusterSpec.parse(cluster), w
    )
    verify_plan(plan)
    verify(planned, "planned")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(flows, models(), clusters, workloads, st.data())
def test_option_pruning_matches_pricing_every_layout(flow, model, cluster, workload, data):
    """The option table skips micro-batches it can prove useless and chains whose state alone
    misses the device; its Pareto front and its "the faster X needs N GB" miss (or, when nothing
    fits, the nearest miss) must equal those of pricing every layout."""
    g = graph(flow)
    roles = {r: model for r in g.roles if g.roles[r].kind not in ("reward", "environment")}
    units = [u for u in units_of(g) if not u.generates and u.role in roles]
    table = OptionTable(units_of(g), roles, demands(g, workload), workload, Hw.of(cluster), Pins(), ("vllm",))
    u = data.draw(st.sampled_from(units))
    d = data.draw(st.sampled_from(divisors(cluster.world_size)))
    got = table.options(u.name, d)

    m = roles[u.role]
    logits = u.kind in ("policy", "reference")
    layouts = table._train_layouts(u, m, d) if u.trainable else table._forward_layouts(u, m, d)
    priced = [(table._trained if u.trainable else table._frozen)(u, m, lay, d, logits) for lay in layouts]
    # memory only grows with the micro-batch: the assumption the pruning rests on
    by_rest: dict[tuple, list] = {}
    for o in priced:
        lay = next(iter(o.layouts.values()))
        by_rest.setdefault(tuple(v for k, v in lay.__dict__.items() if k not in ("micro_batch", "micro_tokens")), []).append(
            (lay.micro_batch, o.need_gb)
        )
    for chain in by_rest.values():
        needs = [need for _, need in sorted(chain)]
        assert needs == sorted(needs)
    useful = [
        o
        for o in priced
        if table.micro_batch_useful(u, next(iter(o.layouts.values())).dp, next(iter(o.layouts.values())).micro_batch)
    ]
    fits = [o for o in useful if o.fits_alone]
    assert [o.layouts for o in got.front] == [o.layouts for o in pareto(fits)]
    over = [o for o in useful if not o.fits_alone]
    if fits:
        faster = [o for o in over if o.time < got.front[0].time]
        want = min(faster, key=lambda o: (o.need_gb, o.time)) if faster else None
    else:
        want = min(over, key=lambda o: (table.shortfall(o), o.need_gb, o.time)) if over else None
    miss = table.faster_miss(u.name, d)
    assert (miss and (miss.need_gb, miss.time)) == (want and (want.need_gb, want.time))
    if not fits:
        assert got.oom is miss


def test_a_micro_batch_never_holds_more_sequences_than_its_replica():
    """Micro-batches beyond a replica's sequences price the same time as the one that holds them all."""
    m = ModelSpec.resolve("qwen2.5-7b")
    hw = Hw.of(ClusterSpec.parse("1x8xH100"))
    dem = Demand(sequences=64, prompt_len=512, response_len=512, mean_response_len=512)
    times = [forward_cost(m, Layout(dp=8, micro_batch=mb), dem, hw, logits=True, frozen=True).time for mb in (8, 16, 64)]
    assert times[0] == pytest.approx(times[1]) == pytest.approx(times[2])


@st.composite
def fronts(draw):
    """A front of options, fastest first: each slower one leaner in resident or transient memory."""
    n = draw(st.integers(FRONT_LIMIT + 1, 60))
    out, time_s, res, trans = [], 1.0, draw(st.floats(5, 200)), draw(st.floats(1, 80))
    for _ in range(n):
        out.append(UnitOption("u", 8, {}, {}, res, trans, time_s))
        time_s *= 1 + draw(st.floats(0.001, 0.5))
        if draw(st.booleans()):
            res *= draw(st.floats(0.8, 0.99))
        else:
            trans *= draw(st.floats(0.8, 0.99))
    return out


@settings(max_examples=200, deadline=None)
@given(front=fronts(), budget_share=st.floats(0.0, 1.0))
def test_a_truncated_front_keeps_the_fastest_option_of_every_memory_budget_it_spans(front, budget_share):
    """What a pool that shares its devices can afford is a memory budget: within any budget the
    kept options hold one no slower than the fastest option of the whole front within the next
    budget level below it (levels spread geometrically from the leanest total to the fastest's),
    and the fastest and leanest options are always kept. (An even spread along the front alone,
    the rule before, fails this.)"""
    assert pareto(front, limit=10**6) == front  # a front already
    kept = pareto(front, FRONT_LIMIT)
    assert len(kept) == FRONT_LIMIT and kept[0] is front[0]
    assert min(o.resident_gb for o in kept) == min(o.resident_gb for o in front)
    assert min(o.transient_gb for o in kept) == min(o.transient_gb for o in front)
    total = [o.resident_gb + o.transient_gb for o in front]
    lo, hi = min(total), max(total[0], min(total))
    levels = (FRONT_LIMIT - 3 + 1) // 2  # budgets beside the three kept extremes (half the other slots)
    step = (hi / lo) ** (1 / (levels + 1))
    budget = lo * (hi / lo) ** budget_share
    within = [o.time for o in kept if o.resident_gb + o.transient_gb <= budget * (1 + 1e-9)]
    below = [o.time for o in front if o.resident_gb + o.transient_gb <= budget / step * (1 + 1e-9)]
    if below:
        assert within and min(within) <= min(below)
