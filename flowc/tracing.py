"""Trace a @flow function into a FlowGraph.

Two steps:

1. **Record** (torch.fx): the function runs once with a proxy for the prompts
   and a role object for every role. Role method calls record opaque nodes;
   tensor math between them (torch ops, tensor methods, ``fc.ops``) is
   recorded by torch.fx's proxies. Python control flow on a traced value,
   misuse of a role and bad keywords are reported at the user's line.
2. **Lower** to the IR: role calls become ``generate``/``logprobs``/… nodes,
   field and tuple accesses become projections on edges, everything else a
   ``compute`` node. Shapes are propagated by running the recorded ops on
   small real tensors under two assignments of distinct primes to the
   workload symbols (B, P, R); each output dimension is matched back to a
   symbolic expression (see :func:`flowc.ir.shapes.match_dim`).
"""

from __future__ import annotations

import operator
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
import torch.fx

from flowc.errors import (
    ControlFlowError,
    FlowcError,
    FlowDefinitionError,
    MissingUpdateError,
    SignatureError,
    SourceLocation,
    ValueUseError,
)
from flowc.ir.functional import PromptBatch, Rollout
from flowc.ir.graph import FlowGraph, Node, RoleInfo, ValueRef
from flowc.ir.shapes import PROBE_ASSIGNMENTS, UNKNOWN, match_dim, mul
from flowc.ir.targets import resolve, short_name, target_name
from flowc.ir.types import (
    BundleType,
    PyType,
    StatsType,
    TensorType,
    TupleType,
    ValueType,
    agent_rollout_type,
    prompts_type,
    rollout_type,
)
from flowc.roles import Role, suggest

_BUNDLE_FIELDS = {
    "prompts": tuple(prompts_type().fields),
    "rollout": tuple(rollout_type("N").fields),
}
_AGENT_FIELDS = tuple(agent_rollout_type("N").fields)


@dataclass(frozen=True)
class RoleCall:
    """The fx target of a role method call (never called: lowered to the IR)."""

    op: str
    role: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - never executed
        raise AssertionError("role calls are lowered, not run")

    @property
    def __name__(self) -> str:  # fx names nodes after their target
        return f"{self.role}_{self.op}"


@dataclass(frozen=True)
class FilterCall:
    """The fx target of ``fc.ops.filter_groups`` (lowered to a ``filter`` node, never called)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # pragma: no cover - never executed
        raise AssertionError("filters are lowered, not run")

    @property
    def __name__(self) -> str:
        return "filter_groups"


FILTER = FilterCall()


# ----------------------------------------------------------------- locating
def _innermost_frame_in(filename: str, frame: FrameType | None) -> SourceLocation | None:
    while frame is not None:
        if frame.f_code.co_filename == filename:
            return SourceLocation(filename, frame.f_lineno)
        frame = frame.f_back
    return None


def _location_from_traceback(filename: str, tb: Any) -> SourceLocation | None:
    found = None
    for fs in traceback.extract_tb(tb):
        if fs.filename == filename and fs.lineno is not None:
            found = SourceLocation(filename, fs.lineno)
    return found


# ------------------------------------------------------------------ record
class FlowProxy(torch.fx.Proxy):
    """An fx proxy that knows whether it stands for prompts, a rollout or a tensor."""

    @property
    def flowc_kind(self) -> str:
        return self.node.meta.get("flowc_kind", "tensor")

    def __getattr__(self, k: str) -> Any:
        kind = self.node.meta.get("flowc_kind", "tensor") if "node" in self.__dict__ else "tensor"
        if kind in _BUNDLE_FIELDS and not k.startswith("_") and k not in _BUNDLE_FIELDS[kind]:
            fields = _BUNDLE_FIELDS[kind]
            single = isinstance(self.node.target, RoleCall) and "env" not in self.node.meta.get("flowc_static", {})
            if kind == "rollout" and k in _AGENT_FIELDS:
                if not single:
                    return super().__getattr__(k)
                raise ValueUseError(
                    f"rollout.{k} exists only on multi-turn rollouts, and this one has no environment",
                    fix="generate with an environment: actor.generate(prompts, env=env) (an fc.Environment parameter)",
                )
            raise ValueUseError(
                f"a {kind} value has no field {k!r}{suggest(k, fields)}",
                fix=f"its fields are {', '.join(fields)}",
            )
        return super().__getattr__(k)

    def __getitem__(self, key: Any) -> Any:
        out = super().__getitem__(key)  # type: ignore[misc]
        if self.flowc_kind == "filtered" and isinstance(out, FlowProxy):
            out.node.meta["flowc_kind"] = {0: "rollout", 1: "tensor"}.get(key, "tensor")
        return out

    def _concrete(self, what: str) -> Any:
        raise ControlFlowError(
            f"{what} of a traced value: its value is only known when the flow runs",
            fix="compute with tensor ops instead (e.g. torch.where(cond, a, b) for if/else), or use a hyperparameter",
        )

    def __len__(self) -> int:
        return self._concrete("len()")

    def __float__(self) -> float:
        return self._concrete("float()")

    def __int__(self) -> int:
        return self._concrete("int()")

    def __index__(self) -> int:
        return self._concrete("using as an index")


class FlowTracer(torch.fx.Tracer):
    """Records a flow; reports misuse at the user's line."""

    def __init__(self, filename: str) -> None:
        super().__init__()
        self.filename = filename
        self.graph = torch.fx.Graph()

    def here(self) -> SourceLocation | None:
        return _innermost_frame_in(self.filename, sys._getframe(1))

    def proxy(self, node: torch.fx.Node) -> FlowProxy:
        return FlowProxy(node, self)

    def create_proxy(
        self,
        kind: str,
        target: Any,
        args: Any,
        kwargs: Any,
        name: str | None = None,
        type_expr: Any = None,
        proxy_factory_fn: Any = None,
    ) -> Any:
        p = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        loc = self.here()
        p.node.meta.setdefault("line", loc.line if loc else None)
        return p

    def create_arg(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return a  # a small constant made while tracing; stored in the IR as a value
        if isinstance(a, Role):
            raise ValueUseError(
                f"the role {a.name!r} itself cannot be used as a value",
                fix=f"call one of its methods ({', '.join(a.methods)}) and use the result",
            )
        return super().create_arg(a)

    def to_bool(self, obj: torch.fx.Proxy) -> bool:
        raise ControlFlowError(
            "Python control flow (if/while/and/or/not) on a traced value: its value is only known when the flow runs",
            fix="express the choice with tensor ops (torch.where(cond, a, b)), or branch on a hyperparameter instead",
            where=self.here(),
        )

    def iter(self, obj: torch.fx.Proxy) -> Any:
        raise ControlFlowError(
            "a Python for-loop (or unpacking into a variable number of names) over a traced value",
            fix="use tensor ops over the whole batch instead of looping over its elements",
            where=self.here(),
        )

    def keys(self, obj: torch.fx.Proxy) -> Any:
        raise ControlFlowError("** unpacking of a traced value", where=self.here())


class TraceContext:
    """State shared by the role objects while one flow is recorded."""

    def __init__(self, tracer: FlowTracer) -> None:
        self.tracer = tracer

    def role_call(self, role: Role, op: str, inputs: dict[str, tuple[Any, str]], static: dict[str, Any]) -> FlowProxy:
        """Record ``role.op(**inputs)``; ``inputs`` maps argument names to
        (value, expected kind: prompts / rollout / tensor)."""
        fx_kwargs: dict[str, Any] = {}
        for arg, (value, expected) in inputs.items():
            _expect(role, op, arg, value, expected)
            fx_kwargs[arg] = value
        p = self.tracer.create_proxy("call_function", RoleCall(op, role.name), (), fx_kwargs)
        p.node.meta["flowc_static"] = static
        p.node.meta["flowc_kind"] = {"generate": "rollout", "update": "stats"}.get(op, "tensor")
        return p


def record_filter(rollout: Any, scores: Any, kwargs: dict[str, Any]) -> FlowProxy:
    """Record ``fc.ops.filter_groups(rollout, scores, **kwargs)`` as one node."""
    for arg, value, expected in (("rollout", rollout, "rollout"), ("scores", scores, "tensor")):
        if not isinstance(value, FlowProxy) or value.flowc_kind != expected:
            raise ValueUseError(
                f"filter_groups: {arg} must be {_article(expected)}, got {_describe(value)}",
                fix="filter_groups(rollout, scores, group_size=n): the rollout from generate and its scores",
            )
    p = rollout.tracer.create_proxy("call_function", FILTER, (rollout, scores), kwargs)
    p.node.meta["flowc_kind"] = "filtered"
    return p


def _describe(value: Any) -> str:
    if isinstance(value, FlowProxy):
        kind = value.flowc_kind
        return {"prompts": "the prompt batch", "rollout": "a rollout", "stats": "update statistics"}.get(kind, "a tensor")
    return f"a {type(value).__name__} ({value!r})"


def _expect(role: Role, op: str, arg: str, value: Any, expected: str) -> None:
    call = f"{role.name}.{'__call__' if op == 'reward' else op}"
    if not isinstance(value, FlowProxy):
        raise ValueUseError(
            f"{call}: {arg} must be a value computed in the flow, got {_describe(value)}",
            fix={"prompts": "pass the flow's prompts parameter", "rollout": "pass the rollout returned by generate"}.get(
                expected, "pass a tensor computed from the rollout"
            ),
        )
    kind = value.flowc_kind
    if expected == kind or (expected == "tensor" and kind == "tensor"):
        return
    fixes = {
        "rollout": "generate a rollout first (rollout = actor.generate(prompts, n=...)) and pass it",
        "prompts": "pass the flow's prompts parameter",
        "tensor": "pass a tensor (e.g. a field such as rollout.response_mask, or a computed advantage)",
    }
    raise ValueUseError(f"{call}: {arg} must be {_article(expected)}, got {_describe(value)}", fix=fixes[expected])


def _article(kind: str) -> str:
    return {"prompts": "the prompt batch", "rollout": "a rollout", "tensor": "a tensor"}[kind]


def record(
    fn: Callable[..., Any], filename: str, data_params: dict[str, str], roles: dict[str, type[Role]], hyper: dict[str, Any]
) -> torch.fx.Graph:
    """Run ``fn`` under the tracer and return the fx graph."""
    tracer = FlowTracer(filename)
    ctx = TraceContext(tracer)
    kwargs: dict[str, Any] = {}
    for name, kind in data_params.items():
        p = tracer.create_proxy("placeholder", name, (), {})
        p.node.meta["flowc_data"] = kind
        p.node.meta["flowc_kind"] = "rollout" if kind == "preferences" else kind  # pairs go where rollouts go
        kwargs[name] = p
    for name, cls in roles.items():
        kwargs[name] = cls(name, ctx)
    kwargs.update(hyper)
    try:
        fn(**kwargs)
    except FlowcError as e:
        raise e.with_location(_location_from_traceback(filename, e.__traceback__)) from None
    except NameError as e:  # UnboundLocalError included
        where = _location_from_traceback(filename, e.__traceback__)
        m = re.search(r"'([^']+)'", str(e))
        name = getattr(e, "name", None) or (m.group(1) if m else "?")
        raise ValueUseError(
            f"{name!r} is used before it exists",
            fix=f"assign {name!r} (e.g. rollout = actor.generate(prompts)) on a line above its first use",
            where=where,
        ) from None
    except torch.fx.proxy.TraceError as e:
        raise ControlFlowError(str(e), where=_location_from_traceback(filename, e.__traceback__)) from None
    except TypeError as e:
        raise SignatureError(str(e), where=_location_from_traceback(filename, e.__traceback__)) from None
    except Exception as e:
        where = _location_from_traceback(filename, e.__traceback__)
        raise FlowDefinitionError(f"tracing failed: {type(e).__name__}: {e}", where=where) from e
    return tracer.graph


# ------------------------------------------------------------------- lower
class _Lowering:
    """fx graph → FlowGraph, with shape propagation on small real tensors."""

    def __init__(self, fx_graph: torch.fx.Graph, g: FlowGraph, filename: str) -> None:
        self.fx = fx_graph
        self.g = g
        self.filename = filename
        self.ref: dict[torch.fx.Node, ValueRef] = {}
        self.vals: dict[torch.fx.Node, list[Any]] = {}
        self.types: dict[torch.fx.Node, ValueType] = {}
        self.envs = [dict(a) for a in PROBE_ASSIGNMENTS]
        self.gen = torch.Generator().manual_seed(0)

    def loc(self, node: torch.fx.Node) -> SourceLocation | None:
        line = node.meta.get("line")
        return SourceLocation(self.filename, line) if line else None

    def run(self) -> FlowGraph:
        for node in self.fx.nodes:
            if node.op == "placeholder":
                self._input(node)
            elif node.op == "output":
                continue
            elif node.op == "call_function" and isinstance(node.target, RoleCall):
                self._role(node)
            elif node.op == "call_function" and isinstance(node.target, FilterCall):
                self._filter(node)
            elif self._is_projection(node):
                self._project(node)
            elif node.op in ("call_function", "call_method"):
                self._compute(node)
            else:  # get_attr: module attributes do not exist in flows
                raise FlowDefinitionError(f"unsupported traced operation {node.op} {node.target}", where=self.loc(node))
        self.g.add_weight_edges()
        return self.g

    # values for shape probing -------------------------------------------
    def _rand(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if dtype == torch.bool:
            return torch.ones(shape, dtype=torch.bool)
        if dtype.is_floating_point:
            return torch.randn(shape, generator=self.gen, dtype=dtype)
        return torch.randint(0, 100, shape, generator=self.gen, dtype=dtype)

    def _materialize(self, t: ValueType, env: dict[str, int]) -> Any:
        from flowc.ir.shapes import eval_dim

        if isinstance(t, TensorType):
            return self._rand(tuple(eval_dim(d, env) for d in t.shape), getattr(torch, t.dtype))
        if isinstance(t, BundleType):
            fields = {k: self._materialize(f, env) for k, f in t.fields.items()}
            if t.kind == "rollout":
                fields["logprobs"] = -fields["logprobs"].abs()
                return Rollout(**fields)
            return PromptBatch(**fields)
        return None

    def _set(self, node: torch.fx.Node, ref: ValueRef, t: ValueType, vals: list[Any] | None = None) -> None:
        self.ref[node] = ref
        self.types[node] = t
        self.vals[node] = vals if vals is not None else [self._materialize(t, env) for env in self.envs]

    # node kinds -----------------------------------------------------------
    def _input(self, node: torch.fx.Node) -> None:
        kind = node.meta["flowc_data"]
        t = rollout_type("2*B") if kind == "preferences" else prompts_type()
        self.g.add(
            Node(
                id=node.target,
                op="input",
                role=None,
                type=t,
                kwargs={"source": node.target, "kind": kind},
                line=node.meta.get("line"),
            )
        )
        self._set(node, ValueRef(node.target), t)

    def _role(self, node: torch.fx.Node) -> None:
        call: RoleCall = node.target
        static = dict(node.meta.get("flowc_static", {}))
        inputs = {k: self.ref[v] for k, v in node.kwargs.items()}
        first_key = next(iter(inputs))
        args = (inputs.pop(first_key),)
        src_t = self.types[node.kwargs[first_key]]
        batch = src_t.batch if isinstance(src_t, BundleType) else "?"
        t: ValueType
        if call.op == "generate":
            n = static["n"]
            sym = self._sample_symbol(n)
            t = (agent_rollout_type if "env" in static else rollout_type)(mul("B", sym) if sym else "B")
            for env in self.envs:
                env.update({s: v for s, v in self.g.symbols.items()})
        elif call.op in ("logprobs", "values"):
            t = TensorType(shape=(batch, "R"), dtype="float32")
        elif call.op in ("score", "reward"):
            t = TensorType(shape=(batch,), dtype="float32")
        else:  # update
            t = StatsType()
        node_id = self.g.unique_id(call.role if call.op == "reward" else f"{call.role}.{call.op}")
        kwargs = {**inputs, **static}
        self.g.add(Node(id=node_id, op=call.op, role=call.role, type=t, args=args, kwargs=kwargs, line=node.meta.get("line")))
        self._set(node, ValueRef(node_id), t)

    def _filter(self, node: torch.fx.Node) -> None:
        rollout, scores = node.args
        rt, st = self.types[rollout], self.types[scores]
        assert isinstance(rt, BundleType)
        if not (isinstance(st, TensorType) and st.shape == (rt.batch,)):
            raise ValueUseError(
                f"filter_groups: scores must hold one value per sequence [{rt.batch}], got {st}",
                fix="pass the rollout's rewards (e.g. reward(rollout)), one per sample",
                where=self.loc(node),
            )
        t = TupleType(items=(rt, st))
        node_id = self.g.unique_id("filter_groups")
        args = (self.ref[rollout], self.ref[scores])
        self.g.add(
            Node(id=node_id, op="filter", role=None, type=t, args=args, kwargs=dict(node.kwargs), line=node.meta.get("line"))
        )
        vals = [(r, s) for r, s in zip(self.vals[rollout], self.vals[scores], strict=True)]
        self._set(node, ValueRef(node_id), t, vals)

    def _sample_symbol(self, n: int) -> str | None:
        if n == 1:
            return None
        for sym, v in self.g.symbols.items():
            if v == n:
                return sym
        sym = "n" if not self.g.symbols else f"n{len(self.g.symbols) + 1}"
        self.g.symbols[sym] = n
        return sym

    def _is_projection(self, node: torch.fx.Node) -> bool:
        if node.op != "call_function" or not node.args or not isinstance(node.args[0], torch.fx.Node):
            return False
        base_t = self.types.get(node.args[0])
        if node.target is getattr and isinstance(base_t, BundleType):
            return True
        return node.target is operator.getitem and isinstance(base_t, TupleType) and isinstance(node.args[1], int)

    def _project(self, node: torch.fx.Node) -> None:
        base, key = node.args[0], node.args[1]
        ref = self.ref[base]
        t = self.types[base]
        sub = t.fields[key] if isinstance(t, BundleType) else t.items[key]  # type: ignore[union-attr]
        vals = [getattr(v, key) if isinstance(t, BundleType) else v[key] for v in self.vals[base]]
        self._set(node, ValueRef(ref.node, (*ref.path, key)), sub, vals)

    def _compute(self, node: torch.fx.Node) -> None:
        method = node.op == "call_method"
        try:
            name = target_name(node.target, method=method)
        except FlowcError as e:
            raise e.with_location(self.loc(node)) from None
        fn = resolve(name)
        args = torch.fx.node.map_arg(node.args, lambda n: self.ref[n])
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: self.ref[n])
        outs = []
        for i in range(len(self.envs)):
            a = torch.fx.node.map_arg(node.args, lambda n, i=i: self.vals[n][i])
            k = torch.fx.node.map_arg(node.kwargs, lambda n, i=i: self.vals[n][i])
            try:
                with torch.no_grad():
                    outs.append(fn(*a, **k))
            except Exception as e:
                shown = ", ".join(str(self.types[n]) for n in node.all_input_nodes)
                raise FlowDefinitionError(
                    f"{short_name(name)}({shown}) failed: {type(e).__name__}: {e}",
                    fix="check the shapes and dtypes of its inputs",
                    where=self.loc(node),
                ) from None
        preferred: list[str] = []
        for n in node.all_input_nodes:
            t = self.types[n]
            if isinstance(t, TensorType):
                preferred.extend(d for d in t.shape if d not in preferred and d != UNKNOWN)
            if isinstance(t, BundleType):
                preferred.extend(d for f in t.fields.values() for d in f.shape if d not in preferred)
        t = self._type_of(outs, preferred)
        node_id = self.g.unique_id(node.name)
        self.g.add(
            Node(
                id=node_id,
                op="compute",
                role=None,
                type=t,
                args=tuple(args),
                kwargs=dict(kwargs),
                target=name,
                line=node.meta.get("line"),
            )
        )
        self._set(node, ValueRef(node_id), t, outs)

    def _type_of(self, outs: list[Any], preferred: list[str]) -> ValueType:
        a = outs[0]
        if isinstance(a, torch.Tensor) and all(isinstance(o, torch.Tensor) for o in outs):
            if len({o.dim() for o in outs}) != 1:
                return TensorType(shape=(UNKNOWN,) * a.dim(), dtype=str(a.dtype).removeprefix("torch."))
            shape = tuple(match_dim([o.shape[d] for o in outs], self.g.symbols, preferred) for d in range(a.dim()))
            return TensorType(shape=shape, dtype=str(a.dtype).removeprefix("torch."))
        if isinstance(a, tuple) and all(isinstance(o, tuple) and len(o) == len(a) for o in outs):
            return TupleType(items=tuple(self._type_of([o[i] for o in outs], preferred) for i in range(len(a))))
        if isinstance(a, Rollout):
            raise FlowDefinitionError("an op returned a rollout; only generate makes rollouts")
        return PyType(name=type(a).__name__)


def lower(fx_graph: torch.fx.Graph, g: FlowGraph, filename: str) -> FlowGraph:
    """Lower a recorded fx graph into ``g`` (roles and header already set)."""
    return _Lowering(fx_graph, g, filename).run()


def trace_function(
    fn: Callable[..., Any],
    *,
    name: str,
    data_params: dict[str, str],
    roles: dict[str, type[Role]],
    hyper: dict[str, Any],
    source: str | None = None,
    def_lineno: int | None = None,
) -> FlowGraph:
    """Record and lower ``fn``; check that the result trains something and
    uses every role it declares."""
    filename = fn.__code__.co_filename
    fx_graph = record(fn, filename, data_params, roles, hyper)
    g = FlowGraph(
        name,
        roles={r: RoleInfo(r, cls.kind) for r, cls in roles.items()},
        hyperparams=hyper,
        source=source,
    )
    lower(fx_graph, g, filename)
    def_line = SourceLocation(filename, def_lineno or fn.__code__.co_firstlineno)
    if not any(n.op == "update" for n in g.nodes):
        trainable = [r for r, cls in roles.items() if cls.kind in ("policy", "critic")]
        raise MissingUpdateError(
            f"flow {name!r} never calls update, so nothing is trained",
            fix=f"call {trainable[0] if trainable else 'actor'}.update(rollout, advantages=..., ...) at the end of the flow",
            where=def_line,
        )
    used = {n.role for n in g.nodes} | {n.kwargs.get("env") for n in g.nodes if n.op == "generate"}
    for r in roles:
        if r not in used:
            raise SignatureError(
                f"role {r!r} is declared but never used",
                fix=f"pass it to generate: actor.generate(prompts, env={r})"
                if roles[r].kind == "environment"
                else f"use {r} in the flow or remove the parameter",
                where=def_line,
            )
    return g
