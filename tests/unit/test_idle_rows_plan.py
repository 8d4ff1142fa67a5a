"""The planner prices an update that leaves out its idle rows (``WorkloadSpec.idle_rows``: the share
of rows whose advantages are all zero), only where the update's loss lets them idle, says so in
``why``, keeps them in the throughput (the batch is trained on) and takes the share a run measured
(``lengths_from``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import EXAMPLES, ROOT

from flowc.ir.plan_text import format_plan
from flowc.lengths import LAST_STEPS, expand
from flowc.loader import load_flow
from flowc.passes.pipeline import make_plan
from flowc.planning import build_request

NOREF = ROOT / "bench" / "grpo_vs_trl" / "grpo_noref.py"  # GRPO without KL or entropy: idle rows add nothing
WORDS = "prompts=256,response_len=2048,mean_response_len=800"


def _plan(flow: Path, words: str, roles: tuple[str, ...] = ("actor",)):
    g = load_flow(str(flow)).trace()
    req = build_request(
        g, model_words=[f"{r}=qwen2.5-7b" for r in roles], cluster="8xH100", workload=words, pin_words=None, plan_file=None
    )
    return make_plan(g, req.models, req.cluster, req.workload, req.pins, target=req.target)[0]


def test_an_update_that_skips_idle_rows_is_priced_for_the_rows_it_computes():
    full, half = _plan(NOREF, WORDS), _plan(NOREF, WORDS + ",idle_rows=0.5")
    upd = {k: p.roles["actor"].phases["train"].time_s for k, p in (("full", full), ("half", half))}
    assert upd["half"] == pytest.approx(upd["full"] / 2, rel=0.15)  # half the rows, about half the time
    assert half.predicted.step_time_s < full.predicted.step_time_s
    # the same batch is trained on, faster: its tokens per second grow as the step shrinks
    assert half.predicted.tokens_per_s == pytest.approx(
        full.predicted.tokens_per_s * full.predicted.step_time_s / half.predicted.step_time_s, rel=1e-3
    )
    text = format_plan(half)
    assert "50 % of rows with zero advantages" in text
    assert "actor.update: computes 1024 of its 2048 rows" in text and "skip_idle_rows" in text


def test_an_update_with_a_kl_term_computes_every_row():
    """GRPO with the KL to the reference in its loss: every row adds to it, none is left out."""
    words = WORDS.replace("256", "64")
    full, idle = (
        _plan(EXAMPLES / "grpo.py", words, ("actor", "ref")),
        _plan(EXAMPLES / "grpo.py", words + ",idle_rows=0.5", ("actor", "ref")),
    )
    assert idle.predicted.step_time_s == pytest.approx(full.predicted.step_time_s, rel=1e-9)
    assert "rows — the rest have advantages all zero" not in format_plan(idle)


def test_lengths_from_takes_the_share_a_run_left_out(tmp_path):
    run = tmp_path / "measured"
    run.mkdir()
    (run / "plan.json").write_text(json.dumps({"workload": {"prompts": 8, "response_len": 24}}))
    rows = [
        {"step": i + 1, "step_s": 1.0, "response_length/mean": 6.0, "actor/idle_rows": x}
        for i, x in enumerate([0.9] * 5 + [0.25, 0.5, 0.75] * 4)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    words, (note,) = expand(f"prompts=8,response_len=24,lengths_from={run}")
    assert words.endswith(",idle_rows=0.5")  # the median of the last steps (the early 0.9 are past them)
    assert len(rows[-LAST_STEPS:]) == LAST_STEPS and "50% of update rows with zero advantages" in note
    with pytest.raises(Exception, match="both idle_rows and lengths_from"):
        expand(f"response_len=24,idle_rows=0.1,lengths_from={run}")
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({k: v for k, v in r.items() if k != "actor/idle_rows"}) + "\n" for r in rows)
    )
    assert "idle_rows" not in expand(f"prompts=8,response_len=24,lengths_from={run}")[0]  # a run that computed every row
