"""runtime.ahead.RolloutBuffer: what is issued ahead, and the lag each step's rollouts may have."""

from __future__ import annotations

import pytest

from flowc.errors import RuntimeFailure
from flowc.runtime.ahead import RolloutBuffer


def test_the_buffer_holds_at_most_k_steps_and_a_lowered_k_still_bounds_what_was_issued_under_it():
    buf: RolloutBuffer[str] = RolloutBuffer()
    issued: list[int] = []

    def issue(s: int) -> str:
        issued.append(s)
        return f"rollouts {s}"

    buf.fill(0, 0, 10, issue)
    assert not buf.ran_ahead and buf.waiting == {}  # lock-step issues nothing ahead
    buf.fill(0, 2, 10, issue)
    buf.fill(1, 2, 10, issue)
    assert (issued == [1, 2, 3] and sorted(buf.waiting) == [2, 3]) or sorted(buf.waiting) == [1, 2, 3]
    assert buf.take(1) == "rollouts 1" and buf.take(1) is None
    assert buf.lag(3, 0, 1, "actor.generate", 1) == 2  # issued under K=2: a lag of 2 holds after K drops to 0
    buf.trained(3)
    with pytest.raises(RuntimeFailure, match=r"2 version\(s\) behind the trainer; staleness=0 allows 0\n"):
        buf.lag(3, 0, 1, "actor.generate", 1)  # nothing was issued ahead for it any more: lock-step
    with pytest.raises(RuntimeFailure, match="staleness=2 allows 0 to 2"):
        buf.lag(5, 2, 2, "actor.generate", 2)
    assert buf.ran_ahead
