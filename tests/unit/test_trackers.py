"""Experiment trackers (flowc.trackers through flowc.run.MetricsLog, no Ray): each tracker's own
files are read back with that tracker's reader — TensorBoard's EventAccumulator, the W&B offline
run's record log, MLflow's file store — and a missing tracker package is refused up front."""

from __future__ import annotations

import glob
import json
import os
import struct
import time
from pathlib import Path

import pytest

from flowc.errors import SpecError
from flowc.run import MetricsLog

STEPS = [
    {
        "step": s,
        "reward": 0.25 * s,
        "reward/mean": 0.25 * s,  # a key that extends another (MLflow's file store: reward/value)
        "critic/score/mean": 0.25 * s,
        "response_length/mean": 5.0 + s,
        "actor/pg_clipfrac": 0.0,
        "timing_s/actor.generate": 0.1 * s,
        "measured_s": {"actor.generate": 0.1 * s},
        "predicted_s": {"actor.generate": 0.05},
        "samples": [
            {"prompt": f"{s}+1=", "response": str(s + 1), "score": 1.0},
            {"prompt": f"{s}+2=", "response": "x|y\nz", "score": 0.0},
        ],
    }
    for s in (1, 2)
]


def _write(out: Path, report_to: list[str], steps=STEPS, resume_step: int = 0) -> None:
    log = MetricsLog(out, resume_step, report_to, run_name="grpo-test", config={"steps": 2, "optim": {"actor": {"lr": 1e-5}}})
    try:
        for m in steps:
            log.write(dict(m))
    finally:
        log.close()


def test_metrics_jsonl_and_samples_jsonl(tmp_path):
    _write(tmp_path, [])
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("samples" not in r for r in rows)
    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples[0] == {"step": 1, "prompt": "1+1=", "response": "2", "score": 1.0} and len(samples) == 4


def test_tensorboard_event_files_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _write(tmp_path, ["tensorboard"])
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    assert {"critic/score/mean", "response_length/mean", "timing_s/actor.generate", "predicted_s/actor.generate"} <= set(
        tags["scalars"]
    )
    assert "step" not in tags["scalars"] and not any("samples" in t for t in tags["scalars"])
    assert [(e.step, e.value) for e in acc.Scalars("critic/score/mean")] == [(1, 0.25), (2, 0.5)]
    text = [t for t in tags["tensors"] if t.startswith("samples")]
    assert text, tags
    table = acc.Tensors(text[0])[0].tensor_proto.string_val[0].decode()
    assert "| step | prompt | response | score |" in table and "1+1=" in table and "x\\|y⏎z" in table


def _wandb_records(path: str):
    """The records of a W&B ``.wandb`` file (a LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and n == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf + chunk)
            buf = b""
            yield rec
        else:
            buf = (buf if kind == 3 else b"") + chunk


def _wandb_history(out: Path) -> list[dict]:
    rows = []
    for f in sorted(glob.glob(str(out / "wandb" / "offline-run-*" / "run-*.wandb"))):
        for rec in _wandb_records(f):
            if rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return rows


def test_wandb_offline_run_read_back():
    """Run in a fresh interpreter: wandb keeps process-wide state (its service and settings) that
    other tests in a long session can leave behind."""
    import os
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"{__file__}::test_wandb_offline_in_a_fresh_process"],
        env={**os.environ, "FLOWC_WANDB_FRESH": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]


@pytest.mark.skipif(not os.environ.get("FLOWC_WANDB_FRESH"), reason="run by test_wandb_offline_run_read_back")
def test_wandb_offline_in_a_fresh_process(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)  # offline is flowc's default
    _write(tmp_path, ["wandb"])
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    assert len(runs) == 1
    # wandb's service process writes the run file; on a loaded machine it can land a moment after finish()
    deadline = time.monotonic() + 60
    while True:
        hist = _wandb_history(tmp_path)
        scores = [(h["_step"], h["critic/score/mean"]) for h in hist if "critic/score/mean" in h]
        if len(scores) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert scores == [(1, 0.25), (2, 0.5)]
    assert any(h.get("samples/_type") == "table-file" for h in hist)
    tables = glob.glob(f"{runs[0]}/files/media/table/samples_*.table.json")
    got = json.loads(Path(sorted(tables)[0]).read_text())
    assert got["columns"] == ["step", "prompt", "response", "score"] and got["data"][0] == [1, "1+1=", "2", 1.0]
    wid = json.loads((tmp_path / "trackers.json").read_text())["wandb"]
    assert runs[0].endswith(wid)


def test_mlflow_file_store_read_back_and_a_resume_continues_the_run(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from mlflow.tracking import MlflowClient

    _write(tmp_path, ["mlflow"], steps=STEPS[:1])
    _write(tmp_path, ["mlflow"], steps=STEPS[1:], resume_step=1)
    run_id = json.loads((tmp_path / "trackers.json").read_text())["mlflow"]
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    hist = client.get_metric_history(run_id, "critic/score/mean")
    assert [(m.step, m.value) for m in hist] == [(1, 0.25), (2, 0.5)]  # one run across the resume
    assert [m.value for m in client.get_metric_history(run_id, "reward/value")] == [0.25, 0.5]
    assert [m.value for m in client.get_metric_history(run_id, "reward/mean")] == [0.25, 0.5]
    run = client.get_run(run_id)
    assert run.data.params["optim.actor.lr"] == "1e-05" and run.info.status == "FINISHED"
    art = Path(run.info.artifact_uri.removeprefix("file://")) / "samples" / "step_000002.json"
    assert json.loads(art.read_text())["data"][0] == [2, "2+1=", "3", 1.0]


def test_a_missing_tracker_package_is_refused_with_the_pip_command(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(SpecError) as e:
        MetricsLog(tmp_path, 0, ["tensorboard", "wandb"])
    assert "wandb package is not installed" in e.value.what and "pip install wandb" in e.value.fix
    assert not (tmp_path / "tensorboard").exists()  # refused before any tracker was opened


def test_report_to_flag_and_config(tmp_path):
    from flowc.cli_requests import trackers_list
    from flowc.ir.run_config import RunConfig

    assert RunConfig().report_to == ["tensorboard"]
    cfg, _ = RunConfig.load(None, [f"report_to={trackers_list('tensorboard,wandb,mlflow')}"])
    assert cfg.report_to == ["tensorboard", "wandb", "mlflow"]
    assert RunConfig.load(None, [f"report_to={trackers_list('none')}"])[0].report_to == []
    with pytest.raises(SpecError):
        RunConfig.load(None, ["report_to=[comet]"])
