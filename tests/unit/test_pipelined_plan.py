"""The planner's steady state of a loop whose rollouts lag the trainer (``--pin staleness=K``)."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
from helpers import DECOUPLED_FLOW
from hypothesis import given, settings
from hypothesis import strategies as st

from flowc.errors import SpecError
from flowc.ir.cluster import ClusterSpec
from flowc.ir.models import ModelSpec
from flowc.ir.plan_text import format_plan
from flowc.ir.workload import WorkloadSpec
from flowc.loader import load_flow
from flowc.passes.pins import parse_pins, pins_from_plan
from flowc.passes.pipeline import make_plan
from flowc.passes.schedule import OpSpec, SyncSpec, simulate

FLOW = DECOUPLED_FLOW
WORKLOAD = WorkloadSpec(prompts=128, prompt_len=512, response_len=4096, mean_response_len=2000)


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    path = tmp_path_factory.mktemp("flow") / "decoupled.py"
    path.write_text(FLOW.replace("{loss}", "decoupled_ppo(0.2)"))
    return load_flow(str(path)).trace()


def _plan(g, pins: list[str], cluster: str = "2x8xH100"):
    m = ModelSpec.resolve("qwen2.5-7b")
    plan, _, _ = make_plan(g, {"actor": m, "ref": m}, ClusterSpec.parse(cluster), WORKLOAD, parse_pins(pins))
    return plan


def _window(ops, pools: int, times: dict[str, float], sync: tuple[str, tuple[int, ...], float]):
    specs = [OpSpec(i, p, tuple((d, 0.0) for d in deps), ahead) for i, p, deps, ahead in ops]
    syncs = [SyncSpec("actor", sync[0], sync[1])]
    arr = {k: np.array([v]) for k, v in times.items()}
    sizes = [np.array([1.0]) for _ in range(pools)]
    lock, _, _ = simulate(specs, syncs, arr, {syncs[0].id: np.array([sync[2]])}, sizes, 1e12, 1e12)
    win: dict = {}
    per, _, _ = simulate(specs, syncs, arr, {syncs[0].id: np.array([sync[2]])}, sizes, 1e12, 1e12, staleness=1, window=win)
    return float(lock[0]), float(per[0]), {k: (float(s[0]), float(e[0])) for k, (s, e) in win.items()}


def test_the_period_is_one_steady_state_step_as_the_runtime_issues_it():
    """The next step's generate is issued first: on its own pool it overlaps the training; an op
    that shares its pool waits behind it, and so does everything after that op."""
    times = {"gen": 6.0, "ref": 3.0, "upd": 4.0}
    split = [("gen", 0, (), True), ("ref", 1, ("gen",), False), ("upd", 1, ("ref",), False)]
    lock, per, win = _window(split, 2, times, ("upd", (1, 0), 0.5))
    assert lock == 13.5 and per == 7.5  # max(gen 6, ref+upd 7) + the sync on both pools
    assert win["gen"] == (0.0, 6.0) and win["ref"] == (0.0, 3.0) and win["actor.weight_sync"] == (7.0, 7.5)
    shared = [("gen", 0, (), True), ("ref", 0, ("gen",), False), ("upd", 1, ("ref",), False)]
    lock, per, win = _window(shared, 2, times, ("upd", (1, 0), 0.5))
    assert per == 13.5 == lock  # ref queues behind the next step's generate, the update behind ref: no gain
    assert win["ref"] == (6.0, 9.0) and win["upd"] == (9.0, 13.0)
    one = [("gen", 0, (), True), ("ref", 0, ("gen",), False), ("upd", 0, ("ref",), False)]
    assert _window(one, 1, times, ("upd", (0,), 0.5))[1] == 13.5  # one pool: the iteration


def test_the_controller_blocks_on_its_own_ops_and_holds_back_what_it_issues_after_them():
    """A compute that reads an op queued behind the next generate keeps the controller from issuing
    anything after it, on any pool: the training pool's log-probs start only when it is done."""
    times = {"gen": 6.0, "score": 2.0, "comp": 0.0, "lp": 3.0, "upd": 4.0}
    ops = [
        ("gen", 0, (), True),
        ("score", 0, ("gen",), False),
        ("comp", None, ("score",), False),
        ("lp", 1, ("gen",), False),
        ("upd", 1, ("comp", "lp"), False),
    ]
    _, per, win = _window(ops, 2, times, ("upd", (1, 0), 0.5))
    assert win["comp"] == (8.0, 8.0) and win["lp"] == (8.0, 11.0) and per == 15.5


def test_a_period_may_exceed_the_iteration_when_generates_are_issued_first_and_the_plan_says_so():
    """Two generates with a model op between them on one pool: the runtime issues the later step's
    generates together, so that op — and the long one reading it on the other pool — waits behind
    both: slower than lock-step, and priced so."""
    from types import SimpleNamespace

    from flowc.passes.explain import pipelined_note

    times = {"gen1": 6.0, "ref": 3.0, "gen2": 6.0, "upd": 10.0, "rew": 0.0}
    ops = [
        ("gen1", 0, (), True),
        ("ref", 0, ("gen1",), False),
        ("gen2", 0, (), True),
        ("upd", 1, ("ref",), False),
        ("rew", None, ("gen2",), False),
    ]
    lock, per, win = _window(ops, 2, times, ("upd", (1, 0), 0.5))
    assert (lock, per) == (19.5, 25.5) and win["ref"] == (12.0, 15.0)
    body = {
        "predicted": SimpleNamespace(step_time_s=per, iteration_s=lock, steady_step_s=per),
        "pools": [SimpleNamespace(name="a", busy_s=15.5)],
    }
    (note,) = pipelined_note(1, body)
    assert "but here it is slower: 25.50 s per step against 19.50 s lock-step" in note


def test_separate_pools_overlap_generation_with_training(graph):
    """On the same placement (pinned), staleness 1 takes the busiest pool's time per step, and one
    of its iterations is exactly the lock-step plan's step."""
    separate = ["colocate=actor.train,ref;actor.gen"]
    lock = _plan(graph, separate)
    ahead = _plan(graph, [*separate, "staleness=1"])
    assert ahead.staleness == 1 and lock.staleness == 0 and lock.predicted.iteration_s is None
    assert ahead.predicted.iteration_s == pytest.approx(lock.predicted.step_time_s, rel=1e-6)
    busiest = max(p.busy_s for p in ahead.pools)
    assert ahead.predicted.step_time_s == pytest.approx(max(e.end_s for e in ahead.steady_state), abs=1e-5)
    assert ahead.predicted.step_time_s >= busiest * (1 - 1e-4)
    assert ahead.predicted.step_time_s < lock.predicted.step_time_s
    assert ahead.predicted.tokens_per_s > lock.predicted.tokens_per_s
    why = " ".join(ahead.why)
    assert "Staleness 1: the rollouts of step s+1 are sampled while step s trains" in why and "lock-step throughput" in why
    assert "pipelined: staleness 1" in format_plan(ahead)
    assert pins_from_plan(ahead).staleness == 1  # re-planning a saved plan keeps it


def test_one_shared_pool_gains_nothing(graph):
    shared = ["colocate=actor.train,actor.gen,ref"]
    lock, ahead = _plan(graph, shared), _plan(graph, [*shared, "staleness=2"])
    assert ahead.predicted.step_time_s == pytest.approx(lock.predicted.step_time_s, rel=1e-6)
    assert "no gain" in " ".join(ahead.why)


@settings(max_examples=8, deadline=None)
@given(k=st.integers(1, 3), cluster=st.sampled_from(["1x8xH100", "2x8xH100", "4x8xH20"]))
def test_a_pipelined_plan_is_never_slower_than_lock_step_and_respects_its_bounds(graph, k, cluster):
    """For a flow whose generate comes first, every candidate's period is at most its iteration, so
    the search's best can only improve; the period is at least the busiest pool's time and is where
    the steady-state step ends; and, as this workload's generates do not vary from step to step
    (the longest response reaches the limit every step), every K ≥ 1 prices the same (one later
    generate overlaps each step)."""
    lock, ahead = _plan(graph, [], cluster), _plan(graph, [f"staleness={k}"], cluster)
    p = ahead.predicted
    assert p.step_time_s <= lock.predicted.step_time_s * (1 + 1e-6)
    assert p.step_time_s >= max(x.busy_s for x in ahead.pools) * (1 - 1e-4)
    assert p.step_time_s == pytest.approx(max(e.end_s for e in ahead.steady_state), abs=1e-5) == p.steady_step_s
    assert p.iteration_s >= p.step_time_s * (1 - 1e-6)
    if k > 1:
        assert p.step_time_s == pytest.approx(_plan(graph, ["staleness=1"], cluster).predicted.step_time_s, rel=1e-9)


def test_a_flow_without_a_correction_cannot_be_planned_ahead(tmp_path):
    path = tmp_path / "plain.py"
    path.write_text(FLOW.replace("{loss}", "ppo_clip(0.2)"))
    g = load_flow(str(path)).trace()
    with pytest.raises(SpecError, match="assumes on-policy samples") as e:
        _plan(g, ["staleness=1"])
    assert "decoupled_ppo" in e.value.fix
    with pytest.raises(SpecError, match="whole number"):
        parse_pins(["staleness=-1"])


def test_a_clipped_loss_without_old_logprobs_cannot_run_ahead(tmp_path):
    """decoupled PPO's clip needs the proximal policy: without old_logprobs the ratio is against the
    policy being trained, so nothing bounds the step from the stale samples' policy."""
    path = tmp_path / "no_old.py"
    path.write_text(
        FLOW.replace("old_logprobs=old, ", "")
        .replace("    old = actor.logprobs(rollout)\n", "")
        .replace("{loss}", "decoupled_ppo(0.2)")
    )
    g = load_flow(str(path)).trace()
    with pytest.raises(SpecError, match="has no old_logprobs") as e:
        _plan(g, ["staleness=1"])
    assert "old_logprobs=actor.logprobs(rollout)" in e.value.fix
    assert _plan(g, []).staleness == 0  # lock-step it plans


def test_flowc_plan_staleness_prints_the_lock_step_plan_beside_it(tmp_path):
    """`flowc plan --staleness 1`: the pipelined plan, its why, and the best lock-step plan's step
    time beside it; a flow whose loss does not correct for stale samples is refused with the fix."""
    import subprocess
    import sys

    from helpers import ROOT

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "flowc.cli", *args], capture_output=True, text=True, cwd=ROOT)

    small = ["--model", "actor=Qwen/Qwen2.5-1.5B", "--model", "ref=Qwen/Qwen2.5-1.5B", "--cluster", "4x8xH100"]
    small += ["--workload", "prompts=128,prompt_len=512,response_len=4096,mean_response_len=1200"]
    r = cli("plan", "examples/grpo_async.py", *small, "--staleness", "1")
    assert r.returncode == 0, r.stderr
    assert "pipelined: staleness 1" in r.stdout and "in the steady state" in r.stdout
    assert "actor.update → actor.generate (≤1 behind)" in r.stdout  # the weight edge shows how far it lags
    (ahead,) = [ln for ln in r.stdout.splitlines() if ln.strip().startswith("staleness 1 ") and "s/step" in ln]
    (lock,) = [ln for ln in r.stdout.splitlines() if ln.strip().startswith("lock-step ")]

    def per_step(line: str) -> float:
        words = line.split()
        return float(words[words.index("s/step") - 1])

    assert "actor.gen ×" in ahead and "×32" in lock  # separate pools ahead, everything shared in lock-step
    gain = float(r.stdout.rsplit("→ ", 1)[1].split("×")[0])
    assert gain == pytest.approx(per_step(lock) / per_step(ahead), rel=0.01) and gain > 1.0
    saved = tmp_path / "pipelined.json"
    assert cli("plan", "examples/grpo_async.py", *small, "--staleness", "1", "-o", str(saved)).returncode == 0
    again = cli("plan", "examples/grpo_async.py", "--plan", str(saved))
    assert again.returncode == 0, again.stderr
    # a saved pipelined plan reproduces itself: printed as saved, with no lock-step search held against it
    assert "changed" not in again.stderr and "beside lock-step" not in again.stdout
    assert per_step(next(ln for ln in again.stdout.splitlines() if ln.startswith("predicted:"))) == per_step(ahead)
    refused = cli("plan", "examples/grpo.py", *small, "--staleness", "1")
    assert refused.returncode != 0
    assert "assumes on-policy samples" in refused.stderr and "decoupled_ppo" in refused.stderr
    # --staleness is checked as the option the user gave, and never contradicts a pin silently
    bad = cli("plan", "examples/grpo_async.py", *small, "--staleness", "3x")
    assert bad.returncode != 0 and "--staleness '3x': not a staleness" in bad.stderr
    both = cli("plan", "examples/grpo_async.py", *small, "--staleness", "1", "--pin", "staleness=2")
    assert both.returncode != 0 and "contradicts --pin staleness=2" in both.stderr
    drawn = tmp_path / "pipelined.html"  # export takes it too: the timeline of two consecutive iterations
    r = cli("export", "examples/grpo_async.py", *small, "--staleness", "1", "-f", "html", "-o", str(drawn))
    assert r.returncode == 0, r.stderr
    assert "[s+1]" in drawn.read_text()


def test_auto_staleness_takes_the_smallest_k_within_tolerance_of_the_fastest(graph):
    """`staleness=auto`: placement and staleness chosen together — the plan is the one pinned at
    the chosen K, every larger K is no more than the tolerance faster, and why lists them all."""
    from flowc.passes.pipeline import AUTO_STALENESS, AUTO_TOLERANCE

    m = ModelSpec.resolve("qwen2.5-1.5b")
    wl = WorkloadSpec(prompts=128, prompt_len=512, response_len=4096, mean_response_len=1200)
    cluster = ClusterSpec.parse("4x8xH100")

    def plan(pins: list[str]):
        return make_plan(graph, {"actor": m, "ref": m}, cluster, wl, parse_pins(pins))[0]

    auto = plan(["staleness=auto"])
    steps = {k: plan([f"staleness={k}"]).predicted.step_time_s for k in AUTO_STALENESS}
    assert auto.staleness == 1 and steps[0] > steps[1] * (1 + AUTO_TOLERANCE)  # lock-step is slower here
    assert auto.predicted.step_time_s == pytest.approx(steps[1])
    assert auto.staleness == min(k for k in AUTO_STALENESS if steps[k] <= min(steps.values()) * (1 + AUTO_TOLERANCE))
    assert auto.why[0].startswith("Staleness (auto): 1 — step time by staleness: 0 → ")
    assert pins_from_plan(auto).staleness == 1  # a saved plan fixes the chosen K


def test_the_verifier_holds_the_mean_period_to_at_least_the_steady_step(graph):
    """A pipelined plan's mean period cannot be below its period at the mean lengths (variation
    only adds to it), and its steady state must end at the latter."""
    from flowc.errors import VerificationError
    from flowc.ir.plan_verify import verify_plan

    p = _plan(graph, ["staleness=1"], "2x8xH100")
    verify_plan(p)
    pred = p.predicted
    below = p.model_copy(update={"predicted": pred.model_copy(update={"step_time_s": pred.steady_step_s * 0.9})})
    with pytest.raises(VerificationError, match="below the steady step at the mean lengths"):
        verify_plan(below)
    off = p.model_copy(update={"predicted": pred.model_copy(update={"steady_step_s": pred.steady_step_s * 0.9})})
    with pytest.raises(VerificationError, match="not at the predicted steady step"):
        verify_plan(off)


def test_auto_staleness_is_lock_step_for_a_loss_without_a_correction(tmp_path):
    path = tmp_path / "naive.py"
    path.write_text(FLOW.replace("{loss}", "ppo_clip(0.2)"))
    g = load_flow(str(path)).trace()
    p = _plan(g, ["staleness=auto"])
    assert p.staleness == 0 and p.predicted.iteration_s is None
    assert p.why[0].startswith("Staleness (auto): 0, lock-step — this flow cannot run ahead:") and "assumes on-policy" in p.why[0]


def test_run_config_takes_a_staleness_or_auto():
    from pydantic import ValidationError

    from flowc.ir.run_config import RunConfig

    assert RunConfig(staleness="auto").staleness == "auto" and RunConfig(staleness=2).staleness == 2
    for bad in ("soon", 17, -1):
        with pytest.raises(ValidationError):
            RunConfig(staleness=bad)


# ----------------------------------------------------------- @fc.flow(max_staleness=K)
def _write(tmp_path, loss: str):
    path = tmp_path / "undeclared.py"
    path.write_text(FLOW.replace("{loss}", loss))
    return path


def _declared(tmp_path, bound: int, loss: str = "decoupled_ppo(0.2)"):
    path = tmp_path / f"declared{bound}.py"
    path.write_text(FLOW.replace("@fc.flow\n", f"@fc.flow(max_staleness={bound})\n").replace("{loss}", loss))
    return load_flow(str(path))


def test_a_flow_declares_its_staleness_bound_and_the_graph_keeps_it(tmp_path):
    from flowc.ir.serialize import from_json, to_json
    from flowc.ir.text import format_graph

    g = _declared(tmp_path, 2).trace()
    assert g.max_staleness == 2
    assert "staleness ≤ 2 weight version(s) (declared: @fc.flow(max_staleness=2))" in format_graph(g)
    again = from_json(to_json(g))
    assert again.max_staleness == 2 and again.with_nodes(again.nodes).max_staleness == 2
    assert '"max_staleness": 2' in to_json(g)
    undeclared = load_flow(str(_write(tmp_path, "decoupled_ppo(0.2)"))).trace()
    assert undeclared.max_staleness is None and "max_staleness" not in to_json(undeclared)
    assert "staleness ≤" not in format_graph(undeclared)


def test_the_declared_bound_is_checked_when_traced_and_must_be_a_version_count(tmp_path):
    from flowc.errors import SignatureError

    naive = _declared(tmp_path, 1, loss="ppo_clip(0.2)")
    with pytest.raises(SpecError, match=r"@fc\.flow\(max_staleness=1\) on 'decoupled': .*assumes on-policy") as e:
        naive.trace()
    assert "decoupled_ppo" in e.value.fix and "max_staleness=0" in e.value.fix
    assert _declared(tmp_path, 0, loss="ppo_clip(0.2)").trace().max_staleness == 0  # 0 promises nothing
    for bad in ("-1", "17", "1.5", "True", "'one'"):
        path = tmp_path / "bad.py"
        path.write_text(FLOW.replace("@fc.flow\n", f"@fc.flow(max_staleness={bad})\n").replace("{loss}", "decoupled_ppo(0.2)"))
        with pytest.raises(SignatureError, match="whole number of weight versions"):
            load_flow(str(path))


def test_a_declared_bound_lets_the_planner_choose_within_it_and_refuses_more(tmp_path):
    """No staleness asked: the planner chooses in 0 … K (auto, bounded); an explicit K above the
    bound is refused with the fix; a bound of 0 plans lock-step and says why."""
    m = ModelSpec.resolve("qwen2.5-1.5b")
    wl = WorkloadSpec(prompts=128, prompt_len=512, response_len=4096, mean_response_len=1200)
    cluster = ClusterSpec.parse("4x8xH100")

    def plan(g, pins: list[str]):
        return make_plan(g, {"actor": m, "ref": m}, cluster, wl, parse_pins(pins))[0]

    one = _declared(tmp_path, 1).trace()
    chosen = plan(one, [])
    assert chosen.staleness == 1  # the workload where running ahead pays (the auto test above)
    assert chosen.why[0].startswith("Staleness (auto, within the flow's max_staleness=1): 1 — step time by staleness: 0 → ")
    assert plan(one, ["staleness=0"]).staleness == 0  # asking for less is allowed
    with pytest.raises(SpecError, match=r"staleness=2, but flow decoupled declares @fc.flow\(max_staleness=1\)") as e:
        plan(one, ["staleness=2"])
    assert "0 … 1" in e.value.fix
    zero = plan(_declared(tmp_path, 0).trace(), [])
    assert zero.staleness == 0 and zero.why[0] == "Staleness: 0, lock-step — the flow declares @fc.flow(max_staleness=0)."
    auto_zero = plan(_declared(tmp_path, 0).trace(), ["staleness=auto"])
    assert auto_zero.staleness == 0 and "the flow declares @fc.flow(max_staleness=0)" in auto_zero.why[0]
    lock = plan(one, ["staleness=0"])
    assert pins_from_plan(lock).staleness == 0  # replaying a lock-step plan of a bounded flow stays lock-step
    replayed, _, _ = make_plan(one, {"actor": m, "ref": m}, cluster, wl, pins_from_plan(lock))
    assert replayed.staleness == 0 and replayed.predicted.step_time_s == pytest.approx(lock.predicted.step_time_s)


def test_an_undeclared_flow_is_lock_step_by_default_and_the_plan_says_why(graph, tmp_path):
    assert (
        _plan(graph, [])
        .why[0]
        .startswith(
            "Staleness: 0, lock-step (the default) — the flow's loss corrects for off-policy samples, so it could run ahead"
        )
    )
    plain = _plan(load_flow(str(_write(tmp_path, "ppo_clip(0.2)"))).trace(), [])
    assert plain.why[0].startswith(
        "Staleness: 0, lock-step (the default) — this flow cannot run ahead: actor.update(loss=ppo_clip"
    )
    assert "assumes on-policy samples" in plain.why[0]
    assert _plan(graph, ["staleness=0"]).why[0].startswith("Searched")  # asked for: no line


# ----------------------------------------------------------- the diagram's steady state
VARIED = WorkloadSpec(prompts=512, prompt_len=512, response_len=16384, mean_response_len=2000, mean_response_cv=0.2)


@pytest.mark.parametrize(
    "pins, cluster, workload",
    [
        (["staleness=1", "colocate=actor.train,ref;actor.gen"], "2x8xH100", WORKLOAD),
        (["staleness=1", "colocate=actor.train;actor.gen,ref"], "2x8xH100", WORKLOAD),
        (["staleness=2"], "4x8xH100", WORKLOAD),
        (["staleness=1", "colocate=actor.train,actor.gen,ref"], "1x8xH100", WORKLOAD),
        ([], "2x8xH100", WORKLOAD),
        (["staleness=1"], "4x8xH100", VARIED),  # the mean period exceeds the drawn one: generation varies
    ],
)
def test_the_diagram_draws_two_steps_of_the_steady_state_within_their_periods(graph, pins, cluster, workload):
    """Each of the two steps' bars lies within its period (at the mean lengths), no two bars of a
    pool overlap, every op of the schedule is drawn once per step, and a pipelined plan's generates
    are the next step's."""
    from flowc.export import to_html
    from flowc.ir.steady_state import drawn_period, pipelined_spans

    m = ModelSpec.resolve("qwen2.5-7b")
    plan, planned, _ = make_plan(graph, {"actor": m, "ref": m}, ClusterSpec.parse(cluster), workload, parse_pins(pins))
    period = drawn_period(plan)
    assert period == (plan.predicted.steady_step_s if plan.staleness else plan.predicted.step_time_s)
    spans = pipelined_spans(plan)
    drawn = [e for e in plan.schedule if e.end_s > e.start_s or e.pool]
    durations = {e.op: e.end_s - e.start_s for e in plan.schedule}
    for j in (0, 1):
        window = [sp for sp in spans if sp.start_s >= j * period - 1e-9 and sp.start_s < (j + 1) * period - 1e-9]
        assert sorted(sp.entry.op for sp in window) == sorted(e.op for e in drawn)
        assert all(sp.end_s <= (j + 1) * period + 1e-5 for sp in window), (j, period, window)  # (the plan rounds to µs)
        at = {sp.entry.op: sp for sp in window}
        for sp in window:
            ahead = plan.staleness and planned[sp.entry.op].op == "generate"
            assert sp.step == j + (plan.staleness if ahead else 0)  # a generate runs K steps ahead
            assert sp.end_s - sp.start_s == pytest.approx(durations[sp.entry.op], abs=2e-6)
            if ahead or sp.entry.op not in planned:
                continue
            for e in planned.inputs(sp.entry.op):  # no op starts before what it reads of its own step is done
                src = at.get(e.src)
                if src is not None and src.step == sp.step:
                    assert src.end_s <= sp.start_s + 1e-5, (src, sp)
    by_pool: dict[str, list] = {}
    for sp in spans:
        if sp.entry.pool is not None and sp.end_s > sp.start_s:
            by_pool.setdefault(sp.entry.pool, []).append((sp.start_s, sp.end_s))
    for pool, bars in by_pool.items():
        bars.sort()
        assert all(a[1] <= b[0] + 1e-5 for a, b in pairwise(bars)), pool
    page = to_html(plan, planned)
    if plan.staleness:
        assert f"steady state, staleness {plan.staleness}: steps s and s+1, {period:.2f} s each at the mean lengths" in page
        assert 'id="steady-state"' in page and f"actor.generate [s+{plan.staleness}]" in page
        assert f'data-step="{plan.staleness + 1}"' in page
        assert "steady state (staleness" in format_plan(plan)
    else:
        assert 'id="steady-state"' not in page and "[s+1]" not in page and "steady state" not in format_plan(plan)
