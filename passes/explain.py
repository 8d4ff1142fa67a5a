"""Why this plan: the runners-up with the reason each lost, and what decided
each choice. Every sentence is computed from the cost tables — nothing here is
canned."""

from __future__ import annotations

from dataclasses import replace

from flowc.ir.graph import FlowGraph
from flowc.ir.plan import Alternative, Layout, PhasePlan
from flowc.passes.costs import PhaseCost
from flowc.passes.flops import Demand
from flowc.passes.fronts import UnitOption
from flowc.passes.generation_costs import generate_cost
from flowc.passes.manager import PlanContext
from flowc.passes.options import OptionTable
from flowc.passes.pools import GenChoice
from flowc.passes.search import Candidate, SearchResult
from flowc.passes.train_costs import train_cost
from flowc.passes.units import generation_rounds

MAX_ALTERNATIVES = 8


def describe(c: Candidate) -> str:
    """``actor.train+actor.gen+critic on 96 | ref+rm on 32`` and the key layouts."""
    pools = " | ".join(f"{'+'.join(b)} on {s}" for b, s in zip(c.partition, c.sizes, strict=True))
    gens = []
    for ch in c.choices:
        for u, gc in ch.gens.items():
            rs = f" via {gc.reshard.method}" if gc.reshard else ""
            gens.append(f"{u} {gc.layout.backend} tp{gc.layout.tp}{f' pp{gc.layout.pp}' if gc.layout.pp > 1 else ''}{rs}")
    return pools + (f" ({', '.join(gens)})" if gens else "")


def _busy_by_pool(c: Candidate) -> list[float]:
    return [ch.busy for ch in c.choices]


def why_slower(alt: Candidate, best: Candidate) -> str:
    """The main reason ``alt`` is slower than ``best``."""
    pct = (alt.step / best.step - 1) * 100 if best.step > 0 else 0.0
    head = f"{pct:.1f} % slower ({alt.step:.1f} s vs {best.step:.1f} s per step)"
    if pct < 0.05:
        return f"ties with the chosen plan ({alt.step:.2f} s per step); the first found is kept"
    idle = [
        (1 - b / alt.step if alt.step > 0 else 0.0, "+".join(p)) for b, p in zip(_busy_by_pool(alt), alt.partition, strict=True)
    ]
    worst_idle, pool = max(idle)
    if len(alt.partition) > 1 and worst_idle >= 0.25:
        return f"{head}: pool {pool} idle {worst_idle * 100:.0f} % of the step"
    # otherwise the op whose time grew the most
    best_times = {op: t for ch in best.choices for op, t in ch.op_times.items()}
    grew = []
    for ch in alt.choices:
        for op, t in ch.op_times.items():
            grew.append((t - best_times.get(op, t), op, t, best_times.get(op, t)))
    if grew:
        d, op, t, b = max(grew)
        if d > 0:
            return f"{head}: {op} takes {t:.1f} s instead of {b:.1f} s"
    if len(alt.partition) == 1 and len(best.partition) > 1:
        return f"{head}: all roles share every device, so nothing overlaps"
    return head


def alternatives(ctx: PlanContext, result: SearchResult) -> list[Alternative]:
    best = result.ranked[0]
    out: list[Alternative] = []
    seen: set[str] = {describe(best)}

    def add(cand: Candidate) -> None:
        s = describe(cand)
        if s not in seen:
            seen.add(s)
            out.append(
                Alternative(
                    summary=s, step_time_s=round(cand.step, 6), tokens_per_s=None, rejected_because=why_slower(cand, best)
                )
            )

    # the best plan of every other co-location, fastest first; then other splits of the winning one
    others = [c for p, c in sorted(result.per_partition.items(), key=lambda kv: kv[1].step) if p != best.partition]
    for cand in others[: MAX_ALTERNATIVES // 2]:
        add(cand)
    for cand in [c for c in result.ranked[1:] if c.partition == best.partition]:
        if len(out) >= MAX_ALTERNATIVES - 2:
            break
        add(cand)
    # faster layouts that do not fit, on the winner's pools
    table = ctx.options
    for block, ch in zip(best.partition, best.choices, strict=True):
        for u in block:
            if table.units[u].generates:
                continue
            miss = table.faster_miss(u, ch.devices)
            if miss is not None and len(out) < MAX_ALTERNATIVES:
                out.append(_oom_alternative(table.units[u].role, u, miss, table.capacity_gb))
    # co-locations that cannot work at all
    for part, reason in result.infeasible.items():
        if len(out) >= MAX_ALTERNATIVES + 2:
            break
        out.append(
            Alternative(
                summary=" | ".join("+".join(b) for b in part),
                step_time_s=None,
                tokens_per_s=None,
                rejected_because=f"infeasible: {reason}",
            )
        )
    return [a.model_copy(update={"tokens_per_s": None}) for a in out]


def _oom_alternative(role: str, unit: str, o: UnitOption, cap: float) -> Alternative:
    phase = "train" if "train" in o.layouts else "forward"
    lay = o.layouts[phase]
    return Alternative(
        summary=f"{unit} {lay.short()} {lay.micro_label} ({lay.backend}) on {o.devices}",
        step_time_s=None,
        tokens_per_s=None,
        rejected_because=f"OOM: needs {o.need_gb:.1f} GB of {cap:.1f} GB on {role}.{phase}",
    )


def _gen_parts(costs: list[PhaseCost]) -> str:
    """``prefill 0.01 s, 24 decode steps 0.09 s, 64 requests' host work 0.05 s``."""
    pre = sum(c.detail.get("prefill", 0.0) for c in costs)
    dec = sum(c.detail.get("decode", 0.0) for c in costs)
    steps = sum(c.detail.get("decode_steps", 0.0) * c.waves for c in costs)
    req = sum(c.detail.get("requests", 0.0) for c in costs)
    parts = [f"prefill {pre:.3g} s", f"{steps:.0f} decode steps {dec:.3g} s"]
    if req > 0:
        parts.append(f"per-request host work {req:.3g} s")
    return ", ".join(parts)


def _batching(costs: list[PhaseCost]) -> str:
    """How a replica's requests go through the engine: ``, 3 padded waves`` (hf), or the
    continuous batch's peak, its preemptions and its tail (vllm)."""
    c = max(costs, key=lambda c: c.time)
    if "preempted" not in c.detail:
        return f", {c.waves} padded waves" if c.waves > 1 else ", one padded wave"
    out = f"; up to {c.detail['concurrency']:.0f} sequences decode at once in {c.memory.kv_cache:.1f} GB of cache"
    if c.detail["preempted"] > 0:
        out += (
            f" (full: {c.detail['preempted']:.0f} preemptions recompute {c.detail['recomputed_tokens']:,.0f} tokens;"
            " more memory would cut them)"
        )
    if c.detail["decode"] > 0 and c.detail["tail"] > 0:
        out += (
            f"; the long tail (under a quarter of them still running) takes {c.detail['tail_steps']:.0f} of"
            f" {c.detail['decode_steps']:.0f} decode steps, {c.detail['tail'] / c.detail['decode'] * 100:.0f} % of the decode time"
        )
    return out


def _utilization(gp: PhasePlan) -> str:
    """``; gpu_memory_utilization 0.62 (planned: …)``: the share of each device the engine takes."""
    if not gp.gpu_memory_utilization:
        return ""  # no share of a device to give: the HF loop, or vLLM on CPUs (given its cache in bytes)
    how = "pinned" if gp.gpu_memory_utilization_pinned else "planned: its weights, the cache's peak and buffers"
    return f"; gpu_memory_utilization {gp.gpu_memory_utilization:.3g} ({how})"


def agent_line(unit: str, costs: list[tuple[str, PhaseCost]], demand: dict[str, Demand]) -> str | None:
    """Where a multi-turn generate's time goes (None for single-turn generates): its turns, the
    observations' prefill and later turns' requests, the environment's chain and its pool."""
    for op, c in costs:
        if "env_wait" not in c.detail:
            continue
        d = c.detail
        total = c.time
        w = int(d["env_workers"])
        lat = demand[op].env_latency_s
        parts = [
            f"{op} runs {d['turns']:.3g} policy turns per trajectory",
            f"prefilling observations {d['obs_prefill']:.3g} s",
            f"later turns' requests {d['turn_requests']:.3g} s",
        ]
        if lat > 0:
            share = d["env_wait"] / total * 100 if total > 0 else 0.0
            procs = f"{w} environment process{'es' if w > 1 else ''} per replica"
            keeps = (
                f"their {d['env_busy']:.3g} s of work fits in the engine's {d['gen_s']:.3g} s"
                if d["env_busy"] <= d["gen_s"] * 1.0001
                else f"their {d['env_busy']:.3g} s of work outlasts the engine's {d['gen_s']:.3g} s: the environment bounds the rollout"
            )
            parts.append(
                f"the environment {d['env_wait']:.3g} s on the critical path ({d['turns']:.3g} steps of {lat:.3g} s, "
                f"{share:.0f} % of the rollout), {procs} ({keeps}; the run config's env_workers overrides it)"
            )
        else:
            parts.append("no environment latency given (workload env_latency_s=…)")
        return f"Multi-turn: {unit}: " + ", ".join(parts) + "."
    return None


def rollout_backend_line(table: OptionTable, unit: str, g: GenChoice) -> str | None:
    """Why ``unit`` generates with its backend: its predicted time against each other rollout
    backend on the same layout and memory (None when only one backend was offered)."""
    role = table.units[unit].role
    chosen = g.layout.backend
    mine = list(g.op_costs.values())
    start = table.hw.rollout_cost(chosen).start_s
    head = f"{unit} generates with {chosen}: {sum(c.time for c in mine):.3g} s per step ({_gen_parts(mine)})"
    if start > 0:
        head += f"; its engine starts in {start:.1f} s, once per run"
    if table.pins.phase(role, "generate").backend:
        return head + " (pinned)."
    others = []
    for b in table.rollout_backends:
        if b == chosen:
            continue
        lay = g.layout.model_copy(update={"backend": b})
        if not table.pins.allows(role, "generate", lay):
            others.append(f"{b} does not run {lay.short()} here")
            continue
        costs = [generate_cost(table.models[role], lay, table.demand[op], table.hw, free_gb=g.free_gb) for op in g.op_costs]
        if any(c is None for c in costs):
            others.append(f"{b} leaves no room for one sequence's KV cache")
            continue
        theirs = [c for c in costs if c is not None]
        others.append(f"{b} would take {sum(c.time for c in theirs):.3g} s ({_gen_parts(theirs)})")
    if not others:
        return None
    return head + "; " + "; ".join(others) + "."


def dynamic_sampling_notes(g: FlowGraph) -> list[str]:
    """One sentence per ``filter`` (dynamic sampling): what it adds to the step."""
    rounds = generation_rounds(g)
    out = []
    for f in g.nodes:
        if f.op == "filter":
            again = sorted(op for op in rounds if g[op].op in ("generate", "logprobs", "values", "score"))
            k = min(1.0 / float(f.kwargs["expected_keep"]), float(f.kwargs["max_rounds"]))
            out.append(
                f"Dynamic sampling ({f.id}): {', '.join(again) or 'its ops'} priced at {k:.2g} rounds per step "
                f"(expected_keep={f.kwargs['expected_keep']}, max_rounds={f.kwargs['max_rounds']})."
            )
    return out


def pipelined_note(k: int, plan_body: dict, bound_k: int | None = None) -> list[str]:
    """What running the rollouts ``k`` versions ahead buys on the chosen placement, and its bound
    (``bound_k``: the flow's ``max_staleness``, which limits the advice)."""
    pred = plan_body["predicted"]
    if not k or not pred.iteration_s:
        return []
    step, it = pred.step_time_s, pred.iteration_s
    steady = pred.steady_step_s if pred.steady_step_s is not None else step  # at the mean lengths
    busiest = max(plan_body["pools"], key=lambda p: p.busy_s)
    if busiest.busy_s >= steady * 0.999:
        bound = f"pool {busiest.name} is busy all of it (its ops and weight syncs of one step)"
    else:
        bound = (
            "the step's own ops and syncs, in the order the runtime issues them, end then (a later step's rollouts"
            " are generated meanwhile)"
        )
    gain = f"{it / step:.2f}× the lock-step throughput" if step > 0 else "no gain"
    head = f"Staleness {k}: the rollouts of step s+{k} are sampled while step s trains"
    if step > it * 1.001:
        return [
            f"{head}, but here it is slower: {step:.2f} s per step against {it:.2f} s lock-step on this placement — the"
            " runtime issues the later step's generates first, and ops of this step that share their pool wait"
            " behind them (lock-step is faster here)."
        ]
    if it <= step * 1.001:
        return [
            f"{head}, but nothing overlaps here (one pool, or the step's ops wait behind the generate on the pool they"
            f" share): {step:.2f} s per step either way (no gain)."
        ]
    return [
        f"{head}: {steady:.2f} s per step in the steady state at the mean lengths — {bound} — against {it:.2f} s for one"
        f" lock-step iteration on this placement ({gain}{', with the variation below' if step > steady * 1.001 else ''})."
        + variation_note(k, pred, _generation_bound(plan_body, steady), bound_k)
    ]


def _generation_bound(plan_body: dict, steady: float) -> bool:
    """Whether the steady step's period follows its generates: a pool that generates is busy all of
    the step, or ops of the step itself run on it after the generate (they wait behind it)."""
    entries = plan_body.get("steady_state", [])
    gen_end: dict[str, float] = {}
    for e in entries:
        if e.phase == "generate" and e.pool:
            gen_end[e.pool] = max(gen_end.get(e.pool, 0.0), e.end_s)
    behind = any(
        e.pool in gen_end and e.phase not in ("generate", "sync") and e.start_s >= gen_end[e.pool] - 1e-6 for e in entries
    )
    return behind or any(p.name in gen_end and p.busy_s >= steady * 0.999 for p in plan_body["pools"])


def variation_note(k: int, pred, generation_bound: bool = False, bound_k: int | None = None) -> str:
    """What the step-to-step variation of generation costs the loop at staleness ``k`` (its mean
    period over the period at the mean lengths), and what a larger K does about it
    (``generation_bound``: a generating pool is busy all of the step; ``bound_k``: the flow's
    ``max_staleness``)."""
    steady = pred.steady_step_s
    if steady is None or pred.step_time_s <= steady * 1.001:
        if k <= 1:
            return ""
        if generation_bound:
            return (
                " Generation's variation from step to step costs this loop nothing on average: the step waits for its"
                " generating pool (busy all of the step, or with ops of the step queued behind the generate), so the"
                " period follows the generate's mean (a slow one is made up by a fast one) — a larger K does not"
                " change that."
            )
        return (
            f" Slow generates cost this loop nothing on average: the rollouts issued up to {k} steps ahead absorb"
            " them, where generation varies from step to step."
        )
    extra = pred.step_time_s - steady
    if k == 1:
        cure = (
            "; a staleness of 2 or more absorbs slow generates in the rollouts issued further ahead, unless the step's"
            " own ops wait behind them on the generation pool"
        )
        if bound_k is not None and bound_k < 2:
            cure += f" (this flow declares max_staleness={bound_k}: raise it to let the planner price 2)"
    else:
        cure = (
            f"; the rollouts issued up to {k} steps ahead absorb a slow generate, not a run of them, nor one that the"
            " step's own ops on the generation pool wait behind"
        )
    return (
        f" Generation varies from step to step (the batch's longest response, the step's mean length): {steady:.2f} s a"
        f" step at the mean lengths, +{extra:.2f} s ({extra / steady:.1%}) on average when a slow generate holds the trainer{cure}."
    )


def why(ctx: PlanContext, result: SearchResult, plan_body: dict, bound_k: int | None = None) -> list[str]:
    """Sentences that explain the winner (``bound_k``: the flow's ``max_staleness``)."""
    best = result.ranked[0]
    lines: list[str] = []
    n_parts = len(result.per_partition) + len(result.infeasible)
    lines.append(
        f"Searched {n_parts} co-locations and {result.evaluated} device splits ({result.strategy}); "
        f"{len(result.infeasible)} co-locations cannot fit."
    )
    lines.append(f"Chosen: {describe(best)} — {best.step:.2f} s per step.")
    lines += pipelined_note(ctx.pins.staleness or 0, plan_body, bound_k)
    runner = next((c for p, c in sorted(result.per_partition.items(), key=lambda kv: kv[1].step) if p != best.partition), None)
    if runner is not None:
        lines.append(f"Next best co-location: {describe(runner)} — {why_slower(runner, best)}.")
    # where the device time goes: device-seconds of each phase over all devices × the step
    pools = plan_body["pools"]
    sched = plan_body["schedule"]
    step = plan_body["predicted"].step_time_s
    size = {p.name: p.device_count for p in pools}
    world = sum(size.values())
    by_phase: dict[str, float] = {}
    for e in sched:
        if e.phase and e.pool in size:
            by_phase[e.phase] = by_phase.get(e.phase, 0.0) + (e.end_s - e.start_s) * size[e.pool]
    if step > 0 and by_phase and world:
        shares = {k: v / (step * world) for k, v in by_phase.items()}
        idle = max(0.0, 1 - sum(shares.values()))
        parts = ", ".join(f"{k} {v * 100:.0f} %" for k, v in sorted(shares.items(), key=lambda kv: -kv[1]))
        lines.append(f"Device time: {parts}, idle {idle * 100:.0f} %.")
    for p in pools:
        if len(pools) > 1:
            lines.append(
                f"Pool {p.name}: {p.device_count} devices, busy {p.busy_s:.1f} s, idle {p.idle_fraction * 100:.0f} % of the step."
            )
    # layout choices: what the fastest layout needed when it was not taken
    table = ctx.options
    for block, ch in zip(best.partition, best.choices, strict=True):
        for u in block:
            unit = table.units[u]
            if unit.generates:
                g = ch.gens[u]
                gp = plan_body["roles"][unit.role].phases["generate"]
                lines.append(
                    f"{u}: {g.layout.short()} — {g.layout.dp} replicas, {g.free_gb:.1f} GB per device left for the KV cache"
                    + _batching(list(g.op_costs.values()))
                    + _utilization(gp)
                    + (f"; weights reach it by {g.reshard.method} in {g.reshard.time:.2f} s" if g.reshard else "")
                    + (
                        f"; the co-located state ({ch.resident_gb:.1f} GB per device) sleeps in host memory while it generates (+{g.swap_s:.1f} s)"
                        if g.swapped
                        else ""
                    )
                    + "."
                )
                if line := rollout_backend_line(table, u, g):
                    lines.append(line)
                if line := agent_line(u, list(g.op_costs.items()), table.demand):
                    lines.append(line)
                continue
            o = ch.options[u]
            lay = o.layouts.get("train") or o.layouts["forward"]
            opts = table.options(u, ch.devices)
            extra = ""
            if (miss := table.faster_miss(u, ch.devices)) is not None:
                o2 = miss.layouts.get("train", miss.layouts.get("forward"))
                extra = f"; the faster {o2.short()} {o2.micro_label} needs {miss.need_gb:.1f} GB"
            elif opts.front and opts.front[0] is not o:
                f0 = opts.front[0].layouts.get("train", opts.front[0].layouts.get("forward"))
                extra = f"; its fastest layout alone ({f0.short()} {f0.micro_label}) leaves too little memory for the roles it shares devices with"
            lines.append(f"{u}: {lay.short()} {lay.micro_label} ({lay.backend}), {o.resident_gb:.1f} GB resident{extra}.")
            if line := shared_prompts_line(u, lay, o.op_costs, table.demand):
                lines.append(line)
            if line := packed_line(u, lay, o.op_costs):
                lines.append(line)
            lines += idle_lines(table, table.units[u].role, lay, o.op_costs)
    for r in plan_body["reshards"]:
        if (r.dst_phase == "generate" and r.method != "in_place") or r.bytes_per_device > 0:
            lines.append(
                f"Weight sync {r.role}: {r.method} over {r.link}, {r.bytes_per_device / 1e9:.2f} GB per device "
                f"(lower bound {r.lower_bound_bytes / 1e9:.2f} GB), {r.time_s:.2f} s."
            )
    return lines


def shared_prompts_line(unit: str, lay: Layout, costs: dict[str, PhaseCost], demand: dict[str, Demand]) -> str | None:
    """What computing each prompt once saves a unit that shares its prompts (``share_prompts``)."""
    if not lay.share_prompts:
        return None
    saved = sum(c.detail.get("shared_prompts", 0.0) for c in costs.values())
    total = sum(c.time for c in costs.values())
    group = max(demand[op].group for op in costs)
    if saved <= 0:
        return f"{unit}: shares prompts (pinned), though the cost model finds it does not pay here; the runtime shares only in micro-batches where the prompt tokens saved exceed a pass's fixed cost."
    if lay.pack_sequences:
        return (
            f"{unit}: each prompt computed once for the {group} rows that share it, its rows' responses after it in the same "
            f"packed line, each attending to the prompt and itself (shared prompts): {saved:.2f} s per step saved "
            f"({saved / (total + saved):.0%} of its ops)."
        )
    return (
        f"{unit}: each prompt computed once for the {group} rows that share it, then their responses on its KV cache "
        f"(shared prompts): {saved:.2f} s per step saved net of the extra pass ({saved / (total + saved):.0%} of its ops)."
    )


def idle_lines(table: OptionTable, role: str, lay: Layout, costs: dict[str, PhaseCost]) -> list[str]:
    """What leaving out an update's idle rows (advantages all zero: the workload's ``idle_rows``)
    saves, per update op that does: its cost with every row, on the same layout, less its cost."""
    out = []
    for op, c in costs.items():
        d = table.demand[op]
        if d.idle:
            every = replace(d, sequences=d.sequences + d.idle, idle=0)
            saved = train_cost(table.models[role], lay, every, table.hw, logits=True).time - c.time
            out.append(
                f"{op}: computes {d.sequences} of its {d.sequences + d.idle} rows — the rest have advantages all zero "
                f"(workload idle_rows) and its loss adds nothing for them (no entropy bonus or KL term): the same "
                f"gradient, {saved:.2f} s per step saved (run setting skip_idle_rows)."
            )
    return out


def packed_line(unit: str, lay: Layout, costs: dict[str, PhaseCost]) -> str | None:
    """What packing a unit's rows without their padding saves (``pack_sequences``)."""
    if not lay.pack_sequences:
        return None
    saved = sum(c.detail.get("padding_removed", 0.0) for c in costs.values())
    total = sum(c.time for c in costs.values())
    if saved <= 0:
        return (
            f"{unit}: packs the rows of a micro-batch that has padding (packed sequences); none is priced here "
            "(every response at the limit: give mean_response_len, or lengths_from a run, to price it)."
        )
    return (
        f"{unit}: rows packed without their padding, end to end in lines where each attends only to itself "
        f"(packed sequences): {saved:.2f} s per step of padding not computed ({saved / (total + saved):.0%} of its ops)."
    )
