"""RunConfig: how `flowc run` trains (what a user writes in a config file or
passes as options). Unknown keys are errors."""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from flowc.errors import SpecError
from flowc.ir.lora import LoraConfig
from flowc.ir.sampling import SamplingParams
from flowc.ir.workload import WorkloadSpec


class OptimConfig(BaseModel):
    """AdamW with a learning-rate schedule, per trained role (field names as verl's and TRL's).

    The schedule counts optimizer updates, not steps: a step makes ``epochs × mini_batches``
    updates per ``update`` of the role in the flow, so a run of ``steps`` steps makes
    ``steps × epochs × mini_batches × updates-per-step`` of them (the runtime derives this
    total from the program; ``total_updates`` pins it, e.g. to decay over a longer run
    that is stopped early and resumed).

    Attributes:
        lr: peak learning rate.
        lr_scheduler: ``constant`` (after the warm-up), ``linear`` (decays linearly from
            ``lr`` to ``min_lr_ratio × lr`` at the last update) or ``cosine`` (half a cosine
            from ``lr`` to ``min_lr_ratio × lr``).
        warmup_steps: optimizer updates to reach ``lr`` linearly (from ``lr / warmup_steps``).
        warmup_ratio: the warm-up as a fraction of all updates (used when ``warmup_steps`` is 0).
        min_lr_ratio: where ``linear`` and ``cosine`` end, as a fraction of ``lr``.
        total_updates: the updates the decay spans (None: derived from the run, see above).
        weight_decay: AdamW's decoupled weight decay.
        betas: AdamW's betas.
        max_grad_norm: clip the global gradient norm (0 disables).
        lora: LoRA adapters to train instead of every weight (``rank`` 0, the default: off;
            e.g. ``optim.actor.lora.rank=8``); see :class:`flowc.ir.lora.LoraConfig`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    lr: float = Field(1e-4, gt=0)
    lr_scheduler: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    warmup_ratio: float = Field(0.0, ge=0, lt=1)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    total_updates: int | None = Field(None, ge=1)
    weight_decay: float = Field(0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = Field(1.0, ge=0)
    lora: LoraConfig = LoraConfig()

    def lr_at(self, update: int, total: int) -> float:
        """The learning rate of optimizer update ``update`` (0-based) of ``total`` (``total_updates``
        wins when set): a linear warm-up over the first updates, then the schedule."""
        total = max(self.total_updates or total, 1)
        warm = self.warmup_steps or int(self.warmup_ratio * total)
        if warm and update < warm:
            return self.lr * (update + 1) / warm
        if self.lr_scheduler == "constant":
            return self.lr
        # progress 0 at the first update after the warm-up, 1 at the last update
        progress = min(max(update - warm, 0) / max(total - warm - 1, 1), 1.0)
        if self.lr_scheduler == "linear":
            factor = 1.0 - progress
        else:
            factor = 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * factor)


# the largest staleness (weight versions of lag) a flow, a run or a pin may ask for
MAX_STALENESS = 16


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
        reward_workers: reward processes that share each call's responses (contiguous shares,
            scored at once: a judge or sandbox that answers per sample runs this many at a time).
        env_workers: environment processes beside each rollout replica (``generate(env=…)``);
            each trajectory's environment lives in one of them, and they answer concurrently.
        env_timeout_s: the longest one ``reset`` or ``step`` of an environment may take; past it
            the process is killed and the trajectory ends with ``env_error_reward``.
        env_error_reward: the reward of a trajectory whose environment raised or timed out.
        executor: where the workers run. ``ray``: each in a Ray actor of its own. ``inline``: a
            plan of one local worker runs in the run's own process, its rewards in a plain child
            process (no Ray processes, no object store; a worker crash ends the run). ``auto``
            (the default): inline for a CPU plan of one worker on this machine, else Ray.
        init: ``pretrained`` (the default): every model's weights come from its checkpoint (a
            directory or a Hugging Face hub id). ``random``: train from random weights of the
            model's architecture (its config and tokenizer; a catalogue name gets the built-in
            tokenizer) — never a fallback, only when asked for.
        report_to: the experiment trackers the metrics go to besides ``metrics.jsonl``:
            ``tensorboard``, ``wandb`` (offline, under the run folder) and ``mlflow`` (a local file
            store under the run folder); ``[]`` for none. See docs/configuration.md.
        sync_check: after every weight sync, check that the generation engine runs the trained
            weights: both score a fixed probe, and a mean log-probability difference per token above
            ``sync_check_tol`` (None: 1e-3 in float32, 0.1 in bfloat16) fails the run
            (``runtime.sync_check``).
        staleness: how many weight versions the rollouts may lag the trainer (0: lock-step, the
            default — unless the flow declares ``@fc.flow(max_staleness=K)``: then, when the run does
            not set it, the planner chooses it in ``0 … K``, and a larger value is refused). With K ≥ 1 the generation engine samples step s+K's rollouts while the
            trainer trains step s (one-step-off at K = 1): its samples come from weights up to K
            updates old, so every policy loss must carry an off-policy correction
            (``fc.losses.decoupled_ppo`` or ``correction=fc.losses.tis(…)``). ``"auto"``: the
            planner chooses it with the placement (lock-step for a loss without a correction).
            See docs/async.md.
        replan_every: every this many steps, compare the mean response length measured over
            them with the plan's; past ``replan_drift`` (a relative difference) plan again at the
            measured length: the staleness is switched in place when the planner chooses it, a
            better placement is written to ``replans/`` and said (0: never, the default;
            ``flowc.replan``).
        replan_drift: how far the measured mean response length may drift from the plan's
            before a re-plan (0.25: 25 %).
        skip_idle_rows: an update whose loss adds nothing for a row with zero advantages (a policy
            loss without an entropy bonus or a KL term: ``ir.losses.idle_without_advantage``) does
            not compute those rows — a GRPO group whose rewards are all equal — and gets the same
            gradient (the metric ``idle_rows`` is their share; entropy, clip fraction and the
            rollout/trainer mismatch are then over the rows computed). False: compute every row.
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
    reward_workers: int = Field(1, ge=1)
    env_workers: int = Field(2, ge=1)
    env_timeout_s: float = Field(30.0, gt=0)
    env_error_reward: float = 0.0
    executor: Literal["auto", "ray", "inline"] = "auto"
    init: Literal["pretrained", "random"] = "pretrained"
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] = ["tensorboard"]
    sync_check: bool = True
    sync_check_tol: float | None = Field(None, gt=0)
    staleness: Annotated[int, Field(ge=0, le=MAX_STALENESS)] | Literal["auto"] = 0
    replan_every: int = Field(0, ge=0)
    replan_drift: float = Field(0.25, gt=0)
    skip_idle_rows: bool = True

    def optim_for(self, role: str) -> OptimConfig:
        return self.optim.get(role, self.default_optim)

    @classmethod
    def load(cls, path: str | Path | None, sets: Sequence[str] = ()) -> tuple[RunConfig, dict[str, Any]]:
        """A YAML config file (None: none) with the ``--set KEY=VALUE`` overrides ``sets`` on top:
        RunConfig fields, plus the keys `flowc run` takes as options (model, data, reward,
        cluster, device, workload, rollout, out, plan, hyperparams) returned separately."""
        data: dict[str, Any] = {}
        where = "--set"
        if path is not None:
            p = Path(path)
            where = f"config {p}"
            try:
                data = yaml.safe_load(p.read_text()) or {}
            except (OSError, yaml.YAMLError) as e:
                raise SpecError(f"cannot read config {p}: {e}") from e
            if not isinstance(data, dict):
                raise SpecError(
                    f"config {p} is not a mapping of settings", fix="write `key: value` lines (see docs/configuration.md)"
                )
        front = {k: data.pop(k) for k in FRONT_KEYS if k in data}
        for word in sets:
            apply_set(data, front, word)
        try:
            return cls.model_validate(data), front
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"])
            raise SpecError(f"{where}: {loc}: {err['msg']}", fix=f"settings: {', '.join(setting_keys())}") from e


# The keys of a config file that are `flowc run` options rather than RunConfig fields.
FRONT_KEYS: dict[str, str] = {
    "model": "ROLE=MODEL per role (model.actor=Qwen/Qwen2.5-0.5B)",
    "data": "the prompts file",
    "eval_data": "the held-out prompts file",
    "reward": "ROLE=module:function per Reward role",
    "env": "ROLE=module:Class per Environment role",
    "cluster": "local, local:N or a Ray address",
    "device": "the GPU type of a Ray cluster",
    "workload": "k=v,… (workload.prompts=64)",
    "rollout": "vllm or hf",
    "out": "the run directory",
    "plan": "a saved plan.json",
    "hyperparams": "the flow's keywords (hyperparams.n=4)",
}
# front-end keys that are maps: one dotted level below them names an entry
_FRONT_MAPS = ("model", "reward", "env", "hyperparams", "workload")


def setting_keys() -> list[str]:
    """Every top-level key a config file or ``--set`` takes."""
    return [*RunConfig.model_fields, *FRONT_KEYS]


def parse_set(word: str) -> tuple[list[str], Any]:
    """``a.b.c=VALUE`` → (["a", "b", "c"], VALUE parsed as a YAML scalar: 5 → int, 1e-5 → float,
    true → bool, [a, b] → list, anything else a string)."""
    key, eq, text = word.partition("=")
    path = [k.strip() for k in key.split(".")]
    if not eq or not all(path):
        raise SpecError(f"--set {word!r} is not KEY=VALUE", fix="e.g. --set optim.actor.lr=1e-5 --set workload.prompts=64")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    if isinstance(value, str):
        try:  # YAML 1.1 reads 1e-5 (no dot) as a string
            value = float(value) if _FLOAT.fullmatch(value.strip()) else value
        except ValueError:
            pass
    return path, value


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def apply_set(data: dict[str, Any], front: dict[str, Any], word: str) -> None:
    """Apply one ``--set`` to a config's RunConfig fields ``data`` or its front-end keys ``front``,
    checking the key against the model (the valid keys, and the closest, listed when wrong)."""
    path, value = parse_set(word)
    top = path[0]
    if top in FRONT_KEYS:
        if top not in _FRONT_MAPS:
            if len(path) > 1:
                raise SpecError(f"--set {word!r}: {top} is a single value", fix=f"--set {top}=VALUE ({FRONT_KEYS[top]})")
            front[top] = value
            return
        if len(path) != 2:
            raise SpecError(f"--set {word!r}: {top} takes one key below it", fix=f"--set {top}.KEY=VALUE ({FRONT_KEYS[top]})")
        if top == "workload":
            _set_workload(front, path[1], value, word)
        else:
            current = front.get(top) or {}
            front[top] = {**current, path[1]: value if top == "hyperparams" else str(value)}
        return
    node: Any = data
    model: Any = RunConfig
    for i, k in enumerate(path):
        here = ".".join(path[:i]) or "the config"
        if model is None:
            raise SpecError(
                f"--set {word!r}: {'.'.join(path[:i])} is a single value, it has no {k!r}",
                fix=f"--set {'.'.join(path[:i])}=VALUE",
            )
        if isinstance(model, type) and issubclass(model, BaseModel):
            keys = list(model.model_fields) + (list(FRONT_KEYS) if model is RunConfig else [])
            if k not in model.model_fields:
                raise SpecError(
                    f"--set {word!r}: {here} has no setting {k!r}{_close(k, keys)}", fix=f"valid keys: {', '.join(keys)}"
                )
            model = _inner(model.model_fields[k].annotation)
        elif model == "map":  # optim.<role>
            model = OptimConfig
        if i == len(path) - 1:
            node[k] = value
        else:
            nxt = node.get(k)
            if not isinstance(nxt, dict):
                nxt = {}
                node[k] = nxt
            node = nxt


def _inner(annotation: Any) -> Any:
    """What a field holds, for walking a dotted key: a model, ``"map"`` (a dict of models keyed by
    role) or None (a value)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) is dict:
        return "map"
    return None


def _set_workload(front: dict[str, Any], key: str, value: Any, word: str) -> None:
    if key not in WorkloadSpec.model_fields:
        keys = list(WorkloadSpec.model_fields)
        raise SpecError(
            f"--set {word!r}: the workload has no {key!r}{_close(key, keys)}", fix=f"workload keys: {', '.join(keys)}"
        )
    items = [w for w in str(front.get("workload") or "").replace(" ", ",").split(",") if w and not w.startswith(f"{key}=")]
    front["workload"] = ",".join([*items, f"{key}={value}"])


def _close(word: str, options: list[str]) -> str:
    near = difflib.get_close_matches(word, options, n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""
