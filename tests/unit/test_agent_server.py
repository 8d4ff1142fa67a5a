"""Server mode: agent harnesses written for the OpenAI client drive trajectories through the
rollout engine's endpoint (runtime.serve), and flowc records exactly the tokens it served."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from flowc.runtime.agent import AgentJob, run_harnesses, stop_token_ids
from flowc.runtime.data import tokenize_prompts
from flowc.runtime.envs import HarnessPool, bind_class
from flowc.runtime.serve import TrajectoryServer
from flowc.tasks.calculator import asset_dir

pytest.importorskip("openai")


class Oracle:
    """A scripted policy on the calculator's tokens: after "a*b=" it calls the tool "(a*b)", after
    the tool's "v|" it answers "v" and EOS."""

    lockstep = False

    def __init__(self, tok):
        self.tok, self.queue = tok, []

    def submit(self, key, tokens, max_tokens, seed):
        self.queue.append((key, tokens, max_tokens))

    def pending(self):
        return len(self.queue)

    def abort(self):
        self.queue = []

    def advance(self):
        out = []
        for key, tokens, limit in self.queue:
            text = self.tok.decode(tokens, skip_special_tokens=True)
            if text.endswith("|"):
                reply = self.tok(text[:-1].rsplit(")", 1)[1], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            else:
                reply = self.tok("(" + text.rsplit("=", 1)[0] + ")", add_special_tokens=False)["input_ids"]
            reply = reply[:limit]
            out.append((key, reply, [-0.25] * len(reply)))
        self.queue = []
        return out


class ChatHarness:
    """An agent written for the OpenAI chat API: a tool call, the tool's answer as the next message."""

    stop = (")",)
    max_turns = 3

    def run(self, record, base_url):
        from openai import OpenAI

        client = OpenAI(base_url=base_url, api_key="flowc", max_retries=0)
        msgs = [{"role": "user", "content": record["prompt"]}]
        r = client.chat.completions.create(model="policy", messages=msgs, max_tokens=12, logprobs=True)
        call = r.choices[0].message.content
        assert r.choices[0].logprobs.content[0].logprob == -0.25 and r.model_extra["prompt_token_ids"]
        a, b = call.strip("()").split("*")
        msgs += [{"role": "assistant", "content": call}, {"role": "user", "content": f"{int(a) * int(b)}|"}]
        r = client.chat.completions.create(model="policy", messages=msgs, max_tokens=12)
        answer = r.choices[0].message.content
        return float(answer == record["answer"]), {"calls": 1.0}


class TokenHarness:
    """The same agent on the completions endpoint with token ids in and out (token-in/token-out)."""

    stop = (")",)
    max_turns = 3

    def run(self, record, base_url):
        from openai import OpenAI

        client = OpenAI(base_url=base_url, api_key="flowc", max_retries=0)
        first = client.completions.create(model="policy", prompt=record["prompt"], max_tokens=12)
        ids = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
        a, b = first.choices[0].text.strip("()").split("*")
        digits = {str(d): 3 + d for d in range(10)}  # the tool's answer in the calculator tokenizer's ids ("|" is 19)
        tool = [digits[c] for c in str(int(a) * int(b))] + [19]
        second = client.completions.create(model="policy", prompt=ids + tool, max_tokens=12)
        return float(second.choices[0].text == record["answer"])


class Rewrites(ChatHarness):
    """Sends a second request whose history differs from what was served: refused."""

    def run(self, record, base_url):
        from openai import OpenAI

        client = OpenAI(base_url=base_url, api_key="flowc", max_retries=0)
        msgs = [{"role": "user", "content": record["prompt"]}]
        client.chat.completions.create(model="policy", messages=msgs, max_tokens=12)
        msgs += [{"role": "assistant", "content": "(99*99)"}, {"role": "user", "content": "9801|"}]
        client.chat.completions.create(model="policy", messages=msgs, max_tokens=12)
        return 1.0


def _run(cls, rows=("12*34=", "56*78="), n=2):
    tok = AutoTokenizer.from_pretrained(str(asset_dir()))
    b = bind_class("calc", cls, cls.__name__, workers=2, timeout_s=30, error_reward=-1.0)
    pool, server = HarnessPool(b), TrajectoryServer()
    try:
        job = AgentJob(
            tok,
            tokenize_prompts(tok, list(rows), 8),
            [{"prompt": r, "answer": str(eval(r[:-1]))} for r in rows],
            n=n,
            max_turns=3,
            budget=24,
            turn_tokens=12,
            eos_ids=(tok.eos_token_id,),
            pad_id=tok.pad_token_id,
            seed_of=lambda *a: 0,
            stop_ids=stop_token_ids(tok, cls.stop, "calc"),
        )
        out = run_harnesses(Oracle(tok), pool, server, b, job)
    finally:
        pool.close()
        server.close()
    return out, tok


@pytest.mark.parametrize("cls", [ChatHarness, TokenHarness])
def test_a_harness_on_the_openai_client_trains_on_exactly_the_served_tokens(cls):
    out, tok = _run(cls)
    r = out.rollout
    assert r.env_reward.tolist() == [1.0] * 4 and r.turns.tolist() == [2] * 4 and out.metrics["env_errors"] == 0
    want = {0: "(12*34)408|408", 2: "(56*78)4368|4368"}
    for row, text in want.items():
        k = int(r.present[row].sum())
        ids = r.response_ids[row, :k].tolist()
        assert tok.decode(ids, skip_special_tokens=True) == text and ids[-1] == tok.eos_token_id
        tool = len(text.split(")")[1].split("|")[0]) + 1  # the tool's answer and "|": the environment's tokens
        call = len(text.split(")")[0]) + 1
        assert r.response_mask[row, :k].tolist() == [True] * call + [False] * tool + [True] * (k - call - tool)
        assert r.logprobs[row][r.response_mask[row]].tolist() == [-0.25] * (k - tool)
        # the trajectory's prompt is the one the harness sent, as served
        assert (
            tok.decode(r.prompt_ids[row][r.prompt_mask[row]].tolist(), skip_special_tokens=True) == ["12*34=", "56*78="][row // 2]
        )


def test_a_request_that_rewrites_what_was_served_is_refused_and_ends_its_trajectory():
    out, _ = _run(Rewrites, rows=("12*34=",), n=1)
    assert out.metrics["env_errors"] == 1.0 and out.rollout.env_reward.tolist() == [-1.0]
    assert "does not extend the conversation served so far" in out.errors[0]


def test_the_endpoint_answers_models_and_unknown_paths():
    import json
    import urllib.error
    import urllib.request

    s = TrajectoryServer()
    try:
        with urllib.request.urlopen(s.base_url(0) + "/models") as resp:
            assert json.loads(resp.read())["data"][0]["id"] == "policy"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(s.url + "/v1/chat/completions", data=b"{}", method="POST"))
        assert e.value.code == 404
        assert s.url.startswith("http://127.0.0.1:")
    finally:
        s.close()


class Concurrent(ChatHarness):
    """Sends two requests of one trajectory at once: the second is refused (a trajectory is one sequence) —
    while the first is being answered, or after it, as no longer extending what was served."""

    def run(self, record, base_url):
        from concurrent.futures import ThreadPoolExecutor

        from openai import BadRequestError, OpenAI

        client = OpenAI(base_url=base_url, api_key="flowc", max_retries=0)
        msgs = [{"role": "user", "content": record["prompt"]}]

        def ask():
            try:
                return client.chat.completions.create(model="policy", messages=msgs, max_tokens=12).choices[0].message.content
            except BadRequestError as e:
                return f"refused: {e}"

        with ThreadPoolExecutor(2) as ex:
            got = sorted(ex.map(lambda _: ask(), range(2)))
        refused = ("already has a request being answered", "does not extend the conversation served so far")
        assert got[0].startswith("(") and any(r in got[1] for r in refused), got
        return 1.0


def test_a_trajectory_takes_one_request_at_a_time():
    out, _ = _run(Concurrent, rows=("12*34=",), n=1)
    assert out.metrics["env_errors"] == 0 and out.rollout.turns.tolist() == [1]
