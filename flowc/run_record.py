"""A run folder is the run: ``run.json`` records every option that shaped it.

``flowc run`` writes ``run.json`` when a run starts: the flow (absolute path and
name), its hyperparameter overrides, models, data, rewards, cluster, workload,
steps, rollout backend, pins, run config (with every ``--set`` override applied: a
resume reproduces them) and saved plan, with the sha256 of
every input file it read (flow, data, reward files). ``flowc run --resume DIR``
rebuilds the run from it: a flag that contradicts the record is refused with the
difference listed, unless ``--override`` is given (``--steps``, to extend or
shorten the run, ``--cluster``/``--device``, where it runs, and ``--report-to``,
where its metrics go, never contradict it). A run resumes on its own plan.json; nothing here rewrites it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from flowc._version import __version__
from flowc.data_source import data_file
from flowc.errors import SpecError
from flowc.ir.run_config import RunConfig, apply_set, setting_keys

RECORD = "run.json"

# Options a resume may change freely: how long the run is and where it runs.
FREE = ("steps", "cluster", "device")
# Run settings a resume may change freely: which experiment trackers it reports to, and where the
# workers run (the same results on either executor, tested to the bit). Not reward_workers: a reward
# that reads its whole call sees other shares of the batch with another pool size.
FREE_SETTINGS = ("report_to", "executor")


class RunRecord(BaseModel):
    """Every option of a run, as it started (paths absolute)."""

    model_config = ConfigDict(extra="forbid")
    format: int = 1
    flowc_version: str = __version__
    flow: str  # FILE:NAME, FILE absolute
    overrides: dict[str, Any] = {}
    models: dict[str, str] = {}
    data: str | None = None
    eval_data: str | None = None
    rewards: dict[str, str] = {}
    envs: dict[str, str] = {}  # Environment role → module:Class (file.py absolute)
    cluster: str = "local"
    device: str | None = None
    workload: str | None = None
    steps: int | None = None
    rollout: str | None = None
    pins: list[str] = []
    config: dict[str, Any] = {}  # the RunConfig fields that were set
    plan_file: str | None = None
    inputs: dict[str, str] = {}  # input file → sha256 when the run started
    resumes: list[dict[str, Any]] = []  # each resume: when, and what --override changed

    # ------------------------------------------------------------ files
    def write(self, run_dir: Path) -> Path:
        path = run_dir / RECORD
        tmp = run_dir / f".{RECORD}.tmp"
        tmp.write_text(self.model_dump_json(indent=2) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, run_dir: Path) -> RunRecord:
        path = run_dir / RECORD
        if not path.exists():
            raise SpecError(
                f"{run_dir} has no {RECORD}: it is not a run folder, or an older flowc wrote it",
                fix=f"give the run's options again with --override (flowc run FILE … --resume {run_dir} --override)",
            )
        try:
            return cls.model_validate_json(path.read_text())
        except Exception as e:
            raise SpecError(f"{path} is damaged: {e}", fix="restore it from a backup, or start a new run") from None

    def run_config(self) -> RunConfig:
        return RunConfig.model_validate(self.config)

    def run_config_with(self, sets: list[str]) -> tuple[RunConfig, dict[str, Any]]:
        """The recorded settings with ``--set`` overrides on top, and the front-end options those
        overrides give (a workload key changes the recorded workload string)."""
        data = json.loads(json.dumps(self.config))
        front: dict[str, Any] = {"workload": self.workload} if self.workload else {}
        for word in sets:
            apply_set(data, front, word)
        if front.get("workload") == self.workload:
            front.pop("workload", None)
        try:
            return RunConfig.model_validate(data), front
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"])
            raise SpecError(f"--set: {loc}: {err['msg']}", fix=f"settings: {', '.join(setting_keys())}") from e

    # ---------------------------------------------------------- compare
    def options(self) -> dict[str, Any]:
        """The options a flag can give, by field name."""
        return {k: v for k, v in self.model_dump().items() if k not in ("format", "flowc_version", "inputs", "resumes")}

    def contradictions(self, given: dict[str, Any]) -> list[str]:
        """What the flags ``given`` (normalised like the record) change, one line each."""
        have = self.options()
        out = []
        for k, v in given.items():
            if k in FREE or v is None or v == have[k]:
                continue
            if k == "config" and _settings(v) == _settings(have[k]):  # only where the metrics go changed
                continue
            out.append(f"--{_flag(k)}: the run has {_show(have[k])}, the command gives {_show(v)}")
        return out

    def changed_inputs(self) -> list[str]:
        """Input files whose contents differ from when the run started (or that are gone)."""
        out = []
        for path, digest in self.inputs.items():
            if not Path(path).exists():
                out.append(f"{path} is gone")
            elif sha256(path) != digest:
                out.append(f"{path} changed since the run started")
        return out

    def resumed(self, overridden: dict[str, Any]) -> RunRecord:
        entry = {"at": time.strftime("%Y-%m-%dT%H:%M:%S"), "flowc_version": __version__}
        if overridden:
            entry["override"] = overridden
        return self.model_copy(update={**overridden, "resumes": [*self.resumes, entry], "inputs": input_hashes(self)})


def sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def absolute(path: str | None) -> str | None:
    """A path option made absolute (so a resume from another folder reads the same file)."""
    return None if path is None else str(Path(path).expanduser().resolve())


def absolute_reward(spec: str) -> str:
    """``file.py:fn`` with the file made absolute; ``module:fn`` as given."""
    mod, sep, fn = spec.rpartition(":")
    return f"{absolute(mod)}:{fn}" if sep and mod.endswith(".py") else spec


def absolute_model(source: str) -> str:
    """A local model folder made absolute; a catalogue name or hub id as given."""
    return str(Path(source).resolve()) if Path(source).expanduser().exists() else source


def input_hashes(rec: RunRecord) -> dict[str, str]:
    """sha256 of every input file the run reads: the flow, the data, reward files."""
    files = [rec.flow.rpartition(":")[0] or rec.flow, data_file(rec.data), data_file(rec.eval_data)]
    files += [s.rpartition(":")[0] for s in [*rec.rewards.values(), *rec.envs.values()] if s.rpartition(":")[0].endswith(".py")]
    return {f: sha256(f) for f in files if f and Path(f).is_file()}


def _settings(config: dict[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (config or {}).items() if k not in FREE_SETTINGS}


def _flag(field: str) -> str:
    return {
        "overrides": "NAME=VALUE",
        "models": "model",
        "rewards": "reward",
        "envs": "env",
        "pins": "pin",
        "plan_file": "plan",
        "config": "config/--set",
    }.get(field, field.replace("_", "-"))


def _show(v: Any) -> str:
    return json.dumps(v, sort_keys=True) if isinstance(v, (dict, list)) else repr(v)
