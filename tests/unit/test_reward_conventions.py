"""verl's and TRL's reward signatures and chat-format prompts, checked by hand."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from flowc.errors import DataError
from flowc.inputs import check_rows, required_columns
from flowc.rewards import adapt, convention, reward_notes
from flowc.runtime.data import Records, call_reward, score_reward, tokenize_prompts
from flowc.tasks.arithmetic import asset_dir


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str == ground_truth), "len": len(solution_str)} if extra_info else 0.5


async def async_score(data_source, solution_str, ground_truth):
    return 1.0 if solution_str == ground_truth else -1.0


def trl_reward(prompts, completions, answer, **kwargs):
    return [
        float(c[0]["content"] == a) if isinstance(c, list) else float(c == a) for c, a in zip(completions, answer, strict=True)
    ]


async def batched_async(prompts, responses, **columns):
    return [float(len(r)) for r in responses]


def plain(prompts, responses, answer):
    return [1.0] * len(responses)


def test_conventions_are_recognised_by_their_parameters():
    assert convention(compute_score) == convention(async_score) == "verl"
    assert convention(trl_reward) == "trl"
    assert convention(plain) == convention(batched_async) == "flowc"
    assert adapt(plain) is plain
    assert required_columns(adapt(compute_score)) == ["data_source", "reward_model"]
    assert required_columns(adapt(trl_reward)) == ["answer"] == required_columns(plain)


def test_verl_per_sample_with_ground_truth_extra_info_and_dict_results():
    cols = {
        "data_source": ["a", "a", "b"],
        "reward_model": [{"ground_truth": "4"}, {"ground_truth": "5"}, {"ground_truth": "6"}],
        "extra_info": [{"i": 0}, {"i": 1}, None],
    }
    got = call_reward(adapt(compute_score), "cs", ["2+2=", "2+3=", "3+3="], ["4", "6", "6"], cols)
    assert got.tolist() == [1.0, 0.0, 0.5]  # dicts give their score; no extra_info: a float
    got = call_reward(adapt(async_score), "as", ["x", "y"], ["4", "6"], {**{k: v[:2] for k, v in cols.items()}})
    assert got.tolist() == [1.0, -1.0]  # awaited, concurrently


def test_trl_completions_are_messages_for_chat_prompts_and_text_otherwise():
    chat = [[{"role": "user", "content": "2+2="}], [{"role": "user", "content": "1+1="}]]
    got = call_reward(adapt(trl_reward), "t", chat, ["4", "3"], {"answer": ["4", "2"], "other": [1, 2]})
    assert got.tolist() == [1.0, 0.0]
    got = call_reward(adapt(trl_reward), "t", ["2+2=", "1+1="], ["4", "2"], {"answer": ["4", "2"]})
    assert got.tolist() == [1.0, 1.0]
    assert call_reward(adapt(batched_async), "b", ["p"], ["abc"], {}).tolist() == [3.0]


def test_a_none_or_a_dict_without_score_is_refused():
    with pytest.raises(DataError, match="returned None for response 1"):
        call_reward(lambda p, r: [1.0, None], "n", ["a", "b"], ["x", "y"], {})
    with pytest.raises(DataError, match="without 'score'"):
        call_reward(lambda p, r: [{"acc": 1}], "d", ["a"], ["x"], {})


@pytest.fixture
def tok():
    return AutoTokenizer.from_pretrained(str(asset_dir()))


def test_chat_prompts_render_through_the_template_and_pad_left(tok):
    chat = [{"role": "user", "content": "12+34="}]
    a = tokenize_prompts(tok, [chat, "7-9="], 10)
    b = tokenize_prompts(tok, ["12+34=", "7-9="], 10)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.attention_mask, b.attention_mask)
    assert not a.attention_mask[:, 0].any() and a.attention_mask[:, -1].all()  # left padded


def _records(tmp_path, rows):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from flowc.inputs import load_rows

    return load_rows(str(p))


def test_chat_prompts_are_checked_before_the_first_step(tmp_path, tok):
    ok = {"prompt": [{"role": "user", "content": "1+1="}]}
    check_rows(_records(tmp_path, [ok]), tok, prompt_len=8, response_len=4, preferences=False, rewards={})
    bad = {"prompt": [{"role": "user"}]}
    with pytest.raises(DataError, match=r"d\.jsonl:2: message 0 of the prompt"):
        check_rows(_records(tmp_path, [ok, bad]), tok, prompt_len=8, response_len=4, preferences=False, rewards={})
    # the templated length counts: 7 tokens with the template's BOS, over a prompt_len of 6
    with pytest.raises(DataError, match=r"d\.jsonl:1: the prompt is 7 tokens"):
        check_rows(
            _records(tmp_path, [{"prompt": [{"role": "user", "content": "12+34="}]}]),
            tok, prompt_len=6, response_len=4, preferences=False, rewards={},
        )  # fmt: skip
    tok.chat_template = None
    with pytest.raises(DataError, match="has no chat template"):
        check_rows(_records(tmp_path, [ok]), tok, prompt_len=8, response_len=4, preferences=False, rewards={})
    check_rows(_records(tmp_path, [{"prompt": "1+1="}]), tok, prompt_len=8, response_len=4, preferences=False, rewards={})


def test_records_keep_nested_verl_columns():
    d = Records([{"prompt": "x", "reward_model": {"ground_truth": "1"}}], "mem")
    assert d.rows[0]["reward_model"]["ground_truth"] == "1"


def test_dict_results_give_their_extra_numbers_as_batch_means():
    def scored(data_source, solution_str, ground_truth, extra_info=None):
        ok = solution_str == ground_truth
        return {"score": float(ok), "acc": ok, "length": len(solution_str), "pred": solution_str}

    cols = {"data_source": ["a"] * 3, "reward_model": [{"ground_truth": "4"}] * 3}
    scores, extras = score_reward(adapt(scored), "s", ["p"] * 3, ["4", "44", "5"], cols)
    assert scores == [1.0, 0.0, 0.0]
    assert extras == pytest.approx({"acc": 1 / 3, "length": 4 / 3})  # text ("pred") is left out
    assert score_reward(plain, "p", ["p"], ["x"], {"answer": ["x"]})[1] == {}


def test_async_per_sample_rewards_run_concurrently():
    async def slow(data_source, solution_str, ground_truth):
        await asyncio.sleep(0.3)
        return float(solution_str == ground_truth)

    cols = {"data_source": ["a"] * 8, "reward_model": [{"ground_truth": "1"}] * 8}
    t = time.perf_counter()
    got = call_reward(adapt(slow), "slow", ["p"] * 8, ["1", "2"] * 4, cols)
    assert time.perf_counter() - t < 1.2  # 8 x 0.3 s one after another would take 2.4 s
    assert got.tolist() == [1.0, 0.0] * 4


def test_trl_and_async_rewards_name_the_columns_they_need():
    def needs(prompts, completions, answer, level=1, **kwargs):
        return [0.0] * len(completions)

    async def batched(prompts, responses, answer, weight=1.0):
        return [0.0] * len(responses)

    assert required_columns(adapt(needs)) == ["answer"]
    assert required_columns(adapt(batched)) == ["answer"]


def test_the_recognised_convention_is_reported():
    fns = {"a": adapt(compute_score), "b": adapt(trl_reward), "c": plain, "d": adapt(async_score)}
    notes = reward_notes(fns, {"a": "v.py:compute_score"})
    assert notes[0].startswith("reward a (v.py:compute_score): called as verl's per-sample compute_score")
    assert "TRL's reward_func(prompts, completions" in notes[1]
    assert "responses' calls awaited concurrently" in notes[2] and len(notes) == 3  # the plain one needs no note


def test_scores_must_be_numbers_one_per_response():
    with pytest.raises(DataError, match="not a sequence of numbers"):
        score_reward(lambda p, r: ["1.0"], "s", ["p"], ["x"], {})  # text is not a score, even if it parses
    with pytest.raises(DataError, match="not a sequence of numbers"):
        score_reward(lambda p, r: [[1.0]], "s", ["p"], ["x"], {})
    with pytest.raises(DataError, match="non-finite"):
        score_reward(lambda p, r: [float("nan")], "s", ["p"], ["x"], {})
    with pytest.raises(DataError, match="float32"):  # it would be inf once a float32 tensor
        score_reward(lambda p, r: [1e39], "s", ["p"], ["x"], {})
    assert score_reward(lambda p, r: np.array([1, 0.5]), "s", ["p"] * 2, ["x"] * 2, {})[0] == [1.0, 0.5]
    assert score_reward(lambda p, r: torch.tensor([True, False]), "s", ["p"] * 2, ["x"] * 2, {})[0] == [1.0, 0.0]
