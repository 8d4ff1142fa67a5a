"""Symbolic shapes: dimension expressions over the workload's symbols.

A dimension is a small arithmetic expression in the text form every IR
printer and the JSON form use, e.g. ``"B*n"``, ``"R"``, ``"P+R"`` or ``"4"``.
The symbols are:

====== =====================================================================
``B``  prompts per step (the batch the data loader yields)
``P``  prompt length in tokens (padded)
``R``  response length in tokens (the generation limit)
``n``  samples per prompt of the first ``generate`` whose ``n > 1``; a later
       generate with a different count binds ``n2``, ``n3``, … The value of
       each sample symbol is fixed by the flow and stored in
       ``FlowGraph.symbols``.
====== =====================================================================

Expressions allow integers, symbols, ``+``, ``-``, ``*`` and ``//`` and
parentheses; :func:`eval_dim` evaluates them safely (no ``eval``).
"""

from __future__ import annotations

import ast
import itertools
import math
from collections.abc import Mapping, Sequence

from flowc.errors import IRError

WORKLOAD_SYMBOLS: tuple[str, ...] = ("B", "P", "R")
"""Symbols whose values come from the workload, not from the flow."""

UNKNOWN = "?"
"""A dimension whose size could not be inferred (data-dependent shapes)."""


def _eval(node: ast.AST, env: Mapping[str, int], expr: str) -> int:
    if isinstance(node, ast.Expression):
        return _eval(node.body, env, expr)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in env:
            raise IRError(
                f"dimension {expr!r} uses symbol {node.id!r}, which has no value",
                fix=f"bind {node.id} (known: {', '.join(sorted(env)) or 'none'})",
            )
        return int(env[node.id])
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left, env, expr), _eval(node.right, env, expr)
        if isinstance(node.op, ast.Add):
            return a + b
        if isinstance(node.op, ast.Sub):
            return a - b
        if isinstance(node.op, ast.Mult):
            return a * b
        if isinstance(node.op, ast.FloorDiv):
            return a // b
    raise IRError(f"dimension {expr!r} is not an expression of integers and symbols with + - * //")


def parse_dim(expr: str) -> ast.Expression:
    """Parse a dimension expression; raises IRError when malformed."""
    try:
        return ast.parse(expr, mode="eval")
    except SyntaxError as e:
        raise IRError(f"dimension {expr!r} does not parse") from e


def eval_dim(expr: str, env: Mapping[str, int]) -> int:
    """Evaluate one dimension under symbol values ``env``."""
    if expr == UNKNOWN:
        raise IRError("dimension '?' (unknown size) cannot be evaluated", fix="give the op a known shape")
    return _eval(parse_dim(expr), env, expr)


def dim_symbols(expr: str) -> set[str]:
    """The symbols a dimension uses."""
    if expr == UNKNOWN:
        return set()
    return {n.id for n in ast.walk(parse_dim(expr)) if isinstance(n, ast.Name)}


def numel(shape: Sequence[str], env: Mapping[str, int]) -> int:
    """Number of elements of a symbolic shape under ``env``."""
    return math.prod(eval_dim(d, env) for d in shape)


def mul(*dims: str) -> str:
    """Product of dimension expressions, simplified for the common cases."""
    parts = [d for d in dims if d != "1"]
    if not parts:
        return "1"
    if len(parts) == 1:
        return parts[0]
    return "*".join(f"({d})" if ("+" in d or "-" in d) else d for d in parts)


# Two assignments of distinct primes: a dimension that evaluates to the same
# candidate expression under both is, with overwhelming likelihood, that
# expression. Used to recover symbolic shapes from shape propagation run on
# concrete "meta" tensors.
PROBE_ASSIGNMENTS: tuple[dict[str, int], dict[str, int]] = (
    {"B": 3, "P": 5, "R": 7},
    {"B": 11, "P": 13, "R": 17},
)


def candidate_dims(sample_symbols: Mapping[str, int]) -> list[str]:
    """Expressions a dimension is matched against, simplest first."""
    factors = ["B", *sorted(sample_symbols), "P", "R", "P+R"]
    out: list[str] = []
    for k in range(1, len(factors) + 1):
        for combo in itertools.combinations(factors, k):
            if "P" in combo and "P+R" in combo:
                continue
            if "R" in combo and "P+R" in combo:
                continue
            out.append(mul(*combo))
    return out


def match_dim(values: Sequence[int], sample_symbols: Mapping[str, int], preferred: Sequence[str] = ()) -> str:
    """Symbolic expression for a dimension observed as ``values`` under
    :data:`PROBE_ASSIGNMENTS` (one value per assignment).

    ``preferred`` (e.g. the input dimensions of the op) are tried first.
    Returns :data:`UNKNOWN` when nothing matches.
    """
    envs = [dict(a, **sample_symbols) for a in PROBE_ASSIGNMENTS]
    if all(v == values[0] for v in values):
        for sym, val in sorted(sample_symbols.items()):
            if val == values[0] and val > 1:
                return sym
        return str(values[0])
    exprs = [e for e in [*preferred, *candidate_dims(sample_symbols)] if e != UNKNOWN]
    for expr in exprs:
        if all(eval_dim(expr, env) == v for env, v in zip(envs, values, strict=True)):
            return expr
    for expr in exprs:  # an integer multiple of a candidate (e.g. 2*B for a concatenation)
        evs = [eval_dim(expr, env) for env in envs]
        if all(e and v % e == 0 for e, v in zip(evs, values, strict=True)):
            ratios = {v // e for e, v in zip(evs, values, strict=True)}
            if len(ratios) == 1:
                return mul(str(ratios.pop()), expr)
    return UNKNOWN
