"""Environments: the user Python a policy acts in over several turns (a tool, a sandbox, a game).

A flow declares one as a parameter (``calc: fc.Environment``) and passes it to
``actor.generate(prompts, env=calc, max_turns=3)``; the run binds it to a class
(``--env calc=my_env.py:Calculator``; a flow run on the built-in task gets the built-in
calculator). The class follows this protocol — subclassing :class:`Env` is optional:

``stop``
    strings that end a policy turn besides EOS (each must be one token of the policy's
    tokenizer, e.g. ``"</tool_call>"``); default none.
``max_turns``
    the policy's turns per trajectory when ``generate`` does not say (default 1).
``reset(record) -> str``
    called once per trajectory with the prompt's data row (``record["prompt"]`` and every other
    column, e.g. ``record["answer"]``); returns the first observation appended after the prompt
    (``""`` for none).
``step(action) -> (observation, reward, done[, info])``
    called after every policy turn with its text (decoded from the tokens the policy sampled);
    returns what to append before the policy's next turn, this turn's reward (summed over the
    trajectory into ``rollout.env_reward``), whether the trajectory is over, and optionally a dict
    of numbers averaged into the step's metrics (``agent/info/KEY``).
``close()``
    optional: called when the trajectory ends.

A new instance serves each trajectory (built with no arguments), in a process of its own
beside the rollout engine (``env_workers`` of them, no torch needed); a call that raises or runs
past ``env_timeout_s`` ends that trajectory with ``env_error_reward``, never the run.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from flowc.errors import SpecError


class Env:
    """Optional base class of an environment (see the module's protocol)."""

    stop: ClassVar[tuple[str, ...]] = ()
    max_turns: ClassVar[int] = 1

    def reset(self, record: dict[str, Any]) -> str:
        return ""

    def step(self, action: str) -> tuple[str, float, bool] | tuple[str, float, bool, dict[str, float]]:
        raise NotImplementedError


def load_env(spec: str) -> tuple[type, str]:
    """The class ``module:Class`` or ``path/to/file.py:Class`` names."""
    from flowc.rewards import load_target

    cls, name, module = load_target(spec, "--env", "module:Class", "e.g. --env calc=my_envs:Calculator")
    if not isinstance(cls, type):
        raise SpecError(f"{module} has no class {name!r}", fix="name an environment class with reset and step (docs/agents.md)")
    return cls, spec


def bind_envs(g: Any, given: dict[str, str], default: tuple[type, str] | None, cfg: Any) -> dict[str, Any]:
    """An :class:`~flowc.runtime.envs.EnvBinding` for every Environment role of ``g``: the class given,
    else ``default`` (the built-in task's), else an error naming the role."""
    from flowc.ir.ops import RoleKind
    from flowc.runtime.envs import bind_class

    for role in given:
        if role not in g.roles or g.roles[role].kind != RoleKind.ENVIRONMENT:
            envs = [r for r, i in g.roles.items() if i.kind == RoleKind.ENVIRONMENT]
            raise SpecError(
                f"--env names {role!r}, which is not an Environment role of flow {g.name!r}",
                fix=f"its environment roles: {', '.join(envs)}" if envs else "the flow declares no fc.Environment parameter",
            )
    out = {}
    for role, info in g.roles.items():
        if info.kind != RoleKind.ENVIRONMENT:
            continue
        if role in given:
            cls, name = load_env(given[role])
        elif default is not None:
            cls, name = default
        else:
            raise SpecError(f"environment role {role!r} has no class", fix=f"bind it: --env {role}=module:Class")
        out[role] = bind_class(
            role, cls, name, workers=cfg.env_workers, timeout_s=cfg.env_timeout_s, error_reward=cfg.env_error_reward
        )
    return out


def check_envs(envs: dict[str, Any], rows: list[dict[str, Any]], prompt_key: str, tokenizer: str) -> None:
    """Before the first step: every stop string is one token of the policy's tokenizer, and each
    environment starts in its process and resets from the first data row as the protocol says (a
    class that fails there would end every trajectory of every step)."""
    import time

    from transformers import AutoTokenizer

    from flowc.runtime.agent import stop_token_ids
    from flowc.runtime.envs import EnvPool

    tok = AutoTokenizer.from_pretrained(tokenizer)
    record = {"prompt": rows[0][prompt_key], **rows[0]} if rows else {"prompt": ""}
    for role, b in envs.items():
        stop_token_ids(tok, b.stop, f"environment {role} ({b.name})")
        if b.harness:  # an agent harness runs against the engine's endpoint: nothing to try without it
            continue
        pool = EnvPool(dataclasses.replace(b, workers=1))
        try:
            pool.submit(0, "reset", record)
            end = time.monotonic() + b.timeout_s + 5
            got = []
            while not got and time.monotonic() < end:
                got = pool.poll(0.5)
            pool.submit(0, "close")
        finally:
            pool.close()
        if not got or got[0][2] != "ok":
            why = "it did not answer" if not got else f"{got[0][2]}: {got[0][3]}"
            raise SpecError(
                f"environment {role} ({b.name}) failed to reset from the first data row: {why}",
                fix="reset(record) gets the prompt's data row (record['prompt'] and every column) and returns the "
                "first observation, a str (docs/agents.md)",
            )
