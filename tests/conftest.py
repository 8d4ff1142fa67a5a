"""Shared fixtures; the whole suite runs the pass manager with verification after every pass.

``flow_file`` writes a flow to a temporary file that tests load the way the
CLI does, so error locations point at real lines.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

os.environ.setdefault("FLOWC_VERIFY_EACH", "1")  # passes.manager: re-verify the graph and plan after every pass


@pytest.fixture
def flow_file(tmp_path):
    """Write flow source (dedented, with ``import flowc as fc`` prepended) to a
    file and return its path."""

    def write(src: str, name: str = "userflow.py") -> Path:
        p = tmp_path / name
        p.write_text("import torch\nimport flowc as fc\n\n" + textwrap.dedent(src).lstrip("\n"))
        return p

    return write
