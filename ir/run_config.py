"""RunConfig: how `flowc run` trains (what a user writes in a config file or
passes as options). Unknown keys are errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flowc.errors import SpecError
from flowc.ir.sampling import SamplingParams


class OptimConfig(BaseModel):
    """AdamW with a linear warm-up, per trained role.

    Attributes:
        lr: peak learning rate.
        warmup_steps: optimizer updates to reach ``lr`` linearly.
        weight_decay: AdamW's decoupled weight decay.
        betas: AdamW's betas.
        max_grad_norm: clip the global gradient norm (0 disables).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    lr: float = Field(1e-4, gt=0)
    warmup_steps: int = Field(0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = Field(1.0, ge=0)


class RunConfig(BaseModel):
    """Everything about a run that is not the algorithm, the models or the plan.

    Attributes:
        steps: iterations of the flow.
        seed: seeds data order, sampling and initialisation.
        optim: per role (``actor``, ``critic``, …); roles not listed use ``default_optim``.
        default_optim: the optimizer of any trained role not in ``optim``.
        sampling: default sampling parameters (a flow's own keywords win).
        eval_every: evaluate on the held-out split every this many steps (0: never).
        eval_size: held-out prompts per evaluation (None: the whole split).
        checkpoint_every: save a checkpoint every this many steps (0: only at the end).
        keep_checkpoints: how many checkpoints to keep.
        dtype, timeout_s, cpus_per_worker: compiled into the plan's target (a saved plan
            keeps its own). dtype: parameter dtype of training and generation (``auto``: float32 on
            CPU, bfloat16 on GPU).
        timeout_s: the longest any remote call may take before the run fails.
        cpus_per_worker: CPUs each worker reserves (CPU clusters).
        reward_timeout_s: the longest one call of a reward function may take (it runs in a
            process of its own, killed when it overruns; the run then fails naming the step).
        init: ``pretrained`` (the default): every model's weights come from its checkpoint (a
            directory or a Hugging Face hub id). ``random``: train from random weights of the
            model's architecture (its config and tokenizer; a catalogue name gets the built-in
            tokenizer) — never a fallback, only when asked for.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    steps: int = Field(100, ge=1)
    seed: int = 0
    optim: dict[str, OptimConfig] = {}
    default_optim: OptimConfig = OptimConfig()
    sampling: SamplingParams = SamplingParams()
    eval_every: int = Field(10, ge=0)
    eval_size: int | None = Field(None, ge=1)
    checkpoint_every: int = Field(25, ge=0)
    keep_checkpoints: int = Field(2, ge=1)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    timeout_s: float = Field(600.0, gt=0)
    cpus_per_worker: float = Field(1.0, gt=0)
    reward_timeout_s: float = Field(120.0, gt=0)
    init: Literal["pretrained", "random"] = "pretrained"

    def optim_for(self, role: str) -> OptimConfig:
        return self.optim.get(role, self.default_optim)

    @classmethod
    def load(cls, path: str | Path) -> tuple[RunConfig, dict[str, Any]]:
        """A YAML config file: RunConfig fields, plus the keys `flowc run`
        takes as options (model, data, reward, cluster, device, workload,
        rollout, out, plan) returned separately."""
        p = Path(path)
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise SpecError(f"cannot read config {p}: {e}") from e
        front = {
            k: data.pop(k)
            for k in (
                "model",
                "data",
                "eval_data",
                "reward",
                "cluster",
                "device",
                "workload",
                "rollout",
                "out",
                "plan",
                "hyperparams",
            )
            if k in data
        }
        try:
            return cls.model_validate(data), front
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"])
            raise SpecError(f"config {p}: {loc}: {err['msg']}", fix=f"fields: {', '.join(cls.model_fields)}") from e
