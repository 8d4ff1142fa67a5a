"""WorkloadSpec: how much work one iteration does.

The flow fixes the algorithm (and the samples per prompt: ``generate(n=…)``,
changed with a hyperparameter override such as ``n=16``); the workload fixes
the sizes. Given on the command line as ``--workload prompts=1024,
prompt_len=512,response_len=1024`` or in a config file.
"""

from __future__ import annotations

import itertools
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from flowc.errors import SpecError

#: the shares of responses at or below each of ``response_percentiles``: min, p50, p90, p99, max
PERCENTILE_SHARES = (0.0, 0.5, 0.9, 0.99, 1.0)


def percentiles_mean(q: tuple[float, ...]) -> float:
    """The mean of the lengths whose quantile function runs linearly between the points
    ``(PERCENTILE_SHARES[i], q[i])`` (how the cost model reads ``response_percentiles``)."""
    pts = list(zip(PERCENTILE_SHARES, q, strict=True))
    return sum((u1 - u0) * (x0 + x1) / 2.0 for (u0, x0), (u1, x1) in itertools.pairwise(pts))


class WorkloadSpec(BaseModel):
    """Sizes of one iteration. Unknown keys are errors.

    Attributes:
        prompts: prompts per step (the symbol ``B``).
        prompt_len: prompt tokens (``P``; prompts are padded to it).
        response_len: response token limit (``R``).
        mean_response_len: expected response length, for the cost model
            (defaults to ``response_len``: every response runs to the limit).
        response_percentiles: measured response lengths ``min/p50/p90/p99/max`` (what
            ``lengths_from=RUN_DIR`` fills in from a run's metrics): generation is priced over
            this distribution (its long tail); None: an exponential with the mean whose last
            percent spreads up to the limit (``passes/response_lengths.py``).
        mean_response_cv: how much a step's mean response length varies from step to step, as a
            share of the mean (its standard deviation over the mean; what ``lengths_from=RUN_DIR``
            measures). A pipelined loop's period prices it, with the variation of each step's
            longest response, which the distribution gives (0: only that).
        idle_rows: the share of an update's rows whose advantages are all zero (a GRPO group whose
            rewards are all equal: all right or all wrong). An update whose loss adds nothing for
            them (``ir.losses.idle_without_advantage``) computes only the rest, and is priced so;
            what ``lengths_from=RUN_DIR`` measures (the metric ``ROLE/idle_rows``). At 1 the update
            runs one row (zero-weighted: the optimizer still steps), as the runtime does.
        mini_batches: optimizer updates per step per epoch (PPO mini-batches).
        epochs: passes over the rollout per step.
        train_micro_batch: sequences per device per micro-step of training
            (None: the planner picks the largest that fits).
        forward_micro_batch: sequences per device per forward micro-step
            (None: the planner picks).
        turns: multi-turn generates (``generate(env=…)``): the policy's mean turns per
            trajectory (None: the flow's ``max_turns``). ``response_len`` is then a trajectory's
            token budget after its prompt, ``mean_response_len`` the policy's tokens in it.
        obs_len: mean tokens of one environment observation (appended between turns).
        env_latency_s: mean seconds of one environment step (a tool call, a sandbox run).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    prompts: int = Field(1024, ge=1)
    prompt_len: int = Field(1024, ge=1)
    response_len: int = Field(1024, ge=1)
    mean_response_len: float | None = Field(None, gt=0)
    response_percentiles: tuple[float, float, float, float, float] | None = None
    mean_response_cv: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="how much a step's mean response length varies from step to step, as a share of the mean,"
        " from 0 to 1 (0.2: ±20 %); lengths_from=RUN_DIR measures it",
    )
    idle_rows: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="the share of an update's rows whose advantages are all zero (GRPO groups whose rewards are all"
        " equal), from 0 to 1; an update whose loss adds nothing for them skips them; lengths_from=RUN_DIR measures it",
    )
    mini_batches: int = Field(1, ge=1)
    epochs: int = Field(1, ge=1)
    train_micro_batch: int | None = Field(None, ge=1)
    forward_micro_batch: int | None = Field(None, ge=1)
    turns: float | None = Field(None, ge=1)
    obs_len: float = Field(0.0, ge=0)
    env_latency_s: float = Field(0.0, ge=0)

    @field_validator("response_percentiles", mode="before")
    @classmethod
    def _percentiles_from_text(cls, v: Any) -> Any:
        """``12/80/200/310/512`` (how ``--workload`` writes them) as a tuple."""
        if isinstance(v, str):
            return tuple(x for x in v.split("/") if x)
        return v

    @model_validator(mode="after")
    def _check(self) -> WorkloadSpec:
        if self.mean_response_len is not None and self.mean_response_len > self.response_len:
            raise ValueError(f"mean_response_len {self.mean_response_len} exceeds response_len {self.response_len}")
        q = self.response_percentiles
        if q is not None:
            if any(b < a for a, b in itertools.pairwise(q)) or q[0] < 1 or q[-1] > self.response_len:
                raise ValueError(
                    f"response_percentiles {'/'.join(f'{x:g}' for x in q)} must be min/p50/p90/p99/max, "
                    f"ascending, from 1 to response_len {self.response_len}"
                )
            if self.mean_response_len is not None and not q[0] <= self.mean_response_len <= q[-1]:
                raise ValueError(
                    f"mean_response_len {self.mean_response_len:g} lies outside response_percentiles' min {q[0]:g} and max {q[-1]:g}"
                )
        return self

    @property
    def avg_response_len(self) -> float:
        """The mean response length: ``mean_response_len``, else the mean of the
        ``response_percentiles`` distribution, else the limit."""
        if self.mean_response_len:
            return self.mean_response_len
        if self.response_percentiles:
            return percentiles_mean(self.response_percentiles)
        return float(self.response_len)

    def env(self, symbols: dict[str, int] | None = None) -> dict[str, int]:
        """Values of the shape symbols: B, P, R and the flow's sample counts."""
        return {"B": self.prompts, "P": self.prompt_len, "R": self.response_len, **(symbols or {})}

    @classmethod
    def parse(cls, text: str | None, base: WorkloadSpec | None = None) -> WorkloadSpec:
        """From ``k=v,k=v`` words (``prompts=1024,response_len=512``)."""
        data: dict[str, Any] = (base or cls()).model_dump(exclude_unset=True) if base else {}
        if text:
            for item in text.replace(" ", ",").split(","):
                if not item:
                    continue
                if "=" not in item:
                    raise SpecError(f"workload item {item!r} is not key=value", fix="write e.g. prompts=1024,response_len=512")
                k, v = item.split("=", 1)
                data[k.strip()] = v.strip()
        return cls.validate_dict(data)

    @classmethod
    def validate_dict(cls, data: dict[str, Any]) -> WorkloadSpec:
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"])
            fields = ", ".join(cls.model_fields)
            where = f"workload {loc}" if loc else "workload"
            field = cls.model_fields.get(loc)
            fix = f"{loc} is {field.description}" if field is not None and field.description else f"workload fields: {fields}"
            raise SpecError(f"{where}: {err['msg'].removeprefix('Value error, ')}", fix=fix) from e
