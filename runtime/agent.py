"""Agent rollouts: multi-turn trajectories between a policy's rollout engine and an environment.

One trajectory per (prompt row, sample). The loop keeps every trajectory in one of three states —
waiting for the engine, waiting for its environment, done — and moves each one as soon as its
own answer arrives: a turn that ends goes to the environment at once (:class:`EnvPool` runs
environments in processes of their own, so they think while the engine generates), and an
observation that arrives goes back to the engine at once. The vLLM engine takes requests one by
one and steps its continuous batch (a turn is submitted as soon as its observation is there); the
``hf`` engine runs lock-step per turn: it waits for every environment, then decodes all the turns
waiting as one batch, so a batch's rows (and so their numerics) never depend on which environment
answered first and a run is reproducible. Replicas are single-rank (the planner plans tp 1, pp 1 for a
multi-turn generate, the engine refuses more): the ranks of a tensor-parallel replica would each run
environments of their own.

Token ids are kept as produced: the policy's turns as the engine sampled them, the observations
as the tokenizer encodes them once (``add_special_tokens=False``); nothing is re-tokenised from
text. A policy turn ends at EOS, at one of the environment's stop tokens, at the turn's token
limit, or where the trajectory's token budget (the rollout's response width) runs out. Every policy
turn is passed to ``env.step``: an observation is appended only when the trajectory goes on (the
environment did not say done, the turn did not end at EOS, turns and budget remain); the budget
cuts an observation that does not fit, and the trajectory ends there (``truncated``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from flowc.errors import SpecError
from flowc.ir.functional import PromptBatch, Rollout
from flowc.runtime.envs import EnvBinding, EnvPool


class TurnEngine(Protocol):
    """What the agent loop needs of a rollout backend: requests in, finished turns out."""

    def submit(self, key: int, tokens: list[int], max_tokens: int, seed: int) -> None:
        """Continue ``tokens`` (a prompt and the trajectory so far) by at most ``max_tokens``."""

    def advance(self) -> list[tuple[int, list[int], list[float]]]:
        """Generate a while; the turns that finished: ``(key, token ids, log-probabilities)``."""

    def pending(self) -> int:
        """Requests submitted and not yet returned."""

    def abort(self) -> None:
        """Drop the requests not yet returned (the loop failed)."""

    lockstep: bool  # True: wait for every environment before the next batch (a deterministic batch)


@dataclass
class Trajectory:
    tid: int
    row: int  # the rollout row it becomes
    seed_row: int  # the global prompt row (seeds follow it)
    sample: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    policy: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0
    reward: float = 0.0
    last: bool = False  # the turn in the environment is the last one
    done: bool = False
    truncated: bool = False
    error: str | None = None  # "error", "timeout" or "lost"
    message: str = ""
    dropped: bool = False  # its environment's process died for another trajectory: no gradient from it
    info: dict[str, float] = field(default_factory=dict)


def stop_token_ids(tok: Any, stop: Sequence[str], where: str) -> list[int]:
    """The token id of each stop string: the vocabulary's entry for it (what the model emits, not a
    SentencePiece tokenizer's word-initial variant of it), else the one token it encodes to; a string
    that is not one token is refused (the engines stop on token ids, and a string spread over tokens
    could be split differently)."""
    vocab = tok.get_vocab() if hasattr(tok, "get_vocab") else {}
    out = []
    for s in stop:
        if s in vocab:
            out.append(int(vocab[s]))
            continue
        ids = tok(s, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise SpecError(
                f"{where}: the stop string {s!r} is {len(ids)} tokens for this tokenizer, not one",
                fix="end a turn with a string the tokenizer keeps as one token (a special token such as '</tool_call>')",
            )
        out.append(int(ids[0]))
    return out


@dataclass
class AgentResult:
    rollout: Rollout
    texts: list[str]
    metrics: dict[str, float]
    errors: list[str]  # "kind: message": the first trajectory its environment ended, of each kind


@dataclass(frozen=True)
class AgentJob:
    """One agent rollout: ``n`` trajectories for each prompt row (``records``: their data rows),
    ``budget`` tokens per trajectory after its prompt, ``turn_tokens`` per policy turn, at most
    ``max_turns`` turns; the ids that end a turn (EOS first, then the model's other end-of-sequence
    ids; ``stop_ids``: the environment's stop tokens); ``seed_of(row, sample, turn)`` each turn's
    seed (``row``: the global prompt row, from ``row_offset``); trajectory ids from ``first_tid``."""

    tok: Any
    prompts: PromptBatch
    records: list[dict[str, Any]]
    n: int
    max_turns: int
    budget: int
    turn_tokens: int
    eos_ids: Sequence[int]
    pad_id: int
    seed_of: Callable[[int, int, int], int]
    row_offset: int = 0
    first_tid: int = 0
    stop_ids: Sequence[int] = ()


def run_agents(engine: TurnEngine, pool: EnvPool, binding: EnvBinding, job: AgentJob, *, lockstep: bool = False) -> AgentResult:
    """Run the job's trajectories to their ends; returns them as one rollout of ``rows·n``
    sequences whose response is ``budget`` tokens wide."""
    tok, prompts, records, n, max_turns, budget = job.tok, job.prompts, job.records, job.n, job.max_turns, job.budget
    turn_tokens, eos_ids, pad_id, seed_of = job.turn_tokens, job.eos_ids, job.pad_id, job.seed_of
    row_offset, first_tid = job.row_offset, job.first_tid
    lockstep = lockstep or bool(getattr(engine, "lockstep", False))
    rows = prompts.input_ids.shape[0]
    if len(records) != rows:
        raise ValueError(f"{len(records)} records for {rows} prompt rows")
    t0 = time.perf_counter()
    env0 = pool.seconds()
    trajs: dict[int, Trajectory] = {}
    for i in range(rows):
        ids = prompts.input_ids[i][prompts.attention_mask[i].bool()].tolist()
        for j in range(n):
            t = Trajectory(first_tid + i * n + j, i * n + j, row_offset + i, j, ids)
            trajs[t.tid] = t
            pool.submit(t.tid, "reset", records[i])
    ready: list[int] = []
    waiting_env = len(trajs)

    def finish(t: Trajectory) -> None:
        t.done = True
        pool.submit(t.tid, "close")

    def observe(t: Trajectory, obs: str) -> None:
        ids = tok(obs, add_special_tokens=False)["input_ids"] if obs else []
        back = tok.decode(ids, skip_special_tokens=False) if ids else ""
        if "".join(back.split()) != "".join(obs.split()):  # the tokenizer dropped or changed characters
            t.error, t.message = (
                "error",
                f"the tokenizer cannot encode the observation {obs[:80]!r} (it reads back as {back[:80]!r})",
            )
            t.reward = binding.error_reward
            finish(t)
            return
        room = budget - len(t.tokens)
        if len(ids) >= room:  # nothing left for the policy after it
            t.tokens += ids[:room]
            t.policy += [False] * min(len(ids), room)
            t.logprobs += [0.0] * min(len(ids), room)
            t.truncated = True
            finish(t)
            return
        t.tokens += ids
        t.policy += [False] * len(ids)
        t.logprobs += [0.0] * len(ids)
        ready.append(t.tid)

    try:
        while waiting_env or ready or engine.pending():
            hold = lockstep and (waiting_env > 0 or engine.pending() > 0)  # lock-step: one whole turn at a time
            if ready and not hold:
                for tid in sorted(ready):  # in trajectory order: a batch does not depend on who answered first
                    t = trajs[tid]
                    room = budget - len(t.tokens)
                    engine.submit(tid, t.prompt + t.tokens, min(turn_tokens, room), seed_of(t.seed_row, t.sample, t.turns))
                ready = []
            if engine.pending():
                for tid, got, lps in engine.advance():
                    t = trajs[tid]
                    t.tokens += got
                    t.policy += [True] * len(got)
                    t.logprobs += lps
                    t.turns += 1
                    eos = bool(got) and got[-1] in eos_ids
                    if len(t.tokens) >= budget and not eos:
                        t.truncated = True
                    t.last = eos or t.truncated or t.turns >= max_turns
                    # the turn's text as sampled, special stop tokens included (the environment tells a tool call
                    # from an answer by them); only the end-of-sequence token is left out
                    action = tok.decode([i for i in got if i not in eos_ids], skip_special_tokens=False)
                    pool.submit(tid, "step", action)
                    waiting_env += 1
            busy = engine.pending() > 0 or (ready and not hold)
            for tid, op, kind, value in pool.poll(0.0 if busy else 0.5):
                t = trajs[tid]
                waiting_env -= 1
                if t.done:
                    continue
                if kind != "ok":
                    t.error, t.message = kind, str(value)
                    if kind == "lost":  # not its own environment's fault: kept out of the loss, not penalised
                        t.dropped = True
                    else:
                        t.reward = binding.error_reward
                    finish(t)
                    continue
                if op == "reset":
                    observe(t, value)
                    continue
                obs, reward, done, info = value
                t.reward += reward
                for k, v in info.items():
                    t.info[k] = t.info.get(k, 0.0) + v
                if t.last or done:
                    finish(t)
                else:
                    observe(t, obs)
    except BaseException:  # nothing of this rollout stays in the engine
        engine.abort()
        raise
    return _assemble(
        list(trajs.values()), prompts, n, budget, pad_id, tok, binding, time.perf_counter() - t0, pool.seconds() - env0
    )


def _assemble(
    trajs: list[Trajectory],
    prompts: PromptBatch,
    n: int,
    budget: int,
    pad_id: int,
    tok: Any,
    binding: EnvBinding,
    seconds: float,
    env_seconds: float,
) -> AgentResult:
    from flowc.runtime.batches import repeat_rows

    trajs = sorted(trajs, key=lambda t: t.row)
    N = len(trajs)
    ids = torch.full((N, budget), pad_id, dtype=torch.long)
    policy = torch.zeros((N, budget), dtype=torch.bool)
    env = torch.zeros((N, budget), dtype=torch.bool)
    lps = torch.zeros((N, budget), dtype=torch.float32)
    for t in trajs:
        k = len(t.tokens)
        ids[t.row, :k] = torch.tensor(t.tokens, dtype=torch.long)
        pm = torch.tensor(t.policy, dtype=torch.bool) & (not t.dropped)
        policy[t.row, :k] = pm
        env[t.row, :k] = ~pm
        lps[t.row, :k] = torch.tensor(t.logprobs, dtype=torch.float32)
    rollout = Rollout(
        repeat_rows(prompts.input_ids, n),
        repeat_rows(prompts.attention_mask, n).bool(),
        ids,
        policy,
        lps,
        env_mask=env,
        env_reward=torch.tensor([t.reward for t in trajs], dtype=torch.float32),
        turns=torch.tensor([t.turns for t in trajs], dtype=torch.long),
    )
    texts = [tok.decode(t.tokens, skip_special_tokens=True) for t in trajs]
    m: dict[str, float] = {
        "trajectories": float(N),
        "turns": sum(t.turns for t in trajs) / max(N, 1),
        "env_errors": float(sum(t.error == "error" for t in trajs)),
        "env_timeouts": float(sum(t.error == "timeout" for t in trajs)),
        "env_lost": float(sum(t.error == "lost" for t in trajs)),
        "truncated": sum(t.truncated for t in trajs) / max(N, 1),
        "env_reward": sum(t.reward for t in trajs) / max(N, 1),
        "policy_tokens": float(policy.sum()),
        "env_tokens": float(env.sum()),
        "seconds": seconds,
        "env_seconds": env_seconds,
    }
    keys = sorted({k for t in trajs for k in t.info})
    for k in keys:
        m[f"info/{k}"] = sum(t.info.get(k, 0.0) for t in trajs) / max(N, 1)
    first: dict[str, str] = {}
    for t in trajs:  # the first message of each kind of error
        if t.error and t.error not in first:
            first[t.error] = f"{t.error}: {t.message}"
    return AgentResult(rollout, texts, m, list(first.values()))


# ----------------------------------------------------------------- server mode
def run_harnesses(engine: TurnEngine, pool: Any, server: Any, binding: EnvBinding, job: AgentJob) -> AgentResult:
    """The job's trajectories, each driven by the user's harness (``run(record, base_url)`` in a
    :class:`~flowc.runtime.envs.HarnessPool`) through ``server`` (:mod:`flowc.runtime.serve`): the
    loop answers the harnesses' requests with the engine and records every token served. A
    trajectory's prompt is its first request's; the job's prompts (flowc's own tokenization of the
    data's prompts) stand in for one that made no request."""
    from flowc.runtime.serve import Refused, completion, error, max_tokens_of

    tok, prompts, records, n, max_turns, budget = job.tok, job.prompts, job.records, job.n, job.max_turns, job.budget
    turn_tokens, eos_ids, pad_id, seed_of = job.turn_tokens, job.eos_ids, job.pad_id, job.seed_of
    row_offset, first_tid, stop_ids = job.row_offset, job.first_tid, job.stop_ids

    rows = prompts.input_ids.shape[0]
    t0, env0 = time.perf_counter(), pool.seconds()
    width = prompts.input_ids.shape[1]
    trajs: dict[int, Trajectory] = {}
    started: dict[int, bool] = {}
    texts: dict[int, str] = {}
    for i in range(rows):
        ids = prompts.input_ids[i][prompts.attention_mask[i].bool()].tolist()
        for j in range(n):
            t = Trajectory(first_tid + i * n + j, i * n + j, row_offset + i, j, ids)
            trajs[t.tid] = t
            pool.submit(t.tid, records[i], server.base_url(t.tid))
    eos_text = [tok.decode([e], skip_special_tokens=False) for e in eos_ids]
    ends = set(eos_ids) | set(stop_ids)
    open_: dict[int, tuple[Any, Trajectory, list[int]]] = {}
    keys = 0

    def append(t: Trajectory, ids: list[int], policy: bool, lps: list[float] | None = None) -> None:
        t.tokens += ids
        t.policy += [policy] * len(ids)
        t.logprobs += lps if lps is not None else [0.0] * len(ids)

    def extend(t: Trajectory, req: Any) -> list[int]:
        """The engine's prompt for ``req``: the trajectory so far and what the request adds."""
        from flowc.runtime.serve import render

        text, ids = render(tok, req)
        if not started.get(t.tid):
            if ids is None:
                ids = tok(text, add_special_tokens=req.kind == "completions")["input_ids"]
            if len(ids) > width:
                raise Refused(f"the prompt is {len(ids)} tokens, longer than the workload's prompt_len {width}")
            t.prompt, started[t.tid] = list(ids), True
            texts[t.tid] = text if text is not None else tok.decode(ids, skip_special_tokens=False)
            return list(ids)
        full = t.prompt + t.tokens
        if ids is not None:
            if ids[: len(full)] != full:
                raise Refused(
                    f"the prompt's token ids do not start with the {len(full)} tokens served so far for this trajectory"
                )
            new, delta = ids[len(full) :], None
        else:
            served = texts[t.tid]
            heads = [served] + [served[: -len(e)] for e in eos_text if e and served.endswith(e)]
            head = next((h for h in heads if text.startswith(h)), None)
            if head is None:
                k = next((i for i, (a, b) in enumerate(zip(served, text, strict=False)) if a != b), min(len(served), len(text)))
                raise Refused(
                    f"the request does not extend the conversation served so far for this trajectory (it differs at "
                    f"character {k}: {text[k : k + 40]!r} where {served[k : k + 40]!r} was served); send the whole "
                    "conversation as it was answered, or token ids (completions with a list prompt)"
                )
            delta = text[len(head) :]
            new = tok(delta, add_special_tokens=False)["input_ids"] if delta else []
        room = budget - len(t.tokens)
        if len(new) > room:
            new, t.truncated = new[:room], True
        append(t, list(new), False)
        texts[t.tid] += delta if delta is not None else tok.decode(list(new), skip_special_tokens=False)
        return t.prompt + t.tokens

    try:
        while pool.pending() or open_:
            arrived = server.take(0.0 if open_ or engine.pending() else 0.01)
            while arrived and getattr(engine, "lockstep", False):  # a batch engine: take what arrives close together
                more = server.take(0.005)
                arrived += more
                if not more:
                    break
            for req in arrived:
                t = trajs.get(req.tid)
                if t is None or t.done:
                    req.answer(400, error(f"trajectory {req.tid} is not running"))
                    continue
                if any(o[1] is t for o in open_.values()):  # its turns form one sequence: one request at a time
                    req.answer(
                        400,
                        error(f"trajectory {req.tid} already has a request being answered: send the next turn after it returns"),
                    )
                    continue
                try:
                    ids = extend(t, req)
                except Refused as e:
                    req.answer(400, error(str(e)))
                    continue
                limit = min(turn_tokens, budget - len(t.tokens), max_tokens_of(req) or turn_tokens)
                if limit <= 0 or t.turns >= max_turns:  # its budget or turns are spent: an empty turn
                    t.truncated = t.truncated or limit <= 0
                    req.answer(200, completion(req, tok, ids, [], [], "length", set(eos_ids)))
                    continue
                keys += 1
                engine.submit(keys, ids, limit, seed_of(t.seed_row, t.sample, t.turns))
                open_[keys] = (req, t, ids)
            if engine.pending():
                for key, got, lps in engine.advance():
                    req, t, ids = open_.pop(key)
                    append(t, got, True, lps)
                    t.turns += 1
                    texts[t.tid] += tok.decode(got, skip_special_tokens=False)
                    finish = "stop" if got and got[-1] in ends else "length"
                    if finish == "length" and len(t.tokens) >= budget:
                        t.truncated = True
                    req.answer(200, completion(req, tok, ids, got, lps, finish, set(eos_ids)))
            for tid, kind, value in pool.poll():
                t = trajs[tid]
                t.done = True
                if kind == "ok":
                    t.reward, t.info = value
                elif kind == "lost":
                    t.error, t.message, t.dropped = kind, str(value), True
                else:
                    t.error, t.message, t.reward = kind, str(value), binding.error_reward
    except BaseException:
        engine.abort()
        raise
    finally:
        for req in server.take(0.0):  # what arrived after the last harness returned
            req.answer(400, error(f"trajectory {req.tid} is not running"))
    prompt_ids = torch.full((len(trajs), width), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((len(trajs), width), dtype=torch.bool)
    for t in trajs.values():
        prompt_ids[t.row, width - len(t.prompt) :] = torch.tensor(t.prompt, dtype=torch.long)
        prompt_mask[t.row, width - len(t.prompt) :] = True
    served = PromptBatch(prompt_ids, prompt_mask)
    return _assemble(
        list(trajs.values()), served, 1, budget, pad_id, tok, binding, time.perf_counter() - t0, pool.seconds() - env0
    )
