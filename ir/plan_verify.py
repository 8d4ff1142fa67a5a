"""Invariants of a Plan (checked by tests on every plan, and by the runtime
before it lowers one).

* each phase's degrees multiply to its pool's device count and its devices
  are its pool's;
* memory per device is within capacity, and equals the sum of its categories;
* pools have disjoint device sets within the cluster;
* every reshard moves at least its lower bound, and no reshard into
  generation is missing for a trained policy that generates;
* the schedule has every model op once, ops of one pool do not overlap, and
  the predicted step time is the end of the schedule.
"""

from __future__ import annotations

import itertools

from flowc.errors import VerificationError
from flowc.ir.plan import Plan


def _ids(spec: str) -> set[int]:
    out: set[int] = set()
    for part in spec.split(","):
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-")
            out.update(range(int(a), int(b) + 1))
        else:
            out.add(int(part))
    return out


def verify_plan(plan: Plan, *, tol: float = 1e-6) -> None:
    """Raise VerificationError naming the first broken invariant."""
    world = int(plan.cluster["world_size"])
    pools = {p.name: p for p in plan.pools}
    seen: set[int] = set()
    for p in plan.pools:
        ids = _ids(p.devices)
        if len(ids) != p.device_count:
            raise VerificationError(f"pool {p.name}: {len(ids)} device ids for {p.device_count} devices")
        if ids & seen:
            raise VerificationError(f"pool {p.name} shares devices {sorted(ids & seen)[:4]} with another pool")
        if ids and (min(ids) < 0 or max(ids) >= world):
            raise VerificationError(f"pool {p.name} uses devices outside the cluster of {world}")
        seen |= ids
    for role, rp in plan.roles.items():
        for ph, pp in rp.phases.items():
            where = f"{role}.{ph}"
            if pp.pool not in pools:
                raise VerificationError(f"{where} runs on unknown pool {pp.pool!r}")
            if pp.device_count != pools[pp.pool].device_count or pp.devices != pools[pp.pool].devices:
                raise VerificationError(f"{where}: devices differ from its pool's")
            lay = pp.layout
            if (pp.dp, pp.tp, pp.pp, pp.cp, pp.ep) != (lay.dp, lay.tp, lay.pp, lay.cp, lay.ep):
                raise VerificationError(f"{where}: degrees differ from its layout")
            if lay.world != pp.device_count:
                raise VerificationError(
                    f"{where}: dp({lay.dp})*tp({lay.tp})*pp({lay.pp})*cp({lay.cp}) = {lay.world} != devices({pp.device_count})"
                )
            if lay.ep > 1 and (lay.dp * lay.cp * lay.tp) % lay.ep:
                raise VerificationError(f"{where}: ep({lay.ep}) does not divide the ranks it is carved from")
            if abs(pp.memory.total - pp.memory_gb_per_device) > 1e-2:
                raise VerificationError(f"{where}: memory categories sum to {pp.memory.total:.3f}, not {pp.memory_gb_per_device}")
            if pp.memory_gb_per_device > pp.capacity_gb + 1e-3:
                raise VerificationError(f"{where}: needs {pp.memory_gb_per_device:.1f} GB of {pp.capacity_gb:.1f} GB per device")
            if pp.time_s < 0:
                raise VerificationError(f"{where}: negative time")
    for r in plan.reshards:
        if r.bytes_per_device + tol < r.lower_bound_bytes:
            raise VerificationError(
                f"reshard {r.src} → {r.dst}: {r.bytes_per_device:.0f} bytes per device, below the lower bound {r.lower_bound_bytes:.0f}"
            )
    for role, rp in plan.roles.items():
        if (
            "generate" in rp.phases
            and "train" in rp.phases
            and not any(r.role == role and r.dst_phase == "generate" for r in plan.reshards)
        ):
            raise VerificationError(f"role {role} trains and generates but has no reshard into generation")
    by_pool: dict[str, list[tuple[float, float, str]]] = {}
    for e in plan.schedule:
        if e.end_s + tol < e.start_s:
            raise VerificationError(f"schedule: {e.op} ends before it starts")
        if e.pool:
            by_pool.setdefault(e.pool, []).append((e.start_s, e.end_s, e.op))
    for pool, spans in by_pool.items():
        spans.sort()
        for (_, e1, a), (s2, _, b) in itertools.pairwise(spans):
            if s2 + 1e-6 < e1:
                raise VerificationError(f"schedule: {a} and {b} overlap on pool {pool}")
    ops = [e.op for e in plan.schedule]
    if len(ops) != len(set(ops)):
        raise VerificationError("schedule lists an op twice")
    end = max((e.end_s for e in plan.schedule), default=0.0)
    if abs(end - plan.predicted.step_time_s) > 1e-3 * max(1.0, end):
        raise VerificationError(f"predicted step {plan.predicted.step_time_s} s is not the schedule's end {end} s")
