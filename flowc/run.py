"""`flowc run`: plan a flow for the cluster at hand and train it.

With nothing but the flow file, the embedded default runs: a local Ray on this
machine's CPUs, the built-in arithmetic task, and the shipped warm-started
tiny model for every role. A user's own prompts come from ``--data`` (JSONL or
Parquet with a ``prompt`` column plus whatever columns their reward reads),
their scoring function from ``--reward ROLE=module:function``. ``--plan
plan.json`` runs a saved plan unchanged; ``--resume DIR`` continues a run on
the plan it was running.

:func:`prepare` reads the inputs, compiles (or checks) the plan, lowers it
and returns what the controller runs; :func:`run` runs it to the last step.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowc.data_source import absolute_data
from flowc.errors import FlowcError, Interrupted, SpecError
from flowc.flows import Flow
from flowc.ir.cluster import ClusterSpec
from flowc.ir.graph import FlowGraph
from flowc.ir.lora import LoraConfig
from flowc.ir.plan import Plan
from flowc.ir.run_config import RunConfig
from flowc.ir.workload import WorkloadSpec
from flowc.lengths import expand as expand_lengths
from flowc.progress import Progress
from flowc.run_record import RunRecord, absolute, absolute_model, absolute_reward, input_hashes
from flowc.run_stop import Stop, checkpoint_status, resume_fix
from flowc.tasks.builtin import BuiltinTask, arithmetic_task
from flowc.trackers import MetricsLog

if TYPE_CHECKING:
    from flowc.runtime.controller import RunSpec

BUILTIN_WORKLOAD = arithmetic_task().workload  # the built-in arithmetic task's (a flow with an environment: the calculator's)
USER_WORKLOAD = "prompts=16,prompt_len=256,response_len=256"


@dataclass
class RunRequest:
    flow: Flow
    overrides: dict[str, Any]
    models: dict[str, str]
    data: str | None
    eval_data: str | None
    rewards: dict[str, str]
    cluster: str
    workload: str | None
    steps: int | None
    out: str | None
    resume: str | None
    rollout: str | None
    pins: list[str]
    config: RunConfig
    plan_file: str | None = None  # a saved plan to run unchanged
    device: str | None = None  # the GPU type of a Ray cluster whose type Ray does not report
    record: RunRecord | None = None  # a resumed run's record (run.json), as this resume changes it
    envs: dict[str, str] = field(default_factory=dict)  # Environment role → module:Class


def record_of(req: RunRequest, config: RunConfig) -> RunRecord:
    """The run.json of a run started from ``req`` with its settings ``config``."""
    rec = RunRecord(
        flow=f"{Path(req.flow.file).resolve()}:{req.flow.name}",
        overrides=req.overrides,
        models={r: absolute_model(m) for r, m in req.models.items()},
        data=absolute_data(req.data),
        eval_data=absolute_data(req.eval_data),
        rewards={r: absolute_reward(s) for r, s in req.rewards.items()},
        envs={r: absolute_reward(s) for r, s in req.envs.items()},
        cluster=req.cluster,
        device=req.device,
        workload=req.workload,
        steps=config.steps,
        rollout=req.rollout,
        pins=req.pins,
        config=req.config.model_dump(mode="json", exclude_unset=True),
        plan_file=absolute(req.plan_file),
    )
    return rec.model_copy(update={"inputs": input_hashes(rec)})


def given_options(
    *,
    flow: Flow | None = None,
    overrides: dict[str, Any] | None = None,
    models: dict[str, str] | None = None,
    data: str | None = None,
    eval_data: str | None = None,
    rewards: dict[str, str] | None = None,
    envs: dict[str, str] | None = None,
    cluster: str | None = None,
    device: str | None = None,
    workload: str | None = None,
    steps: int | None = None,
    rollout: str | None = None,
    pins: list[str] | None = None,
    config: RunConfig | None = None,
    plan_file: str | None = None,
) -> dict[str, Any]:
    """The options a command gave (None: not given), normalised as run.json records them."""
    return {
        "flow": f"{Path(flow.file).resolve()}:{flow.name}" if flow is not None else None,
        "overrides": overrides or None,
        "models": {r: absolute_model(m) for r, m in models.items()} if models else None,
        "data": absolute_data(data),
        "eval_data": absolute_data(eval_data),
        "rewards": {r: absolute_reward(s) for r, s in rewards.items()} if rewards else None,
        "envs": {r: absolute_reward(s) for r, s in envs.items()} if envs else None,
        "cluster": cluster,
        "device": device,
        "workload": workload,
        "steps": steps,
        "rollout": rollout,
        "pins": pins or None,
        "config": config.model_dump(mode="json", exclude_unset=True) if config is not None else None,
        "plan_file": absolute(plan_file),
    }


def resume_request(run_dir: str, given: dict[str, Any], *, override: bool) -> RunRequest:
    """The request that continues the run in ``run_dir``: its run.json, with the options
    ``given`` where they only say where and how long it runs; a contradiction is refused
    (each listed) unless ``override``."""
    from flowc.loader import load_flow

    rec = RunRecord.read(Path(run_dir))
    flags, files = rec.contradictions(given), rec.changed_inputs()
    if (flags or files) and not override:
        fix = (
            f"continue it as it was: flowc run --resume {run_dir} (add --steps N to change its length), or pass --override to change it"
            if flags
            else "restore the file as it was, or pass --override to continue with it as it is now"
        )
        raise SpecError(f"this command contradicts the run in {run_dir}: " + "; ".join(flags + files), fix=fix)
    have = rec.options()
    changed = {k: v for k, v in given.items() if v is not None and v != have[k]}
    rec = rec.resumed(changed)
    return RunRequest(
        flow=load_flow(rec.flow),
        overrides=rec.overrides,
        models=rec.models,
        data=rec.data,
        eval_data=rec.eval_data,
        rewards=rec.rewards,
        envs=rec.envs,
        cluster=rec.cluster,
        workload=rec.workload,
        steps=rec.steps,
        out=run_dir,
        resume=run_dir,
        rollout=rec.rollout,
        pins=rec.pins,
        config=rec.run_config(),
        plan_file=rec.plan_file,
        device=rec.device,
        record=rec,
    )


@dataclass
class Prepared:
    """A run ready to start: what the controller runs, the plan it was lowered from,
    the Ray address to join (None: start Ray here)."""

    run: RunSpec
    plan: Plan
    address: str | None
    from_run_dir: bool = False  # resumed on the run directory's own plan


def with_measured_lengths(req: RunRequest) -> RunRequest:
    """``req`` with a ``--workload lengths_from=RUN_DIR`` replaced by the response lengths that run
    measured (mean and percentiles; said on the console); unchanged without one."""
    words, measured = expand_lengths(req.workload)
    for line in measured:
        print(f"note: {line}", file=sys.stderr)
    return dataclasses.replace(req, workload=words) if measured else req


# ---------------------------------------------------------------------- run
def prepare(req: RunRequest, *, dry_run: bool = False) -> Prepared:
    """Trace, read the inputs, compile (or check) the plan and lower it. ``dry_run``: the same,
    without creating the run folder (`flowc run --dry-run`, `flowc plan`): random weights a
    run would write there go to a temporary folder, deleted before this returns."""
    import tempfile

    req = with_measured_lengths(req)
    g = req.flow.trace(**req.overrides)
    out = Path(req.resume or req.out or f"runs/{g.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    if not dry_run:
        return _prepare(req, g, _run_dir(out), out)
    with tempfile.TemporaryDirectory(prefix="flowc-dry-run-") as scratch:
        return _prepare(req, g, out, out if out.is_dir() else Path(scratch), dry_run=True)


def _prepare(req: RunRequest, g: FlowGraph, out: Path, models_dir: Path, *, dry_run: bool = False) -> Prepared:
    from flowc.envs import bind_envs, check_envs
    from flowc.inputs import check_data, load_data, model_sources
    from flowc.rewards import bind_rewards, reward_notes
    from flowc.runtime.controller import RunSpec
    from flowc.runtime.inline import choose_executor
    from flowc.runtime.program import lower
    from flowc.tasks.builtin import builtin_task
    from flowc.trackers import check_trackers

    check_trackers(req.config.report_to)  # a tracker's missing package is refused before anything starts
    sources, tokenizer, notes = model_sources(g, req.models, models_dir, init=req.config.init)
    for line in notes:  # what the user should know about the weights (random, a fresh critic head)
        print(f"note: {line}", file=sys.stderr)
    data, eval_data = load_data(g, req.data, req.eval_data)
    task = builtin_task(g) if req.data is None else None
    rewards, names = bind_rewards(g, req.rewards, task.reward if task else None)
    envs = bind_envs(g, req.envs, task.env if task else None, req.config)
    for line in reward_notes(rewards, names):  # the convention recognised (verl's, TRL's) and how it is called
        print(f"note: {line}", file=sys.stderr)
    plan, address, own = _plan(req, g, sources, out, task.workload if task else USER_WORKLOAD)
    check_data(g, [data, eval_data], tokenizer, plan.workload, rewards, names)  # every row, before the first step
    if envs and not dry_run:
        check_envs(envs, data.rows, data.prompt_key, tokenizer)  # stop strings, and a reset from the first row
    if not dry_run:
        _check_space(out, plan, req.config.keep_checkpoints)
    program, cfg = lower(plan, here=address is None), _config(req, task)
    executor = choose_executor(cfg.executor, program, local=address is None)
    spec = RunSpec(program, cfg, sources, tokenizer, data, eval_data, rewards, names, out, executor=executor, envs=envs)
    return Prepared(spec, plan, address, own)


def _plan(req: RunRequest, g: FlowGraph, sources: dict[str, str], out: Path, workload: str) -> tuple[Plan, str | None, bool]:
    """The plan to run (a saved one, checked; else compiled here), the Ray address to join, and
    whether the plan is the run directory's own."""
    from flowc.compile import check_saved, compile_plan, saved_conflicts
    from flowc.planning import read_plan

    own = req.resume is not None and (out / "plan.json").exists()  # a resume runs on the run's own plan
    saved_path = out / "plan.json" if own else (Path(req.plan_file) if req.plan_file else None)
    if saved_path is not None:
        plan = read_plan(saved_path)
        what = f"the run's plan {saved_path}" if own else f"the saved plan {saved_path}"
        check_saved(plan, g, sources, what=what)
        # a resume recorded its options with the plan: only what --override changed can contradict it
        if own and req.record is not None:
            opts = req.record.resumes[-1].get("override", {}) if req.record.resumes else {}
        else:
            opts = vars(req)
        wrong = saved_conflicts(
            plan,
            workload=opts.get("workload"),
            pins=list(opts.get("pins") or []),
            rollout=opts.get("rollout"),
            config=_as_config(opts.get("config")),
        )
        if wrong:
            fix = "start a new run to change what the plan decided" if own else "drop them (the plan decides), or plan again"
            raise SpecError(f"options contradict {what}: {'; '.join(wrong)}", fix=fix)
        return plan, _join(req, plan.cluster_spec()), own
    cluster, address = _cluster(req)
    wl = WorkloadSpec.parse(req.workload or workload)
    plan = compile_plan(
        g,
        sources,
        cluster,
        wl,
        req.config,
        pin_words=req.pins,
        rollout=req.rollout,
        split_local=req.cluster == "local",
        here=address is None,
    )
    return plan, address, False


def _run_dir(out: Path) -> Path:
    """The run folder, created and shown to be writable."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".flowc-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise SpecError(
            f"cannot write the run folder {out}: {e.strerror or e}", fix="choose another --out, or fix its permissions"
        ) from None
    return out


def checkpoint_bytes(plan: Plan) -> float:
    """What one checkpoint of ``plan`` takes on disk: every trained role's fp32 weights and
    Adam's two moments (12 bytes a parameter; with LoRA, a parameter of the adapters only)."""
    from flowc.ir.models import ModelSpec

    def trained(model: str, params_b: float, lora: LoraConfig | None) -> float:
        if lora is None:
            return params_b * 1e9
        return float(ModelSpec.resolve(model).model_copy(update={"lora": lora}).trained_params)

    return sum(12.0 * trained(rp.model, rp.params_b, rp.lora) for rp in plan.roles.values() if "train" in rp.phases)


def _check_space(out: Path, plan: Plan, keep: int) -> None:
    """Room for the checkpoints the run keeps, one being written, and the exported policy."""
    import shutil

    one = checkpoint_bytes(plan)
    need = (keep + 1) * one + 4.0 * max((rp.params_b * 1e9 for rp in plan.roles.values()), default=0.0)
    free = shutil.disk_usage(out).free
    if free < need:
        raise SpecError(
            f"{out} has {free / 1e9:.1f} GB free; the run needs about {need / 1e9:.1f} GB "
            f"({keep + 1} checkpoints of {one / 1e9:.1f} GB and the exported policy)",
            fix="free space there, choose another --out, or keep fewer checkpoints (keep_checkpoints in the run config)",
        )


def _as_config(c: RunConfig | dict[str, Any] | None) -> RunConfig:
    return c if isinstance(c, RunConfig) else RunConfig.model_validate(c or {})


def _cluster(req: RunRequest) -> tuple[ClusterSpec, str | None]:
    """(the cluster to plan for, the Ray address to join or None)."""
    if req.cluster == "local" or req.cluster.startswith("local:"):
        return ClusterSpec.parse(req.cluster), None
    from flowc.clusters import join

    cluster, _ = join(req.cluster, req.device)
    return cluster, req.cluster


def _join(req: RunRequest, planned: ClusterSpec) -> str | None:
    """The Ray address a saved plan runs on, checked to be the cluster it was planned for."""
    if req.cluster == "local" or req.cluster.startswith("local:"):
        if planned.profile.kind != "cpu":
            raise SpecError(
                f"the saved plan is for {planned.name}, not this machine's CPUs",
                fix="run it with --cluster ADDRESS of that cluster",
            )
        return None
    from flowc.clusters import join

    have, _ = join(req.cluster, req.device)
    if (have.device, have.nodes, have.devices_per_node) != (planned.device, planned.nodes, planned.devices_per_node):
        raise SpecError(
            f"the saved plan is for {planned.nodes}x{planned.devices_per_node}x{planned.device}, the cluster at {req.cluster} "
            f"is {have.nodes}x{have.devices_per_node}x{have.device}",
            fix="plan again for this cluster",
        )
    return req.cluster


def _config(req: RunRequest, task: BuiltinTask | None) -> RunConfig:
    """The run's settings: the config, the built-in task's defaults where the config is silent, ``--steps``."""
    cfg = req.config
    if task is not None and "steps" not in cfg.model_fields_set:
        cfg = cfg.model_copy(update={"steps": task.steps})
    if task is not None and "eval_every" not in cfg.model_fields_set:
        cfg = cfg.model_copy(update={"eval_every": task.eval_every})
    if req.steps is not None:
        if req.steps < 1:
            raise SpecError(f"--steps {req.steps}: a run takes at least one step", fix="give --steps N with N >= 1")
        cfg = cfg.model_copy(update={"steps": req.steps})
    return cfg


def _note_env_errors(m: dict[str, Any], seen: set[str]) -> None:
    """Tell the user, once per kind, why environments ended trajectories (the step's metrics count them)."""
    for e in m.get("agent/errors") or []:
        kind = e.split(":", 2)[:2]
        key = ":".join(kind)
        if key not in seen:
            seen.add(key)
            counter = {"error": "env_errors", "timeout": "env_timeouts", "lost": "env_lost"}.get(kind[0].strip(), "env_errors")
            print(
                f"note: step {m['step']}: an environment ended a trajectory — {e[:300]} (agent/{counter} counts them)",
                file=sys.stderr,
            )


def write_plan(p: Prepared) -> None:
    """plan.json, plan.html and program.txt in the run directory (a run resumed on its own plan keeps them)."""
    from flowc.export import to_html

    out = p.run.out_dir
    if p.from_run_dir:
        return
    (out / "plan.json").write_text(p.plan.to_json() + "\n")
    (out / "plan.html").write_text(to_html(p.plan, p.run.program.graph))
    (out / "program.txt").write_text(str(p.run.program))


def run(req: RunRequest, *, progress: bool = True, on_step: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """Run to the last step; returns the run directory.

    SIGINT (Ctrl-C) and SIGTERM (``timeout``, Slurm, Kubernetes) stop the run at the next step
    boundary, after a checkpoint of that step, with :class:`Interrupted` (exit code 130 or 143);
    a second signal aborts at once (the last finished checkpoint stays intact)."""
    import ray

    from flowc.replan import maybe_replan
    from flowc.runtime.controller import Controller
    from flowc.runtime.ray_session import init_ray, shutdown_ray

    req = with_measured_lengths(req)  # what run.json records: the mean, not a folder that may change
    p = prepare(req)
    spec, out = p.run, p.run.out_dir
    write_plan(p)
    (req.record or record_of(req, spec.config)).write(out)
    ctl = Controller(spec)  # checks the run config against the program before Ray starts
    ctl.clean_checkpoints()  # what an earlier run left half-written
    # the inline executor runs the one worker and the rewards in this process and its children: no Ray
    started = init_ray(p.address) if spec.executor == "ray" and not ray.is_initialized() else False
    stop = Stop()
    resume = f"flowc run --resume {out}"
    log: MetricsLog | None = None
    try:
        with stop.installed():
            ctl.start()
            (out / "placement.json").write_text(json.dumps(ctl.placement, indent=2))
            start_step = int(ctl.restore(out)["step"]) if req.resume else 0
            cfg = spec.config
            if start_step >= cfg.steps:
                raise SpecError(
                    f"the run in {out} is at step {start_step} already; it was asked for {cfg.steps}",
                    fix=f"extend it: {resume} --steps N with N > {start_step}",
                )
            log = MetricsLog(
                out, start_step, cfg.report_to, run_name=out.name, config=cfg.model_dump(mode="json", exclude_unset=True)
            )
            bar = Progress(cfg.steps, start_step, enabled=progress)
            current = p.plan  # the plan as re-planning last left it (its lengths, its staleness)
            with bar:
                if start_step == 0 and cfg.eval_every:
                    first = {"step": 0, **ctl.evaluate()}
                    log.write(first)
                    ctl.history.append(first)
                seen_errors: set[str] = set()
                for step in range(start_step, cfg.steps):
                    m = ctl.run_step(step)
                    _note_env_errors(m, seen_errors)
                    if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
                        m.update(ctl.evaluate())
                    log.write(m)
                    ctl.history.append(
                        {k: v for k, v in m.items() if k not in ("measured_s", "predicted_s", "timeline_s", "samples")}
                    )
                    if cfg.replan_every and (step + 1) % cfg.replan_every == 0 and step + 1 < cfg.steps:
                        current = maybe_replan(req, p, ctl, current, step + 1, log)
                    bar.update(m)
                    if on_step is not None:
                        on_step(m)
                    due = cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0
                    if stop.signum is not None or (due and step + 1 < cfg.steps):
                        with stop.deferred():  # a second signal waits until the checkpoint is whole
                            if stop.signum is not None:  # the weight syncs staleness ≥ 2 deferred are checked too
                                ctl.flush_syncs()
                            path = ctl.save(
                                step + 1, {"seed": cfg.seed, "data_position": (step + 1) * spec.program.workload.prompts}
                            )
                    if stop.signum is not None:
                        raise Interrupted(
                            f"stopped by {stop.name} after step {step + 1} of {cfg.steps}; checkpoint {path} written",
                            exit_code=128 + stop.signum,
                            fix=f"continue with: {resume}",
                        )
            with stop.deferred():
                ctl.save(cfg.steps, {"seed": cfg.seed, "data_position": cfg.steps * spec.program.workload.prompts})
                ctl.export_policy(out / "final")
    except KeyboardInterrupt:
        if not stop.aborted:
            raise
        raise Interrupted(
            f"aborted by a second {stop.name} during the run; {checkpoint_status(out)}",
            exit_code=128 + (stop.signum or signal.SIGINT),
            fix=resume_fix(out, resume),
        ) from None
    except Interrupted:
        raise
    except FlowcError as e:
        if e.fix is None or "--resume" not in e.fix:
            e.fix = f"{e.fix + '; then ' if e.fix else ''}{resume_fix(out, resume)} ({checkpoint_status(out)})"
        raise
    finally:
        if log is not None:
            log.close()
        ctl.shutdown()
        if started:
            shutdown_ray()
    return out
