"""What a run's program and config must satisfy before and between steps, and the sampling a
generate step uses: checks the controller runs (a response limit the plan did not price, an
off-policy correction over processed log-probabilities, an environment that ended every
trajectory), each a loud error with the fix."""

from __future__ import annotations

from typing import Any

from flowc.errors import DataError, SpecError
from flowc.ir.ops import Op
from flowc.ir.run_config import RunConfig
from flowc.ir.sampling import SamplingParams
from flowc.runtime.program import Program, Step


def check_environments(m: dict[str, Any], step: int) -> None:
    """A step whose every trajectory its environment ended (an error, a timeout, or the process of
    one) trains on nothing but error rewards: that is a broken environment, not bad luck — stop."""
    n = m.get("agent/trajectories", 0)
    failed = m.get("agent/env_errors", 0) + m.get("agent/env_timeouts", 0) + m.get("agent/env_lost", 0)
    if n and failed >= n:
        first = "; ".join(m.get("agent/errors") or []) or "no message"
        raise DataError(
            f"step {step + 1}: the environment ended all {int(n)} trajectories before they finished ({first})",
            fix="fix the environment class (its protocol: docs/agents.md), or raise env_timeout_s if it is only slow",
        )


def check_response_lengths(p: Program, cfg: RunConfig) -> None:
    """No generate asks for longer responses than the plan priced (its workload's response_len)."""
    limit = p.workload.response_len
    asked = [("the run config's sampling.max_tokens", cfg.sampling.max_tokens)]
    asked += [(f"{st.node}(max_tokens=…)", st.args.get("max_tokens")) for st in p.steps if st.op == Op.GENERATE]
    for where, n in asked:
        if n and int(n) > limit:
            raise SpecError(
                f"{where} asks for responses of {int(n)} tokens, but the plan was made for response_len={limit}",
                fix=f"plan for them: --workload response_len={int(n)} (or lower max_tokens)",
            )


def sampling_of(st: Step, cfg: RunConfig) -> SamplingParams:
    """A generate step's sampling: the run config's, with the flow's own keywords on top."""
    own = {k: v for k, v in st.args.items() if k in SamplingParams.model_fields}
    if "temperature" in own and "greedy" not in own:  # the flow's temperature decides (0 is greedy)
        own["greedy"] = own["temperature"] == 0.0
    return SamplingParams.model_validate({**cfg.sampling.model_dump(exclude_unset=True), **own})


def behaviour_comparable(p: Program, cfg: RunConfig) -> bool:
    """Whether the rollouts' log-probabilities compare with the trainer's (every generate samples
    plainly, see ``SamplingParams.plain``); refuses an off-policy correction when they do not."""
    plain = all(sampling_of(st, cfg).plain for st in p.steps if st.op == Op.GENERATE)
    if plain:
        return True
    for st in p.steps_of(Op.UPDATE):
        loss = p.graph[st.node].kwargs.get("loss")
        if getattr(loss, "correction", None) is not None:
            raise SpecError(
                f"{st.node}(loss={loss}) weighs the rollout engine's log-probabilities against the trainer's, but the"
                " rollout samples with temperature ≠ 1 or top-k/top-p/min-p: the engine's log-probabilities are of that"
                " processed distribution, which the trainer does not compute",
                fix="sample at temperature 1 with top_p=1, top_k=-1, min_p=0 (sampling.* in the run config), or drop the correction",
            )
    return False
