"""Front-end glue for planning: which model each role is, reading the user's
options, and re-planning a saved plan."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from flowc.errors import SpecError
from flowc.ir.cluster import ClusterSpec
from flowc.ir.graph import FlowGraph
from flowc.ir.models import ModelSpec
from flowc.ir.plan import Plan
from flowc.ir.run_config import compute_dtype
from flowc.ir.workload import WorkloadSpec
from flowc.passes.pins import Pins, parse_pins, pins_from_plan

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
    model_roles = {r.name: r.kind for r in g.roles.values() if r.kind != "reward"}
    for role in given:
        if role not in g.roles:
            close = difflib.get_close_matches(role, list(g.roles), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise SpecError(
                f"--model names role {role!r}, which flow {g.name!r} does not have{hint}", fix=f"its roles: {', '.join(g.roles)}"
            )
        if g.roles[role].kind == "reward":
            raise SpecError(
                f"role {role!r} is a Python reward function, not a model", fix=f"bind it with --reward {role}=module:function"
            )
    notes: list[str] = []
    policies = [r for r, k in model_roles.items() if k == "policy"]
    if given and policies and not any(p in given for p in policies):
        raise SpecError(f"no model given for policy role {policies[0]!r}", fix=f"pass --model {policies[0]}=NAME")
    base = next((given[p] for p in policies if p in given), None) or next(iter(given.values()), DEFAULT_MODEL)
    out: dict[str, ModelSpec] = {}
    for role, kind in model_roles.items():
        out[role] = ModelSpec.resolve(given.get(role, base))
        if role not in given:
            notes.append(f"{role} ({kind}) uses {out[role].name} (not given)")
    return out, notes


@dataclass
class PlanRequest:
    models: dict[str, ModelSpec]
    cluster: ClusterSpec
    workload: WorkloadSpec
    pins: Pins
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
) -> PlanRequest:
    """Everything `flowc plan` needs, from its options (a saved plan fills in
    what the options leave out, and pins every decision)."""
    saved = None
    pin_files = [w for w in (pin_words or []) if w.endswith((".yaml", ".yml")) and Path(w).exists()]
    pins = parse_pins([w for w in (pin_words or []) if w not in pin_files], pin_files)
    given = parse_model_words(model_words)
    if plan_file:
        try:
            saved = Plan.from_json(Path(plan_file).read_text())
        except OSError as e:
            raise SpecError(f"cannot read plan {plan_file}: {e}") from e
        except Exception as e:
            raise SpecError(f"{plan_file} is not a flowc plan: {e}") from e
        if saved.flow != g.name:
            raise SpecError(f"{plan_file} is a plan of flow {saved.flow!r}, not {g.name!r}")
        given = {**{r: rp.model for r, rp in saved.roles.items()}, **given}
        pins = pins_from_plan(saved).merged(pins)
        if cluster is None:
            c = dict(saved.cluster)
            c.pop("world_size", None)
            cl = ClusterSpec(**c)
        if workload is None:
            wl = WorkloadSpec(**saved.workload)
    models, notes = resolve_models(g, given)
    cl = ClusterSpec.parse(cluster) if cluster is not None else (cl if saved else ClusterSpec.parse("local"))
    dtype = compute_dtype("auto", cl.profile.kind)
    if any(m.dtype != dtype for m in models.values()):
        models = {r: m.model_copy(update={"dtype": dtype}) for r, m in models.items()}
        notes = [*(notes or []), f"models priced in {dtype}, the dtype flowc run computes in on {cl.profile.kind.upper()}s"]
    wl = WorkloadSpec.parse(workload) if workload is not None else (wl if saved else WorkloadSpec())
    return PlanRequest(models, cl, wl, pins, saved, notes)


def same_decisions(a: Plan, b: Plan) -> list[str]:
    """What differs between two plans' decisions and predictions (empty: same)."""
    diffs = []
    for key in ("roles", "pools", "reshards", "schedule", "predicted"):
        if getattr(a, key) != getattr(b, key):
            diffs.append(key)
    return diffs
