"""The controller's weight syncs: issued through the plan's transport, waited for when due, checked.

A weight sync moves a trainer's weights to a rollout engine by the transport the plan's
method lowers to: ``local`` (the two engines share a worker; lock-step, the rollout engine
may run the trainer's own parameters) or ``object_store`` (the trainer exports buckets, the
engine imports them). Lock-step and at staleness K = 1 the controller waits for step s's sync
at the end of step s; at K ≥ 2 the wait moves to step s+K−1, just before the trainer needs
the rollouts the engine sampled after it (``runtime.ahead``). After every sync both sides score a
fixed probe sequence and must agree (``runtime.sync_check``), before any rollout sampled after
the sync is trained on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flowc.ir.ops import Op
from flowc.ir.run_config import RunConfig
from flowc.runtime.ahead import PendingSync, SyncQueue
from flowc.runtime.iteration import Iteration
from flowc.runtime.program import EngineKey, EngineSpec, Program, Step
from flowc.runtime.step_metrics import StepTally
from flowc.runtime.sync_check import SyncCheck, first, probe_rollout, tolerance

if TYPE_CHECKING:
    from flowc.runtime.inline import InlineGroup
    from flowc.runtime.worker import WorkerGroup

    Group = WorkerGroup | InlineGroup


class WeightSyncs:
    """Every weight sync of a run: issuing it, the queue of those not waited for, and their checks.

    ``program`` returns the controller's current program (a re-plan may change its staleness
    between steps); ``group_of`` and ``wait`` are the controller's; ``tally`` returns the step's
    tally (what the step's metrics add up beyond its ops' reports)."""

    def __init__(
        self,
        program: Callable[[], Program],
        cfg: RunConfig,
        tok: Any,
        context: int,
        group_of: Callable[[EngineKey], tuple[Group, EngineSpec]],
        wait: Callable[[Step, list[Any], str], list[Any]],
        tally: Callable[[], StepTally],
    ) -> None:
        self._program = program
        self._group_of = group_of
        self._wait = wait
        self._tally = tally
        p = program()
        # a fixed probe both sides score after every sync (one token short of the engine's context:
        # vLLM scores a sequence as a prompt with one token to generate)
        self.probe = probe_rollout(tok, context - 1) if cfg.sync_check else None
        tol = tolerance(p.target.dtype, cfg.sync_check_tol)
        self.checks = {st.node: SyncCheck(st.engine.role, tol, p.target.dtype) for st in p.steps_of(Op.WEIGHT_SYNC)}
        self._trainer_probe: dict[str, list[float] | None] = {}  # a sync's trainer side, until it joins the queue
        self.queue: SyncQueue[Step] = SyncQueue(cfg.steps)  # syncs issued, not waited for yet (K ≥ 2)
        self._transports: dict[str, Callable[[Step], list[Any]]] = {"local": self._local, "object_store": self._buckets}

    # ------------------------------------------------------------- issuing
    def issue(self, st: Step, step: int) -> list[Any]:
        """Step ``step``'s sync ``st``, after the earlier syncs due in this step: an object-store
        sync's exported copy of the weights stays in the store until the engine has loaded it
        (``runtime.ahead.SyncQueue``), so at most max(K−1, 1) copies are held at once."""
        for q in self.queue.take_due(step):
            self._wait(q.sync, q.refs, "weight sync")
        return self.run(st)

    def run(self, st: Step) -> list[Any]:
        """A weight sync by the method the plan chose, through the transport the runtime implements it with."""
        return self._transports[st.args["transport"]](st)

    def _local(self, st: Step) -> list[Any]:
        wg, _ = self._group_of(st.engine)
        # lock-step: the rollout engine may run the trainer's own parameters (no copy; see Worker.sync_local)
        return wg.call("sync_local", st.engine, st.args["to"], self.probe, self._program().staleness == 0)

    def _buckets(self, st: Step) -> list[Any]:
        train, _ = self._group_of(st.engine)
        gen, _ = self._group_of(st.args["to"])
        exported = train.get(
            train.call("export_weights", st.engine, st.args["bucket_bytes"], self.probe),
            f"weight sync {st.engine.role} (gather)",
        )
        self._tally().ran([meta for _, meta in exported])
        self._trainer_probe[st.node] = first([meta for _, meta in exported], "probe_trainer")
        return gen.call("import_weights", st.args["to"], exported[0][0], self.probe)

    # ------------------------------------------------------------- waiting
    def due(self, step: int, it: Iteration) -> list[PendingSync[Step]]:
        """This step's weight syncs join the pending ones; those due by its end (``runtime.ahead``)
        leave, with any taken before the step issued its syncs, in the order issued. The step's
        metrics report the last of each role's (its bytes, seconds): ``it.metas`` holds its results
        in place of this step's own; an earlier one of the same role (two due at once: the run's last
        step, or a lowered K) counts only towards the spans the step waited on."""
        p = self._program()
        for st in p.steps_of(Op.WEIGHT_SYNC):
            if st.node in it.metas:
                probe = self._trainer_probe.pop(st.node, None)
                self.queue.add(PendingSync(step, p.staleness, st, it.metas.pop(st.node), probe))
        self.queue.take_due(step)
        due = self.queue.report()
        for i, q in enumerate(due):
            if any(later.sync.node == q.sync.node for later in due[i + 1 :]):
                self._tally().ran(self._wait(q.sync, q.refs, "weight sync"))
            else:
                it.metas[q.sync.node] = q.refs
        return due

    def report(self, due: list[PendingSync[Step]], step: int, m: dict[str, Any]) -> None:
        """Check the step's due syncs, in the order issued (waited for already: the step's metrics
        read every op's results), into its metrics ``m``: the probe's difference, and the step a
        sync deferred from an earlier step (staleness ≥ 2) was issued for."""
        for q in due:
            role = q.sync.engine.role
            diff = self.check(q.sync, self._wait(q.sync, q.refs, "weight sync"), q.step, q.trainer_probe)
            if diff is not None:
                m[f"{role}/sync_probe_diff"] = diff
            if q.step != step:
                m[f"{role}/sync_step"] = q.step + 1
            else:
                m.pop(f"{role}/sync_step", None)

    def flush(self) -> None:
        """Wait for and check every sync issued and not checked yet (staleness ≥ 2 defers them):
        a run that stops before its last step calls it before its checkpoint."""
        for q in self.queue.flush():
            self.check(q.sync, self._wait(q.sync, q.refs, "weight sync"), q.step, q.trainer_probe)

    def reload(self, step: int) -> None:
        """Every rollout engine gets the trainers' weights now, checked (a resume, after the
        trainers loaded the checkpoint of ``step``)."""
        for st in self._program().steps_of(Op.WEIGHT_SYNC):
            refs = self.run(st)
            self.check(st, self._wait(st, refs, "weight sync"), step - 1, self._trainer_probe.pop(st.node, None))

    # ------------------------------------------------------------- checking
    def check(self, st: Step, metas: list[dict[str, Any]], step: int, trainer_probe: list[float] | None) -> float | None:
        """The sync's probe check (``runtime.sync_check``); None when the run does not check.
        ``trainer_probe``: the trainer's side, where the trainer returned it apart from ``metas``."""
        if self.probe is None:
            return None
        if metas and all(m.get("aliased") for m in metas):  # the engine runs the trainer's storage itself
            self.checks[st.node].last = None
            return 0.0
        trainer = trainer_probe or first(metas, "probe_trainer")
        return self.checks[st.node](step, trainer, first(metas, "probe_engine"))
