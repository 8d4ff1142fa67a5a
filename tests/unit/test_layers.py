"""The layers import one way: ir ← passes ← runtime; front end on top.

``flowc.ir`` imports nothing of flowc but ``flowc.errors``; ``flowc.passes``
imports ``flowc.ir``; ``flowc.runtime`` imports ``flowc.ir`` and never
``flowc.passes``. Checked on the source (every import statement) and at run
time (importing a layer loads nothing above it)."""

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
