"""`flowc report` on a pipelined run: the staleness histogram, the importance-ratio statistics and
each pool's measured busy time against the plan's."""

from __future__ import annotations

import json

from flowc.report import draw, pipeline_summary, pool_figures, staleness_histogram


def _write(tmp_path, rows: list[dict]) -> None:
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _rows(lags: list[int]) -> list[dict]:
    rows = [{"event": "start"}]
    for s, lag in enumerate(lags):
        rows.append(
            {
                "step": s + 1,
                "step_s": 0.5 + 0.1 * s,
                "reward": 0.1 * s,
                "rollout/staleness": lag,
                "rollout/buffered": min(2, len(lags) - 1 - s),
                "actor/is_weight": 1.0 + 0.01 * s,
                "actor/is_cut_frac": 0.0 if s < 2 else 0.25,
                "actor/mismatch_kl": 1e-3 * s,
                "pool/actor.gen/busy_s": 0.2,
                "pool/actor.gen/busy_predicted_s": 0.25,
                "pool/actor.gen/idle_fraction": 0.6,
                "pool/actor.train/busy_s": 0.45,
                "pool/actor.train/busy_predicted_s": 0.3,
                "pool/actor.train/idle_fraction": 0.1,
            }
        )
    return rows


def test_the_histogram_counts_steps_by_lag_and_the_pools_average_per_step():
    rows = _rows([0, 1, 2, 2, 2])
    assert staleness_histogram(rows) == {0: 1, 1: 1, 2: 3}
    assert staleness_histogram([{"step_s": 1.0}, {"step_s": 1.0}]) == {0: 2}  # lock-step: every step 0 behind
    pools = pool_figures(rows[1:])
    assert pools["actor.gen"] == {"busy_s": 0.2, "busy_predicted_s": 0.25, "idle_fraction": 0.6}
    assert pools["actor.train"]["busy_s"] == 0.45


def test_report_prints_and_draws_the_pipeline(tmp_path):
    rows = _rows([0, 1, 2, 2])
    del rows[2]["pool/actor.gen/idle_fraction"]  # a figure missing is said so, not shown as 0
    _write(tmp_path, rows)
    text = pipeline_summary(tmp_path)
    assert "  0 behind: 1 step(s)\n  1 behind: 1 step(s)\n  2 behind: 2 step(s)" in text
    assert "rollout buffer: at most 2 step(s) issued ahead of the trainer" in text
    assert "actor/is_weight: 1.015" in text and "actor/is_cut_frac: 0.125" in text
    assert "actor.gen: 0.2 s / 0.25 s (0.80×), idle 60%" in text  # (the mean of the steps that report it)
    assert "actor.train: 0.45 s / 0.3 s (1.50×), idle 10%" in text
    png = draw(tmp_path)
    assert png.stat().st_size > 10_000
    import matplotlib.image as mpimg

    assert mpimg.imread(png).shape[0] == 1200  # three rows of panels at 100 dpi


def test_a_lock_step_run_has_no_summary_and_two_rows(tmp_path):
    lock = {k: v for k, v in _rows([0])[1].items() if not k.startswith("rollout/")}  # its pools, but no lag
    _write(tmp_path, [lock])
    assert pipeline_summary(tmp_path) == ""
    import matplotlib.image as mpimg

    assert mpimg.imread(draw(tmp_path)).shape[0] == 800


def test_report_prints_and_draws_an_agent_runs_turns_tool_use_and_errors(tmp_path):
    import matplotlib.image as mpimg

    from flowc.report import agent_summary

    rows = [{"step": 0, "eval/accuracy": 0.1, "eval/agent/turns": 1.1, "eval/agent/info/tool_calls": 0.1}]
    for s in range(1, 5):
        rows.append(
            {
                "step": s,
                "step_s": 0.5,
                "reward": 0.2 * s,
                "agent/trajectories": 8.0,
                "agent/turns": 1.0 + 0.25 * s,
                "agent/info/tool_calls": 0.25 * s,
                "agent/env_errors": 1.0 if s == 2 else 0.0,
                "agent/env_timeouts": 0.0,
                "agent/env_lost": 2.0 if s == 3 else 0.0,
                "agent/truncated": 0.125,
                "agent/seconds": 0.4,
                "agent/env_seconds": 0.1,
            }
        )
    rows.append({"step": 4, "eval/accuracy": 0.9, "eval/agent/turns": 2.0, "eval/agent/info/tool_calls": 1.0})
    _write(tmp_path, rows)
    text = agent_summary(tmp_path)
    assert "turns: 1.25 → 2" in text and "info/tool_calls: 0.25 → 1" in text
    assert "held out (0 → 4): accuracy 0.1 → 0.9" in text
    assert "1 errors, 0 timeouts, 2 lost of 32" in text and "busy 0.4 s (summed over processes) in 1.6 s" in text
    assert mpimg.imread(draw(tmp_path)).shape[0] == 1200  # a third row of plots
    _write(tmp_path, rows[1:2] and [{"step": 1, "reward": 0.0, "step_s": 0.1}])
    assert agent_summary(tmp_path) == ""
