"""Experiment trackers: where a run's metrics go besides ``metrics.jsonl``.

``report_to`` (``flowc run --report-to tensorboard,wandb,mlflow``, or ``report_to: [...]`` in the
config) names them; each writes under the run folder, so a run folder stays the whole run:

- ``tensorboard``: event files in ``RUN/tensorboard`` (``tensorboard --logdir RUN/tensorboard``).
- ``wandb``: Weights & Biases, offline unless ``WANDB_MODE`` says otherwise; the run is in
  ``RUN/wandb/offline-run-*`` (``wandb sync RUN/wandb/offline-run-*`` uploads it later).
- ``mlflow``: MLflow's local file store ``RUN/mlruns`` (``mlflow ui --backend-store-uri
  RUN/mlruns``), or the server ``MLFLOW_TRACKING_URI`` names.

Every numeric metric of a step is logged under its own name (verl's names where the meaning is
the same: ``critic/score/mean``, ``response_length/mean``, ``timing_s/<op>``, ``actor/pg_clipfrac``);
the planner's predicted time of each op as ``predicted_s/<op>``; a few of the step's generations
as a table (step, prompt, response, score). A resumed run continues the same W&B and MLflow run
(their ids are kept in ``RUN/trackers.json``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

from flowc.errors import SpecError
from flowc.report import read_metrics

TRACKERS = ("tensorboard", "wandb", "mlflow")
# tracker → (module it imports, the package that provides it)
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"), "mlflow": ("mlflow", "mlflow-skinny")}
SAMPLE_COLUMNS = ("step", "prompt", "response", "score")


def check_trackers(names: Iterable[str]) -> None:
    """Refuse, before anything starts, a tracker whose package is not installed."""
    for name in names:
        if name not in PACKAGES:
            raise SpecError(f"report_to: unknown tracker {name!r}", fix=f"choose from {', '.join(TRACKERS)}")
        module, package = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise SpecError(
                f"--report-to {name}: the {package} package is not installed",
                fix=f"pip install {package} (or pip install 'flowc[trackers]'), or drop {name} from --report-to",
            )


class Tracker(Protocol):
    def log(self, step: int, scalars: dict[str, float]) -> None: ...
    def samples(self, step: int, rows: list[dict[str, Any]]) -> None: ...
    def close(self) -> None: ...


def scalars_of(m: dict[str, Any]) -> dict[str, float]:
    """A step's metrics as ``name → number`` (``step``, the step's clock time and the per-op time
    tables left out; the measured times are ``timing_s/<op>`` already, the predicted ones become
    ``predicted_s/<op>``)."""
    out = {
        k: float(v)
        for k, v in m.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "started_at")
    }
    for op, sec in (m.get("predicted_s") or {}).items():
        out[f"predicted_s/{op}"] = float(sec)
    return out


def open_trackers(names: Iterable[str], out: Path, *, run_name: str, config: dict[str, Any], resume_step: int) -> list[Tracker]:
    """The trackers ``names``, writing under the run folder ``out`` (a resume continues their runs)."""
    names = list(dict.fromkeys(names))
    check_trackers(names)
    state_path = out / "trackers.json"
    state: dict[str, str] = json.loads(state_path.read_text()) if resume_step and state_path.exists() else {}
    made: list[Tracker] = []
    try:
        for name in names:
            if name == "tensorboard":
                made.append(_TensorBoard(out / "tensorboard", resume_step))
            elif name == "wandb":
                made.append(_Wandb(out, run_name, config, state))
            elif name == "mlflow":
                made.append(_MLflow(out, run_name, config, state))
    except Exception:
        for t in made:
            t.close()
        raise
    state_path.write_text(json.dumps(state, indent=2) + "\n")
    return made


class MetricsLog:
    """metrics.jsonl (every step's metrics), samples.jsonl (a few generations a step) and the
    experiment trackers ``report_to`` names (see :mod:`flowc.trackers`)."""

    def __init__(
        self,
        out: Path,
        resume_step: int,
        report_to: Sequence[str] = ("tensorboard",),
        *,
        run_name: str | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.path = out / "metrics.jsonl"
        self.samples_path = out / "samples.jsonl"
        for path in (self.path, self.samples_path):
            if resume_step == 0 and path.exists():
                path.unlink()
            elif path.exists():  # keep what was written up to the checkpoint
                path.write_text("".join(json.dumps(m) + "\n" for m in read_metrics(path) if m.get("step", 0) <= resume_step))
        self.trackers = open_trackers(report_to, out, run_name=run_name or out.name, config=config or {}, resume_step=resume_step)

    def write(self, m: dict[str, Any]) -> None:
        """One step's metrics; its ``samples`` (prompt, response, score rows) go to samples.jsonl
        and the trackers' tables, not to metrics.jsonl."""
        rows = m.get("samples") or []
        with self.path.open("a") as f:
            f.write(json.dumps({k: v for k, v in m.items() if k != "samples"}) + "\n")
        if rows:
            with self.samples_path.open("a") as f:
                f.write("".join(json.dumps({"step": m["step"], **r}) + "\n" for r in rows))
        scalars = scalars_of(m)
        for t in list(self.trackers):
            try:
                t.log(m["step"], scalars)
                if rows:
                    t.samples(m["step"], [{"step": m["step"], **r} for r in rows])
            except Exception as e:  # a tracker's failure does not stop training; metrics.jsonl has every step
                self.trackers.remove(t)
                print(
                    f"warning: {type(t).__name__.strip('_').lower()} stopped logging at step {m['step']}: {e} "
                    f"(metrics.jsonl keeps every step)",
                    file=sys.stderr,
                )

    def close(self) -> None:
        for t in self.trackers:
            t.close()


# -------------------------------------------------------------- tensorboard
class _TensorBoard:
    def __init__(self, logdir: Path, resume_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # a resume drops the events written after its checkpoint (purge_step), as metrics.jsonl does
        self.w = SummaryWriter(str(logdir), purge_step=resume_step + 1 if resume_step else None)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in scalars.items():
            self.w.add_scalar(k, v, step)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        head = "| " + " | ".join(SAMPLE_COLUMNS) + " |\n|" + "---|" * len(SAMPLE_COLUMNS) + "\n"
        body = "".join("| " + " | ".join(_cell(r.get(c, step)) for c in SAMPLE_COLUMNS) + " |\n" for r in rows)
        self.w.add_text("samples", head + body, step)

    def close(self) -> None:
        self.w.close()


def _cell(v: Any) -> str:
    return str(v).replace("|", "\\|").replace("\n", "⏎")


# -------------------------------------------------------------------- wandb
class _Wandb:
    def __init__(self, out: Path, run_name: str, config: dict[str, Any], state: dict[str, str]) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE", "offline")  # offline: works without a network or an account
        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "flowc"),
            name=run_name,
            dir=str(out),
            mode=mode,  # type: ignore[arg-type]
            config=config,
            id=state.get("wandb"),
            resume="allow" if state.get("wandb") else None,
            settings=wandb.Settings(silent=True, console="off"),
        )
        state["wandb"] = self.run.id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.run.log(scalars, step=step)

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        table = self.wandb.Table(columns=list(SAMPLE_COLUMNS), data=[[r.get(c, step) for c in SAMPLE_COLUMNS] for r in rows])
        self.run.log({"samples": table}, step=step)

    def close(self) -> None:
        self.run.finish()


# ------------------------------------------------------------------- mlflow
_MLFLOW_KEY = re.compile(r"[^A-Za-z0-9_\-. :/]")


class _MLflow:
    def __init__(self, out: Path, run_name: str, config: dict[str, Any], state: dict[str, str]) -> None:
        uri = os.environ.get("MLFLOW_TRACKING_URI") or (out / "mlruns").resolve().as_uri()
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
        from mlflow.entities import Metric, Param, RunStatus
        from mlflow.tracking import MlflowClient

        self.Metric, self.RunStatus = Metric, RunStatus
        self.client = MlflowClient(tracking_uri=uri)
        self.parents: set[str] = set()  # keys that other keys extend (see _key)
        if state.get("mlflow"):
            self.run_id = state["mlflow"]
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "flowc")
            exp = self.client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(name)
            self.run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
            params = [Param(k[:250], str(v)[:6000]) for k, v in _flatten(config).items()]
            for i in range(0, len(params), 100):
                self.client.log_batch(self.run_id, params=params[i : i + 100])
        state["mlflow"] = self.run_id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [self.Metric(self._key(k, scalars), v, now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def _key(self, k: str, scalars: dict[str, float]) -> str:
        """MLflow's name for metric ``k``. Its file store keeps a metric in a file named by the
        key, so ``reward`` beside ``reward/mean`` is logged as ``reward/value``."""
        key = _MLFLOW_KEY.sub("_", k)
        if key in self.parents or any(other.startswith(key + "/") for other in scalars):
            self.parents.add(key)
            return f"{key}/value"
        return key

    def samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        table = {"columns": list(SAMPLE_COLUMNS), "data": [[r.get(c, step) for c in SAMPLE_COLUMNS] for r in rows]}
        self.client.log_dict(self.run_id, table, f"samples/step_{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{key}."))
        else:
            out[key] = v
    return out
