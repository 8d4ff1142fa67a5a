"""Run one of a bench script's measuring functions in a fresh Python process.

Measurements of start-up time and of memory need a process that has not imported or built
anything yet (vLLM and torch keep what they loaded). ``in_fresh_process("calibrate_memory",
"head")`` imports ``bench/calibrate_memory.py`` in a new interpreter, calls ``head()`` and
returns its JSON-able result.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MARK = "RESULT "


def in_fresh_process(module: str, fn: str, *args: Any, timeout: float = 1800) -> Any:
    """``module.fn(*args)`` (a script in bench/, JSON-able arguments and result) in a new
    interpreter started in the repository root; its stderr's tail in the error if it fails."""
    code = (
        f"import json, sys; sys.path.insert(0, {str(HERE)!r}); from {module} import {fn}; "
        f"print({MARK!r} + json.dumps({fn}(*json.loads({json.dumps(list(args))!r}))))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    line = next((x for x in r.stdout.splitlines() if x.startswith(MARK)), None)
    if line is None:
        raise RuntimeError(f"{module}.{fn}{tuple(args)} failed:\n{r.stderr[-4000:]}")
    return json.loads(line[len(MARK) :])
