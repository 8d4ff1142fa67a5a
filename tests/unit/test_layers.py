"""The layers import one way: ir ← passes ← runtime; front end on top.

``flowc.ir`` imports nothing of flowc but ``flowc.errors``; ``flowc.passes``
imports ``flowc.ir``; ``flowc.runtime`` imports ``flowc.ir`` and never
``flowc.passes``. Inside the runtime, backends sit below the controller: a
backend module never imports the controller, the worker or the program, and
nothing but the registry's lazy loader (``BackendInfo.load``) names a
concrete backend module — the controller, worker and front end reach
backends only through ``flowc.runtime.backends``. Checked on the source
(every import statement) and at run time (importing a layer loads nothing
above it)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys

import pytest
from helpers import ROOT

ALLOWED = {
    "ir": ("flowc.errors", "flowc.ir"),
    "passes": ("flowc.errors", "flowc.ir", "flowc.passes"),
    "runtime": ("flowc.errors", "flowc.ir", "flowc.runtime"),
}


def _flowc_imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield node.lineno, a.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.lineno, node.module


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports_only_below_itself(layer):
    bad = []
    for f in (ROOT / layer).rglob("*.py"):
        for line, mod in _flowc_imports(f):
            if (mod == "flowc" or mod.startswith("flowc.")) and not mod.startswith(ALLOWED[layer]):
                bad.append(f"{f.relative_to(ROOT)}:{line} imports {mod}")
            if mod.split(".")[0] in ("ir", "passes", "runtime"):
                bad.append(f"{f.relative_to(ROOT)}:{line} imports {mod}: write flowc.{mod} (the installed name)")
    assert not bad, "\n".join(bad)


def test_importing_the_ir_loads_no_front_end(tmp_path):
    code = "import sys, json, flowc.ir, flowc.ir.verify, flowc.ir.models; print(json.dumps(sorted(m for m in sys.modules if m.startswith('flowc'))))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path)
    loaded = json.loads(r.stdout)
    front = [m for m in loaded if not (m.startswith("flowc.ir") or m in ("flowc", "flowc._version", "flowc.errors"))]
    assert not front, front


CONCRETE = {f"flowc.runtime.backends.{m}" for m in ("fsdp2", "megatron", "hf", "vllm")}
ABOVE_BACKENDS = ("flowc.runtime.controller", "flowc.runtime.worker", "flowc.runtime.program")


def test_backends_sit_below_the_controller():
    bad = []
    for f in (ROOT / "runtime" / "backends").glob("*.py"):
        for line, mod in _flowc_imports(f):
            if mod.startswith(ABOVE_BACKENDS):
                bad.append(f"{f.relative_to(ROOT)}:{line} imports {mod}")
    assert not bad, "\n".join(bad)


def test_concrete_backends_are_reached_only_through_the_registry():
    """Adding a backend is one new module and one registry row: no other code names one."""
    bad = []
    for top in ("flowc", "ir", "passes", "runtime"):
        for f in (ROOT / top).rglob("*.py"):
            if f.parent.name == "backends" and f.stem in {m.rsplit(".", 1)[1] for m in CONCRETE}:
                continue  # a backend module itself
            for line, mod in _flowc_imports(f):
                if mod in CONCRETE:
                    bad.append(f"{f.relative_to(ROOT)}:{line} imports {mod}")
    assert not bad, "\n".join(bad)
    from flowc.runtime.backends import BACKENDS

    assert {b.module for b in BACKENDS.values()} == CONCRETE
    for b in (b for b in BACKENDS.values() if b.installed()):  # every row names a class that follows its protocol
        cls = b.load()
        need = (
            ("sample", "logprobs", "load", "sleep")
            if b.role == "rollout"
            else ("agree", "dp_sum", "run", "share", "zero_grad", "step", "weights", "state", "load_state", "export_hf")
        )
        assert all(callable(getattr(cls, m, None)) for m in need), (b.name, [m for m in need if not hasattr(cls, m)])
