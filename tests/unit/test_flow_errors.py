"""Every error a user meets while writing a flow: the right exception type,
the user's file and line, what was wrong and a fix. The CLI prints them
without a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import line_of

from flowc.errors import (
    ControlFlowError,
    FlowcError,
    LoadError,
    MissingUpdateError,
    RoleUsageError,
    SignatureError,
    ValueUseError,
)
from flowc.loader import load_flow

HEADER = """
@fc.flow
def f(prompts: fc.Prompts, actor: fc.Policy, ref: fc.Reference, reward: fc.Reward, *, n: int = 4):
"""


def trace(path):
    return load_flow(str(path)).trace()


def expect(exc_type, path, needle, *, what, fix=None):
    with pytest.raises(exc_type) as info:
        trace(path)
    e = info.value
    assert e.where is not None, "error has no location"
    assert e.where.file == str(path)
    assert e.where.line == line_of(path, needle), f"points at {e.where.line}, expected the line with {needle!r}"
    assert what in e.what, e.what
    if fix is not None:
        assert e.fix and fix in e.fix, e.fix
    return e


def test_method_the_role_lacks(flow_file):
    p = flow_file(
        HEADER
        + """
    rollout = actor.generate(prompts, n=n)
    adv = fc.ops.group_normalize(reward(rollout), n)
    ref.update(rollout, advantages=adv)
    actor.update(rollout, advantages=adv)
"""
    )
    e = expect(RoleUsageError, p, "ref.update", what="Reference role 'ref' has no method 'update'", fix="frozen")
    assert "fc.Policy" in e.fix


def test_misspelt_role_method_suggests(flow_file):
    p = flow_file(
        HEADER
        + """
    rollout = actor.genrate(prompts, n=n)
"""
    )
    expect(RoleUsageError, p, "actor.genrate", what="did you mean 'generate'")


def test_python_if_on_traced_value(flow_file):
    p = flow_file(
        HEADER
        + """
    rollout = actor.generate(prompts, n=n)
    scores = reward(rollout)
    if scores.mean() > 0:
        scores = scores * 2
    actor.update(rollout, advantages=scores)
"""
    )
    e = expect(ControlFlowError, p, "if scores.mean()", what="control flow")
    assert "torch.where" in e.fix


def test_python_for_over_traced_value(flow_file):
    p = flow_file(
        HEADER
        + """
    rollout = actor.generate(prompts, n=n)
    scores = reward(rollout)
    total = 0
    for s in scores:
        total = total + s
    actor.update(rollout, advantages=scores)
"""
    )
    expect(ControlFlowError, p, "for s in scores", what="for-loop")


def test_len_of_traced_value(flow_file):
    p = flow_file(
        HEADER
        + """
    rollout = actor.generate(prompts, n=n)
    k = len(reward(rollout))
"""
    )
    expect(ControlFlowError, p, "len(reward", what="len()")


def test_parameter_without_role_annotation(flow_file):
    p = flow_file(
        """
@fc.flow
def f(prompts: fc.Prompts, actor, reward: fc.Reward):
    pass
"""
    )
    with pytest.raises(SignatureError) as info:
        load_flow(str(p))
    e = info.value
    assert "parameter 'actor'" in e.what and "no annotation" in e.what
    assert "fc.Policy" in e.fix
    assert e.where.line == line_of(p, "def f")


def test_hyperparameter_without_default(flow_file):
    p = flow_file(
        """
@fc.flow
def f(prompts: fc.Prompts, actor: fc.Policy, *, clip: float):
    pass
"""
    )
    with pytest.raises(SignatureError, match="hyperparameter 'clip'"):
        load_flow(str(p))


def test_misspelt_sampling_keyword(flow_file):
    p = flow_file(
        HEADER
        + """
    rollout = actor.generate(prompts, n=n, temprature=0.7)
"""
    )
    e = expect(SignatureError, p, "temprature", what="unexpected keyword 'temprature'")
    assert "did you mean 'temperature'" in e.what


def test_unknown_update_keyword(flow_file):
    p = flow_file(
        HEADER
        + """
    rollout = actor.generate(prompts, n=n)
    adv = fc.ops.group_normalize(reward(rollout), n)
    actor.update(rollout, advantage=adv)
"""
    )
    e = expect(SignatureError, p, "advantage=adv", what="unexpected keyword 'advantage'")
    assert "advantages" in e.what


def test_unknown_op_keyword(flow_file):
    p = flow_file(
        HEADER
        + """
    rollout = actor.generate(prompts, n=n)
    adv = fc.ops.group_normalize(reward(rollout), group=n)
    actor.update(rollout, advantages=adv)
"""
    )
    expect(SignatureError, p, "group=n", what="group")


def test_value_used_before_it_exists(flow_file):
    p = flow_file(
        HEADER
        + """
    old = actor.logprobs(rollout)
    rollout = actor.generate(prompts, n=n)
    actor.update(rollout, advantages=old)
"""
    )
    e = expect(ValueUseError, p, "actor.logprobs(rollout)", what="'rollout' is used before it exists")
    assert "above" in e.fix


def test_prompts_where_a_rollout_is_needed(flow_file):
    p = flow_file(
        HEADER
        + """
    old = actor.logprobs(prompts)
"""
    )
    e = expect(ValueUseError, p, "actor.logprobs(prompts)", what="must be a rollout, got the prompt batch")
    assert "generate" in e.fix


def test_unknown_rollout_field(flow_file):
    p = flow_file(
        HEADER
        + """
    rollout = actor.generate(prompts, n=n)
    m = rollout.response_masks
"""
    )
    expect(ValueUseError, p, "response_masks", what="did you mean 'response_mask'")


def test_flow_without_update(flow_file):
    p = flow_file(
        HEADER
        + """
    rollout = actor.generate(prompts, n=n)
    reward(rollout)
    ref.logprobs(rollout)
"""
    )
    e = expect(MissingUpdateError, p, "def f", what="never calls update")
    assert "actor.update" in e.fix


def test_kl_without_reference_logprobs(flow_file):
    p = flow_file(
        HEADER
        + """
    rollout = actor.generate(prompts, n=n)
    ref.logprobs(rollout)
    actor.update(rollout, advantages=fc.ops.group_normalize(reward(rollout), n), kl_coef=0.1)
"""
    )
    expect(SignatureError, p, "kl_coef=0.1", what="needs ref_logprobs")


def test_op_failing_on_shapes_points_at_line(flow_file):
    p = flow_file(
        HEADER
        + """
    rollout = actor.generate(prompts, n=n)
    bad = fc.ops.kl(actor.logprobs(rollout), ref.logprobs(rollout), kind="k4")
"""
    )
    expect(FlowcError, p, 'kind="k4"', what="unknown KL kind 'k4'")


def test_file_with_no_flow(tmp_path):
    p = tmp_path / "empty.py"
    p.write_text("x = 1\n")
    with pytest.raises(LoadError, match=r"defines no @fc\.flow"):
        load_flow(str(p))


def test_missing_file(tmp_path):
    with pytest.raises(LoadError, match="no such file"):
        load_flow(str(tmp_path / "nope.py"))


def test_several_flows_need_a_name(flow_file):
    body = """
    rollout = actor.generate(prompts)
    actor.update(rollout, advantages=reward(rollout))
"""
    p = flow_file(
        "@fc.flow\ndef a(prompts: fc.Prompts, actor: fc.Policy, reward: fc.Reward):"
        + body
        + "\n@fc.flow\ndef b(prompts: fc.Prompts, actor: fc.Policy, reward: fc.Reward):"
        + body
    )
    with pytest.raises(LoadError, match="several flows: a, b") as info:
        load_flow(str(p))
    assert ":a" in info.value.fix
    assert load_flow(f"{p}:b").name == "b"


def test_syntax_error_in_file(tmp_path):
    p = tmp_path / "broken.py"
    p.write_text("import flowc as fc\n\ndef f(:\n    pass\n")
    with pytest.raises(LoadError) as info:
        load_flow(str(p))
    assert info.value.where.line == 3


def test_unused_role_is_reported(flow_file):
    p = flow_file(
        HEADER
        + """
    rollout = actor.generate(prompts, n=n)
    actor.update(rollout, advantages=fc.ops.group_normalize(reward(rollout), n))
"""
    )
    expect(SignatureError, p, "def f", what="role 'ref' is declared but never used")


def test_unknown_hyperparameter_override(flow_file):
    p = flow_file(
        HEADER
        + """
    rollout = actor.generate(prompts, n=n)
    ref.logprobs(rollout)
    actor.update(rollout, advantages=fc.ops.group_normalize(reward(rollout), n))
"""
    )
    fl = load_flow(str(p))
    with pytest.raises(SignatureError, match="no hyperparameter 'm'"):
        fl.trace(m=3)
    with pytest.raises(SignatureError, match="not a valid int"):
        fl.parse_overrides(["n=four"])
    assert fl.parse_overrides(["n=2"]) == {"n": 2}


def test_cli_prints_location_without_traceback(flow_file):
    p = flow_file(
        HEADER
        + """
    rollout = actor.generate(prompts, n=n)
    ref.update(rollout, advantages=reward(rollout))
"""
    )
    r = subprocess.run([sys.executable, "-m", "flowc.cli", "graph", str(p)], capture_output=True, text=True)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    assert f"{p}:{line_of(p, 'ref.update')}:" in r.stderr
    assert "fix:" in r.stderr


def test_reading_the_unfiltered_rollout_after_filter_groups(flow_file):
    from flowc.ir.verify import verify

    p = flow_file(
        HEADER
        + """
    rollout = actor.generate(prompts, n=n)
    kept, scores = fc.ops.filter_groups(rollout, reward(rollout), group_size=n)
    adv = fc.ops.group_normalize(scores, n)
    actor.update(rollout, advantages=adv, ref_logprobs=ref.logprobs(kept))
"""
    )
    with pytest.raises(FlowcError, match="filter_groups filters; use the filter's outputs"):
        verify(trace(p))


def test_filter_groups_needs_a_rollout(flow_file):
    p = flow_file(
        HEADER
        + """
    rollout = actor.generate(prompts, n=n)
    s = reward(rollout)
    kept, scores = fc.ops.filter_groups(s, s, group_size=n)
    actor.update(kept, advantages=scores, ref_logprobs=ref.logprobs(kept))
"""
    )
    expect(ValueUseError, p, "fc.ops.filter_groups(s, s", what="filter_groups: rollout must be a rollout")


def test_dpo_needs_preference_pairs(flow_file):
    from flowc.ir.verify import verify

    p = flow_file(
        HEADER
        + """
    rollout = actor.generate(prompts, n=n)
    actor.update(rollout, ref_logprobs=ref.logprobs(rollout), loss=fc.losses.dpo(0.1))
    reward(rollout)
"""
    )
    with pytest.raises(FlowcError, match=r"dpo\(\) trains on preference pairs"):
        verify(trace(p))


def test_dpo_without_reference_logprobs(flow_file):
    p = flow_file(
        """
@fc.flow
def f(pairs: fc.Preferences, actor: fc.Policy):
    actor.update(pairs, loss=fc.losses.dpo(0.1))
"""
    )
    expect(SignatureError, p, "actor.update(pairs", what="needs ref_logprobs=", fix="ref.logprobs(pairs)")
