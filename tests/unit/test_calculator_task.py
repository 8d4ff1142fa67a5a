"""The built-in tool-using task (flowc.tasks.calculator): its tokenizer, the environment,
the reward, the split and the shipped warm-start model."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flowc.tasks import arithmetic as arith
from flowc.tasks import calculator as calc


def test_the_tokenizer_extends_arithmetics_by_four_single_token_characters():
    tok, old = calc.build_tokenizer(), arith.build_tokenizer()
    assert len(tok) == len(arith.VOCAB) + 4 == 20
    for t in arith.VOCAB:  # the existing 16 ids unchanged
        assert tok.convert_tokens_to_ids(t) == old.convert_tokens_to_ids(t)
    assert [tok.convert_tokens_to_ids(c) for c in "*()|"] == [16, 17, 18, 19]
    for s in calc.Calculator.stop:
        assert len(tok(s, add_special_tokens=False)["input_ids"]) == 1
    text = "37*48=(37*48)1776|1776"
    ids = tok(text + "</s>")["input_ids"]
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id and len(ids) == len(text) + 2
    assert tok.pad_token_id not in ids  # no character fell to the unknown (pad) token
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_arithmetics_tokenizer_is_unchanged():
    """build_tokenizer takes the vocabulary now; its default output is the shipped one's
    (the shipped file also records the batch padding it was last used with)."""
    tok = arith.build_tokenizer()
    built = json.loads(tok.backend_tokenizer.to_str())
    shipped = json.loads((arith.asset_dir() / "tokenizer.json").read_text())
    built.pop("padding"), shipped.pop("padding")
    assert built == shipped


def test_a_tool_call_is_evaluated_and_a_malformed_one_refused():
    env = calc.Calculator()
    assert env.reset({"prompt": "37*48=", "answer": "1776"}) == ""
    assert env.step("(37*48)") == ("1776|", 0.0, False, {"tool_calls": 1.0, "tool_ok": 1.0})
    assert env.step("(37+48)")[0] == "85|"
    assert env.step("(37-48)")[0] == "-11|"
    assert env.step("( 3 * -4 )")[0] == "-12|"
    bad = ("|", 0.0, False, {"tool_calls": 1.0, "tool_ok": 0.0})
    for action in ("37*48)", "(37*)", "(37/48)", "(1+2+3)", "()", ")", "((1+2))", "(__import__('os').getcwd())", "(2**99)"):
        assert env.step(action) == bad, action


def test_a_final_answer_is_rewarded_when_exact():
    env = calc.Calculator()
    env.reset({"prompt": "37*48=", "answer": "1776"})
    assert env.step("1776") == ("", 1.0, True, {"correct": 1.0})
    assert env.step(" 1776 ") == ("", 1.0, True, {"correct": 1.0})
    assert env.step("1777") == ("", 0.0, True, {"correct": 0.0})
    assert env.step("") == ("", 0.0, True, {"correct": 0.0})
    assert calc.Calculator.max_turns == 3 and calc.Calculator.stop == (")",)
    with pytest.raises(RuntimeError):
        calc.Calculator().step("1")


def test_final_answer_reads_after_the_last_observation():
    responses = ["(37*48)1776|1776", "1776", "(37*48)1776|1777", "(37*4)148|(148*12)1776|1776", "(37*)|", " 1776 "]
    assert calc.final_answer(["37*48="] * 6, responses, ["1776"] * 6) == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]


def test_the_split_is_fixed_and_disjoint():
    train, held_out = calc.split()
    assert len(held_out) == calc.EVAL_SIZE == 500 and len(train) == 8100 - 500
    assert {p.prompt for p in train}.isdisjoint({p.prompt for p in held_out})
    assert calc.split() == (train, held_out)
    assert held_out[:2] == [calc.Problem("97*23=", "2231"), calc.Problem("21*36=", "756")]
    for p in train[:50] + held_out[:50]:
        a, b = map(int, p.prompt.rstrip("=").split("*"))
        assert 10 <= a <= 99 and 10 <= b <= 99 and p.answer == str(a * b)
    rows = calc.records(held_out[:2])
    assert rows[0] == {"prompt": "97*23=", "answer": "2231"}
    assert calc.tool_text(held_out[0]) == "(97*23)2231|2231"


def test_the_module_imports_no_torch():
    code = "import sys, flowc.tasks.calculator; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_the_shipped_checkpoint_loads_with_its_tokenizer_and_uses_the_tool():
    import torch
    from transformers import AutoTokenizer

    from flowc.runtime.modeling import load_causal_lm
    from flowc.tasks.make_tool_checkpoint import play

    path = calc.asset_dir()
    tok = AutoTokenizer.from_pretrained(str(path))
    built = calc.build_tokenizer()
    # AutoTokenizer loads it as a Qwen2Tokenizer, which appends an unknown token (as for arith-tiny)
    assert {k: v for k, v in tok.get_vocab().items() if v < len(built)} == built.get_vocab()
    text = "37*48=(37*48)1776|1776</s>"
    assert tok(text)["input_ids"] == built(text)["input_ids"]
    assert tok.padding_side == "left" and tok.chat_template
    assert tok.apply_chat_template([{"role": "user", "content": "37*48="}], tokenize=False) == "<s>37*48="
    model = load_causal_lm(path)
    assert model.config.vocab_size >= len(tok)
    assert sum(p.numel() for p in model.parameters()) * 4 < 8 * 2**20
    torch.manual_seed(0)
    _, held_out = calc.split()
    problems = held_out[:100]
    greedy = play(model, tok, problems, greedy=True)
    sampled = play(model, tok, problems, greedy=False, seed=0)
    used = [e for e in sampled if e.tool_calls]
    assert 0.05 <= len(used) / len(sampled) <= 0.6  # the tool is used sometimes
    assert sum(e.correct for e in used) >= 0.7 * len(used)  # and used well
    assert sum(e.correct for e in greedy) <= 0.5 * len(greedy)  # room for RL
