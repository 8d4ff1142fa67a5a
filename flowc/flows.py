"""``@fc.flow``: declare one training iteration of an RL algorithm.

The decorated function's parameters say what it needs:

* a parameter annotated ``fc.Prompts`` receives the batch of prompts;
* parameters annotated with a role type (``fc.Policy``, ``fc.Critic``,
  ``fc.Reference``, ``fc.RewardModel``, ``fc.Reward``) bind roles;
* keyword-only parameters with defaults are hyperparameters, overridable from
  the command line (``flowc graph FILE n=4``) or :meth:`Flow.trace`.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Iterable
from typing import Any

from flowc.errors import SignatureError, SourceLocation, SpecError, display_path
from flowc.ir.graph import FlowGraph
from flowc.ir.run_config import MAX_STALENESS
from flowc.ir.verify import check_staleness
from flowc.roles import ROLE_TYPES, Preferences, Prompts, Role, suggest

DATA_TYPES: dict[type, str] = {Prompts: "prompts", Preferences: "preferences"}


class Flow:
    """A traced-on-demand RL algorithm. Create with :func:`flow`."""

    def __init__(self, fn: Callable[..., Any], *, max_staleness: int | None = None) -> None:
        self.fn = fn
        self.name: str = fn.__name__
        self.doc: str = inspect.getdoc(fn) or ""
        self.file: str = fn.__code__.co_filename
        self.line, self._param_lines = _source_lines(fn)
        self.data_params: dict[str, str] = {}
        self.roles: dict[str, type[Role]] = {}
        self.hyperparams: dict[str, Any] = {}
        self._read_signature()
        if max_staleness is not None and (
            isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or not 0 <= max_staleness <= MAX_STALENESS
        ):
            raise SignatureError(
                f"@fc.flow(max_staleness={max_staleness!r}) on {self.name!r}: the bound is a whole number of weight"
                f" versions, 0 to {MAX_STALENESS}",
                fix="e.g. @fc.flow(max_staleness=1): rollouts sampled with weights at most one update older than the trainer's",
                where=self._where(),
            )
        self.max_staleness: int | None = max_staleness

    def _where(self, param: str | None = None) -> SourceLocation:
        return SourceLocation(self.file, self._param_lines.get(param, self.line) if param else self.line)

    def _read_signature(self) -> None:
        try:
            hints = typing.get_type_hints(self.fn)
        except Exception as e:  # NameError on an unresolvable string annotation
            raise SignatureError(f"cannot resolve the annotations of flow {self.name!r}: {e}", where=self._where()) from e
        for p in inspect.signature(self.fn).parameters.values():
            ann = hints.get(p.name)
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise SignatureError(
                    f"flow {self.name!r} has *{p.name}; a flow's parameters must each be named",
                    fix="declare each role and data parameter by name",
                    where=self._where(p.name),
                )
            if isinstance(ann, type) and ann in DATA_TYPES:
                self.data_params[p.name] = DATA_TYPES[ann]
            elif isinstance(ann, type) and issubclass(ann, Role) and ann in ROLE_TYPES:
                if p.default is not p.empty:
                    raise SignatureError(
                        f"role parameter {p.name!r} of flow {self.name!r} has a default",
                        fix="remove the default: which model a role is comes from the run's configuration",
                        where=self._where(p.name),
                    )
                self.roles[p.name] = ann
            elif p.kind is p.KEYWORD_ONLY:
                if p.default is p.empty:
                    raise SignatureError(
                        f"hyperparameter {p.name!r} of flow {self.name!r} has no default",
                        fix=f"give it one, e.g. *, {p.name}: float = 0.1",
                        where=self._where(p.name),
                    )
                self.hyperparams[p.name] = p.default
            else:
                shown = "no annotation" if ann is None else f"annotation {getattr(ann, '__name__', ann)!s}"
                raise SignatureError(
                    f"parameter {p.name!r} of flow {self.name!r} has {shown}, which is not a role type",
                    fix=(
                        f"annotate it with a role type (e.g. {p.name}: fc.Policy) or, for a hyperparameter, "
                        f"make it keyword-only with a default (after a '*')"
                    ),
                    where=self._where(p.name),
                )
        if len(self.data_params) != 1:
            found = ", ".join(self.data_params) or "none"
            raise SignatureError(
                f"flow {self.name!r} needs exactly one data parameter, fc.Prompts or fc.Preferences (found {found})",
                fix="add a parameter such as prompts: fc.Prompts (or pairs: fc.Preferences for offline preference data)",
                where=self._where(),
            )
        if not self.roles:
            raise SignatureError(
                f"flow {self.name!r} declares no roles",
                fix="add at least a policy, e.g. actor: fc.Policy",
                where=self._where(),
            )

    # ------------------------------------------------------------------
    def resolve_hyperparams(self, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """Defaults updated by ``overrides``; unknown names are errors."""
        hyper = dict(self.hyperparams)
        for k, v in (overrides or {}).items():
            if k not in hyper:
                raise SignatureError(
                    f"flow {self.name!r} has no hyperparameter {k!r}{suggest(k, list(hyper))}",
                    fix=f"its hyperparameters are {', '.join(hyper) or '(none)'}",
                )
            hyper[k] = v
        return hyper

    def parse_overrides(self, words: Iterable[str]) -> dict[str, Any]:
        """Parse ``name=value`` words, converting each value to the type of the
        hyperparameter's default (int, float, bool, str, or None → Python literal)."""
        out: dict[str, Any] = {}
        for w in words:
            if "=" not in w:
                raise SignatureError(f"{w!r} is not name=value", fix="write overrides as e.g. n=4 clip=0.28")
            k, raw = w.split("=", 1)
            k = k.strip()
            if k not in self.hyperparams:
                raise SignatureError(
                    f"flow {self.name!r} has no hyperparameter {k!r}{suggest(k, list(self.hyperparams))}",
                    fix=f"its hyperparameters are {', '.join(self.hyperparams) or '(none)'}",
                )
            out[k] = _coerce(k, raw, self.hyperparams[k])
        return out

    def trace(self, **overrides: Any) -> FlowGraph:
        """The IR of one iteration with the given hyperparameter values."""
        from flowc.tracing import trace_function

        hyper = self.resolve_hyperparams(overrides)
        g = trace_function(
            self.fn,
            name=self.name,
            data_params=self.data_params,
            roles=self.roles,
            hyper=hyper,
            source=display_path(self.file),
            def_lineno=self.line,
        )
        if self.max_staleness:  # the flow promises its loss tolerates that lag: hold it to it now, not when planned
            try:
                check_staleness(g, self.max_staleness)
            except SpecError as e:
                raise SpecError(
                    f"@fc.flow(max_staleness={self.max_staleness}) on {self.name!r}: {e.what}",
                    fix=f"{e.fix} — or declare max_staleness=0" if e.fix else "declare max_staleness=0",
                    where=self._where(),
                ) from None
        g.max_staleness = self.max_staleness
        return g

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise SignatureError(
            f"flow {self.name!r} is not called directly",
            fix=f"trace it with {self.name}.trace(), or run it with `flowc run {self.file}`",
        )

    def __repr__(self) -> str:
        roles = ", ".join(f"{k}: {v.title}" for k, v in self.roles.items())
        return f"<flow {self.name}({roles})>"


def _source_lines(fn: Callable[..., Any]) -> tuple[int, dict[str, int]]:
    """The line of ``def`` and of each parameter (the decorator line is skipped)."""
    import ast
    import textwrap

    first = fn.__code__.co_firstlineno
    try:
        lines, start = inspect.getsourcelines(fn)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, SyntaxError, TypeError):
        return first, {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == fn.__name__:
            a = node.args
            params = {x.arg: start + x.lineno - 1 for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]}
            for x in (a.vararg, a.kwarg):
                if x is not None:
                    params[x.arg] = start + x.lineno - 1
            return start + node.lineno - 1, params
    return first, {}


def _coerce(name: str, raw: str, default: Any) -> Any:
    raw = raw.strip()
    try:
        if isinstance(default, bool):
            low = raw.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if isinstance(default, int):
            return int(raw)
        if isinstance(default, float):
            return float(raw)
        if isinstance(default, str):
            return raw
        import ast

        return ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        kind = type(default).__name__
        raise SignatureError(
            f"hyperparameter {name}={raw!r} is not a valid {kind}", fix=f"give a {kind}, e.g. {name}={default!r}"
        ) from None


@typing.overload
def flow(fn: Callable[..., Any], /) -> Flow: ...
@typing.overload
def flow(*, max_staleness: int | None = None) -> Callable[[Callable[..., Any]], Flow]: ...
def flow(
    fn: Callable[..., Any] | None = None, /, *, max_staleness: int | None = None
) -> Flow | Callable[[Callable[..., Any]], Flow]:
    """Declare ``fn`` as one training iteration of an RL algorithm: ``@fc.flow``, or
    ``@fc.flow(max_staleness=K)`` for an algorithm whose loss tolerates rollouts sampled with
    weights up to ``K`` updates older than the trainer's. A run of such a flow lets the planner
    choose the staleness in ``0 … K`` with the placement (``--staleness K`` beyond it is refused);
    the loss must correct for the lag (``correction=``), checked when the flow is traced."""
    if fn is None:
        return lambda f: Flow(f, max_staleness=max_staleness)
    if not callable(fn):
        raise SignatureError(
            f"@fc.flow got {fn!r}, not a function",
            fix="write @fc.flow or @fc.flow(max_staleness=1) above the def",
        )
    return Flow(fn, max_staleness=max_staleness)
