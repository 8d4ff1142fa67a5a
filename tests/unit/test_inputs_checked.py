"""Every input of a run is checked before its first step: data rows, run records, CLI values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import EXAMPLES

from flowc.errors import DataError, SpecError
from flowc.inputs import check_rows, load_rows, required_columns
from flowc.tasks import arithmetic as arith


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(arith.asset_dir()))


def jsonl(tmp_path: Path, lines: list[str | bytes], name: str = "d.jsonl") -> str:
    p = tmp_path / name
    p.write_bytes(b"\n".join(x if isinstance(x, bytes) else x.encode() for x in lines) + b"\n")
    return str(p)


def answer_reward(prompts, responses, answer):
    return [1.0] * len(responses)


def loose_reward(prompts, responses, **columns):
    return [0.0] * len(responses)


def check(d, tok, prompt_len=16, rewards=None, preferences=False):
    check_rows(
        d,
        tok,
        prompt_len=prompt_len,
        response_len=8,
        preferences=preferences,
        rewards={"reward": (answer_reward, "rw.py:answer_reward")} if rewards is None else rewards,
    )


def test_rows_that_cannot_be_read_name_their_file_and_line(tmp_path):
    good = '{"prompt": "1+1=", "answer": "2"}'
    with pytest.raises(DataError, match=r"d\.jsonl:3: not UTF-8 text"):
        load_rows(jsonl(tmp_path, [good, good, b'{"prompt": "\xff\xfe"}']))
    with pytest.raises(DataError, match=r"d\.jsonl:2: a JSON list where a row \(a JSON object\) belongs"):
        load_rows(jsonl(tmp_path, [good, '["1+1=", "2"]']))
    with pytest.raises(DataError, match=r"d\.jsonl:4: not JSON"):
        load_rows(jsonl(tmp_path, [good, "", good, "{prompt: 1}"]))
    with pytest.raises(DataError, match="does not exist"):
        load_rows(str(tmp_path / "nope.jsonl"))
    d = load_rows(jsonl(tmp_path, [good, "", good]))
    assert d.lines == [1, 3] and d.where(1).endswith("d.jsonl:3")


def test_every_row_is_checked_before_the_first_step(tmp_path, tok):
    good = '{"prompt": "1+1=", "answer": "2"}'
    # a row without the prompt, deep in the file
    d = load_rows(jsonl(tmp_path, [good] * 5 + ['{"question": "1+1=", "answer": "2"}']))
    with pytest.raises(DataError, match=r"d\.jsonl:6: the row has no 'prompt' column"):
        check(d, tok)
    # a row without the column the reward reads (its parameter), named with the reward
    d = load_rows(jsonl(tmp_path, [good, '{"prompt": "2+2="}']))
    with pytest.raises(
        DataError, match=r"d\.jsonl:2: the row has no 'answer' column, which reward reward \(rw\.py:answer_reward\)"
    ):
        check(d, tok)
    check(d, tok, rewards={"reward": (loose_reward, "loose")})  # **columns: it reads what is there
    # a prompt longer than the workload's prompt_len, with the longest and how many
    long = json.dumps({"prompt": "1+" * 40 + "1=", "answer": "41"})
    d = load_rows(jsonl(tmp_path, [good, long, good, long]))
    with pytest.raises(
        DataError, match=r"d\.jsonl:2: the prompt is \d+ tokens, longer than the workload's prompt_len 16 \(2 of 4"
    ) as e:
        check(d, tok)
    assert "--workload prompt_len=" in e.value.fix
    # a prompt that is neither text nor chat messages
    d = load_rows(jsonl(tmp_path, [good, '{"prompt": 12, "answer": "x"}']))
    with pytest.raises(DataError, match=r"d\.jsonl:2: 'prompt' is a int, not text or a list of chat messages"):
        check(d, tok)
    # text the tokenizer cannot encode (it would become <unk>: "What is the capital of France?" was [1])
    for bad in ('{"prompt": "What is 1+1?", "answer": "2"}', '{"prompt": [{"role": "user", "content": "hi"}], "answer": "x"}'):
        d = load_rows(jsonl(tmp_path, [good, bad]))
        with pytest.raises(DataError, match=r"d\.jsonl:2: the policy's tokenizer cannot encode the prompt"):
            check(d, tok)
    # preference pairs: both responses, within response_len with EOS
    pair = '{"prompt": "1+1=", "chosen": "2", "rejected": "3"}'
    d = load_rows(jsonl(tmp_path, [pair, '{"prompt": "1+1=", "chosen": "2"}']))
    with pytest.raises(DataError, match=r"d\.jsonl:2: the row has no 'rejected' column"):
        check(d, tok, preferences=True, rewards={})
    d = load_rows(jsonl(tmp_path, [pair, json.dumps({"prompt": "1+1=", "chosen": "2" * 30, "rejected": "3"})]))
    with pytest.raises(DataError, match=r"d\.jsonl:2: the 'chosen' response is \d+ tokens with EOS"):
        check(d, tok, preferences=True, rewards={})


def test_tokenising_an_overlong_prompt_is_a_data_error_not_a_transformers_one(tok):
    from flowc.runtime.data import tokenize_prompts

    with pytest.raises(DataError, match="longer than the workload's prompt_len 4"):
        tokenize_prompts(tok, ["1+1=", "1+1+1+1+1+1="], 4)
    assert tokenize_prompts(tok, ["1+1=", "2+2="], 8).input_ids.shape == (2, 8)


def test_required_columns_are_the_parameters_without_defaults():
    def fn(prompts, responses, answer, level=1, *, tag):
        return []

    assert required_columns(fn) == ["answer", "tag"]
    assert required_columns(loose_reward) == []
    assert required_columns(arith.exact_match) == required_columns(arith.exact_match)


def test_the_run_record_lists_what_a_resume_would_change(tmp_path):
    from flowc.ir.run_config import RunConfig
    from flowc.loader import load_flow
    from flowc.run import RunRequest, given_options, record_of, resume_request

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    rw = tmp_path / "rw.py"
    rw.write_text("def half(prompts, responses, **c):\n    return [0.5] * len(responses)\n")
    fl = load_flow(str(EXAMPLES / "grpo.py"))
    req = RunRequest(
        flow=fl,
        overrides={"n": 4},
        models={},
        data=str(data),
        eval_data=None,
        rewards={"reward": f"{rw}:half"},
        cluster="local:1",
        workload="prompts=8,prompt_len=8,response_len=6",
        steps=6,
        out=str(tmp_path / "run"),
        resume=None,
        rollout="hf",
        pins=[],
        config=RunConfig(checkpoint_every=2),
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rec = record_of(req, RunConfig(steps=6, checkpoint_every=2))
    rec.write(run_dir)
    assert set(rec.inputs) == {str(data), str(rw), str((EXAMPLES / "grpo.py").resolve())}

    given = given_options

    # nothing given: the run as it was, everything from run.json
    again = resume_request(str(run_dir), given(), override=False)
    assert (again.data, again.rewards, again.rollout, again.cluster) == (str(data), {"reward": f"{rw}:half"}, "hf", "local:1")
    assert again.overrides == {"n": 4} and again.steps == 6 and again.config.checkpoint_every == 2
    # --steps and the same values never contradict
    assert resume_request(str(run_dir), given(steps=9, data=str(data), flow=fl), override=False).steps == 9
    # a different data file, rollout backend and hyperparameter: each listed, refused
    other = tmp_path / "other.jsonl"
    other.write_text('{"prompt": "2+2=", "answer": "4"}\n')
    with pytest.raises(SpecError) as e:
        resume_request(str(run_dir), given(data=str(other), rollout="vllm", overrides={"n": 8}), override=False)
    assert "--data" in e.value.what and "--rollout" in e.value.what and "--NAME=VALUE" in e.value.what
    assert "--override" in e.value.fix
    # --override takes them and records what it changed
    changed = resume_request(str(run_dir), given(data=str(other)), override=True)
    assert changed.data == str(other) and changed.record.resumes[-1]["override"] == {"data": str(other)}
    # an input file edited since the run started is a contradiction too
    data.write_text('{"prompt": "3+3=", "answer": "6"}\n')
    with pytest.raises(SpecError, match="changed since the run started"):
        resume_request(str(run_dir), given(), override=False)
    with pytest.raises(SpecError, match=r"has no run\.json"):
        resume_request(str(tmp_path), given(), override=False)


def test_a_torn_last_metrics_line_is_dropped_with_a_warning(tmp_path, capsys):
    from flowc.report import read_metrics

    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "rew')
    assert read_metrics(p) == [{"step": 1, "reward": 0.5}]
    assert "torn last line" in capsys.readouterr().err
    p.write_text('{"step": 1\n{"step": 2}\n')
    with pytest.raises(DataError, match=r"metrics\.jsonl:1"):
        read_metrics(p)


def test_losses_and_ops_suggest_the_name_meant():
    import flowc as fc

    with pytest.raises(AttributeError, match=r"did you mean 'ppo_clip'"):
        fc.losses.ppo_clp  # noqa: B018
    with pytest.raises(AttributeError, match=r"did you mean 'group_normalize'"):
        fc.ops.group_normalise  # noqa: B018


def test_cluster_addresses_are_checked_before_ray_is_asked(tmp_path):
    import time

    from flowc.clusters import check_address

    for bad in ("my-cluster", "10.0.0.1", "host:notaport", "host:70000"):
        with pytest.raises(SpecError, match="neither local, local:N nor a Ray address"):
            check_address(bad)
    t0 = time.perf_counter()
    with pytest.raises(SpecError, match=r"no Ray cluster answers at 127\.0\.0\.1:1"):
        check_address("127.0.0.1:1", wait_s=2)
    assert time.perf_counter() - t0 < 10
