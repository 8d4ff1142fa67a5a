"""WorkloadSpec: how much work one iteration does.

The flow fixes the algorithm (and the samples per prompt: ``generate(n=…)``,
changed with a hyperparameter override such as ``n=16``); the workload fixes
the sizes. Given on the command line as ``--workload prompts=1024,
prompt_len=512,response_len=1024`` or in a config file.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from flowc.errors import SpecError


class WorkloadSpec(BaseModel):
    """Sizes of one iteration. Unknown keys are errors.

    Attributes:
        prompts: prompts per step (the symbol ``B``).
        prompt_len: prompt tokens (``P``; prompts are padded to it).
        response_len: response token limit (``R``).
        mean_response_len: expected response length, for the cost model
            (defaults to ``response_len``: every response runs to the limit).
        mini_batches: optimizer updates per step per epoch (PPO mini-batches).
        epochs: passes over the rollout per step.
        train_micro_batch: sequences per device per micro-step of training
            (None: the planner picks the largest that fits).
        forward_micro_batch: sequences per device per forward micro-step
            (None: the planner picks).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    prompts: int = Field(1024, ge=1)
    prompt_len: int = Field(1024, ge=1)
    response_len: int = Field(1024, ge=1)
    mean_response_len: float | None = Field(None, gt=0)
    mini_batches: int = Field(1, ge=1)
    epochs: int = Field(1, ge=1)
    train_micro_batch: int | None = Field(None, ge=1)
    forward_micro_batch: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check(self) -> WorkloadSpec:
        if self.mean_response_len is not None and self.mean_response_len > self.response_len:
            raise ValueError(f"mean_response_len {self.mean_response_len} exceeds response_len {self.response_len}")
        return self

    @property
    def avg_response_len(self) -> float:
        return self.mean_response_len or float(self.response_len)

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
            loc = ".".join(str(x) for x in err["loc"]) or "workload"
            fields = ", ".join(cls.model_fields)
            raise SpecError(f"workload {loc}: {err['msg']}", fix=f"workload fields: {fields}") from e
