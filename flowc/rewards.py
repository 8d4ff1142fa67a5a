"""Binding a flow's ``Reward`` roles to Python functions (``--reward ROLE=module:function``)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flowc.errors import SpecError

if TYPE_CHECKING:
    from flowc.ir.graph import FlowGraph


def load_reward(spec: str) -> tuple[Callable[..., Any], str]:
    """``module:function`` (importable from the working directory) or ``path/to/file.py:function``
    (its folder importable while it loads)."""
    fn, fn_name, mod_name = load_target(spec, "--reward", "module:function", "e.g. --reward reward=my_rewards:exact_match")
    if not callable(fn):
        raise SpecError(
            f"{mod_name} has no function {fn_name!r}", fix="name a function fn(prompts, responses, **columns) -> list[float]"
        )
    return adapt(fn), spec


def load_target(spec: str, option: str, form: str, example: str) -> tuple[Any, str, str]:
    """The object ``spec`` names (``module:NAME`` importable from the working directory, or
    ``path/to/file.py:NAME`` with its folder importable while it loads), its name and module
    (None when the module lacks it); ``option`` and ``form`` word the errors."""
    from flowc.loader import on_path  # not at import: see bind_rewards

    mod_name, sep, fn_name = spec.rpartition(":")
    if not sep or not mod_name or not fn_name:
        raise SpecError(f"{option} {spec!r} is not {form}", fix=example)
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
        raise SpecError(f"cannot import the module {mod_name!r} of {option} {spec!r}: {type(e).__name__}: {e}") from e
    return getattr(module, fn_name, None), fn_name, mod_name


# ------------------------------------------------------------ conventions
VERL_PARAMS = ("data_source", "solution_str", "ground_truth")


def convention(fn: Callable[..., Any]) -> str:
    """Which calling convention a reward function follows, by its parameter names: ``verl``
    (per sample: ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``),
    ``trl`` (``reward_func(prompts, completions, **kwargs)``) or ``flowc`` (batched:
    ``fn(prompts, responses, **columns)``)."""
    params = list(inspect.signature(fn).parameters)
    if all(p in params for p in VERL_PARAMS):
        return "verl"
    if "completions" in params[:2]:
        return "trl"
    return "flowc"


def adapt(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as flowc calls rewards (batched, ``(prompts, responses, **columns)``): verl's and
    TRL's conventions wrapped; ``async def`` functions awaited (verl's per sample, concurrently)."""
    kind = convention(fn)
    if kind == "verl":
        return VerlReward(fn)
    if kind == "trl":
        return TrlReward(fn)
    if inspect.iscoroutinefunction(fn):
        return AsyncReward(fn)
    return fn


def _run(coro: Any) -> Any:
    import asyncio

    return asyncio.run(coro)


class AsyncReward:
    """A batched ``async def`` reward, awaited (its columns are read from its signature)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "reward")
        self.__signature__ = inspect.signature(fn)

    def __call__(self, prompts: list[Any], responses: list[str], **columns: Any) -> Any:
        return _run(self.fn(prompts, responses, **columns))


class VerlReward:
    """verl's per-sample ``compute_score(data_source, solution_str, ground_truth, extra_info)``
    over a batch: ``ground_truth`` from the row's ``reward_model.ground_truth`` (or a
    ``ground_truth`` column), ``extra_info`` passed when the function takes it; a coroutine
    function's calls run concurrently; a dict result gives its ``score``."""

    columns = ("data_source", "reward_model")

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "compute_score")
        self.takes_extra = "extra_info" in inspect.signature(fn).parameters

    def _kwargs(self, i: int, response: str, columns: dict[str, list[Any]]) -> dict[str, Any]:
        rm = columns.get("reward_model", [None] * (i + 1))[i]
        truth = rm.get("ground_truth") if isinstance(rm, dict) else columns.get("ground_truth", [None] * (i + 1))[i]
        kw = {"data_source": columns["data_source"][i], "solution_str": response, "ground_truth": truth}
        if self.takes_extra:
            kw["extra_info"] = columns.get("extra_info", [None] * (i + 1))[i]
        return kw

    def __call__(self, prompts: list[Any], responses: list[str], **columns: Any) -> list[Any]:
        calls = [self._kwargs(i, r, columns) for i, r in enumerate(responses)]
        if inspect.iscoroutinefunction(self.fn):
            import asyncio

            async def all_of() -> list[Any]:
                return list(await asyncio.gather(*(self.fn(**kw) for kw in calls)))

            return _run(all_of())
        return [self.fn(**kw) for kw in calls]


class TrlReward:
    """TRL's ``reward_func(prompts, completions, **kwargs)``: completions are text for text
    prompts and ``[{"role": "assistant", "content": …}]`` for chat prompts, as TRL passes them;
    every data column arrives as a keyword. The columns it names without a default are required."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "reward_func")
        params = inspect.signature(fn).parameters.values()
        self.columns = tuple(
            p.name
            for p in params
            if p.name not in ("prompts", "completions")
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.default is p.empty
        )

    def __call__(self, prompts: list[Any], responses: list[str], **columns: Any) -> Any:
        chat = bool(prompts) and isinstance(prompts[0], list)
        completions = [[{"role": "assistant", "content": r}] for r in responses] if chat else list(responses)
        out = self.fn(prompts=prompts, completions=completions, **columns)
        return _run(out) if inspect.iscoroutine(out) else out


CALLED_AS = {
    "verl": "verl's per-sample compute_score(data_source, solution_str, ground_truth, extra_info), "
    "ground_truth from reward_model.ground_truth",
    "trl": "TRL's reward_func(prompts, completions, **kwargs), the other columns as keywords",
}


def reward_notes(fns: dict[str, Callable[..., Any]], names: dict[str, str]) -> list[str]:
    """A line per reward bound in verl's or TRL's convention (or ``async``): how flowc calls it."""
    out = []
    for role, fn in fns.items():
        user = getattr(fn, "fn", fn)
        kind = convention(user)
        how = CALLED_AS.get(kind, "flowc's batched fn(prompts, responses, **columns)")
        if kind != "flowc" or inspect.iscoroutinefunction(user):
            asynchronous = ""
            if inspect.iscoroutinefunction(user):
                asynchronous = (
                    ", async def: the responses' calls awaited concurrently" if kind == "verl" else ", async def: awaited"
                )
            out.append(f"reward {role} ({names.get(role, role)}): called as {how}{asynchronous}")
    return out


def bind_rewards(
    g: FlowGraph, given: dict[str, str], default: tuple[Callable[..., Any], str] | None
) -> tuple[dict[str, Callable[..., Any]], dict[str, str]]:
    """A function for every Reward role of ``g``: the one given, else ``default`` (the built-in
    task's), else an error naming the role; and the names they are reported by."""
    from flowc.ir.ops import RoleKind  # not at import: a reward process loads this module, and flowc.ir loads torch

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
