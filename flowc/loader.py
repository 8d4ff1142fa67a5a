"""Load the @flow functions of a user's file (``FILE`` or ``FILE:NAME``)."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from flowc.errors import FlowcError, LoadError, SourceLocation
from flowc.flows import Flow


def split_spec(spec: str) -> tuple[Path, str | None]:
    """``"examples/ppo.py:ppo"`` → (path, "ppo"); ``"examples/ppo.py"`` → (path, None)."""
    path, sep, name = spec.rpartition(":")
    if sep and name.isidentifier() and path:
        return Path(path), name
    return Path(spec), None


@contextmanager
def on_path(folder: str) -> Iterator[None]:
    """``folder`` on ``sys.path`` while a user's module imports (its sibling modules
    import too), and off it again afterwards."""
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        yield
    finally:
        if added:
            sys.path.remove(folder)


def load_module_flows(path: Path) -> dict[str, Flow]:
    """Import ``path`` as a fresh module and return its flows by name."""
    if not path.exists():
        raise LoadError(f"{path}: no such file", fix="give the path of a Python file that defines an @fc.flow function")
    if path.suffix != ".py":
        raise LoadError(f"{path} is not a Python file", fix="give a .py file that defines an @fc.flow function")
    resolved = path.resolve()
    mod_name = "flowc_user_" + path.stem + "_" + hashlib.sha1(str(resolved).encode()).hexdigest()[:8]
    spec = importlib.util.spec_from_file_location(mod_name, str(path))
    if spec is None or spec.loader is None:
        raise LoadError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        with on_path(str(resolved.parent)):
            spec.loader.exec_module(module)
    except SyntaxError as e:
        raise LoadError(f"syntax error: {e.msg}", where=SourceLocation(str(path), e.lineno or 1)) from None
    except FlowcError as e:
        raise e from None
    except Exception as e:
        where = None
        for fs in traceback.extract_tb(e.__traceback__):
            if Path(fs.filename).resolve() == resolved and fs.lineno:
                where = SourceLocation(str(path), fs.lineno)
        raise LoadError(f"importing {path} failed: {type(e).__name__}: {e}", where=where) from e
    return {v.name: v for v in vars(module).values() if isinstance(v, Flow)}


def load_flow(spec: str) -> Flow:
    """The flow named by ``FILE`` (its only flow) or ``FILE:NAME``."""
    path, name = split_spec(spec)
    flows = load_module_flows(path)
    if not flows:
        raise LoadError(
            f"{path} defines no @fc.flow function",
            fix="decorate the function that describes one training iteration with @fc.flow",
        )
    if name is None:
        if len(flows) > 1:
            raise LoadError(
                f"{path} defines several flows: {', '.join(sorted(flows))}",
                fix=f"choose one with {path}:NAME, e.g. {path}:{sorted(flows)[0]}",
            )
        return next(iter(flows.values()))
    if name not in flows:
        raise LoadError(f"{path} has no flow named {name!r}", fix=f"its flows are {', '.join(sorted(flows))}")
    return flows[name]
