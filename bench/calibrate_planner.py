"""Calibrate the planner's efficiency factors and check it against published runs.

    python bench/calibrate_planner.py            # prints the table for docs/planner.md
    python bench/calibrate_planner.py --fit      # also refits the training efficiency (prints it)
    python bench/calibrate_planner.py --phases   # only the per-phase table (verl's published phases)

Every published figure comes from ../shared/reference/README.md. Where a
publication leaves a setting out (batch size, layouts), the assumption is
stated in the table; a figure used to fit a factor is marked "fit", the others
are held out.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import flowc as fc
from flowc.errors import FlowcError
from flowc.ir import hardware
from flowc.ir.cluster import ClusterSpec
from flowc.ir.models import ModelSpec
from flowc.ir.plan import Layout
from flowc.ir.workload import WorkloadSpec
from flowc.loader import load_flow
from flowc.passes.costs import Hw
from flowc.passes.pins import parse_pins
from flowc.passes.pipeline import make_plan
from flowc.passes.reshard import colocated_options, separate_options

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@dataclass
class Row:
    what: str
    published: float
    predicted: float
    unit: str
    assumptions: str
    use: str = "held out"

    @property
    def error(self) -> float:
        return (self.predicted - self.published) / self.published


def _set_train(value: float) -> None:
    """Use ``value`` as the training efficiency of every GPU profile (this process only)."""
    profs = hardware.profiles()
    for name, p in list(profs.items()):
        if p.kind == "gpu":
            # forward-only passes run the training pass's kernels: the GPU profiles set forward = train
            update = {"train": value, "forward": value}
            profs[name] = p.model_copy(update={"efficiency": p.efficiency.model_copy(update=update)})


def qwen3_moe_mfu(gpus: int) -> float:
    g = load_flow(str(EXAMPLES / "grpo.py")).trace(n=8)
    m = ModelSpec.resolve("qwen3-30b-a3b")
    w = WorkloadSpec(prompts=256, prompt_len=1024, response_len=2048, mean_response_len=1024, mini_batches=4)
    pins = parse_pins(["actor.train.backend=megatron", "actor.train.tp=1", "actor.train.pp=1", "actor.train.ep=8"])
    plan, _, _ = make_plan(g, {"actor": m, "ref": m}, ClusterSpec.parse(f"{gpus // 8}x8xH100"), w, pins)
    return plan.roles["actor"].phases["train"].mfu


QWEN3_ASSUMED = "GRPO n=8, 256 prompts, prompt 1024, response ≤ 2048 (mean 1024), 4 updates/step, H100, Megatron tp1 pp1 ep8"


FIT_GPUS, FIT_TARGET = 32, 0.31  # the published point where the optimizer fits without offload


def fit_train() -> float:
    """Bisect the training efficiency until the predicted MFU at FIT_GPUS is FIT_TARGET."""
    lo, hi = 0.2, 1.0
    for _ in range(20):
        mid = (lo + hi) / 2
        _set_train(mid)
        if qwen3_moe_mfu(FIT_GPUS) < FIT_TARGET:
            lo = mid
        else:
            hi = mid
    return round((lo + hi) / 2, 3)


def deepseek_671b() -> tuple[float, float, float]:
    """verl's DeepSeek-671B GRPO benchmark (docs/perf/dpsk.md) with its published layout pinned."""
    g = load_flow(str(EXAMPLES / "grpo.py")).trace(n=8)
    m = ModelSpec.resolve("deepseek-v3")
    w = WorkloadSpec(prompts=96, prompt_len=2048, response_len=8192, mean_response_len=1960, mini_batches=3)
    pins = parse_pins(
        [
            "actor.train.backend=megatron",
            "actor.train.tp=8",
            "actor.train.pp=12",
            "actor.train.ep=8",
            "actor.generate.tp=32",
            "colocate=actor.train,actor.gen,ref",
        ]
    )
    plan, _, _ = make_plan(g, {"actor": m, "ref": m}, ClusterSpec.parse("12x8xH20"), w, pins)
    gen = sum(e.end_s - e.start_s for e in plan.schedule if e.phase == "generate")
    return plan.predicted.step_time_s, gen, plan.roles["actor"].phases["train"].mfu


DS_ASSUMED = (
    "verl docs/perf/dpsk.md and its script run_deepseek671b_math_megatron_96gb.sh: GRPO n=8, 96 prompts, prompt ≤ 2048, "
    "response ≤ 8192 (the script's 1204*8 read as 1024*8; mean 1960), 3 updates/step, 12×8 H20, "
    "megatron tp8 pp12 ep8 and vllm tp32 pinned, co-located"
)


def hybridflow_70b() -> tuple[float, float, float, float]:
    m = ModelSpec.resolve("llama-3.1-70b")
    cluster = ClusterSpec(device="A100-80GB", nodes=16, devices_per_node=8, inter_node_gb_s=25)
    hw = Hw.of(cluster)
    train = Layout(dp=4, tp=8, pp=4, backend="megatron")
    gen = Layout(dp=16, tp=8, backend="vllm")
    co = {o.method: o for o in colocated_options(m, train, gen, hw)}
    half_train = Layout(dp=2, tp=8, pp=4, backend="megatron")
    half_gen = Layout(dp=8, tp=8, backend="vllm")
    sep = {o.method: o for o in separate_options(m, half_train, half_gen, hw, same_node=False)}
    return (
        co["micro_dp_allgather"].time,
        co["micro_dp_allgather"].bytes_per_device,
        sep["broadcast"].time,
        co["full_allgather"].time,
    )


def checkpoint_engine() -> float:
    m = ModelSpec.resolve("qwen3-30b-a3b")
    cluster = ClusterSpec(device="H100-80GB", nodes=4, devices_per_node=8, inter_node_gb_s=50)
    hw = Hw.of(cluster)
    train = Layout(dp=2, tp=1, ep=8, backend="megatron")
    gen = Layout(dp=4, tp=4, backend="vllm")
    return min(o.time for o in separate_options(m, train, gen, hw, same_node=False))


def rows(fitted: float) -> list[Row]:
    _set_train(fitted)
    out = [
        Row("Qwen3-30B-A3B actor MFU, 8 GPUs", 0.40, qwen3_moe_mfu(8), "", QWEN3_ASSUMED),
        Row("Qwen3-30B-A3B actor MFU, 16 GPUs", 0.37, qwen3_moe_mfu(16), "", QWEN3_ASSUMED),
        Row("Qwen3-30B-A3B actor MFU, 32 GPUs", 0.31, qwen3_moe_mfu(32), "", QWEN3_ASSUMED, "fit (train)"),
    ]
    step, gen, mfu = deepseek_671b()
    out += [
        Row("DeepSeek-671B GRPO step, 96 H20", 1700, step, "s", DS_ASSUMED),
        Row("DeepSeek-671B rollout time", 1050, gen, "s", DS_ASSUMED),
        Row("DeepSeek-671B MFU", 0.19, mfu, "", DS_ASSUMED + " (MFU of the actor update)"),
    ]
    micro, micro_bytes, bcast, _ = hybridflow_70b()
    hf = "70B on 16×8 A100, 200 Gb/s per node; training t8 p4 d4, generation t8"
    t, p, tg = 8, 4, 8
    out += [
        Row(
            "HybridFlow 70B micro-DP volume / GPU",
            (t * p - tg) / (tg * t * p) * 140.0,
            micro_bytes / 1e9,
            "GB",
            hf + "; the paper's formula with M = 140 GB",
        ),
        Row("HybridFlow 70B transition (theirs)", 87.8 - 78.2, micro, "s", hf + "; published: 89.1 % below 87.8 s"),
        Row("OpenRLHF-style 70B transition", 87.8, bcast, "s", hf + "; separate pools, full broadcast"),
        Row(
            "Checkpoint-engine sync, Qwen3-30B-A3B",
            7.0,
            checkpoint_engine(),
            "s",
            "4×8 H100, 400 Gb/s IB per node; training ep8 → generation tp4, separate pools",
        ),
    ]
    return out


@dataclass
class Published:
    """A published configuration: its batch shape, layout and measured step time.

    ``pins`` is the published layout as ``--pin`` words; ``assumed`` says what the source leaves
    out and this row fills in."""

    name: str
    source: str
    model: str
    cluster: str
    n: int
    workload: WorkloadSpec
    pins: tuple[str, ...]
    step_s: float
    layout: str
    assumed: str = ""


NEMO = "NeMo-RL v0.6 performance summary (H100 BF16, on-policy; docs.nvidia.com/nemo/rl/0.6.0/about/performance-summary.html)"
NEMO5 = "NeMo-RL v0.5 performance summary (H100 BF16, on-policy)"
NEMO_ASSUMED = "prompt 256 of the max sequence (not published); mean response = published mean sequence − 256"


def _nemo(max_seq: int, avg_seq: int, prompts: int, n: int, train_gbs: int = 512) -> WorkloadSpec:
    """NeMo-RL's batch shape: sequences of at most ``max_seq`` (prompt and response) averaging
    ``avg_seq``, ``prompts × n`` samples trained in global batches of ``train_gbs``."""
    prompt = 256
    return WorkloadSpec(
        prompts=prompts,
        prompt_len=prompt,
        response_len=max_seq - prompt,
        mean_response_len=avg_seq - prompt,
        mini_batches=max(1, prompts * n // train_gbs),
    )


def _megatron(tp: int, cp: int, ep: int, pp: int, gen_tp: int) -> tuple[str, ...]:
    """NeMo-RL's Megatron layout ``[TP, CP, EP, PP]``, vLLM ``TP``, everything on the same devices."""
    return (
        "actor.train.backend=megatron",
        f"actor.train.tp={tp}",
        f"actor.train.cp={cp}",
        f"actor.train.ep={ep}",
        f"actor.train.pp={pp}",
        f"actor.generate.tp={gen_tp}",
        "colocate=actor.train,actor.gen,ref",
    )


#: NeMo-RL's published rows: (model, release, GPUs, max sequence, mean sequence, prompts, samples per
#: prompt, Megatron [TP, CP, EP, PP], vLLM TP, step seconds)
NEMO_ROWS = (
    ("deepseek-v3", NEMO, 256, 1536, 701, 32, 16, (1, 1, 16, 16), 32, 134.0),
    ("deepseek-v3", NEMO, 512, 1536, 697, 32, 16, (1, 1, 16, 16), 32, 111.0),
    ("qwen3-235b-a22b", NEMO, 128, 8192, 5698, 16, 32, (2, 2, 16, 8), 16, 395.0),
    ("qwen3-235b-a22b", NEMO, 256, 8192, 5713, 16, 32, (2, 2, 16, 8), 16, 312.0),
    ("qwen3-30b-a3b", NEMO, 32, 4096, 3203, 64, 32, (1, 1, 8, 1), 2, 192.0),
    ("qwen3-32b", NEMO5, 32, 4096, 3251, 64, 32, (4, 1, 1, 4), 4, 376.0),
    ("llama-3.1-8b", NEMO5, 16, 4096, 1019, 64, 32, (1, 1, 1, 2), 1, 92.8),
)


def published_configs() -> list[Published]:
    out = []
    for model, source, gpus, max_seq, avg, prompts, n, (tp, cp, ep, pp), gen_tp, step in NEMO_ROWS:
        w = _nemo(max_seq, avg, prompts, n)
        name = f"{ModelSpec.resolve(model).hf_id.split('/')[-1]} GRPO, {gpus} H100"
        layout = f"megatron tp{tp} cp{cp} ep{ep} pp{pp}, vllm tp{gen_tp}"
        pins = _megatron(tp, cp, ep, pp, gen_tp)
        out.append(Published(name, source, model, f"{gpus // 8}x8xH100", n, w, pins, step, layout, NEMO_ASSUMED))
    return out


def plan_published(c: Published, pinned: bool) -> tuple[float | None, str]:
    """(predicted step seconds, the plan's layout or why it was refused)."""
    g = load_flow(str(EXAMPLES / "grpo.py")).trace(n=c.n)
    m = ModelSpec.resolve(c.model)
    pins = parse_pins(list(c.pins)) if pinned else None
    try:
        plan, _, _ = make_plan(g, {"actor": m, "ref": m}, ClusterSpec.parse(c.cluster), c.workload, pins)
    except FlowcError as e:
        return None, f"refused: {e.what}"
    tr, ge = plan.roles["actor"].phases["train"], plan.roles["actor"].phases["generate"]
    lay = f"{tr.layout.backend} {tr.layout.short()}, {ge.layout.backend} {ge.layout.short()}"
    return plan.predicted.step_time_s, lay


def _against(x: float | None, published: float) -> tuple[str, str]:
    return ("—", "—") if x is None else (f"{x:.1f} s", f"{x / published:.2f}")


def published_table(configs: list[Published]) -> str:
    lines = [
        "| configuration | published step | published layout pinned | ratio | planner's own plan | ratio | its layout |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for c in configs:
        pin_s, pin_lay = plan_published(c, True)
        own_s, own_lay = plan_published(c, False)

        (ps, pr), (os_, or_) = _against(pin_s, c.step_s), _against(own_s, c.step_s)
        shown = pin_lay if pin_s is None else own_lay
        lines.append(f"| {c.name} | {c.step_s:.1f} s | {ps} | {pr} | {os_} | {or_} | {shown} |")
    return "\n".join(lines)


def sources(configs: list[Published]) -> str:
    return "\n".join(
        f"* **{c.name}**: {c.source}; n={c.n}, {c.workload.prompts} prompts, prompt ≤ {c.workload.prompt_len}, "
        f"response ≤ {c.workload.response_len} (mean {c.workload.mean_response_len:g}), "
        f"{c.workload.mini_batches} update(s)/step; published layout {c.layout}"
        + (f"; assumed: {c.assumed}" if c.assumed else "")
        for c in configs
    )


# ---------------------------------------------------------------- per phase
VERL_ASYNC = (
    "verl docs/advance/fully_async.md, the 'colocate sync' rows (Qwen2.5-Math-7B DAPO on H20, vLLM + FSDP2), "
    "with the settings of its scripts recipe/fully_async_policy/shell/dapo_7b_math_fsdp2_*.sh"
)
#: verl's published synchronous, co-located runs: (GPUs, step, gen, old_log_prob, update_actor) in seconds
VERL_SYNC_ROWS = (
    (32, 790.10, 357.41, 107.71, 313.81),
    (64, 365.28, 150.72, 70.26, 133.41),
    (128, 356.30, 177.85, 53.92, 113.81),
)
#: the scripts' layout as pins: FSDP2 over every device, vLLM tp 4 at gpu_memory_utilization 0.8, one pool.
#: Ulysses sequence parallelism 4 over 61,440-token micro-batches (use_dynamic_bsz) leaves each device a
#: quarter of a micro-batch's tokens; flowc's fsdp2 has no sequence parallelism, so that share is pinned.
VERL_PINS = (
    "actor.train.backend=fsdp2",
    "actor.train.tp=1",
    "actor.train.share_prompts=false",
    "actor.train.activation_checkpointing=true",
    "actor.train.micro_tokens=15360",
    "actor.generate.tp=4",
    "actor.generate.gpu_memory_utilization=0.8",
    "colocate=actor.train,actor.gen",
)
VERL_ASSUMED = (
    "n=16, 512 prompts a step, mini-batches of 32 prompts (16 updates), prompt 256 tokens (its limit is 2048; "
    "DAPO-Math prompts are short), response ≤ 28,672; no dynamic sampling (the fully asynchronous mode it is "
    "compared with has none) and no KL (no reference); activation checkpointing on (verl's default). The mean "
    "response length is not published: each row fits it so that the predicted update equals the published one"
)


@fc.flow
def dapo_streamed(prompts: fc.Prompts, actor: fc.Policy, reward: fc.Reward, *, n: int = 16):
    """DAPO as verl's fully asynchronous comparison runs it: clip-higher, token-mean, no dynamic sampling."""
    rollout = actor.generate(prompts, n=n)
    scores = reward(rollout)
    old_logp = actor.logprobs(rollout)
    adv = fc.ops.group_normalize(scores, group_size=n)
    actor.update(rollout, advantages=adv, old_logprobs=old_logp, loss=fc.losses.ppo_clip(0.2, 0.28, agg="token-mean"))


@dataclass
class Phases:
    gpus: int
    mean_response: float
    step: float
    generate: float
    logprobs: float
    update: float


def verl_phases(gpus: int, mean_response: float) -> Phases:
    """The per-phase prediction of verl's co-located DAPO run on ``gpus`` H20 at a mean response length."""
    g = dapo_streamed.trace(n=16)
    m = ModelSpec.resolve("qwen2.5-7b")  # Qwen2.5-Math-7B has Qwen2.5-7B's architecture
    w = WorkloadSpec(prompts=512, prompt_len=256, response_len=28672, mean_response_len=mean_response, mini_batches=16)
    plan, _, _ = make_plan(g, {"actor": m}, ClusterSpec.parse(f"{gpus // 8}x8xH20"), w, parse_pins(list(VERL_PINS)))
    ph = plan.roles["actor"].phases
    return Phases(
        gpus, mean_response, plan.predicted.step_time_s, ph["generate"].time_s, ph["forward"].time_s, ph["train"].time_s
    )


def fit_mean_response(gpus: int, update_s: float) -> Phases:
    """The mean response length at which the predicted update takes ``update_s`` (bisection: the
    update grows with the tokens)."""
    lo, hi = 50.0, 28000.0
    for _ in range(30):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if verl_phases(gpus, mid).update < update_s else (lo, mid)
    return verl_phases(gpus, (lo * hi) ** 0.5)


def phases_table() -> str:
    lines = [
        "| H20s | fitted mean response | update (fitted) | log-probs: published | predicted | ratio "
        "| generate: published | predicted | ratio | step: published | predicted | ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for gpus, step, gen, logp, update in VERL_SYNC_ROWS:
        p = fit_mean_response(gpus, update)
        lines.append(
            f"| {gpus} | {p.mean_response:.0f} | {update:.1f} s | {logp:.1f} s | {p.logprobs:.1f} s | {p.logprobs / logp:.2f} "
            f"| {gen:.1f} s | {p.generate:.1f} s | {p.generate / gen:.2f} | {step:.1f} s | {p.step:.1f} s | {p.step / step:.2f} |"
        )
    return "\n".join(lines)


def table(rs: list[Row]) -> str:
    lines = ["| figure | published | predicted | error | use | assumptions |", "|---|---:|---:|---:|---|---|"]
    for r in rs:
        unit = "" if r.unit in ("", "GB") else f" {r.unit}"
        digits = 2 if r.unit in ("", "GB") else 1
        pub, pred = f"{r.published:.{digits}f}{unit}", f"{r.predicted:.{digits}f}{unit}"
        lines.append(f"| {r.what} | {pub} | {pred} | {r.error * 100:+.0f} % | {r.use} | {r.assumptions} |")
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--fit", action="store_true")
    ap.add_argument("--phases", action="store_true", help="only the per-phase table")
    args = ap.parse_args()
    if args.phases:
        print(phases_table())
        print()
        print(f"Source: {VERL_ASYNC}. Assumed: {VERL_ASSUMED}.")
        raise SystemExit(0)
    current = hardware.get_profile("H100").efficiency.train
    value = fit_train() if args.fit else current
    if args.fit:
        print(f"fitted train = {value} (profiles have {current})")
    print(table(rows(value)))
    configs = published_configs()
    print()
    print(published_table(configs))
    print()
    print(sources(configs))
    print()
    print(phases_table())
