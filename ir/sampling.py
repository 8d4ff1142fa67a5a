"""Sampling parameters of ``generate``.

A flow states only what the algorithm needs (``n``, ``greedy=True`` for a
baseline, a temperature); anything it leaves out comes from the run's
configuration, then from these defaults.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SamplingParams(BaseModel):
    """How ``generate`` samples. Unknown keys are errors.

    Attributes:
        temperature: softmax temperature; 0 means greedy.
        top_p: nucleus sampling mass (1.0 disables).
        top_k: keep the k most likely tokens (-1 disables).
        min_p: drop tokens below ``min_p`` × the top token's probability.
        greedy: take the most likely token (temperature and top-* ignored).
        max_tokens: response length limit; ``None`` takes the workload's ``R``.
        stop: strings that end a response (besides EOS).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, lt=1.0)
    greedy: bool = False
    max_tokens: int | None = Field(None, ge=1)
    stop: tuple[str, ...] = ()

    @property
    def plain(self) -> bool:
        """The sampler's log-probabilities are the model's own (temperature 1, nothing truncated; or
        greedy), so they compare with a trainer's: what an off-policy correction needs."""
        return self.greedy or (self.temperature == 1.0 and self.top_p == 1.0 and self.top_k <= 0 and self.min_p == 0.0)

    @model_validator(mode="before")
    @classmethod
    def _zero_temperature_is_greedy(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("temperature") == 0.0 and not data.get("greedy"):
            return {**data, "greedy": True}
        return data


SAMPLING_KEYS: tuple[str, ...] = tuple(SamplingParams.model_fields)
