"""Binding a flow's ``Reward`` roles to Python functions (``--reward ROLE=module:function``)."""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flowc.errors import SpecError
from flowc.ir.graph import FlowGraph
from flowc.ir.ops import RoleKind
from flowc.loader import on_path


def load_reward(spec: str) -> tuple[Callable[..., Any], str]:
    """``module:function`` (importable from the working directory) or ``path/to/file.py:function``
    (its folder importable while it loads)."""
    mod_name, sep, fn_name = spec.rpartition(":")
    if not sep or not mod_name or not fn_name:
        raise SpecError(f"--reward {spec!r} is not module:function", fix="e.g. --reward reward=my_rewards:exact_match")
    try:
        if mod_name.endswith(".py"):
            path = Path(mod_name)
            sp = importlib.util.spec_from_file_location(f"flowc_reward_{path.stem}", path)
            if sp is None or sp.loader is None:
                raise ImportError(f"cannot import {path}")
            module = importlib.util.module_from_spec(sp)
            with on_path(str(path.resolve().parent)):
                sp.loader.exec_module(module)
        else:
            with on_path(os.getcwd()):
                module = importlib.import_module(mod_name)
    except Exception as e:
        raise SpecError(f"cannot import the reward module {mod_name!r}: {type(e).__name__}: {e}") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise SpecError(
            f"{mod_name} has no function {fn_name!r}", fix="name a function fn(prompts, responses, **columns) -> list[float]"
        )
    return fn, spec


def bind_rewards(
    g: FlowGraph, given: dict[str, str], default: tuple[Callable[..., Any], str] | None
) -> tuple[dict[str, Callable[..., Any]], dict[str, str]]:
    """A function for every Reward role of ``g``: the one given, else ``default`` (the built-in
    task's), else an error naming the role; and the names they are reported by."""
    for role in given:
        if role not in g.roles or g.roles[role].kind != RoleKind.REWARD:
            raise SpecError(f"--reward names {role!r}, which is not a Reward role of flow {g.name!r}")
    fns: dict[str, Callable[..., Any]] = {}
    names: dict[str, str] = {}
    for role, info in g.roles.items():
        if info.kind != RoleKind.REWARD:
            continue
        if role in given:
            fns[role], names[role] = load_reward(given[role])
        elif default is not None:
            fns[role], names[role] = default
        else:
            raise SpecError(f"reward role {role!r} has no function", fix=f"bind it: --reward {role}=module:function")
    return fns, names
