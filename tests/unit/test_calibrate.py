"""`flowc calibrate` fits the profile's efficiency factors to measured runs: two recorded runs of
the default GRPO on this project's 2-core machine (different batch sizes, 1 and 2 workers), one
fitted on, the other held apart; the held-apart run's re-planned predictions get closer."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import flowc_cmd

from flowc.calibrate import error, fit, read_run, repredict
from flowc.ir.cluster import ClusterSpec

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "calibrate"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def runs(tmp_path) -> dict[str, Path]:
    """The recorded run folders, their paths pointed at this checkout."""
    out = {}
    for name in ("runA", "runB"):
        d = tmp_path / name
        shutil.copytree(FIXTURES / name, d)
        for f in d.iterdir():
            f.write_text(f.read_text().replace("{REPO}", str(REPO)))
        out[name] = d
    return out


@pytest.mark.parametrize("fit_on,held", [("runA", "runB"), ("runB", "runA")])
def test_a_fitted_profile_predicts_a_held_apart_run_better(runs, fit_on, held):
    result = fit([runs[fit_on]])
    assert {"decode_bw", "forward", "train"} <= set(result.scale)
    plan, times = read_run(runs[held])
    # before: this cost model's own prediction with the profile's factors (not the recorded one)
    base = repredict(runs[held], plan.cluster_spec().profile.efficiency)
    before = error([(base[o.op], o.measured_s) for o in times])
    after_pred = repredict(runs[held], result.cluster.profile.efficiency)
    after = error([(after_pred[o.op], o.measured_s) for o in times])
    assert after < before * 0.85, (before, after)


def test_the_cluster_file_plans(runs, tmp_path):
    import subprocess

    out = tmp_path / "cpu-fitted.yaml"
    r = subprocess.run(
        flowc_cmd("calibrate", str(runs["runA"]), "--check", str(runs["runB"]), "-o", str(out)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "held apart runB" in r.stdout and "decode_bw" in r.stdout
    cluster = ClusterSpec.parse(str(out))
    fitted = fit([runs["runA"]]).cluster.profile.efficiency
    assert cluster.profile.efficiency.decode_bw == pytest.approx(fitted.decode_bw, abs=1e-4)
    assert cluster.profile.efficiency.decode_bw != ClusterSpec.parse("local").profile.efficiency.decode_bw
