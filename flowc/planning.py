"""Front-end glue for planning: which model each role is, reading the user's
options, what the runtime executes (as pins and a target for the planner),
and re-planning a saved plan."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flowc.errors import SpecError
from flowc.ir.cluster import ClusterSpec
from flowc.ir.graph import FlowGraph
from flowc.ir.models import ModelSpec
from flowc.ir.ops import PYTHON_KINDS
from flowc.ir.plan import ROLLOUT_BACKENDS, Plan, Target
from flowc.ir.run_config import RunConfig
from flowc.ir.workload import WorkloadSpec
from flowc.lengths import expand as expand_lengths
from flowc.passes.pins import PhasePin, Pins, parse_pins, pins_from_plan

DEFAULT_MODEL = "flowc-tiny"


def parse_model_words(words: list[str] | None) -> dict[str, str]:
    """``["actor=qwen2.5-7b", "rm=path/config.json"]`` → {role: ref}."""
    out: dict[str, str] = {}
    for w in words or []:
        if "=" not in w:
            raise SpecError(f"--model {w!r} is not ROLE=MODEL", fix="e.g. --model actor=qwen2.5-7b")
        role, ref = (x.strip() for x in w.split("=", 1))
        out[role] = ref
    return out


def resolve_models(g: FlowGraph, given: dict[str, str]) -> tuple[dict[str, ModelSpec], list[str]]:
    """A ModelSpec for every model role, and notes on the defaults used.

    A role not given defaults to the policy's model (the reference is the
    policy's initial weights; critics and reward models are commonly
    initialised from it); with no model at all, the built-in tiny model."""
    from flowc.inputs import check_model_roles

    model_roles = {r.name: r.kind for r in g.roles.values() if r.kind not in PYTHON_KINDS}
    check_model_roles(g, given)
    notes: list[str] = []
    policies = [r for r, k in model_roles.items() if k == "policy"]
    base = next((given[p] for p in policies if p in given), None) or next(iter(given.values()), DEFAULT_MODEL)
    out: dict[str, ModelSpec] = {}
    for role, kind in model_roles.items():
        out[role] = ModelSpec.resolve(given.get(role, base))
        if role not in given:
            notes.append(f"{role} ({kind}) uses {out[role].name} (not given)")
    return out, notes


# ------------------------------------------------------------ the runtime
def runtime_pins(kind: str) -> Pins:
    """What the runtime's backends execute on ``kind`` devices, as pins for the planner
    (from the backend registry): the backends that run there, the layout fields each
    fixes, weight syncs limited to whole tensors (every rollout backend reloads
    whole HF tensors), and co-located training state kept on the device while generating."""
    from flowc.runtime.backends import BACKENDS

    here = {name: info for name, info in BACKENDS.items() if info.runs_on(kind)}
    return Pins(
        backends=list(here),
        limits={name: PhasePin(**info.limits[kind]) for name, info in here.items()},
        whole_tensor_sync=True,
        sleep_colocated=False,  # the runtime keeps co-located training state on the device
    )


def check_backend_pins(pins: Pins, kind: str) -> None:
    """A user pin naming a backend that does not run on ``kind`` devices fails here, with the fix."""
    from flowc.runtime.backends import BACKENDS

    for role, phases in pins.roles.items():
        for ph, pin in phases.items():
            info = BACKENDS.get(pin.backend) if pin.backend else None
            if info is not None and not info.runs_on(kind):
                where = " or ".join(f"{k.upper()}s" for k in info.limits)
                raise SpecError(
                    f"{role}.{ph} pinned to backend={pin.backend}, which runs on {where} only, not {kind.upper()}s",
                    fix=f"drop the pin (the planner chooses among the backends that run here), or plan for a cluster of {where}",
                )


def fit_rollout(g: FlowGraph, models: dict[str, ModelSpec], target: Target, pins: Pins) -> tuple[Pins, list[str]]:
    """Each generating role's rollout backends, checked against its model before anything starts
    (vLLM's CPU build runs some attention head sizes only). A role whose backend is not pinned
    keeps the planner's choice among the target's backends that run its model; when some do not,
    the first that does is pinned here, with a line saying why. A pinned backend (``--rollout``,
    ``--pin``) that cannot run the model is refused."""
    from flowc.runtime.backends import BACKENDS

    kind, extra, notes = target.kind, [], []
    for role in dict.fromkeys(n.role for n in g.nodes if n.op == "generate" and n.role in models):
        m, pinned = models[role], pins.phase(role, "generate").backend
        choices = (pinned,) if pinned else target.rollout_backends
        refusals = {b: BACKENDS[b].refuses(kind, m) for b in choices if b in BACKENDS}
        ok = [b for b in choices if not refusals.get(b)]
        if len(ok) == len(choices):
            continue
        if ok:
            no = next(b for b in choices if refusals.get(b))
            extra.append(f"{role}.generate.backend={ok[0]}")
            notes.append(f"{role} generates with {ok[0]}, not {no}: {no} {refusals[no]}")
            continue
        runs = [b for b, info in BACKENDS.items() if info.role == "rollout" and info.runs_on(kind) and not info.refuses(kind, m)]
        how = f"--pin {role}.generate.backend={pinned}" if pinned else f"--rollout {choices[0]}"
        alt = (f"--pin {role}.generate.backend={runs[0]}" if pinned else f"--rollout {runs[0]}") if runs else ""
        raise SpecError(
            f"{role} generates with {choices[0]} ({how}), which {refusals[choices[0]]}",
            fix=(f"generate with {runs[0]} ({alt}), or " if runs else "")
            + f"give {role} a model that {choices[0]} runs (docs/backends.md)",
        )
    return (pins.merged(parse_pins(extra)) if extra else pins), notes


def run_target(cluster: ClusterSpec, config: RunConfig, rollout: str | None, *, here: bool = True) -> Target:
    """The target a run on ``cluster`` compiles for: the config's dtype and timeout, a CPU
    worker's share of the cores, and the rollout backends that run there (or ``rollout``):
    those installed, when the run is ``here``; for a cluster elsewhere, every one."""
    from flowc.runtime.backends import BACKENDS, rollout_backends

    kind = cluster.profile.kind
    if rollout is not None:
        info = BACKENDS.get(rollout)
        if info is None or info.role != "rollout":
            raise SpecError(f"--rollout {rollout!r} is not a rollout backend", fix=f"use one of {', '.join(ROLLOUT_BACKENDS)}")
        if not info.runs_on(kind) or (here and not info.installed()):
            why = "is not installed" if info.runs_on(kind) else f"does not run on {kind.upper()}s"
            raise SpecError(f"--rollout {rollout}, but {rollout} {why}", fix=info.install or "use another rollout backend")
        backends: tuple[str, ...] = (rollout,)
    else:
        backends = rollout_backends(kind, installed=here)
    cpus = config.cpus_per_worker if "cpus_per_worker" in config.model_fields_set else None
    return Target.of(cluster, dtype=config.dtype, cpus_per_worker=cpus, timeout_s=config.timeout_s, rollout_backends=backends)


def read_plan(path: Path) -> Plan:
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError(f"cannot read plan {path}: {e}") from e
    try:
        return Plan.from_json(text)
    except SpecError as e:
        raise SpecError(f"{path}: {e.what}", fix=e.fix) from None
    except Exception as e:
        raise SpecError(f"{path} is not a flowc plan: {e}", fix="give a plan.json written by flowc plan -o or flowc run") from e


@dataclass
class PlanRequest:
    models: dict[str, ModelSpec]
    cluster: ClusterSpec
    workload: WorkloadSpec
    pins: Pins
    target: Target
    saved: Plan | None = None
    notes: list[str] | None = None


def build_request(
    g: FlowGraph,
    *,
    model_words: list[str] | None,
    cluster: str | None,
    workload: str | None,
    pin_words: list[str] | None,
    plan_file: str | None,
    for_run: bool = False,
) -> PlanRequest:
    """Everything `flowc plan` needs, from its options (a saved plan fills in
    what the options leave out, and pins every decision). ``for_run`` plans
    within what the runtime executes, as ``flowc run`` does."""
    saved = None
    pin_files = [w for w in (pin_words or []) if w.endswith((".yaml", ".yml")) and Path(w).exists()]
    pins = parse_pins([w for w in (pin_words or []) if w not in pin_files], pin_files)
    given = parse_model_words(model_words)
    if plan_file:
        saved = read_plan(Path(plan_file))
        if saved.flow != g.name:
            raise SpecError(f"{plan_file} is a plan of flow {saved.flow!r}, not {g.name!r}")
        given = {**{r: rp.model for r, rp in saved.roles.items()}, **given}
        pins = pins_from_plan(saved).merged(pins)
        if cluster is None:
            cl = saved.cluster_spec()
        if workload is None:
            wl = WorkloadSpec(**saved.workload)
    models, notes = resolve_models(g, given)
    cl = ClusterSpec.parse(cluster) if cluster is not None else (cl if saved else ClusterSpec.parse("local"))
    # a plan for this machine's CPUs chooses among the backends installed here; for a GPU cluster, among all
    here = cl.profile.kind == "cpu"
    target = saved.target if saved is not None and cluster is None else run_target(cl, RunConfig(), None, here=here)
    dtype = target.dtype
    if any(m.dtype != dtype for m in models.values()):
        models = {r: m.model_copy(update={"dtype": dtype}) for r, m in models.items()}
        notes = [*(notes or []), f"models priced in {dtype}, the dtype flowc run computes in on {cl.profile.kind.upper()}s"]
    workload, measured = expand_lengths(workload)  # lengths_from=RUN_DIR: the mean that run measured
    notes = [*(notes or []), *measured]
    wl = WorkloadSpec.parse(workload) if workload is not None else (wl if saved else WorkloadSpec())
    if for_run:
        check_backend_pins(pins, cl.profile.kind)
        pins = runtime_pins(cl.profile.kind).merged(pins)
    pins, fitted = fit_rollout(g, models, target, pins)
    return PlanRequest(models, cl, wl, pins, target, saved, [*(notes or []), *fitted])


def same_decisions(a: Plan, b: Plan) -> list[str]:
    """What differs between two plans' decisions and predictions (empty: same)."""
    diffs = []
    for key in ("roles", "pools", "reshards", "schedule", "predicted"):
        if getattr(a, key) != getattr(b, key):
            diffs.append(key)
    return diffs
