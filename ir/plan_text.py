"""The human (and golden-tested) text form of a Plan: what ``flowc plan`` prints."""

from __future__ import annotations

from flowc.ir.plan import Plan
from flowc.ir.steady_state import drawn_period, pipelined_spans


def _table(headers: list[str], rows: list[list[str]], right: set[int] | None = None) -> list[str]:
    right = right or set()
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=True)] if rows else [len(h) for h in headers]

    def fmt(r: list[str]) -> str:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        return "  " + "  ".join(cells).rstrip()

    return [fmt(headers), fmt(["-" * w for w in widths]), *[fmt(r) for r in rows]]


def _s(x: float) -> str:
    if x >= 100:
        return f"{x:.0f} s"
    if x >= 1:
        return f"{x:.1f} s"
    return f"{x * 1000:.0f} ms"


def params(b: float) -> str:
    """Parameters in billions as people write them: 70.6B, 494M, 0.6M."""
    if b >= 1:
        return f"{b:.3g}B" if b < 100 else f"{b:.0f}B"
    return f"{b * 1000:.3g}M"


def format_plan(plan: Plan) -> str:
    """The whole text: header, pools, roles, reshards, schedule, why, alternatives."""
    sections = (_header, _pools, _roles, _reshards, _schedule, _why, _alternatives)
    return "\n".join(line for section in sections for line in section(plan)) + "\n"


def _lengths(w: dict) -> str:
    """`` (mean 940, min/p50/p90/p99/max 10/200/…)``: what the workload says of response lengths."""
    parts = [f"mean {w['mean_response_len']}"] if w.get("mean_response_len") else []
    if w.get("response_percentiles"):
        parts.append("min/p50/p90/p99/max " + "/".join(f"{x:g}" for x in w["response_percentiles"]))
    if w.get("mean_response_cv"):
        parts.append(f"step means ±{w['mean_response_cv'] * 100:.0f} %")
    if w.get("idle_rows"):
        parts.append(f"{w['idle_rows'] * 100:.0f} % of rows with zero advantages")
    return f" ({', '.join(parts)})" if parts else ""


def _header(plan: Plan) -> list[str]:
    c, w, p = plan.cluster, plan.workload, plan.predicted
    models = ", ".join(
        f"{r}={rp.model} ({rp.params_b:g}B"
        + (f", {rp.active_params_b:g}B active" if rp.active_params_b != rp.params_b else "")
        + (f", LoRA {rp.lora.short()})" if rp.lora is not None else ")")
        for r, rp in plan.roles.items()
    )
    return [
        f"plan {plan.flow} on {c['name']} ({c['world_size']} devices)",
        f"  workload  {w['prompts']} prompts/step, prompt {w['prompt_len']}, response {w['response_len']}"
        + _lengths(w)
        + f", {w['mini_batches']} update(s) × {w['epochs']} epoch(s)",
        f"  models    {models}",
        "",
        f"predicted: {p.step_time_s:.2f} s/step · {p.tokens_per_s:,.0f} tokens/s · {p.tokens_per_s_per_device:,.1f} tokens/s/device · MFU {p.mfu * 100:.1f} %",
        *(
            [
                f"  pipelined: staleness {plan.staleness} (rollouts up to {plan.staleness} weight version(s) behind); one iteration {p.iteration_s:.2f} s"
                + (
                    f"; {p.steady_step_s:.2f} s a step at the mean lengths, +{p.step_time_s - p.steady_step_s:.2f} s as generation varies"
                    if p.steady_step_s is not None and p.step_time_s > p.steady_step_s + 5e-3
                    else ""
                )
            ]
            if plan.staleness and p.iteration_s is not None
            else []
        ),
    ]


def _pools(plan: Plan) -> list[str]:
    rows = [
        [x.name, str(x.device_count), x.devices, str(x.nodes), _s(x.busy_s), f"{x.idle_fraction * 100:.0f} %"] for x in plan.pools
    ]
    return ["", "pools", *_table(["pool", "devices", "ids", "nodes", "busy", "idle"], rows, right={1, 3, 4, 5})]


_ROLE_HEADERS = [
    "role.phase",
    "devs",
    "degrees",
    "backend",
    "weights",
    "grads",
    "optim",
    "act",
    "kv",
    "buf",
    "others",
    "total/cap",
    "time",
]
_FLAGS = (
    ("fsdp", "fsdp"),
    ("off-p", "offload_params"),
    ("off-o", "offload_optimizer"),
    ("ckpt", "activation_checkpointing"),
    ("sp", "share_prompts"),
    ("pk", "pack_sequences"),
)


def _roles(plan: Plan) -> list[str]:
    rows = []
    for r, rp in plan.roles.items():
        for ph, pp in rp.phases.items():
            m, lay = pp.memory, pp.layout
            flags = [short for short, field in _FLAGS if getattr(lay, field)]
            degrees = (
                f"dp{pp.dp} tp{pp.tp} pp{pp.pp}" + (f" cp{pp.cp}" if pp.cp > 1 else "") + (f" ep{pp.ep}" if pp.ep > 1 else "")
            )
            backend = (
                lay.backend + (f" [{','.join(flags)}]" if flags else "") + (f" {lay.micro_label}" if ph != "generate" else "")
            )
            gb = [f"{x:.1f}" for x in (m.weights, m.gradients, m.optimizer, m.activations, m.kv_cache, m.buffers, m.other_roles)]
            total = f"{pp.memory_gb_per_device:.1f}/{pp.capacity_gb:.0f}"
            time = _s(pp.time_s) + (f" ({pp.waves} waves)" if pp.waves > 1 else "")
            rows.append([f"{r}.{ph}", str(pp.device_count), degrees, backend, *gb, total, time])
    return ["", "roles (memory per device, GB)", *_table(_ROLE_HEADERS, rows, right={1, 4, 5, 6, 7, 8, 9, 10, 11, 12})]


def _reshards(plan: Plan) -> list[str]:
    rows = [
        [
            r.role,
            f"{r.src} → {r.dst}" + (f" (≤{plan.staleness} behind)" if plan.staleness and r.dst_phase == "generate" else ""),
            r.method,
            f"{r.bytes_per_device / 1e9:.2f}",
            f"{r.lower_bound_bytes / 1e9:.2f}",
            _s(r.time_s),
            r.link,
        ]
        for r in plan.reshards
    ]
    return [
        "",
        "reshards",
        *_table(["role", "edge", "method", "GB/device", "lower bound", "time", "link"], rows, right={3, 4, 5}),
    ]


def _schedule(plan: Plan) -> list[str]:
    rows = [
        [f"{e.start_s:.2f}", f"{e.end_s:.2f}", e.op, e.pool or "controller"]
        for e in plan.schedule
        if e.end_s > e.start_s or e.pool
    ]
    out = ["", "schedule (one iteration)", *_table(["start", "end", "op", "pool"], rows, right={0, 1})]
    if plan.staleness and plan.steady_state:
        spans = sorted(pipelined_spans(plan), key=lambda sp: (sp.start_s, sp.step))
        steady = [
            [
                f"{sp.start_s:.2f}",
                f"{sp.end_s:.2f}",
                sp.entry.op,
                "s" if not sp.step else f"s+{sp.step}",
                sp.entry.pool or "controller",
            ]
            for sp in spans
        ]
        head = (
            f"steady state (staleness {plan.staleness}: two steps of {drawn_period(plan):.2f} s"
            f" at the mean lengths; a generate of step s+{plan.staleness} runs while step s trains)"
        )
        out += ["", head, *_table(["start", "end", "op", "step", "pool"], steady, right={0, 1})]
    return out


def _why(plan: Plan) -> list[str]:
    return ["", "why", *(f"  - {x}" for x in plan.why)]


def _alternatives(plan: Plan) -> list[str]:
    if not plan.alternatives:
        return []
    lines = ["", "alternatives"]
    for a in plan.alternatives:
        lines += [f"  - {a.summary}", f"      {a.rejected_because}"]
    return lines
