"""Names of the functions ``compute`` nodes call, and their resolution.

A graph stores a compute node's function by name so that it is plain data:
``flowc.ir.functional.gae``, ``torch.exp``, ``operator.sub``,
``builtins.getattr`` or ``Tensor.<method>`` for a tensor method. Resolution
is limited to an allow-list of modules, so loading a graph never imports or
calls anything else.
"""

from __future__ import annotations

import builtins
import importlib
import operator
from collections.abc import Callable
from typing import Any

import torch

from flowc.errors import IRError

ALLOWED_MODULES = ("flowc.ir.functional", "torch", "operator", "builtins", "math")
FUNCTIONAL = "flowc.ir.functional"


def target_name(fn: Callable[..., Any] | str, *, method: bool = False) -> str:
    """The stored name of a callable (or of a tensor method when ``method``)."""
    if method:
        return f"Tensor.{fn}"
    op = getattr(fn, "__flowc_op__", None)
    if op is not None:
        return f"{FUNCTIONAL}.{op}"
    if getattr(operator, getattr(fn, "__name__", ""), None) is fn:
        return f"operator.{fn.__name__}"  # type: ignore[union-attr]
    if getattr(builtins, getattr(fn, "__name__", ""), None) is fn:
        return f"builtins.{fn.__name__}"  # type: ignore[union-attr]
    try:
        name = torch.overrides.resolve_name(fn)  # e.g. "torch.exp", "torch.nn.functional.softmax"
    except Exception:
        name = None
    if name:
        return name
    mod = getattr(fn, "__module__", None) or ""
    qual = getattr(fn, "__qualname__", None) or repr(fn)
    full = f"{mod}.{qual}"
    if not mod.startswith(ALLOWED_MODULES):
        raise IRError(
            f"{full} cannot run on the controller: only torch, operator, math and fc.ops functions can",
            fix="write the computation with torch operations or fc.ops, or add a declarative op",
        )
    return full


def short_name(name: str) -> str:
    """How printers show a target: ``gae``, ``torch.exp``, ``sub``, ``Tensor.mean``."""
    for prefix in (f"{FUNCTIONAL}.", "operator.", "builtins."):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def resolve(name: str) -> Callable[..., Any]:
    """The callable a stored name stands for (tensor methods become a
    function calling the method on the first argument)."""
    if name.startswith("Tensor."):
        meth = name[len("Tensor.") :]
        if not hasattr(torch.Tensor, meth):
            raise IRError(f"unknown tensor method in graph: {name}")

        def call_method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return getattr(self, meth)(*args, **kwargs)

        return call_method
    if not name.startswith(tuple(m + "." for m in ALLOWED_MODULES)):
        raise IRError(f"graph names {name!r}, which is outside the allowed modules ({', '.join(ALLOWED_MODULES)})")
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for p in parts[i:]:
                obj = getattr(obj, p)
        except AttributeError:
            break
        return obj
    raise IRError(f"cannot resolve function {name!r} named by the graph")
