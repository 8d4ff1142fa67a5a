"""The install layout: ir/, passes/, runtime/ import as flowc.ir, flowc.passes,
flowc.runtime from an editable install and from a built wheel, and nothing
else lands at the top of site-packages."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import ROOT

PROBE = """
import importlib.util, json, sys
import flowc, flowc.ir, flowc.passes, flowc.runtime, flowc.ir.models
from flowc.ir.models import catalogue
from flowc.ir.hardware import profiles
print(json.dumps({
    "files": {m: sys.modules[m].__file__ for m in ["flowc", "flowc.ir", "flowc.passes", "flowc.runtime"]},
    "bare": {m: importlib.util.find_spec(m) is not None for m in ["ir", "passes", "runtime"]},
    "catalogue": len(catalogue()),
    "profiles": len(profiles()),
}))
"""


def _probe(cwd: Path, env_extra: dict[str, str] | None = None) -> dict:
    import json
    import os

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(env_extra or {})
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, capture_output=True, text=True, env=env, check=True)
    return json.loads(r.stdout)


def _packages_in_tree() -> set[str]:
    out = set()
    for top, name in (("flowc", "flowc"), ("ir", "flowc.ir"), ("passes", "flowc.passes"), ("runtime", "flowc.runtime")):
        for init in (ROOT / top).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / top)
            out.add(".".join([name, *rel.parts]))
    return out


def test_installed_package_maps_the_layers(tmp_path):
    info = _probe(tmp_path)
    assert info["files"]["flowc.ir"] == str(ROOT / "ir" / "__init__.py")
    assert info["files"]["flowc.passes"] == str(ROOT / "passes" / "__init__.py")
    assert info["files"]["flowc.runtime"] == str(ROOT / "runtime" / "__init__.py")
    assert info["bare"] == {"ir": False, "passes": False, "runtime": False}
    assert info["catalogue"] >= 12 and info["profiles"] >= 6


def test_pyproject_lists_every_package():
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert listed == _packages_in_tree()


@pytest.mark.slow
def test_built_wheel_imports_under_flowc_only(tmp_path):
    import shutil

    src = tmp_path / "src"  # build from a copy so the checkout gets no build/ or egg-info
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "runs", "*.egg-info", "__pycache__"))
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(src)],
        check=True,
        capture_output=True,
    )
    (wheel,) = dist.glob("flowc-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    distinfo = wheel.name.split("-py3")[0] + ".dist-info"
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"flowc", distinfo}, tops
    assert "flowc/ir/catalogue/qwen2.5-7b.json" in names
    assert "flowc/ir/hardware/h100-80gb.yaml" in names
    site = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
    )
    assert {p.name for p in site.iterdir()} - {"bin"} == {"flowc", distinfo}  # bin/: the flowc script
    info = _probe(tmp_path, {"PYTHONPATH": str(site)})
    for mod, path in info["files"].items():
        assert path.startswith(str(site)), (mod, path)
    assert info["bare"] == {"ir": False, "passes": False, "runtime": False}
    assert info["catalogue"] >= 12 and info["profiles"] >= 6
