"""The ``flowc`` command line.

Every command prints a :class:`~flowc.errors.FlowcError` as ``file:line:
what`` plus a ``fix:`` line, without a traceback, and exits with status 1.
``flowc -v …`` (or ``FLOWC_TRACEBACK=1``) shows the Python traceback as well.
"""

from __future__ import annotations

import json
import os
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated

# torch's C++ warnings (vLLM's CPU build logs its NUMA memory binding through them) stay off the
# console, as in the Ray workers (ray_session.WORKER_ENV); read once, when torch loads, so set here
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import typer
from rich.console import Console
from rich.markup import escape

from flowc._version import __version__
from flowc.cli_requests import role_pairs, run_request
from flowc.errors import FlowcError

app = typer.Typer(
    name="flowc",
    help="flowc: write an RL algorithm as a @flow; trace it, plan it, run it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
err_console = Console(stderr=True, highlight=False, soft_wrap=True)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"flowc {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool | None, typer.Option("--version", "-V", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = None,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="On an error, print the Python traceback too (for bug reports).")
    ] = False,
) -> None:
    """flowc: write an RL algorithm as a @flow; trace it, plan it, run it."""
    if verbose:
        os.environ["FLOWC_TRACEBACK"] = "1"


class GraphFormat(str, Enum):
    text = "text"
    dot = "dot"
    mermaid = "mermaid"


FileArg = Annotated[str, typer.Argument(help="A Python file with one @fc.flow, or FILE:NAME to pick one.", metavar="FILE")]
OverridesArg = Annotated[
    list[str] | None, typer.Argument(help="Hyperparameter overrides, e.g. n=4 clip=0.28.", metavar="[NAME=VALUE]...")
]


@app.command()
def graph(
    file: FileArg,
    overrides: OverridesArg = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the graph as JSON (nodes and edges).")] = False,
    fmt: Annotated[GraphFormat, typer.Option("--format", "-f", help="Output format when not --json.")] = GraphFormat.text,
) -> None:
    """Trace the flow in FILE and print its dataflow graph."""
    from flowc.ir.serialize import to_dict
    from flowc.ir.text import format_graph, to_dot, to_mermaid
    from flowc.ir.verify import verify
    from flowc.loader import load_flow

    fl = load_flow(file)
    g = fl.trace(**fl.parse_overrides(overrides or []))
    verify(g)
    if as_json:
        typer.echo(json.dumps(to_dict(g), indent=2))
    elif fmt is GraphFormat.dot:
        typer.echo(to_dot(g), nl=False)
    elif fmt is GraphFormat.mermaid:
        typer.echo(to_mermaid(g), nl=False)
    else:
        typer.echo(format_graph(g), nl=False)


ModelOpt = Annotated[
    list[str] | None,
    typer.Option("--model", "-m", help="ROLE=MODEL: a catalogue name, an HF config.json or model directory. Repeat per role."),
]
ClusterOpt = Annotated[
    str | None,
    typer.Option("--cluster", "-c", help="local, NODESxDEVICESxTYPE (16x8xA100-80GB, 2x8xH100) or a YAML file. Default: local."),
]
WorkloadOpt = Annotated[
    str | None,
    typer.Option(
        "--workload",
        "-w",
        help="k=v,…: prompts, prompt_len, response_len, mean_response_len, response_percentiles (MIN/P50/P90/P99/MAX),"
        " mean_response_cv (how much a step's mean length varies from step to step, 0-1: 0.2 = ±20 %),"
        " idle_rows (the share of update rows with zero advantages, 0-1), mini_batches,"
        " epochs, train_micro_batch, forward_micro_batch; multi-turn: turns, obs_len, env_latency_s;"
        " lengths_from=RUN_DIR: the lengths (and idle rows) a run measured.",
    ),
]
PinOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--pin",
        "-p",
        help="Fix a decision: ROLE.PHASE.FIELD=VALUE, colocate=a,b;c, reshard.ROLE=METHOD, or a YAML plan fragment. Repeatable.",
    ),
]
PlanOpt = Annotated[str | None, typer.Option("--plan", help="A saved plan (JSON) to reproduce: its decisions become pins.")]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        "-s",
        help="KEY=VALUE: override one run setting on top of --config (dotted: optim.actor.lr=1e-5, "
        "workload.prompts=64, report_to=[wandb]); values are YAML scalars. Repeatable.",
        metavar="KEY=VALUE",
    ),
]
ConfigOpt = Annotated[
    str | None,
    typer.Option("--config", help="A YAML run config (RunConfig fields, plus model/data/reward/cluster/workload)."),
]
ForRunOpt = Annotated[
    bool,
    typer.Option(
        "--for-run",
        help="Plan within what flowc run executes (its backends' limits, whole-tensor weight sync): a plan flowc run --plan runs.",
    ),
]


def _plan(file: str, overrides, model, cluster, workload, pin, plan_file, for_run=False):
    from flowc.loader import load_flow
    from flowc.passes.pipeline import make_plan
    from flowc.planning import build_request, same_decisions

    fl = load_flow(file)
    g = fl.trace(**fl.parse_overrides(overrides or []))
    req = build_request(
        g, model_words=model, cluster=cluster, workload=workload, pin_words=pin, plan_file=plan_file, for_run=for_run
    )
    plan, planned, ctx = make_plan(g, req.models, req.cluster, req.workload, req.pins, target=req.target)
    if req.saved is not None:
        diffs = same_decisions(plan, req.saved)
        if not diffs:
            plan = req.saved
        else:
            err_console.print(
                f"[yellow]note:[/] re-planning the saved plan changed: {', '.join(diffs)} (this flowc's cost model differs); printing the new plan"
            )
    return plan, planned, ctx, req


StalenessOpt = Annotated[
    str | None,
    typer.Option(
        "--staleness",
        help="Plan a loop whose rollouts lag the trainer by up to K weight versions (its steady state); "
        "auto: the planner chooses K. Same as --pin staleness=K.",
    ),
]


def _with_staleness(pin: list[str] | None, staleness: str | None) -> list[str] | None:
    """``pin`` with ``--staleness K`` added as ``staleness=K``: K checked here, so that a bad one is
    named as the option the user gave, and refused where a pin already says another."""
    if staleness is None:
        return pin
    from flowc.ir.run_config import MAX_STALENESS
    from flowc.passes.pins import parse_pins

    k = staleness.strip().lower()
    if k != "auto" and not (k.isdigit() and int(k) <= MAX_STALENESS):
        raise FlowcError(
            f"--staleness {staleness!r}: not a staleness",
            fix=f"give a whole number of weight versions from 0 to {MAX_STALENESS} (0: lock-step), or auto",
        )
    pinned = parse_pins(pin or []).staleness
    if pinned is not None and str(pinned) != k:
        raise FlowcError(f"--staleness {staleness} contradicts --pin staleness={pinned}", fix="give the staleness once")
    return [*(pin or []), f"staleness={k}"]


@app.command()
def plan(
    file: FileArg,
    overrides: OverridesArg = None,
    model: ModelOpt = None,
    cluster: ClusterOpt = None,
    workload: WorkloadOpt = None,
    pin: PinOpt = None,
    plan_file: PlanOpt = None,
    for_run: ForRunOpt = False,
    data: Annotated[
        str | None, typer.Option("--data", help="The prompts flowc run would read: plan the run's workload for them.")
    ] = None,
    reward: Annotated[list[str] | None, typer.Option("--reward", "-r", help="ROLE=module:function, as flowc run.")] = None,
    rollout: Annotated[str | None, typer.Option("--rollout", help="Generation backend, as flowc run.")] = None,
    config: ConfigOpt = None,
    sets: SetOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan as JSON.")] = False,
    out: Annotated[str | None, typer.Option("--out", "-o", help="Also save the plan as JSON to this path.")] = None,
    staleness: Annotated[
        str | None,
        typer.Option(
            "--staleness",
            help="Plan a loop whose rollouts lag the trainer by up to K weight versions (its steady state), "
            "and compare it with the best lock-step plan; auto: the planner chooses K. Same as --pin staleness=K.",
        ),
    ] = None,
) -> None:
    """Plan where and how every role of the flow runs, and explain why.

    On a cluster flowc run can run on (none given, local, local:N or a Ray address) with models
    it can load (the built-in one, local folders, cached hub ids), this is the plan `flowc run`
    with the same options runs (its workload, backends and worker split; `flowc run --dry-run`
    prints the same). For hardware described by a shorthand (16x8xH100) or a YAML file, or a
    catalogue model, it is a what-if plan for the planner's default workload unless --workload.
    """
    import time

    from flowc.ir.plan_text import format_plan

    t0 = time.perf_counter()
    lock_step_pins = [*(pin or []), "staleness=0"]  # the comparison's: the user's pins, lock-step (last wins)
    pin = _with_staleness(pin, staleness)
    if _previews_run(cluster, model, plan_file) or data or config or sets or reward or rollout:
        if plan_file:
            raise FlowcError(
                "--plan re-plans a saved plan; it takes no run options", fix="drop --data/--config/--set/--reward/--rollout"
            )
        req = run_request(
            file, overrides, model=model, data=data, eval_data=None, reward=reward, env=None, cluster=cluster or "local",
            device=None, plan_file=None, workload=workload, steps=None, out=None, resume=None, override=False,
            rollout=rollout, pin=pin, config=config, sets=sets, report_to=None,
        )  # fmt: skip
        _print_run_plan(req, as_json=as_json, save=out)
        return
    p, _, _, req = _plan(file, overrides, model, cluster, workload, pin, plan_file, for_run)
    if out:
        from pathlib import Path

        Path(out).write_text(p.to_json() + "\n")
    if as_json:
        typer.echo(p.to_json())
    else:
        typer.echo(format_plan(p), nl=False)
        if p.staleness and not plan_file:  # (a saved plan is printed as saved: its decisions, not another search's)
            typer.echo(_beside_lock_step(p, _plan(file, overrides, model, cluster, workload, lock_step_pins, None, for_run)[0]))
        for n in req.notes or []:
            err_console.print(f"note: {escape(n)}")
        err_console.print(f"planned in {time.perf_counter() - t0:.2f} s")


def _beside_lock_step(ahead, lock) -> str:
    """The pipelined plan and the best lock-step plan, side by side."""

    def where(p) -> str:
        return " | ".join(f"{x.name} ×{x.device_count}" for x in p.pools)

    k, a, b = ahead.staleness, ahead.predicted.step_time_s, lock.predicted.step_time_s
    gain = b / a if a > 0 else 0.0
    return (
        f"\nstaleness {k} beside lock-step (each plan's best placement):\n"
        f"  staleness {k}  {a:8.2f} s/step  {where(ahead)}\n"
        f"  lock-step    {b:8.2f} s/step  {where(lock)}\n"
        f"  → {gain:.2f}× the lock-step throughput, for samples up to {k} weight version(s) old\n"
    )


def _previews_run(cluster: str | None, model: list[str] | None, plan_file: str | None) -> bool:
    """Whether `flowc plan` with these options plans what `flowc run` would run: a cluster the run
    can use and models it can load (a catalogue name or a shorthand cluster: a what-if plan)."""
    import re

    from flowc.inputs import BUILTIN_MODELS
    from flowc.ir.hub import cached_snapshot, is_hub_id

    if plan_file:
        return False
    c = cluster or "local"
    runnable = c in ("local", "auto") or c.startswith(("local:", "ray://")) or bool(re.fullmatch(r"[\w.-]+:\d+", c))
    if not runnable:
        return False
    for ref in role_pairs(model, "--model").values():
        loadable = ref in BUILTIN_MODELS or Path(ref).expanduser().is_dir() or (is_hub_id(ref) and cached_snapshot(ref))
        if not loadable:
            return False
    return True


class ExportFormat(str, Enum):
    html = "html"
    svg = "svg"
    dot = "dot"
    mermaid = "mermaid"


@app.command()
def export(
    file: FileArg,
    overrides: OverridesArg = None,
    model: ModelOpt = None,
    cluster: ClusterOpt = None,
    workload: WorkloadOpt = None,
    pin: PinOpt = None,
    plan_file: PlanOpt = None,
    for_run: ForRunOpt = False,
    fmt: Annotated[
        ExportFormat, typer.Option("--format", "-f", help="html (one self-contained file), svg (needs Graphviz), dot or mermaid.")
    ] = ExportFormat.html,
    output: Annotated[
        str | None, typer.Option("--output", "-o", help="Where to write; default: stdout (html/svg: FLOW.FORMAT).")
    ] = None,
    staleness: StalenessOpt = None,
) -> None:
    """Draw the plan: placement over time, the annotated dataflow graph, memory per device, the timeline."""
    from pathlib import Path

    from flowc.export import render

    pin = _with_staleness(pin, staleness)
    p, planned, _, _ = _plan(file, overrides, model, cluster, workload, pin, plan_file, for_run)
    text = render(p, planned, fmt.value)
    if output is None and fmt.value in ("html", "svg"):
        output = f"{p.flow}.{fmt.value}"
    if output:
        Path(output).write_text(text)
        err_console.print(f"wrote {output}")
    else:
        typer.echo(text, nl=False)


@app.command()
def run(
    file: Annotated[
        str | None,
        typer.Argument(help="A Python file with one @fc.flow, or FILE:NAME (with --resume: optional).", metavar="FILE"),
    ] = None,
    overrides: OverridesArg = None,
    model: ModelOpt = None,
    data: Annotated[
        str | None,
        typer.Option(
            "--data",
            help="Prompts with a 'prompt' column (text or chat messages) and the columns your reward reads: "
            "FILE (.jsonl .json .parquet .csv .arrow), FOLDER or hub dataset ID, [:SUBSET]:SPLIT optional "
            "(e.g. data.parquet, openai/gsm8k:main:train, data/:train[:256]).",
        ),
    ] = None,
    eval_data: Annotated[
        str | None, typer.Option("--eval-data", help="Held-out prompts, as --data (default split: test), for the accuracy curve.")
    ] = None,
    reward: Annotated[
        list[str] | None,
        typer.Option("--reward", "-r", help="ROLE=module:function (or ROLE=path/file.py:function) for each Reward role."),
    ] = None,
    env: Annotated[
        list[str] | None,
        typer.Option("--env", help="ROLE=module:Class (or ROLE=path/file.py:Class) for each Environment role (docs/agents.md)."),
    ] = None,
    cluster: Annotated[
        str, typer.Option("--cluster", "-c", help="local (this machine's CPUs, local:N for N workers), or a Ray address.")
    ] = "local",
    device: Annotated[
        str | None, typer.Option("--device", help="The GPU type of a Ray cluster, when Ray does not detect it (e.g. H200).")
    ] = None,
    plan_file: Annotated[
        str | None, typer.Option("--plan", help="Run this saved plan (plan.json) unchanged, instead of planning.")
    ] = None,
    workload: WorkloadOpt = None,
    steps: Annotated[
        int | None, typer.Option("--steps", "-n", min=1, help="Iterations to run (default: the config's, 100).")
    ] = None,
    out: Annotated[str | None, typer.Option("--out", "-o", help="Run directory (default runs/FLOW-TIME).")] = None,
    resume: Annotated[
        str | None,
        typer.Option("--resume", help="A run directory to continue from its last checkpoint, with the options it recorded."),
    ] = None,
    override: Annotated[
        bool, typer.Option("--override", help="With --resume: let the options given change what the run recorded.")
    ] = False,
    rollout: Annotated[
        str | None, typer.Option("--rollout", help="Generation backend: vllm (default where installed) or hf.")
    ] = None,
    pin: PinOpt = None,
    config: ConfigOpt = None,
    sets: SetOpt = None,
    report_to: Annotated[
        str | None,
        typer.Option(
            "--report-to", help="Experiment trackers, comma-separated: tensorboard (default), wandb, mlflow; none for none."
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the plan this run would run (workload, backends) and exit.")
    ] = False,
    init: Annotated[
        str | None,
        typer.Option(
            "--init",
            help="pretrained (default: every model's weights from its checkpoint) or random (random weights of the "
            "model's architecture; the only way to run a catalogue name). Same as --set init=….",
        ),
    ] = None,
    staleness: Annotated[
        str | None,
        typer.Option(
            "--staleness",
            help="Weight versions the rollouts may lag the trainer: 0 (default) lock-step, 1 one-step-off, K: the engine "
            "samples K steps ahead (needs an off-policy correction in the loss; docs/async.md); auto: the planner "
            "chooses. Same as --set staleness=K.",
        ),
    ] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
) -> None:
    """Plan the flow for this cluster and train it; writes runs/<name>/."""
    from flowc.run import run as do_run

    if init is not None:
        sets = [*(sets or []), f"init={init}"]
    if staleness is not None:
        sets = [*(sets or []), f"staleness={staleness}"]
    req = run_request(
        file, overrides, model=model, data=data, eval_data=eval_data, reward=reward, env=env, cluster=cluster, device=device,
        plan_file=plan_file, workload=workload, steps=steps, out=out, resume=resume, override=override,
        rollout=rollout, pin=pin, config=config, sets=sets, report_to=report_to,
    )  # fmt: skip
    if dry_run:
        _print_run_plan(req, as_json=False)
        return
    path = do_run(req, progress=not quiet)
    err_console.print(f"run written to {path} (metrics.jsonl, plan.html, final/); draw it with: flowc report {path}")


@app.command()
def report(
    run_dir: Annotated[str, typer.Argument(help="A run directory written by flowc run.", metavar="RUN_DIR")],
    output: Annotated[str | None, typer.Option("--output", "-o", help="PNG path (default RUN_DIR/report.png).")] = None,
) -> None:
    """Draw a run's curves (reward, accuracy, KL, predicted vs measured time per op; for a pipelined
    run its staleness, importance ratios and pools; for a multi-turn run its turns, tool use and
    environment errors) to PNG, and print the pipeline's and the agents' figures."""
    from flowc.report import agent_summary, draw, idle_summary, pipeline_summary

    path = draw(run_dir, output)
    for summary in (idle_summary(run_dir), pipeline_summary(run_dir), agent_summary(run_dir)):
        if summary:
            typer.echo(summary)
    typer.echo(f"wrote {path}")


@app.command()
def calibrate(
    run_dirs: Annotated[list[str], typer.Argument(help="Run directories to fit on.", metavar="RUN_DIR…")],
    output: Annotated[
        str | None, typer.Option("--output", "-o", help="Write the calibrated cluster file (for --cluster FILE).")
    ] = None,
    held_apart: Annotated[
        list[str] | None, typer.Option("--check", help="A run directory held apart: its error before and after.")
    ] = None,
) -> None:
    """Fit the hardware profile's efficiency factors to runs' measured op times (see docs/planner.md)."""
    from flowc.calibrate import fit, report, write_cluster

    result = fit([Path(d) for d in run_dirs])
    typer.echo(report(result, [Path(d) for d in held_apart or []]))
    if output:
        write_cluster(result, Path(output))
        typer.echo(f"wrote {output} (use it with --cluster {output})")


def _print_run_plan(req, *, as_json: bool, save: str | None = None) -> None:
    """The plan `flowc run` would run for ``req`` (through the run's own prepare), printed
    (and saved to ``save``)."""
    import time

    from flowc.ir.plan_text import format_plan
    from flowc.run import prepare

    t0 = time.perf_counter()
    p = prepare(req, dry_run=True)
    if save:
        Path(save).write_text(p.plan.to_json() + "\n")
    if as_json:
        typer.echo(p.plan.to_json())
        return
    typer.echo(format_plan(p.plan), nl=False)
    err_console.print(f"planned in {time.perf_counter() - t0:.2f} s (the plan flowc run runs with these options)")


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``flowc`` script."""
    try:
        app(args=argv, standalone_mode=True)
    except FlowcError as e:
        if os.environ.get("FLOWC_TRACEBACK"):
            raise
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", markup=True, highlight=False)
        sys.exit(getattr(e, "exit_code", 1))


if __name__ == "__main__":  # pragma: no cover
    main()
