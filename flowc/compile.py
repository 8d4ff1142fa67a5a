"""The plan a run executes: compiled for the cluster at hand within what the
runtime executes, or a saved plan (``--plan``, or the run's own on
``--resume``) checked against the flow, the models and the options given.

A plan is the whole compiled artifact (its graph, layouts, sync methods and
target); once it exists nothing here or in the runtime decides anything
again, so a saved plan runs unchanged.
"""

from __future__ import annotations

import os

from flowc.errors import InfeasibleError, SpecError
from flowc.ir.cluster import ClusterSpec
from flowc.ir.graph import FlowGraph
from flowc.ir.lora import LoraConfig, check_lora_backend
from flowc.ir.lora import refusal as lora_refusal
from flowc.ir.models import ModelSpec
from flowc.ir.ops import Op
from flowc.ir.plan import Plan
from flowc.ir.run_config import RunConfig
from flowc.ir.serialize import to_dict
from flowc.ir.workload import WorkloadSpec
from flowc.lengths import expand as expand_lengths
from flowc.passes.pins import Pins, parse_pins
from flowc.planning import check_backend_pins, fit_rollout, run_target, runtime_pins


def compile_plan(
    g: FlowGraph,
    sources: dict[str, str],
    cluster: ClusterSpec,
    workload: WorkloadSpec,
    config: RunConfig,
    *,
    pin_words: list[str],
    rollout: str | None,
    split_local: bool,
    here: bool = True,
) -> Plan:
    """Plan ``g`` for ``cluster`` within what the runtime executes. On this machine's
    CPUs (``split_local``) how many worker processes to split the cores into is a
    decision too: every split is planned and the fastest kept. ``here``: the workers run on
    this machine, so only the backends installed here are candidates (on a remote cluster,
    every one; its workers load them)."""
    from flowc.passes.pipeline import make_plan

    kind = cluster.profile.kind
    user = parse_pins(pin_words)
    check_backend_pins(user, kind)
    loras = lora_roles(g, config, user)
    asked = "staleness" in config.model_fields_set  # (an explicit 0 counts)
    if asked and user.staleness is not None and user.staleness != config.staleness:
        raise SpecError(
            f"--pin staleness={user.staleness} and staleness={config.staleness} in the run config disagree",
            fix="give the staleness once (--staleness K)",
        )
    if asked:  # the run's staleness is a decision of its plan: priced, then executed
        user = user.merged(Pins(staleness=config.staleness))
    pins = runtime_pins(kind).merged(user)
    if loras:  # only fsdp2 trains LoRA adapters: the planner chooses among its layouts for those roles
        pins = pins.merged(parse_pins([f"{r}.train.backend=fsdp2" for r in loras]))
    if workload.idle_rows and not config.skip_idle_rows:  # the run computes every row: priced so
        workload = workload.model_copy(update={"idle_rows": 0.0})
    candidates = [cluster]
    if split_local:
        cores = os.cpu_count() or 1
        candidates = [ClusterSpec.local(d) for d in range(1, cores + 1) if cores % d == 0]
    best: Plan | None = None
    for c in candidates:
        target = run_target(c, config, rollout, here=here)
        specs = role_specs(sources, loras, target.dtype)
        for r, lora in loras.items():
            if why := lora_refusal(specs[r], lora):
                raise SpecError(
                    f"{r}: {why}",
                    fix=f"adapt the attention only (--set optim.{r}.lora.target_modules=[q_proj,k_proj,v_proj,o_proj]) "
                    f"or train every weight (drop optim.{r}.lora)",
                )
        fitted, notes = fit_rollout(g, specs, target, pins)  # e.g. a head_dim vLLM's CPU build cannot run: hf
        try:
            plan, _, _ = make_plan(g, specs, c, workload, fitted, target=target)
        except InfeasibleError:  # e.g. pins that need two pools: one worker cannot hold them, two may
            if c is candidates[-1] and best is None:
                raise
            continue
        if notes:
            plan = plan.model_copy(update={"why": [*notes, *plan.why]})
        if best is None or plan.predicted.step_time_s < best.predicted.step_time_s:
            best = plan
    return best


def role_specs(sources: dict[str, str], loras: dict[str, LoraConfig], dtype: str) -> dict[str, ModelSpec]:
    """Each role's model as the planner prices it: its source resolved, in the run's dtype, with
    its LoRA adapters (:func:`lora_roles`)."""
    return {r: ModelSpec.resolve(src).model_copy(update={"dtype": dtype, "lora": loras.get(r)}) for r, src in sources.items()}


def lora_roles(g: FlowGraph, config: RunConfig, pins: Pins | None = None) -> dict[str, LoraConfig]:
    """The trained roles whose optimizer asks for LoRA adapters (``optim.ROLE.lora.rank`` > 0, or
    ``default_optim``'s), each checked against a training backend the user pinned."""
    out = {}
    for role in dict.fromkeys(n.role for n in g.nodes if n.op == Op.UPDATE):
        lora = config.optim_for(role).lora
        if not lora.enabled:
            continue
        pinned = pins.phase(role, "train").backend if pins is not None else None
        if pinned:
            check_lora_backend(role, lora, pinned)
        out[role] = lora
    return out


def check_saved(plan: Plan, g: FlowGraph, sources: dict[str, str], *, what: str) -> None:
    """``plan`` (named ``what`` in errors) is a plan of this flow, with these hyperparameters and
    models, and its rollout backends run those models."""
    from flowc.runtime.backends import backend

    if plan.flow != g.name:
        raise SpecError(f"{what} is a plan of flow {plan.flow!r}, not {g.name!r}", fix="give the plan of this flow")
    again = (
        "start a new run (a run keeps the plan it started with)"
        if what.startswith("the run's plan")
        else "plan the flow again (flowc plan … --for-run -o plan.json)"
    )
    if g.max_staleness is not None and plan.staleness > g.max_staleness:
        raise SpecError(
            f"{what} runs the rollouts {plan.staleness} weight version(s) behind the trainer, but flow {g.name!r}"
            f" declares @fc.flow(max_staleness={g.max_staleness})",
            fix=again,
        )
    if plan.staleness and not plan.steady_state:
        raise SpecError(
            f"{what} runs the rollouts {plan.staleness} weight version(s) ahead but records no steady state: an earlier"
            " flowc made it, pricing the pipelined loop by a formula that can be wrong",
            fix=again,
        )
    if _shape(to_dict(g)) != _shape(plan.graph):
        raise SpecError(
            f"{what} was planned for another version of flow {g.name!r} (its graph or hyperparameters differ)",
            fix="plan the flow again (flowc plan … --for-run -o plan.json), or give the hyperparameters it was planned with",
        )
    for role, src in sources.items():
        m, rp = ModelSpec.resolve(src), plan.roles.get(role)
        if rp is None:
            continue
        if (float(f"{m.params_total / 1e9:.6g}"), float(f"{m.params_active / 1e9:.6g}")) != (rp.params_b, rp.active_params_b):
            raise SpecError(
                f"{what} plans {role} as {rp.model} ({rp.params_b:g}B parameters), but its model is {src} ({m.params_total / 1e9:g}B)",
                fix=f"give the model the plan was made for (--model {role}=…), or plan again",
            )
        gen = rp.phases.get("generate")
        if gen is not None and (why := backend(gen.layout.backend).refuses(plan.target.kind, m)):
            raise SpecError(
                f"{what} generates {role} with {gen.layout.backend}, which {why}",
                fix="plan again without --plan (the planner picks a rollout backend that runs the model), or give another model",
            )


def _lora_text(lora: LoraConfig | None) -> str:
    return f"{lora.short()} dropout {lora.dropout:g}" if lora is not None and lora.enabled else "off"


def _shape(graph: dict) -> tuple:
    """What must match between a traced graph and a plan's: nodes (without the analyses' meta
    or the planner's weight syncs), roles and hyperparameters."""
    nodes = [{k: v for k, v in n.items() if k not in ("meta", "line")} for n in graph["nodes"] if n["op"] != str(Op.WEIGHT_SYNC)]
    return (graph["roles"], graph["hyperparams"], nodes)


def saved_conflicts(plan: Plan, *, workload: str | None, pins: list[str], rollout: str | None, config: RunConfig) -> list[str]:
    """The options given beside a saved plan that contradict a decision in it (the plan wins only when none do)."""
    out = []
    # both read as WorkloadSpec: a plan saved before a workload field existed holds no key for it
    if workload is not None and WorkloadSpec.parse(expand_lengths(workload)[0]) != WorkloadSpec(**plan.workload):
        out.append(f"--workload {workload} (the plan's: {WorkloadSpec(**plan.workload).model_dump(exclude_defaults=True)})")
    if pins:
        out.append(f"--pin {' '.join(pins)} (a saved plan fixes every decision)")
    if "staleness" in config.model_fields_set and config.staleness not in ("auto", plan.staleness):
        out.append(f"staleness={config.staleness} (the plan's: {plan.staleness})")
    gens = {pp.layout.backend for rp in plan.roles.values() for ph, pp in rp.phases.items() if ph == "generate"}
    if rollout is not None and gens and gens != {rollout}:
        out.append(f"--rollout {rollout} (the plan generates with {', '.join(sorted(gens))})")
    t = plan.target
    for field, have in (("dtype", t.dtype), ("timeout_s", t.timeout_s), ("cpus_per_worker", t.cpus_per_worker)):
        if (
            field in config.model_fields_set
            and getattr(config, field) != have
            and not (field == "dtype" and config.dtype == "auto")
        ):
            out.append(f"config {field}={getattr(config, field)} (the plan's: {have})")
    for role, rp in plan.roles.items():
        if "train" not in rp.phases:
            continue
        o = config.optim_for(role)
        if "lora" not in o.model_fields_set:  # the config is silent: the plan's adapters (or none) run
            continue
        want = o.lora
        if (want if want.enabled else None) != rp.lora:
            out.append(f"config optim.{role}.lora: {_lora_text(want)} (the plan's: {_lora_text(rp.lora)})")
    return out
