"""The flows shown in the docs and README trace as written."""

from __future__ import annotations

import re

import pytest
from helpers import ROOT

from flowc.ir.verify import verify
from flowc.loader import load_flow

DOCS = sorted([*ROOT.glob("docs/*.md"), ROOT / "README.md"])
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def flow_blocks():
    for doc in DOCS:
        for i, block in enumerate(BLOCK.findall(doc.read_text())):
            if "@fc.flow" in block:
                yield pytest.param(block, id=f"{doc.name}-{i}")


@pytest.mark.parametrize("block", list(flow_blocks()))
def test_doc_flow_traces(block, tmp_path):
    p = tmp_path / "doc_flow.py"
    p.write_text(block)
    verify(load_flow(str(p)).trace())
