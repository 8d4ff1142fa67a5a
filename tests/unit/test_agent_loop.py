"""The agent loop (runtime.agent) with a scripted engine and real environment processes: tokens kept
exactly as produced, the policy's and the environment's tokens told apart, turn and length limits,
and environments that raise or hang ending their trajectory only; and the loss over a trajectory
is the loss over the policy's tokens alone."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flowc.errors import SpecError
from flowc.ir.functional import PromptBatch
from flowc.ir.losses import PPOClip, policy_loss
from flowc.runtime.agent import AgentJob, run_agents, stop_token_ids
from flowc.runtime.envs import EnvPool, bind_class

EOS, PAD = 0, 1


class CharTok:
    """A character tokenizer: id = code point (EOS 0, PAD 1)."""

    eos_token_id, pad_token_id = EOS, PAD

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i not in (EOS, PAD))


class Script:
    """An engine whose turns are scripted per trajectory: ``turns[tid]`` lists each turn's text
    (``$`` stands for EOS); it records every request it got."""

    def __init__(self, turns: dict[int, list[str]]) -> None:
        self.turns, self.queue, self.requests = turns, [], []

    def submit(self, key: int, tokens: list[int], max_tokens: int, seed: int) -> None:
        self.queue.append((key, tokens, max_tokens, seed))
        self.requests.append((key, list(tokens), max_tokens, seed))

    def pending(self) -> int:
        return len(self.queue)

    def abort(self) -> None:
        self.queue = []

    def advance(self):
        out = []
        for key, _tokens, limit, _ in self.queue:
            text = self.turns[key][sum(1 for k, *_ in self.requests if k == key) - 1]
            ids = [EOS if c == "$" else ord(c) for c in text][:limit]
            out.append((key, ids, [-0.5 - 0.01 * i for i in range(len(ids))]))
        self.queue = []
        return out


class Tool:
    """A turn ending in '?' is a tool call: the observation is '<' + the call + '>'; anything else
    is the final answer, rewarded 1 when it is the record's answer."""

    stop = ("?",)
    max_turns = 4

    def reset(self, record):
        self.answer = record["answer"]
        return ""

    def step(self, action):
        if action.endswith("?"):
            return f"<{action[:-1]}>", 0.25, False, {"calls": 1}
        return "", float(action == self.answer), True


class Raises(Tool):
    def step(self, action):
        if action.startswith("boom"):
            raise ZeroDivisionError("the tool divided by zero")
        return super().step(action)


class Hangs(Tool):
    def step(self, action):
        if action.startswith("hang"):
            time.sleep(60)
        return super().step(action)


def _prompts(rows: list[str]) -> PromptBatch:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), PAD)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor([ord(c) for c in r])
        mask[i, width - len(r) :] = 1
    return PromptBatch(ids, mask)


def _run(cls, turns, *, rows=("p1", "p2"), n=1, budget=24, max_turns=4, timeout_s=5.0, workers=2):
    b = bind_class("env", cls, f"{cls.__name__}", workers=workers, timeout_s=timeout_s, error_reward=-1.0)
    pool = EnvPool(b)
    engine = Script(turns)
    try:
        job = AgentJob(
            CharTok(),
            _prompts(list(rows)),
            [{"prompt": r, "answer": "ok"} for r in rows],
            n=n,
            max_turns=max_turns,
            budget=budget,
            turn_tokens=8,
            eos_ids=(EOS,),
            pad_id=PAD,
            seed_of=lambda row, j, turn: 1000 * row + 10 * j + turn,
        )
        out = run_agents(engine, pool, b, job)
    finally:
        pool.close()
    return out, engine


def _ids(text: str) -> list[int]:
    return [EOS if c == "$" else ord(c) for c in text]


def test_a_trajectory_keeps_every_token_as_produced_and_marks_whose_it_is():
    out, engine = _run(Tool, {0: ["ab?", "ok$"], 1: ["x$"]})
    r = out.rollout
    want = _ids("ab?") + _ids("<ab>") + _ids("ok$")
    assert r.response_ids[0, : len(want)].tolist() == want  # ids in = ids trained: nothing re-encoded
    assert r.response_mask[0, : len(want)].tolist() == [True] * 3 + [False] * 4 + [True] * 3
    assert r.env_mask[0, : len(want)].tolist() == [False] * 3 + [True] * 4 + [False] * 3
    assert not r.present[0, len(want) :].any()
    assert r.logprobs[0, :3].tolist() == pytest.approx([-0.5, -0.51, -0.52])
    assert r.logprobs[0, 3:7].tolist() == [0.0] * 4  # the environment's tokens have no sampler log-probabilities
    assert r.env_reward.tolist() == pytest.approx([1.25, 0.0]) and r.turns.tolist() == [2, 1]
    assert out.texts[0] == "ab?<ab>ok"
    # the second turn continues the prompt and the whole trajectory so far, with a seed of its own
    second = [q for q in engine.requests if q[0] == 0][1]
    assert second[1] == _ids("p1") + _ids("ab?") + _ids("<ab>") and second[3] == 1
    assert out.metrics["info/calls"] == pytest.approx(0.5) and out.metrics["turns"] == pytest.approx(1.5)


def test_an_environment_that_raises_ends_its_trajectory_not_the_run():
    out, _ = _run(Raises, {0: ["boom?"], 1: ["a?", "ok$"]})
    assert out.rollout.env_reward.tolist() == pytest.approx([-1.0, 1.25])
    assert out.metrics["env_errors"] == 1.0 and "ZeroDivisionError: the tool divided by zero" in out.errors[0]
    assert out.rollout.turns.tolist() == [1, 2]


def test_an_environment_past_its_deadline_is_killed_and_its_trajectory_ends():
    t0 = time.monotonic()
    out, _ = _run(Hangs, {0: ["hang?"], 1: ["a?", "ok$"]}, timeout_s=1.0, workers=1)
    assert time.monotonic() - t0 < 20
    assert out.metrics["env_timeouts"] == 1.0 and out.rollout.env_reward[0].item() == -1.0
    # trajectory 1 shared the killed process: it ends as lost, or finished before the kill
    assert out.metrics["env_lost"] + (out.rollout.env_reward[1].item() == pytest.approx(1.25)) == 1


def test_max_turns_and_the_token_budget_end_a_trajectory():
    out, _ = _run(Tool, {0: ["a?"] * 5, 1: ["abcdef?", "x$"]}, max_turns=3, budget=13)
    r = out.rollout
    assert r.turns[0].item() == 3  # the third call is still passed to the environment, its answer not appended
    assert r.response_ids[0, : int(r.present[0].sum())].tolist() == _ids("a?<a>a?<a>a?")
    # trajectory 1: the observation "<abcdef>" does not fit the 13-token budget after "abcdef?": cut there
    assert int(r.present[1].sum()) == 13 and not r.response_mask[1, 7:].any() and out.metrics["truncated"] == pytest.approx(0.5)


def test_a_stop_string_must_be_one_token():
    class Words:
        def __call__(self, text, add_special_tokens=True):
            return {"input_ids": [1, 2] if text == "</tool>" else [3]}

    assert stop_token_ids(CharTok(), ["?"], "env") == [ord("?")]
    with pytest.raises(SpecError, match="'</tool>' is 2 tokens"):
        stop_token_ids(Words(), ["</tool>"], "environment calc (my:Env)")


def test_binding_refuses_what_is_not_an_environment():
    with pytest.raises(SpecError, match="has no step method"):
        bind_class("env", type("NoStep", (), {"reset": lambda self, r: ""}), "x:NoStep", workers=1, timeout_s=1, error_reward=0)
    with pytest.raises(SpecError, match="stop must be a tuple"):
        bind_class("env", type("S", (Tool,), {"stop": "?"}), "x:S", workers=1, timeout_s=1, error_reward=0)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]))
def test_the_loss_over_a_trajectory_is_the_loss_over_the_policy_tokens_alone(seed, agg):
    g = torch.Generator().manual_seed(seed)
    n, width = 4, 10
    policy = torch.rand((n, width), generator=g) < 0.5
    policy[:, 0] = True
    logp, old, adv = (torch.randn((n, width), generator=g) for _ in range(3))
    spec = PPOClip(agg=agg)
    loss, _ = policy_loss(spec, logp, old, adv, policy)
    # whatever the environment's positions (and the padding) hold, the loss is the same
    noise = [torch.randn((n, width), generator=g) * 100 for _ in range(3)]
    off = ~policy
    moved = [torch.where(off, z, x) for z, x in zip(noise, (logp, old, adv), strict=True)]
    assert torch.allclose(policy_loss(spec, *moved, policy)[0], loss, atol=1e-5)
    # and it is the loss of a rollout that holds the policy's tokens only (packed to the left)
    packed = [torch.zeros((n, width)) for _ in range(3)]
    pmask = torch.zeros((n, width), dtype=torch.bool)
    for i in range(n):
        k = int(policy[i].sum())
        for dst, src in zip(packed, (logp, old, adv), strict=True):
            dst[i, :k] = src[i][policy[i]]
        pmask[i, :k] = True
    assert torch.allclose(policy_loss(spec, *packed, pmask)[0], loss, atol=1e-5)


def test_the_protocol_takes_numpy_numbers_and_refuses_what_is_not_a_bool_or_a_number():
    import numpy as np

    from flowc.runtime.env_process import step_result

    assert step_result(("x", np.float32(1.0), np.bool_(False), {"k": np.int64(2)}), "E") == ("x", 1.0, False, {"k": 2.0})
    with pytest.raises(TypeError, match="done 'false' \\(str\\), expected a bool"):
        step_result(("x", 1.0, "false"), "E")
    with pytest.raises(TypeError, match="reward True"):
        step_result(("x", True, False), "E")
    with pytest.raises(TypeError, match="expected \\(observation: str"):
        step_result("ok", "E")


class Lossy(Tool):
    def step(self, action):
        return "résumé", 0.0, False  # the character tokenizer below has no 'é'


class NoAccents(CharTok):
    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text if ord(c) < 128]}


def test_an_observation_the_tokenizer_cannot_encode_ends_its_trajectory_loudly():
    b = bind_class("env", Lossy, "Lossy", workers=1, timeout_s=5, error_reward=-1.0)
    pool = EnvPool(b)
    try:
        job = AgentJob(NoAccents(), _prompts(["p"]), [{"prompt": "p", "answer": "ok"}], 1, 3, 20, 8, (EOS,), PAD, lambda *a: 0)
        out = run_agents(Script({0: ["a?", "b$"]}), pool, b, job)
    finally:
        pool.close()
    assert out.metrics["env_errors"] == 1.0 and out.rollout.env_reward.tolist() == [-1.0]
    assert "cannot encode the observation 'résumé' (it reads back as 'rsum')" in out.errors[0]


def test_a_step_that_every_trajectory_failed_stops_the_run_and_says_why():
    from flowc.errors import DataError
    from flowc.runtime.run_checks import check_environments

    check_environments({"agent/trajectories": 4.0, "agent/env_errors": 3.0}, 0)  # some failed: the run goes on
    with pytest.raises(DataError, match=r"step 3: the environment ended all 4 trajectories .*ZeroDivisionError"):
        check_environments(
            {
                "agent/trajectories": 4.0,
                "agent/env_errors": 2.0,
                "agent/env_lost": 2.0,
                "agent/errors": ["error: ZeroDivisionError"],
            },
            2,
        )


def test_the_pool_counts_the_environments_own_time_not_the_loops():
    pool = EnvPool(bind_class("env", Tool, "Tool", workers=1, timeout_s=5, error_reward=0.0))
    try:
        pool.submit(0, "reset", {"answer": "ok"})
        pool.submit(0, "close")
        time.sleep(1.0)  # the loop busy elsewhere: the answers wait
        while pool.pending():
            pool.poll(0.1)
        assert pool.seconds() < 0.2
    finally:
        pool.close()
