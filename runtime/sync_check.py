"""Checked weight sync: after every sync the generation engine must run the weights it was sent.

Silent stale or base-model rollouts are the most reported weight-sync bug in RL frameworks (a
weight name the engine does not map, a fused q/k/v or gate/up shard loaded into the wrong
slice, a LoRA merge that never reaches the engine): training goes on, on samples from the
wrong policy. So each sync ends with a probe: the trainer and the engine score the same fixed
sequence, teacher-forced, in the calls that move the weights (no extra round trip), and the
controller compares the two: their mean absolute log-probability difference per token must be
within the tolerance of the run's dtype (float32: 1e-3 — measured ≤ 1e-5 between the trainer and
vLLM's CPU build; bfloat16: 0.1, a prior until a GPU measures it). A stale engine differs by
what the trainer learnt since its last sync, so it fails as soon as that exceeds the tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from flowc.errors import RuntimeFailure
from flowc.ir.functional import Rollout

PROBE_TEXT = "Weight sync probe. Question: what is 17 + 25? Answer: 17 + 25 = 42, so the answer is 42."
PROBE_PROMPT_TOKENS = 12  # the rest of the probe's tokens are its "response", scored teacher-forced
TOLERANCE = {"float32": 1e-3, "bfloat16": 0.1, "float16": 0.1}


def probe_rollout(tok: Any, max_len: int) -> Rollout:
    """The fixed probe as a one-row rollout: the first tokens of :data:`PROBE_TEXT` as the prompt,
    the rest as the response (real tokens of the policy's tokenizer), at most ``max_len`` tokens in
    all (the rollout engine's context: vLLM refuses a longer sequence)."""
    if max_len < 2:
        raise ValueError(f"the weight sync probe needs a context of 2 tokens or more, got {max_len}")
    ids = tok(PROBE_TEXT, add_special_tokens=False)["input_ids"][:max_len]
    p = min(PROBE_PROMPT_TOKENS, max(1, len(ids) // 2))
    prompt, response = torch.tensor([ids[:p]]), torch.tensor([ids[p:]])
    return Rollout(
        prompt,
        torch.ones_like(prompt, dtype=torch.bool),
        response,
        torch.ones_like(response, dtype=torch.bool),
        torch.zeros(response.shape),
    )


def tolerance(dtype: str, asked: float | None) -> float:
    """The largest mean |Δ log-probability| per probe token a sync may show: ``asked`` or the dtype's."""
    return float(asked) if asked is not None else TOLERANCE.get(dtype, TOLERANCE["bfloat16"])


def first(metas: list[dict[str, Any]], key: str) -> list[float] | None:
    """The first rank's ``key`` among a sync's results (the ranks that computed it agree)."""
    return next((m[key] for m in metas if m.get(key) is not None), None)


@dataclass
class SyncCheck:
    """One trained role's sync checks over a run: compares each sync's probes and remembers them."""

    role: str
    tol: float
    dtype: str
    last: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def __call__(self, step: int, trainer: list[float] | None, engine: list[float] | None) -> float:
        """The mean |trainer − engine| per probe token after the sync of ``step`` (0-based);
        raises :class:`RuntimeFailure` when it exceeds the tolerance or a side did not answer."""
        if trainer is None or engine is None:
            side = "trainer" if trainer is None else "generation engine"
            raise RuntimeFailure(
                f"{self.role}: the weight sync of step {step + 1} returned no probe from the {side}",
                fix="this is a flowc bug (a sync path that skips the probe); report it, or set sync_check=false to run unchecked",
            )
        t, e = torch.tensor(trainer), torch.tensor(engine)
        diff = float((t - e).abs().mean())
        prev, self.last = self.last, (t, e)
        dt = de = None
        if prev is not None:
            dt, de = float((t - prev[0]).abs().mean()), float((e - prev[1]).abs().mean())
        # within the tolerance, unless the engine scored the probe bit for bit as before while the
        # trainer's moved clearly (a wide bfloat16 tolerance would let a stale engine pass for steps)
        stale = de == 0.0 and dt is not None and dt > max(self.tol / 10, 1e-4)
        if diff <= self.tol and not stale:
            return diff
        moved = ""
        if prev is not None:
            moved = f"; since the previous sync the trainer's moved by {dt:.3g} and the engine's by {de:.3g}"
            if de == 0.0:
                moved += " (the engine did not change: it kept its old weights)"
        raise RuntimeFailure(
            f"{self.role}: after the weight sync of step {step + 1} the generation engine does not run the trained"
            f" weights: on a fixed probe its log-probabilities differ from the trainer's by {diff:.3g} per token on"
            f" average (tolerance {self.tol:g} for {self.dtype}){moved}",
            fix="a weight the engine did not load or loaded into the wrong place (an unmapped name, a fused q/k/v or"
            " gate/up shard, a LoRA merge); if the difference is only the engine's numerics, raise sync_check_tol"
            " (--set sync_check_tol=…), or set sync_check=false to run unchecked",
        )
