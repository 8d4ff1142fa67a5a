"""The single controller: starts the worker groups of a Program and runs it.

Each iteration walks the program's steps in order, each op through its
handler (one table, keyed by op). Device steps are submitted to their worker
group without waiting (Ray actors run their calls in order, so one group's
steps are sequential and different groups overlap); the controller waits only
when its own step (a reward, a compute) needs a value. Bulk values stay in the
object store as one shard per worker; the controller passes references and row
ranges. Everything the controller decides with comes from the Program — the
plan's layouts, sync methods, target (dtype, collective, timeouts, CPUs per
worker) and workload — never from defaults of its own.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
import torch

from flowc.errors import RuntimeFailure, SpecError
from flowc.ir.functional import DEFAULT_KL_KIND, varied_groups
from flowc.ir.graph import Node, ValueRef
from flowc.ir.losses import PREFERENCE_LOSSES, update_skips_idle
from flowc.ir.ops import Op, RoleKind
from flowc.ir.run_config import RunConfig
from flowc.ir.targets import resolve
from flowc.ir.verify import check_staleness, filter_region
from flowc.runtime.ahead import RolloutBuffer
from flowc.runtime.backends import EngineInit
from flowc.runtime.batches import (
    INLINE_BYTES,
    Inline,
    Sharded,
    assemble,
    cat_rows,
    even_split,
    minibatch_rows,
    nbytes,
    num_rows,
    take_rows,
)
from flowc.runtime.checkpoints import CheckpointDir
from flowc.runtime.data import Records, RewardFn, tokenize_pairs, tokenize_prompts
from flowc.runtime.envs import EnvBinding
from flowc.runtime.evaluation import HeldOut
from flowc.runtime.inline import Executor, InlineGroup
from flowc.runtime.iteration import Iteration, Local, value_at
from flowc.runtime.program import MICRO_ARGS, EngineKey, EngineKind, EngineSpec, GroupSpec, Program, Step
from flowc.runtime.ranks import output_ranks, replica_of
from flowc.runtime.rewards import Rewards
from flowc.runtime.run_checks import behaviour_comparable, check_environments, check_response_lengths, sampling_of
from flowc.runtime.step_metrics import StepTally, step_metrics
from flowc.runtime.sync_check import first
from flowc.runtime.weight_sync import WeightSyncs
from flowc.runtime.worker import WorkerGroup

Group = WorkerGroup | InlineGroup  # a pool's workers: Ray actors, or one worker in this process

UPDATE_TENSORS = ("advantages", "old_logprobs", "ref_logprobs", "returns", "old_values")


@dataclass
class RunSpec:
    """Everything a run needs besides the cluster: the lowered plan and the run's own inputs."""

    program: Program
    config: RunConfig
    model_sources: dict[str, str]  # role → HF model directory
    tokenizer: str  # the policy's tokenizer directory
    data: Records
    eval_data: Records | None
    rewards: dict[str, RewardFn]  # Reward role → function
    reward_names: dict[str, str] = field(default_factory=dict)
    out_dir: Path = Path("runs/run")
    envs: dict[str, EnvBinding] = field(default_factory=dict)  # Environment role → its class, bound
    executor: Executor = "ray"  # where the workers run: Ray actors, or in this process (runtime.inline)


def _replica_args(args: dict[str, Any], rows: tuple[int, int]) -> dict[str, Any]:
    """A generate's arguments for the replica of prompt rows ``rows``: where its rows start (seeds
    follow global rows) and, for an agent rollout, its rows' data records."""
    out = {**args, "row_offset": rows[0]}
    if args.get("records") is not None:
        out["records"] = args["records"][rows[0] : rows[1]]
    return out


class Controller(HeldOut):
    """Owns the worker groups for the length of a run."""

    def __init__(self, spec: RunSpec) -> None:
        from transformers import AutoTokenizer

        self.s = spec
        self.p = spec.program
        self.cfg = spec.config
        check_response_lengths(self.p, self.cfg)
        for st in self.p.steps_of(Op.GENERATE):
            env = st.args.get("env")
            if env is not None and str(env) not in spec.envs:
                raise SpecError(
                    f"{st.node} runs environment {env!r}, which this run does not bind",
                    fix=f"bind it: flowc run … --env {env}=module:Class (docs/agents.md)",
                )
        self._behaviour = behaviour_comparable(self.p, self.cfg)
        check_staleness(self.p.graph, self.p.staleness)  # a saved plan's too
        self._ahead: RolloutBuffer[Iteration] = RolloutBuffer()  # staleness K: later steps' rollouts, issued
        # a rollout engine's weight version is this plus the syncs it reports it has loaded (a resume's restore: its step − 1)
        self._load_base = 0
        self.rewards = Rewards(
            spec.rewards,
            spec.reward_names,
            self.cfg.reward_timeout_s,
            self.cfg.reward_workers,
            processes="local" if spec.executor == "inline" else "ray",
        )
        self.groups: dict[str, Group] = {}
        self.tok = AutoTokenizer.from_pretrained(spec.tokenizer)
        self.history: list[dict[str, Any]] = []
        self.placement: dict[str, list[dict[str, Any]]] = {}
        # what a step's filter rounds add to its metrics (extra device seconds, tokens); reset per step
        self._tally = StepTally()
        self._handlers: dict[Op, Callable[[Step, Node, Iteration], None]] = {
            Op.INPUT: self._input,
            Op.GENERATE: self._generate_step,
            Op.LOGPROBS: self._forward_step,
            Op.VALUES: self._forward_step,
            Op.SCORE: self._forward_step,
            Op.UPDATE: self._update_step,
            Op.WEIGHT_SYNC: self._sync_step,
            Op.REWARD: self._reward,
            Op.COMPUTE: self._compute,
        }
        # issued through the plan's transport, waited for when due (K ≥ 2 defers it), checked by a probe
        self.syncs = WeightSyncs(
            lambda: self.p, self.cfg, self.tok, self._context(), self._group_of, self._wait, lambda: self._tally
        )

    # ---------------------------------------------------------------- start
    def start(self) -> None:
        """Create every worker group, join its world, load its engines."""
        t = self.p.target
        for g in self.p.groups:
            roles = ", ".join(str(e.key) for e in g.engines)
            wg: Group
            if self.s.executor == "inline":
                wg = InlineGroup(g.name, g.size, cpus_per_worker=t.cpus_per_worker, timeout_s=t.timeout_s, roles=roles)
            else:
                strategy = "STRICT_PACK" if len(g.nodes) == 1 else "SPREAD"
                wg = WorkerGroup(
                    g.name,
                    g.size,
                    gpus=t.kind == "gpu",
                    cpus_per_worker=t.cpus_per_worker,
                    strategy=strategy,
                    timeout_s=t.timeout_s,
                    roles=roles,
                )
            self.groups[g.name] = wg
            self.placement[g.name] = wg.join(t.collective)
            for e in g.engines:
                wg.get(wg.call("add_engine", e.key, self._init(g, e)), f"loading {e.key}")

    def _init(self, g: GroupSpec, e: EngineSpec) -> EngineInit:
        return EngineInit(
            role=e.role,
            kind=e.role_kind,
            source=self.s.model_sources[e.role],
            layout=e.layout,
            dtype=self.p.target.dtype,
            seed=self.cfg.seed,
            optim=self.cfg.optim_for(e.role) if e.key.kind == EngineKind.TRAIN else None,
            lora=e.lora,  # the plan's adapters (what it priced), not re-read from the config
            total_updates=self._total_updates(e.role),
            tokenizer=self.s.tokenizer,
            # the longest sequence a rollout engine sees: a prompt and the longest response any generate asks for
            max_model_len=self._context(),
            # a rollout engine sharing its devices with a trainer frees its memory between rollouts (where it can)
            colocated=g.hosts(EngineKind.TRAIN),
            memory_fraction=e.memory_fraction,
            kv_cache_bytes=round(e.kv_cache_gb * 1e9),
            max_num_seqs=e.max_num_seqs,
            timeout_s=self.p.target.timeout_s,
        )

    def _total_updates(self, role: str) -> int:
        """Optimizer updates ``role`` makes in the whole run: steps × epochs × mini-batches × its
        updates per step (what a decaying learning-rate schedule spans)."""
        w = self.p.workload
        per_step = sum(1 for st in self.p.steps_of(Op.UPDATE) if st.engine is not None and st.engine.role == role)
        return max(self.cfg.steps * w.epochs * w.mini_batches * per_step, 1)

    def _context(self) -> int:
        """A rollout engine's context: the longest prompt and response (the probe fits it too)."""
        return self.p.workload.prompt_len + max(self.p.workload.response_len, self._max_tokens())

    def _max_tokens(self) -> int:
        asked = [int(st.args["max_tokens"]) for st in self.p.steps if st.args.get("max_tokens")]
        return max([self.cfg.sampling.max_tokens or 0, *asked])

    def describe(self) -> dict[str, list[dict[str, Any]]]:
        """What every worker of every group runs, as built (engines, threads, timeout)."""
        return {name: wg.get(wg.call("describe"), "describe") for name, wg in self.groups.items()}

    def shutdown(self) -> None:
        self.rewards.stop()
        for wg in self.groups.values():
            wg.shutdown()
        self.groups.clear()

    # ------------------------------------------------------------- values
    def _group_of(self, key: EngineKey) -> tuple[Group, EngineSpec]:
        gspec, espec = self.p.engine(key)
        return self.groups[gspec.name], espec

    def _sharded(self, v: Any) -> Sharded:
        """A controller value as one shard: a small one (or any, when the workers run in this
        process) inline in the calls that use it, a bulk one in the object store."""
        if isinstance(v, Sharded):
            return v
        inline = self.s.executor == "inline" or nbytes(v.value) <= INLINE_BYTES
        ref = Inline(v.value) if inline else ray.put(v.value)
        return Sharded((ref,), (num_rows(v.value),))

    def _materialize(self, v: Any) -> Any:
        if isinstance(v, Local):
            return v.value
        got = assemble(v.pieces(0, v.rows), lambda refs: ray.get(list(refs), timeout=self.p.target.timeout_s))
        # inline, these are the worker's own objects, which later ops read too: a copy, as a fetch from
        # Ray's object store gives, so a compute op that edits its input in place changes nothing else
        return copy.deepcopy(got) if self.s.executor == "inline" else got

    def _arg(self, env: dict[str, Any], x: Any) -> Any:
        if isinstance(x, ValueRef):
            return self._materialize(value_at(env, x))
        if isinstance(x, (list, tuple)):
            return type(x)(self._arg(env, y) for y in x)
        if isinstance(x, dict):
            return {k: self._arg(env, y) for k, y in x.items()}
        return x

    @staticmethod
    def _per_rank(values: dict[str, Sharded], size: int) -> list[dict[str, list[Any]]]:
        rows = next(iter(values.values())).rows
        return [{k: v.pieces(lo, hi) for k, v in values.items()} for lo, hi in even_split(rows, size)]

    def _wait(self, st: Step, refs: list[Any], what: str) -> list[Any]:
        group = self.groups[st.group] if st.group else next(iter(self.groups.values()))
        return group.get(refs, f"{what} {st.node}")

    # -------------------------------------------------------------- a step
    def run_step(self, step: int) -> dict[str, Any]:
        t_step = time.perf_counter()
        self._tally = StepTally()  # what the step adds up beyond its ops' reports (filter rounds, busy spans)
        it = self._ahead.take(step) or self._rollouts(step)
        self._ahead.fill(step, self.p.staleness, self.cfg.steps, self._rollouts)
        for st in self.p.steps:
            if st.node in it.env:  # the prompts and rollouts, issued already
                continue
            if st.op == Op.FILTER:
                it.env[st.node] = self._filter(st, it)
            else:
                self._exec(st, it)
        due = self.syncs.due(step, it)
        m = step_metrics(self.p, it, self._tally, t_step, wait=self._wait, read=self._materialize, limit=self._response_limit)
        check_environments(m, step)
        self._check_lag(step, it, m)
        if (
            self._ahead.ran_ahead
        ):  # the rollout buffer at the end of the step: later steps' rollouts issued, not yet trained on (≤ K)
            m["rollout/buffered"] = len(self._ahead.waiting)
        self.syncs.report(due, step, m)
        return m

    def flush_syncs(self) -> None:
        """Wait for and check every weight sync not checked yet (``WeightSyncs.flush``): a run that
        stops before its last step calls it before its checkpoint."""
        self.syncs.flush()

    def _check_lag(self, step: int, it: Iteration, m: dict[str, Any]) -> None:
        """How many weight versions behind the trainer each synced rollout engine sampled this step's
        rollouts, from the syncs the engine itself reports it had loaded: 0 lock-step, at most the
        staleness K (``rollout/staleness``); anything else fails the run (a sync that did not reach
        the engine, or calls that ran out of order)."""
        synced = {st.args["to"] for st in self.p.steps_of(Op.WEIGHT_SYNC)}
        for st in self.p.steps_of(Op.GENERATE):
            if st.engine not in synced or st.node not in it.metas:
                continue
            loaded = int(first(self._wait(st, it.metas[st.node], "generate"), "weights_loaded") or 0)
            lag = self._ahead.lag(step, self.p.staleness, self._load_base + loaded, st.node, loaded)
            if self._ahead.ran_ahead:
                m["rollout/staleness"] = lag
        self._ahead.trained(step)

    def _rollouts(self, step: int) -> Iteration:
        """Step ``step``'s iteration with its prompts read and its generates issued (not waited for).
        A rollout engine runs calls in the order they were issued, so a generate issued before
        this step's weight sync samples with the weights the previous syncs delivered."""
        it = self._iteration(step, 0)
        for st in self.p.steps:
            if st.op in (Op.INPUT, Op.GENERATE) and (st.op == Op.INPUT or self.p.staleness):
                self._exec(st, it)
        return it

    def set_staleness(self, k: int) -> None:
        """Change the staleness between steps (a re-plan, ``flowc.replan``): from the next step the
        rollouts of up to ``k`` later steps are issued ahead. Rollouts issued already stay and are
        trained on in order; their lag stays within the staleness they were issued under."""
        if k == self.p.staleness:
            return
        check_staleness(self.p.graph, k)
        self.p = replace(self.p, staleness=k)

    def _iteration(self, step: int, round_: int) -> Iteration:
        """The prompts of ``step`` (a fresh draw of its own for each filter round) and the other data columns."""
        seed = self.cfg.seed if round_ == 0 else f"{self.cfg.seed}/round{round_}"
        drawn = self.s.data.batch_indices(step, self.p.workload.prompts, seed)
        rows = [self.s.data.rows[i] for i in drawn]
        key = self.s.data.prompt_key
        columns = {k: [r[k] for r in rows] for k in rows[0] if k != key}
        return Iteration(step, round_, [r[key] for r in rows], columns, rows=drawn)

    def _exec(self, st: Step, it: Iteration) -> None:
        handler = self._handlers.get(st.op)
        if handler is None:
            raise RuntimeFailure(f"the runtime cannot execute op {st.op!r} ({st.node})")
        handler(st, self.p.graph[st.node], it)

    def _input(self, st: Step, node: Node, it: Iteration) -> None:
        w = self.p.workload
        if node.kwargs.get("kind") == "preferences":
            pairs = tokenize_pairs(
                self.tok, it.prompts, it.columns["chosen"], it.columns["rejected"], w.prompt_len, w.response_len
            )
            it.env[st.node] = Local(pairs)
        else:
            it.env[st.node] = Local(tokenize_prompts(self.tok, it.prompts, w.prompt_len))

    def _generate_step(self, st: Step, node: Node, it: Iteration) -> None:
        n = int(st.args.get("n", 1))
        it.samples[st.node] = n
        records = None
        if st.args.get("env") is not None:  # what each trajectory's environment is reset from: the prompt's data row
            records = [{"prompt": p, **{c: v[i] for c, v in it.columns.items()}} for i, p in enumerate(it.prompts)]
        it.env[st.node], it.metas[st.node] = self._generate(st, it.env[node.args[0].node], n, it.step, it.round, records)

    def _forward_step(self, st: Step, node: Node, it: Iteration) -> None:
        it.env[st.node], it.metas[st.node] = self._forward(st, value_at(it.env, node.args[0]))

    def _update_step(self, st: Step, node: Node, it: Iteration) -> None:
        it.metas[st.node] = self._update(st, it.env, node)

    def _sync_step(self, st: Step, node: Node, it: Iteration) -> None:
        it.metas[st.node] = self.syncs.issue(st, it.step)

    def _reward(self, st: Step, node: Node, it: Iteration) -> None:
        src = node.args[0].node
        if src not in it.metas:
            raise RuntimeFailure(f"reward {st.node} must score a rollout straight from generate, not %{src}")
        texts = [t for m in self._wait(st, it.metas[src], "generate") for t in m["texts"]]
        k = it.samples[src]
        cols = {c: [v for v in vals for _ in range(k)] for c, vals in it.columns.items()}
        ptext = [p for p in it.prompts for _ in range(k)]
        where = (
            f"step {it.step}{f' (filter round {it.round})' if it.round else ''}: {len(texts)} responses to "
            f"{len(it.prompts)} prompts ({self.s.data.rows_named(it.rows)})"
        )
        start, t0 = time.time(), time.perf_counter()
        scores, it.reward_metrics[st.node] = self.rewards.score_with_metrics(node.role, ptext, texts, cols, where=where)
        self._tally.busy.append((start, time.perf_counter() - t0))  # the user's reward code: not the controller's
        it.env[st.node] = Local(scores)

    def _compute(self, st: Step, node: Node, it: Iteration) -> None:
        fn = resolve(node.target)
        args, kwargs = self._arg(it.env, node.args), self._arg(it.env, node.kwargs)
        try:
            it.env[st.node] = Local(fn(*args, **kwargs))
        except Exception as e:
            raise RuntimeFailure(f"compute {st.node} ({node.target}) failed at step {it.step}: {type(e).__name__}: {e}") from e

    def _filter(self, st: Step, it: Iteration) -> Local:
        """Dynamic sampling: keep the groups whose scores vary; re-run the filter's ancestors on
        fresh prompts until the batch holds as many groups as it started with, or the rounds run out."""
        node = self.p.graph[st.node]
        k, max_rounds = int(node.kwargs["group_size"]), int(node.kwargs["max_rounds"])
        region = filter_region(self.p.graph, st.node)
        steps = [s for s in self.p.steps if s.node in region]
        rollout, scores = self._arg(it.env, node.args[0]), self._arg(it.env, node.args[1])
        want = num_rows(rollout) // k
        kept: list[tuple[Any, torch.Tensor]] = []
        first_keep = varied_groups(scores, k)
        spare = (rollout, scores, (~first_keep).repeat_interleave(k))
        keep, rounds, n_kept = first_keep, 1, 0
        while True:
            rows = keep.repeat_interleave(k).nonzero().squeeze(-1)
            kept.append((take_rows(rollout, rows), scores[rows]))
            n_kept += int(keep.sum())
            if n_kept >= want or rounds >= max_rounds:
                break
            again = self._iteration(it.step, rounds)
            for s in steps:
                self._exec(s, again)
            for s in steps:  # this round's device time and generated tokens count toward the step
                if s.node in again.metas:
                    got = self._wait(s, again.metas[s.node], s.op)
                    sec = self._tally.seconds
                    sec[s.node] = sec.get(s.node, 0.0) + max(x.get("seconds", 0.0) for x in got)
                    self._tally.ran(got)
                    if s.op == Op.GENERATE:
                        self._tally.tokens += sum(x["tokens"] for x in got)
            rollout, scores = self._arg(again.env, node.args[0]), self._arg(again.env, node.args[1])
            keep, rounds = varied_groups(scores, k), rounds + 1
        if n_kept < want:  # rounds ran out: top up with groups that carry no gradient
            rows = spare[2].nonzero().squeeze(-1)[: (want - n_kept) * k]
            kept.append((take_rows(spare[0], rows), spare[1][rows]))
        out_rollout = take_rows(cat_rows([r for r, _ in kept]), torch.arange(want * k))
        out_scores = torch.cat([s for _, s in kept])[: want * k]
        self._tally.metrics.update(
            {
                f"{st.node}/rounds": rounds,
                f"{st.node}/kept_groups": min(n_kept, want) / want,
                f"{st.node}/first_round_kept": float(first_keep.float().mean()),
            }
        )
        return Local((out_rollout, out_scores))

    # ---------------------------------------------------------- device calls
    def _generate(
        self, st: Step, prompts: Any, n: int, step: int, round_: int = 0, records: list[dict[str, Any]] | None = None
    ) -> tuple[Sharded, list[Any]]:
        wg, e = self._group_of(st.engine)
        sp = sampling_of(st, self.cfg)
        max_tokens = sp.max_tokens or self.p.workload.response_len
        src = self._sharded(prompts)
        args: dict[str, Any] = {"n": n, "sampling": sp, "max_tokens": max_tokens, "step": step, "round": round_}
        if st.args.get("env") is not None:  # an agent rollout: the trajectory's budget is the plan's response_len
            binding = self._binding(st)
            args.update(
                env=binding,
                records=records,
                max_tokens=self.p.workload.response_len,
                turn_tokens=max_tokens,
                max_turns=int(st.args.get("max_turns") or binding.max_turns),
            )
        out = self._generate_call(wg, e, src, args)
        counts = [n * (hi - lo) for lo, hi in even_split(src.rows, e.layout.dp)]
        return Sharded(tuple(o[0] for o in out), tuple(counts)), [o[1] for o in out]

    def _binding(self, st: Step) -> EnvBinding:
        """The environment of an agent generate, with its pool's size: the run config's
        ``env_workers`` when it sets one, else the plan's (sized to keep up with the engine)."""
        binding = self.s.envs[str(st.args["env"])]
        planned = int(st.args.get("env_workers") or 0)  # type: ignore[call-overload]
        if planned and "env_workers" not in self.cfg.model_fields_set:
            binding = replace(binding, workers=planned)
        return binding

    def _generate_call(self, wg: Group, e: EngineSpec, src: Sharded, args: dict[str, Any]) -> list[Any]:
        """One generate per replica: the ``tp`` ranks of a replica get the same prompts
        (vLLM's tensor-parallel group); only its first rank's output is kept. Each
        replica is told where its rows start, so seeds follow global rows."""
        tp = e.layout.tp
        ranges = even_split(src.rows, e.layout.dp)
        per = self._per_rank({"prompts": src}, e.layout.dp)
        calls = [(e.key, Op.GENERATE, per[r // tp], _replica_args(args, ranges[r // tp])) for r in range(wg.size)]
        return wg.call("run", per_rank=calls, num_returns=2)[::tp]

    def _forward(self, st: Step, rollout: Any) -> tuple[Sharded, list[Any]]:
        """Every rank of a data-parallel replica gets the replica's rows (Megatron's
        tp/pp ranks); one rank per replica answers (see runtime.ranks)."""
        wg, e = self._group_of(st.engine)
        rollout = self._sharded(rollout)
        per = self._per_rank({"rollout": rollout}, e.layout.dp)
        replica = replica_of(e.layout)
        out = wg.call(
            "run",
            per_rank=[(e.key, st.op, per[replica[r]], {k: st.args[k] for k in MICRO_ARGS}) for r in range(wg.size)],
            num_returns=2,
        )
        counts = [hi - lo for lo, hi in even_split(rollout.rows, e.layout.dp)]
        return Sharded(tuple(out[r][0] for r in output_ranks(e.layout)), tuple(counts)), [o[1] for o in out]

    def _update(self, st: Step, env: dict[str, Any], node: Node) -> list[Any]:
        wg, e = self._group_of(st.engine)
        values: dict[str, Sharded] = {"rollout": self._sharded(value_at(env, node.args[0]))}
        for name in UPDATE_TENSORS:
            if name in node.kwargs:
                v = value_at(env, node.kwargs[name])
                values[name] = self._sharded(v) if isinstance(v, Local) else v
        w = self.p.workload
        unit = 2 if isinstance(node.kwargs["loss"], PREFERENCE_LOSSES) else 1  # DPO's pairs stay on one rank
        ranges = minibatch_rows(values["rollout"].rows, w.mini_batches, e.layout.dp, unit)
        per = [{k: [p for a, b in ranges[r] for p in v.pieces(a, b)] for k, v in values.items()} for r in range(e.layout.dp)]
        base = {
            "loss": node.kwargs["loss"],
            "kl_coef": float(node.kwargs.get("kl_coef", 0.0)),
            "kl_kind": node.kwargs.get("kl_kind", DEFAULT_KL_KIND),  # unused without ref_logprobs (kl_coef 0)
            "entropy_coef": float(node.kwargs.get("entropy_coef", 0.0)),
            "epochs": w.epochs,
            **{k: st.args[k] for k in MICRO_ARGS},
            **({"behaviour": self._behaviour} if e.role_kind == RoleKind.POLICY else {}),
        }
        if e.role_kind == RoleKind.POLICY and self.cfg.skip_idle_rows:
            base["skip_idle"] = update_skips_idle(node.kwargs)  # as the planner priced it
        args = [{**base, "mini_sizes": [b - a for a, b in ranges[r]]} for r in range(e.layout.dp)]
        replica = replica_of(e.layout)
        calls = [(e.key, Op.UPDATE, per[replica[r]], args[replica[r]]) for r in range(wg.size)]
        return [o[1] for o in wg.call("run", per_rank=calls, num_returns=2)]

    def _response_limit(self, st: Step) -> int:
        """The longest response ``st`` may generate (what ``response_length/clip_ratio`` counts; a
        multi-turn generate's policy tokens are bounded by the trajectory's budget)."""
        if st.args.get("env") is not None:
            return self.p.workload.response_len
        return int(st.args.get("max_tokens") or self.cfg.sampling.max_tokens or self.p.workload.response_len)

    # ----------------------------------------------------------- checkpoints
    def _trained(self) -> list[tuple[Group, EngineSpec]]:
        return [(self.groups[g.name], e) for g in self.p.groups for e in g.engines if e.key.kind == EngineKind.TRAIN]

    def clean_checkpoints(self) -> list[Path]:
        """Remove what an interrupted save left behind; returns it."""
        return CheckpointDir(self.s.out_dir).clean()

    def save(self, step: int, extra: dict[str, Any]) -> Path:
        """Write step's checkpoint: every trained rank's state and the controller's (see CheckpointDir.write)."""

        def save_ranks(folder: Path) -> None:
            for wg, e in self._trained():
                wg.get(wg.call("save", e.key, str(folder)), f"saving {e.role}")

        ckpts = CheckpointDir(self.s.out_dir, self.cfg.keep_checkpoints)
        return ckpts.write(step, {"step": step, "metrics": self.history, **extra}, save_ranks)

    def restore(self, run_dir: Path) -> dict[str, Any]:
        """Load the latest checkpoint of ``run_dir`` into the engines; returns its controller state."""
        ckpt, state = CheckpointDir(run_dir).read_latest()
        for wg, e in self._trained():
            wg.get(wg.call("load", e.key, str(ckpt)), f"loading {e.role}")
        self.syncs.reload(int(state.get("step", 0)))  # the rollout engines get the restored weights (checked)
        self.history = state.get("metrics", [])
        self._load_base = int(state.get("step", 0)) - (1 if self.p.steps_of(Op.WEIGHT_SYNC) else 0)  # one load: the restore
        return state

    def export_policy(self, path: Path) -> None:
        """The trained policy in HF format at ``path``; any other trained role (a critic) beside it in
        ``path/ROLE`` (a critic as a sequence classifier with its value head)."""
        for wg, e in self._trained():
            where = path if e.role_kind == "policy" else path / e.key.role
            wg.get(wg.call("export_hf", e.key, str(where), self.s.tokenizer), f"exporting {e.key.role}")


__all__ = ["Controller", "Local", "RunSpec"]
