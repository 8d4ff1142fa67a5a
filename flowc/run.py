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

import faulthandler
import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowc.errors import FlowcError, SpecError
from flowc.flows import Flow
from flowc.ir.cluster import ClusterSpec
from flowc.ir.graph import FlowGraph
from flowc.ir.plan import Plan
from flowc.ir.run_config import RunConfig
from flowc.ir.workload import WorkloadSpec

if TYPE_CHECKING:
    from flowc.runtime.controller import RunSpec

BUILTIN_WORKLOAD = "prompts=64,prompt_len=8,response_len=6"
USER_WORKLOAD = "prompts=16,prompt_len=256,response_len=256"
BUILTIN_STEPS = 800  # ~7 minutes on 2 CPU cores; held-out accuracy rises by ~20 points (docs/runtime.md)
BUILTIN_EVAL_EVERY = 20


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


@dataclass
class Prepared:
    """A run ready to start: what the controller runs, the plan it was lowered from,
    the Ray address to join (None: start Ray here)."""

    run: RunSpec
    plan: Plan
    address: str | None
    from_run_dir: bool = False  # resumed on the run directory's own plan


# ---------------------------------------------------------------------- run
def prepare(req: RunRequest) -> Prepared:
    """Trace, read the inputs, compile (or check) the plan and lower it."""
    from flowc.inputs import load_data, model_sources
    from flowc.rewards import bind_rewards
    from flowc.runtime.controller import RunSpec
    from flowc.runtime.program import lower
    from flowc.tasks import arithmetic as arith

    g = req.flow.trace(**req.overrides)
    out = Path(req.resume or req.out or f"runs/{g.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    sources, tokenizer = model_sources(g, req.models, out)
    data, eval_data = load_data(g, req.data, req.eval_data)
    builtin = req.data is None
    rewards, names = bind_rewards(g, req.rewards, (arith.exact_match, "flowc.tasks.arithmetic:exact_match") if builtin else None)
    plan, address, own = _plan(req, g, sources, out, builtin)
    spec = RunSpec(
        lower(plan, here=address is None), _config(req, builtin), sources, tokenizer, data, eval_data, rewards, names, out
    )
    return Prepared(spec, plan, address, own)


def _plan(req: RunRequest, g: FlowGraph, sources: dict[str, str], out: Path, builtin: bool) -> tuple[Plan, str | None, bool]:
    """The plan to run (a saved one, checked; else compiled here), the Ray address to join, and
    whether the plan is the run directory's own."""
    from flowc.compile import check_saved, compile_plan, saved_conflicts
    from flowc.planning import read_plan

    saved_path = (
        Path(req.plan_file) if req.plan_file else (out / "plan.json" if req.resume and (out / "plan.json").exists() else None)
    )
    if saved_path is not None:
        plan = read_plan(saved_path)
        what = f"the saved plan {saved_path}"
        check_saved(plan, g, sources, what=what)
        wrong = saved_conflicts(plan, workload=req.workload, pins=req.pins, rollout=req.rollout, config=req.config)
        if wrong:
            raise SpecError(f"options contradict {what}: {'; '.join(wrong)}", fix="drop them (the plan decides), or plan again")
        return plan, _join(req, plan.cluster_spec()), req.plan_file is None
    cluster, address = _cluster(req)
    wl = WorkloadSpec.parse(req.workload or (BUILTIN_WORKLOAD if builtin else USER_WORKLOAD))
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


def _config(req: RunRequest, builtin: bool) -> RunConfig:
    """The run's settings: the config, the built-in task's defaults where the config is silent, ``--steps``."""
    cfg = req.config
    if builtin and "steps" not in cfg.model_fields_set:
        cfg = cfg.model_copy(update={"steps": BUILTIN_STEPS})
    if builtin and "eval_every" not in cfg.model_fields_set:
        cfg = cfg.model_copy(update={"eval_every": BUILTIN_EVAL_EVERY})
    if req.steps:
        cfg = cfg.model_copy(update={"steps": req.steps})
    return cfg


def write_plan(p: Prepared) -> None:
    """plan.json, plan.html and program.txt in the run directory (a run resumed on its own plan keeps them)."""
    from flowc.export import to_html

    out = p.run.out_dir
    if p.from_run_dir:
        return
    (out / "plan.json").write_text(p.plan.to_json() + "\n")
    (out / "plan.html").write_text(to_html(p.plan, p.run.program.graph))
    (out / "program.txt").write_text(str(p.run.program))


class MetricsLog:
    """metrics.jsonl, plus TensorBoard events when tensorboard is installed."""

    def __init__(self, out: Path, resume_step: int) -> None:
        self.path = out / "metrics.jsonl"
        if resume_step == 0 and self.path.exists():
            self.path.unlink()
        elif self.path.exists():  # keep what was written up to the checkpoint
            kept = [ln for ln in self.path.read_text().splitlines() if ln and json.loads(ln).get("step", 0) <= resume_step]
            self.path.write_text("".join(k + "\n" for k in kept))
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tensorboard"))
        except Exception:
            self.tb = None

    def write(self, m: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(m) + "\n")
        if self.tb is not None:
            for k, v in m.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, m["step"])
            for k, v in m.get("measured_s", {}).items():
                self.tb.add_scalar(f"time/{k}/measured", v, m["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def run(req: RunRequest, *, progress: bool = True, on_step: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """Run to the last step; returns the run directory."""
    import ray

    from flowc.runtime.controller import Controller, init_ray

    p = prepare(req)
    spec, out = p.run, p.run.out_dir
    write_plan(p)
    ctl = Controller(spec)  # checks the run config against the program before Ray starts
    started = init_ray(p.address) if not ray.is_initialized() else False
    start_step = 0
    log: MetricsLog | None = None
    # Ctrl-C asks for a stop at the next step boundary (no Ray call is cut in half); a second one aborts
    stops = [0]

    def _on_sigint(signum: int, frame: Any) -> None:
        stops[0] += 1
        if stops[0] > 1:
            raise KeyboardInterrupt
        print("\nCtrl-C: stopping after the current step (press it again to abort now)", file=sys.stderr, flush=True)

    prev_handler = None
    if threading.current_thread() is threading.main_thread():
        prev_handler = signal.signal(signal.SIGINT, _on_sigint)
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints where a stuck run is
    try:
        ctl.start()
        (out / "placement.json").write_text(json.dumps(ctl.placement, indent=2))
        if req.resume:
            state = ctl.restore(out)
            start_step = int(state["step"])
        log = MetricsLog(out, start_step)
        cfg = spec.config
        bar = _Progress(cfg.steps, start_step, enabled=progress)
        with bar:
            if start_step == 0 and cfg.eval_every:
                first = {"step": 0, **ctl.evaluate()}
                log.write(first)
                ctl.history.append(first)
            for step in range(start_step, cfg.steps):
                m = ctl.run_step(step)
                if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
                    m.update(ctl.evaluate())
                log.write(m)
                ctl.history.append({k: v for k, v in m.items() if k not in ("measured_s", "predicted_s")})
                bar.update(m)
                if on_step is not None:
                    on_step(m)
                if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
                    ctl.save(step + 1, {"seed": cfg.seed, "data_position": (step + 1) * spec.program.workload.prompts})
                if stops[0]:
                    raise KeyboardInterrupt
        ctl.save(cfg.steps, {"seed": cfg.seed, "data_position": cfg.steps * spec.program.workload.prompts})
        ctl.export_policy(out / "final")
    except KeyboardInterrupt:
        raise FlowcError(
            f"interrupted; the last checkpoint in {out}/checkpoints is intact",
            fix=f"continue with: flowc run {req.flow.file} --resume {out}",
        ) from None
    finally:
        if prev_handler is not None:
            signal.signal(signal.SIGINT, prev_handler)
        if log is not None:
            log.close()
        ctl.shutdown()
        if started:
            ray.shutdown()
    return out


class _Progress:
    """A live bar: step, reward, accuracy, tokens/s, ETA."""

    def __init__(self, total: int, done: int, enabled: bool) -> None:
        self.enabled = enabled
        self.total = total
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.p = Progress(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                transient=False,
            )
            self.task = self.p.add_task("run", total=total, completed=done, info="")

    def __enter__(self) -> _Progress:
        if self.enabled:
            self.p.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            self.p.__exit__(*exc)

    def update(self, m: dict[str, Any]) -> None:
        if not self.enabled:
            return
        parts = []
        if "reward" in m:
            parts.append(f"reward {m['reward']:.3f}")
        if "accuracy" in m:
            parts.append(f"acc {m['accuracy']:.3f}")
        if "eval/accuracy" in m:
            parts.append(f"eval acc {m['eval/accuracy']:.3f}")
        if "eval/dpo_accuracy" in m:
            parts.append(f"eval pref acc {m['eval/dpo_accuracy']:.3f}")
        parts.append(f"{m['tokens_per_s']:.0f} tok/s")
        self.p.update(self.task, completed=m["step"], info=" · ".join(parts))
