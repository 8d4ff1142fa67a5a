"""Pins: the parts of a plan a user fixes; the search fills in the rest.

From the command line, ``--pin ROLE.PHASE.FIELD=VALUE`` (``actor.generate.tp=2``,
``critic.train.backend=megatron``, ``ref.forward.devices=8``, ``actor.generate.gpu_memory_utilization=0.6``),
``--pin colocate=actor,critic;ref,rm`` (which roles share devices; a policy's
generation is ``actor.gen`` when it should get its own devices) and
``--pin reshard.actor=p2p``. Or a YAML plan fragment::

    roles:
      actor:
        generate: {tp: 2}
        train: {backend: megatron, pp: 2}
    colocate: [[actor.train, critic], [actor.gen], [ref, rm]]
    reshard: {actor: micro_dp_allgather}

A saved plan is a complete set of pins (:func:`pins_from_plan`), so re-planning
with ``--plan saved.json`` reproduces it.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from flowc.errors import SpecError
from flowc.ir.plan import PHASES, Backend, Layout, Plan, ReshardMethod
from flowc.ir.run_config import MAX_STALENESS

#: pin fields that are not :class:`Layout` fields (the search does not enumerate them)
NOT_LAYOUT = ("devices", "gpu_memory_utilization")


class PhasePin(BaseModel):
    """Fixed fields of one role's phase; None leaves a field to the search."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    dp: int | None = Field(None, ge=1)
    tp: int | None = Field(None, ge=1)
    pp: int | None = Field(None, ge=1)
    cp: int | None = Field(None, ge=1)
    ep: int | None = Field(None, ge=1)
    backend: Backend | None = None
    fsdp: bool | None = None
    offload_params: bool | None = None
    offload_optimizer: bool | None = None
    activation_checkpointing: bool | None = None
    micro_batch: int | None = Field(None, ge=1)
    micro_tokens: int | None = Field(None, ge=0)
    share_prompts: bool | None = None
    pack_sequences: bool | None = None
    devices: int | None = Field(None, ge=1)
    # generate only: the share of each device the engine may take (vLLM's gpu_memory_utilization:
    # its weights, KV cache and buffers); None: planned from the cache's peak demand
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)

    def layout_fields(self) -> dict[str, Any]:
        return dict(self._pinned_fields)

    @cached_property
    def _pinned_fields(self) -> tuple[tuple[str, Any], ...]:
        # the planner asks hundreds of thousands of times per run; a pin is immutable
        return tuple((k, v) for k, v in self.model_dump().items() if v is not None and k not in NOT_LAYOUT)

    def allows(self, lay: Layout) -> bool:
        return all(getattr(lay, k) == v for k, v in self._pinned_fields)

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> PhasePin:
        # a copy with other fields must not keep this pin's cached fields
        out = super().model_copy(update=update, deep=deep)
        out.__dict__.pop("_pinned_fields", None)
        return out

    def merged(self, other: PhasePin) -> PhasePin:
        a, b = self.model_dump(), other.model_dump()
        for k, v in b.items():
            if v is None:
                continue
            if a[k] is not None and a[k] != v:
                raise SpecError(f"conflicting pins for {k}: {a[k]} and {v}")
            a[k] = v
        return PhasePin(**a)


_UNPINNED = PhasePin()  # a phase nothing pins (the planner asks for it hundreds of thousands of times)


class Pins(BaseModel):
    """Everything a user can fix. Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    roles: dict[str, dict[str, PhasePin]] = {}
    colocate: list[list[str]] | None = None
    reshard: dict[str, ReshardMethod] = {}
    # weight versions the rollouts may lag the trainer (runtime RunConfig.staleness): the plan prices
    # the pipelined loop's steady state (schedule.simulate); "auto": the planner chooses
    # (pipeline.make_plan); None: lock-step
    staleness: Annotated[int, Field(ge=0, le=MAX_STALENESS)] | Literal["auto"] | None = None
    # What the runtime executes, set by its registry (not by users): the backends
    # that run on the cluster's devices (None: any), and per backend the fields a
    # layout on it must have (limits[B]; fsdp2: tp=pp=cp=ep=1).
    backends: list[Backend] | None = None
    limits: dict[Backend, PhasePin] = {}
    # Set by the runtime: its generation engines reload whole tensors, so only the
    # reshard methods that deliver whole tensors are open (reshard.whole_tensor_options).
    whole_tensor_sync: bool = False
    # Set by the runtime: whether the co-located training state may sleep in host
    # memory while a generation engine on the same devices runs (the runtime does not move it yet).
    sleep_colocated: bool = True

    @model_validator(mode="after")
    def _utilization_on_generate(self) -> Pins:
        for role, phases in self.roles.items():
            for phase, pin in phases.items():
                if pin.gpu_memory_utilization is not None and phase != "generate":
                    raise ValueError(
                        f"{role}.{phase}.gpu_memory_utilization: only a generation engine has one "
                        f"(pin {role}.generate.gpu_memory_utilization)"
                    )
        return self

    def phase(self, role: str, phase: str) -> PhasePin:
        return self.roles.get(role, {}).get(phase, _UNPINNED)

    def within_limits(self, lay: Layout) -> bool:
        if self.backends is not None and lay.backend not in self.backends:
            return False
        limit = self.limits.get(lay.backend)
        return limit is None or limit.allows(lay)

    def allows(self, role: str, phase: str, lay: Layout) -> bool:
        """The role's pins and its backend's limits both allow ``lay``."""
        return self.phase(role, phase).allows(lay) and self.within_limits(lay)

    def is_empty(self) -> bool:
        return (
            not self.roles
            and self.colocate is None
            and self.staleness is None
            and not self.reshard
            and not self.limits
            and self.backends is None
            and not self.whole_tensor_sync
            and self.sleep_colocated
        )

    def merged(self, other: Pins) -> Pins:
        roles: dict[str, dict[str, PhasePin]] = {r: dict(p) for r, p in self.roles.items()}
        for r, phases in other.roles.items():
            for ph, pin in phases.items():
                roles.setdefault(r, {})
                roles[r][ph] = roles[r][ph].merged(pin) if ph in roles[r] else pin
        return Pins(
            roles=roles,
            colocate=other.colocate if other.colocate is not None else self.colocate,
            staleness=other.staleness if other.staleness is not None else self.staleness,
            reshard={**self.reshard, **other.reshard},
            whole_tensor_sync=self.whole_tensor_sync or other.whole_tensor_sync,
            sleep_colocated=self.sleep_colocated and other.sleep_colocated,
            backends=_both(self.backends, other.backends),
            limits={
                b: self.limits[b].merged(other.limits[b])
                if b in self.limits and b in other.limits
                else (other.limits.get(b) or self.limits[b])
                for b in {*self.limits, *other.limits}
            },
        )

    def summary(self) -> dict[str, Any]:
        return self.model_dump(exclude_defaults=True)


def _both(a: list[Backend] | None, b: list[Backend] | None) -> list[Backend] | None:
    """The backends both allow (None allows every one)."""
    if a is None or b is None:
        return b if a is None else a
    return [x for x in a if x in b]


_FIELDS = tuple(PhasePin.model_fields)


def _value(raw: str) -> Any:
    low = raw.strip().lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw.strip()


def parse_pin(text: str) -> Pins:
    """One ``--pin`` word."""
    if "=" not in text:
        raise SpecError(
            f"pin {text!r} is not KEY=VALUE", fix="e.g. --pin actor.generate.tp=2 or --pin colocate=actor,critic;ref,rm"
        )
    key, raw = (s.strip() for s in text.split("=", 1))
    if key == "colocate":
        groups = [[u.strip() for u in g.split(",") if u.strip()] for g in raw.split(";") if g.strip()]
        return Pins(colocate=groups)
    if key == "staleness":
        try:
            return Pins(staleness=_value(raw))
        except ValidationError as e:
            raise SpecError(f"pin {text!r}: staleness is a whole number of weight versions, 0 to {MAX_STALENESS}, or auto") from e
    parts = key.split(".")
    if parts[0] == "reshard" and len(parts) == 2:
        try:
            return Pins(reshard={parts[1]: raw})
        except ValidationError as e:
            raise SpecError(f"pin {text!r}: {e.errors()[0]['msg'].removeprefix('Value error, ')}") from e
    if len(parts) != 3:
        raise SpecError(
            f"pin {text!r} is not ROLE.PHASE.FIELD=VALUE",
            fix=f"phases: {', '.join(PHASES)}; fields: {', '.join(_FIELDS)}",
        )
    role, phase, field = parts
    if phase not in PHASES:
        raise SpecError(f"pin {text!r}: unknown phase {phase!r}", fix=f"phases: {', '.join(PHASES)}")
    if field not in _FIELDS:
        import difflib

        close = difflib.get_close_matches(field, _FIELDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise SpecError(f"pin {text!r}: unknown field {field!r}{hint}", fix=f"fields: {', '.join(_FIELDS)}")
    try:
        return Pins(roles={role: {phase: PhasePin(**{field: _value(raw)})}})
    except ValidationError as e:
        raise SpecError(f"pin {text!r}: {e.errors()[0]['msg'].removeprefix('Value error, ')}") from e


def load_pins_yaml(path: str | Path) -> Pins:
    """A YAML plan fragment (see the module docstring)."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text()) or {}
        return Pins.model_validate(data)
    except OSError as e:
        raise SpecError(f"cannot read pin file {p}: {e}") from e
    except (yaml.YAMLError, ValidationError) as e:
        raise SpecError(f"pin file {p} is not a valid plan fragment: {e}", fix="keys: roles, colocate, reshard") from e


def parse_pins(words: list[str] | None, files: list[str] | None = None) -> Pins:
    pins = Pins()
    for f in files or []:
        pins = pins.merged(load_pins_yaml(f))
    for w in words or []:
        pins = pins.merged(parse_pin(w))
    return pins


def pins_from_plan(plan: Plan) -> Pins:
    """Every decision of a saved plan as pins: re-planning reproduces it."""
    roles: dict[str, dict[str, PhasePin]] = {}
    for name, rp in plan.roles.items():
        for ph, pp in rp.phases.items():
            fields = pp.layout.model_dump()
            if fields["micro_tokens"]:  # a budget: its rows follow from the workload it is re-planned for
                fields["micro_batch"] = None
            util = pp.gpu_memory_utilization if pp.gpu_memory_utilization_pinned else None
            roles.setdefault(name, {})[ph] = PhasePin(**fields, devices=pp.device_count, gpu_memory_utilization=util)
    colocate = [list(p.units) for p in plan.pools]
    reshard = {r.role: r.method for r in plan.reshards if r.dst_phase == "generate"}
    return Pins(roles=roles, colocate=colocate, reshard=reshard, staleness=plan.staleness)
