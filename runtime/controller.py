"""The single controller: starts the worker groups of a Program and runs it.

Each iteration walks the program's steps in order. Device steps are submitted
to their worker group without waiting (Ray actors run their calls in order,
so one group's steps are sequential and different groups overlap); the
controller waits only when its own step (a reward, a compute) needs a value.
Bulk values stay in the object store as one shard per worker; the controller
passes references and row ranges.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import ray
import torch

from flowc.errors import DataError, RuntimeFailure
from flowc.ir.functional import PromptBatch, varied_groups
from flowc.ir.graph import FlowGraph, ValueRef
from flowc.ir.losses import PREFERENCE_LOSSES, dpo_loss
from flowc.ir.plan import Plan
from flowc.ir.run_config import RunConfig
from flowc.ir.sampling import SamplingParams
from flowc.ir.targets import resolve
from flowc.ir.verify import filter_region
from flowc.ir.workload import WorkloadSpec
from flowc.runtime.batches import Piece, Sharded, cat_rows, even_split, minibatch_rows, num_rows, project, take_rows
from flowc.runtime.data import Records, RewardFn, call_reward, tokenize_pairs, tokenize_prompts
from flowc.runtime.program import EngineSpec, Program, Step
from flowc.runtime.ranks import output_ranks, replica_of
from flowc.runtime.worker import WorkerGroup

BUCKET_BYTES = 64e6


@dataclass
class RunSpec:
    """Everything a run needs besides the cluster."""

    program: Program
    plan: Plan
    graph: FlowGraph
    config: RunConfig
    workload: WorkloadSpec
    model_sources: dict[str, str]  # role → HF model directory
    tokenizer: str  # the policy's tokenizer directory
    data: Records
    eval_data: Records | None
    rewards: dict[str, RewardFn]  # Reward role → function
    reward_names: dict[str, str] = field(default_factory=dict)
    out_dir: Path = Path("runs/run")
    gpus: bool = False


@dataclass
class Local:
    value: Any


class Controller:
    """Owns the worker groups for the length of a run."""

    def __init__(self, spec: RunSpec) -> None:
        from transformers import AutoTokenizer

        self.s = spec
        self.cfg = spec.config
        self.groups: dict[str, WorkerGroup] = {}
        self.tok = AutoTokenizer.from_pretrained(spec.tokenizer)
        self.dtype = self.cfg.dtype_on("gpu" if spec.gpus else "cpu")
        self.history: list[dict[str, Any]] = []
        self.placement: dict[str, list[dict[str, Any]]] = {}
        # what a step's filter rounds add to its metrics (extra device seconds, tokens); reset per step
        self._extra: dict[str, Any] = {"seconds": {}, "tokens": 0, "metrics": {}}

    # ---------------------------------------------------------------- start
    def start(self) -> None:
        """Create every worker group, join its world, load its engines."""
        backend = "nccl" if self.s.gpus else "gloo"
        for g in self.s.program.groups:
            strategy = "STRICT_PACK" if len(g.nodes) == 1 else "SPREAD"
            roles = ", ".join(f"{e.role}/{e.engine}" for e in g.engines)
            wg = WorkerGroup(
                g.name,
                g.size,
                gpus=self.s.gpus,
                cpus_per_worker=self.cfg.cpus_per_worker,
                strategy=strategy,
                timeout_s=self.cfg.timeout_s,
                roles=roles,
            )
            self.groups[g.name] = wg
            self.placement[g.name] = wg.get(wg.call("where"), "start")
            master = self.placement[g.name][0]["ip"]
            port = wg.get(wg.workers[0].port.remote(), "start")
            wg.get(wg.call("init_dist", master, port, backend, self.cfg.timeout_s), "joining the process group")
            for e in g.engines:
                wg.get(
                    wg.call("add_engine", self._key(e), e.kind, e.engine, self._source(e), e.layout, self._options(e)),
                    f"loading {e.role}/{e.engine}",
                )

    def _key(self, e: EngineSpec) -> str:
        return f"{e.role}/{e.engine}"

    def _source(self, e: EngineSpec) -> str:
        return self.s.model_sources[e.role]

    def _options(self, e: EngineSpec) -> dict[str, Any]:
        w = self.s.workload
        group = next(g for g in self.s.program.groups if e in g.engines)
        return {
            "dtype": self.dtype,
            "seed": self.cfg.seed,
            "optim": self.cfg.optim_for(e.role),
            "tokenizer": self.s.tokenizer,
            # the longest sequence a rollout engine sees: a prompt and the longest response any generate asks for
            "max_model_len": w.prompt_len + max(w.response_len, self._max_tokens()),
            # a rollout engine sharing its devices with a trainer frees its memory between rollouts (where it can)
            "colocated": any(x.engine == "train" for x in group.engines),
        }

    def _max_tokens(self) -> int:
        asked = [int(st.args["max_tokens"]) for st in self.s.program.steps if st.args.get("max_tokens")]
        return max([self.cfg.sampling.max_tokens or 0, *asked])

    def shutdown(self) -> None:
        for wg in self.groups.values():
            wg.shutdown()
        self.groups.clear()

    # ------------------------------------------------------------- values
    def _group_of(self, step: Step) -> tuple[WorkerGroup, EngineSpec]:
        role, engine = step.engine.split("/")
        gspec, espec = self.s.program.engine(role, engine)
        return self.groups[gspec.name], espec

    def _sharded(self, v: Any) -> Sharded:
        if isinstance(v, Sharded):
            return v
        return Sharded((ray.put(v.value),), (num_rows(v.value),))

    def _value(self, env: dict[str, Any], ref: ValueRef) -> Any:
        base = env[ref.node]
        if isinstance(base, Sharded):
            out = base
            for p in ref.path:
                out = out.project(p)
            return out
        return Local(project(base.value, ref.path))

    def _materialize(self, v: Any) -> Any:
        if isinstance(v, Local):
            return v.value
        from flowc.runtime.batches import assemble

        return assemble(v.pieces(0, v.rows), lambda refs: ray.get(list(refs), timeout=self.cfg.timeout_s))

    def _arg(self, env: dict[str, Any], x: Any) -> Any:
        if isinstance(x, ValueRef):
            return self._materialize(self._value(env, x))
        if isinstance(x, (list, tuple)):
            return type(x)(self._arg(env, y) for y in x)
        if isinstance(x, dict):
            return {k: self._arg(env, y) for k, y in x.items()}
        return x

    @staticmethod
    def _per_rank(values: dict[str, Sharded], size: int) -> list[dict[str, list[Piece]]]:
        rows = next(iter(values.values())).rows
        ranges = even_split(rows, size)
        return [{k: v.pieces(lo, hi) for k, v in values.items()} for lo, hi in ranges]

    # -------------------------------------------------------------- a step
    def run_step(self, step: int) -> dict[str, Any]:
        t_step = time.perf_counter()
        env: dict[str, Any] = {}
        metas: dict[str, list[Any]] = {}
        n_of: dict[str, int] = {}
        self._extra = {"seconds": {}, "tokens": 0, "metrics": {}}
        batch = self._prompt_batch(step, self.cfg.seed)
        for st in self.s.program.steps:
            if st.op == "filter":
                env[st.node] = self._filter(st, env, step)
            else:
                self._exec(st, env, metas, n_of, step, batch)
        return self._metrics(step, env, metas, n_of, t_step)

    def _prompt_batch(self, step: int, seed: int | str) -> tuple[list[str], dict[str, list[Any]]]:
        """The prompts of ``step`` and the other data columns (what reward functions read)."""
        rows = self.s.data.batch(step, self.s.workload.prompts, seed)
        columns = {k: [r[k] for r in rows] for k in rows[0] if k != self.s.data.prompt_key}
        return [r[self.s.data.prompt_key] for r in rows], columns

    def _exec(
        self,
        st: Step,
        env: dict[str, Any],
        metas: dict[str, list[Any]],
        n_of: dict[str, int],
        step: int,
        batch: tuple[list[str], dict[str, list[Any]]],
    ) -> None:
        node = self.s.graph[st.node]
        prompts_text, columns = batch
        if st.op == "input" and node.kwargs.get("kind") == "preferences":
            w = self.s.workload
            pairs = tokenize_pairs(self.tok, prompts_text, columns["chosen"], columns["rejected"], w.prompt_len, w.response_len)
            env[st.node] = Local(pairs)
        elif st.op == "input":
            env[st.node] = Local(tokenize_prompts(self.tok, prompts_text, self.s.workload.prompt_len))
        elif st.op == "generate":
            n = int(st.args.get("n", 1))
            n_of[st.node] = n
            env[st.node], metas[st.node] = self._generate(st, env[node.args[0].node], n, step)
        elif st.op in ("logprobs", "values", "score"):
            env[st.node], metas[st.node] = self._forward(st, self._value(env, node.args[0]))
        elif st.op == "update":
            metas[st.node] = self._update(st, env, node)
        elif st.op == "weight_sync":
            metas[st.node] = self._sync(st)
        elif st.op == "reward":
            src = node.args[0].node
            if src not in metas:
                raise RuntimeFailure(f"reward {st.node} must score a rollout straight from generate, not %{src}")
            texts = [t for m in self._wait(st, metas[src], "generate") for t in m["texts"]]
            k = n_of[src]
            cols = {c: [v for v in vals for _ in range(k)] for c, vals in columns.items()}
            ptext = [p for p in prompts_text for _ in range(k)]
            env[st.node] = Local(
                call_reward(self.s.rewards[node.role], self.s.reward_names.get(node.role, node.role), ptext, texts, cols)
            )
        elif st.op == "compute":
            fn = resolve(node.target)
            args = self._arg(env, node.args)
            kwargs = self._arg(env, node.kwargs)
            try:
                env[st.node] = Local(fn(*args, **kwargs))
            except Exception as e:
                raise RuntimeFailure(f"compute {st.node} ({node.target}) failed at step {step}: {type(e).__name__}: {e}") from e
        else:
            raise RuntimeFailure(f"the runtime cannot execute op {st.op!r} ({st.node})")

    def _filter(self, st: Step, env: dict[str, Any], step: int) -> Local:
        """Dynamic sampling: keep the groups whose scores vary; re-run the filter's ancestors on
        fresh prompts until the batch holds as many groups as it started with, or the rounds run out."""
        node = self.s.graph[st.node]
        k, max_rounds = int(node.kwargs["group_size"]), int(node.kwargs["max_rounds"])
        region = filter_region(self.s.graph, st.node)
        steps = [s for s in self.s.program.steps if s.node in region]
        rollout, scores = self._arg(env, node.args[0]), self._arg(env, node.args[1])
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
            env2: dict[str, Any] = {}
            metas2: dict[str, list[Any]] = {}
            n2: dict[str, int] = {}
            batch = self._prompt_batch(step, f"{self.cfg.seed}/round{rounds}")
            for s in steps:
                self._exec(s, env2, metas2, n2, step, batch)
            for s in steps:  # this round's device time and generated tokens count toward the step
                if s.node in metas2:
                    got = self._wait(s, metas2[s.node], s.op)
                    sec = self._extra["seconds"]
                    sec[s.node] = sec.get(s.node, 0.0) + max(x.get("seconds", 0.0) for x in got)
                    if s.op == "generate":
                        self._extra["tokens"] += sum(x["tokens"] for x in got)
            rollout, scores = self._arg(env2, node.args[0]), self._arg(env2, node.args[1])
            keep, rounds = varied_groups(scores, k), rounds + 1
        if n_kept < want:  # rounds ran out: top up with groups that carry no gradient
            rows = spare[2].nonzero().squeeze(-1)[: (want - n_kept) * k]
            kept.append((take_rows(spare[0], rows), spare[1][rows]))
        out_rollout = take_rows(cat_rows([r for r, _ in kept]), torch.arange(want * k))
        out_scores = torch.cat([s for _, s in kept])[: want * k]
        self._extra["metrics"].update(
            {
                f"{st.node}/rounds": rounds,
                f"{st.node}/kept_groups": min(n_kept, want) / want,
                f"{st.node}/first_round_kept": float(first_keep.float().mean()),
            }
        )
        return Local((out_rollout, out_scores))

    def _wait(self, st: Step, refs: list[Any], what: str) -> list[Any]:
        group = self.groups[st.group] if st.group else next(iter(self.groups.values()))
        return group.get(refs, f"{what} {st.node}")

    def _generate(self, st: Step, prompts: Any, n: int, step: int) -> tuple[Sharded, list[Any]]:
        wg, e = self._group_of(st)
        sp = self.cfg.sampling.model_copy(update={k: v for k, v in st.args.items() if k in SamplingParams.model_fields})
        max_tokens = sp.max_tokens or self.s.workload.response_len
        src = self._sharded(prompts)
        out = self._generate_call(wg, e, src, {"n": n, "sampling": sp, "max_tokens": max_tokens, "step": step})
        counts = [n * (hi - lo) for lo, hi in even_split(src.rows, e.layout.dp)]
        return Sharded(tuple(o[0] for o in out), tuple(counts)), [o[1] for o in out]

    def _generate_call(self, wg: WorkerGroup, e: EngineSpec, src: Sharded, args: dict[str, Any]) -> list[Any]:
        """One generate per replica: the ``tp`` ranks of a replica get the same prompts
        (vLLM's tensor-parallel group); only its first rank's output is kept."""
        tp = e.layout.tp
        per = self._per_rank({"prompts": src}, e.layout.dp)
        out = wg.call("run", per_rank=[(self._key(e), "generate", per[r // tp], args) for r in range(wg.size)], num_returns=2)
        return out[::tp]

    def _forward(self, st: Step, rollout: Sharded) -> tuple[Sharded, list[Any]]:
        """Every rank of a data-parallel replica gets the replica's rows (Megatron's
        tp/pp ranks); one rank per replica answers (see runtime.ranks)."""
        wg, e = self._group_of(st)
        rollout = self._sharded(rollout)
        per = self._per_rank({"rollout": rollout}, e.layout.dp)
        replica = replica_of(e.layout)
        out = wg.call(
            "run",
            per_rank=[(self._key(e), st.op, per[replica[r]], {"micro": e.layout.micro_batch}) for r in range(wg.size)],
            num_returns=2,
        )
        counts = [hi - lo for lo, hi in even_split(rollout.rows, e.layout.dp)]
        return Sharded(tuple(out[r][0] for r in output_ranks(e.layout)), tuple(counts)), [o[1] for o in out]

    def _update(self, st: Step, env: dict[str, Any], node: Any) -> list[Any]:
        wg, e = self._group_of(st)
        values: dict[str, Sharded] = {"rollout": self._sharded(self._value(env, node.args[0]))}
        for name in ("advantages", "old_logprobs", "ref_logprobs", "returns", "old_values"):
            if name in node.kwargs:
                v = self._value(env, node.kwargs[name])
                values[name] = self._sharded(v) if isinstance(v, Local) else v
        w = self.s.workload
        unit = 2 if isinstance(node.kwargs["loss"], PREFERENCE_LOSSES) else 1  # DPO's pairs stay on one rank
        ranges = minibatch_rows(values["rollout"].rows, w.mini_batches, e.layout.dp, unit)
        per = [{k: [p for a, b in ranges[r] for p in v.pieces(a, b)] for k, v in values.items()} for r in range(e.layout.dp)]
        base = {
            "loss": node.kwargs["loss"],
            "kl_coef": float(node.kwargs.get("kl_coef", 0.0)),
            "kl_kind": node.kwargs.get("kl_kind", "low_var_kl"),
            "entropy_coef": float(node.kwargs.get("entropy_coef", 0.0)),
            "epochs": w.epochs,
            "micro": e.layout.micro_batch,
        }
        args = [{**base, "mini_sizes": [b - a for a, b in ranges[r]]} for r in range(e.layout.dp)]
        replica = replica_of(e.layout)
        out = wg.call(
            "run", per_rank=[(self._key(e), "update", per[replica[r]], args[replica[r]]) for r in range(wg.size)], num_returns=2
        )
        return [o[1] for o in out]

    def _sync(self, st: Step) -> list[Any]:
        role = st.engine.split("/")[0]
        tg, te = self.s.program.engine(role, "train")
        gg, ge = self.s.program.engine(role, "rollout")
        src, dst = self._key(te), self._key(ge)
        if tg.name == gg.name:
            wg = self.groups[tg.name]
            return wg.call("sync_local", src, dst)
        train, gen = self.groups[tg.name], self.groups[gg.name]
        exported = train.get(train.call("export_weights", src, BUCKET_BYTES), f"weight sync {role} (gather)")
        buckets = exported[0][0]
        return gen.call("import_weights", dst, buckets)

    # -------------------------------------------------------------- metrics
    def _metrics(
        self, step: int, env: dict[str, Any], metas: dict[str, list[Any]], n_of: dict[str, int], t_step: float
    ) -> dict[str, Any]:
        g = self.s.graph
        m: dict[str, Any] = {"step": step + 1}
        measured: dict[str, float] = {}
        gen_tokens = 0
        tokens_of: dict[str, int] = {}
        for st in self.s.program.steps:
            if st.node not in metas:
                continue
            got = self._wait(st, metas[st.node], st.op)
            measured[st.node] = max(x.get("seconds", 0.0) for x in got)
            used = [x["device_gb"] for x in got if "device_gb" in x]
            if used:
                m["device_gb"] = max([m.get("device_gb", 0.0), *used])  # GPU memory in use after an op, worst device
            if st.op == "generate":
                tokens_of[st.node] = sum(x["tokens"] for x in got)
                gen_tokens += tokens_of[st.node]
            if st.op == "update":
                stats = [x["stats"] for x in got]
                for k in stats[0]:
                    m[f"{g[st.node].role}/{k}"] = sum(s[k] for s in stats) / len(stats)
            if st.op == "weight_sync":
                m[f"{g[st.node].role}/sync_bytes_per_device"] = max(x["bytes"] for x in got)
                m[f"{g[st.node].role}/sync_s"] = max(x["seconds"] for x in got)
                # the planner's, beside the measured (one sync feeds every generate of the role, as lowered)
                r = next(r for r in self.s.plan.reshards if r.role == g[st.node].role and r.dst_phase == "generate")
                m[f"{g[st.node].role}/sync_bytes_predicted"] = r.bytes_per_device
        for st in self.s.program.steps:
            node = g[st.node]
            if st.op == "reward":
                scores = env[st.node].value
                m[f"{st.node}/mean"] = float(scores.mean())
                m[f"{st.node}/std"] = float(scores.std()) if scores.numel() > 1 else 0.0
                if bool(((scores == 0) | (scores == 1)).all()):
                    m[f"{st.node}/accuracy"] = float(scores.mean())
            if st.op == "generate" and node.kwargs.get("greedy") is not True and "response_length" not in m:
                m["response_length"] = tokens_of[st.node] / max(env[st.node].rows, 1)
        first_reward = next((st.node for st in self.s.program.steps if st.op == "reward"), None)
        if first_reward:
            m["reward"] = m[f"{first_reward}/mean"]
            m["reward_std"] = m[f"{first_reward}/std"]
            if f"{first_reward}/accuracy" in m:
                m["accuracy"] = m[f"{first_reward}/accuracy"]
        extra = self._extra
        if extra:
            for node_id, sec in extra["seconds"].items():
                measured[node_id] = measured.get(node_id, 0.0) + sec
            gen_tokens += extra["tokens"]
            m.update(extra["metrics"])
        wall = time.perf_counter() - t_step  # every op of the step has finished
        m["step_s"] = wall
        m["gen_tokens"] = gen_tokens
        m["tokens_per_s"] = gen_tokens / wall if wall > 0 else 0.0
        m["measured_s"] = measured
        m["predicted_s"] = {st.node: st.predicted_s for st in self.s.program.steps if st.group}
        return m

    # ------------------------------------------------------------- evaluate
    def evaluate(self) -> dict[str, float]:
        """Greedy responses to held-out prompts, scored by the first reward function."""
        data = self.s.eval_data
        if data is None:
            return {}
        dpo = [
            st
            for st in self.s.program.steps
            if st.op == "update" and isinstance(self.s.graph[st.node].kwargs["loss"], PREFERENCE_LOSSES)
        ]
        if dpo:
            return self._evaluate_pairs(dpo[0], data)
        if not self.s.rewards:
            return {}
        rows = data.head(self.cfg.eval_size)
        role = next(iter(self.s.rewards))
        gen_step = next(st for st in self.s.program.steps if st.op == "generate")
        wg, e = self._group_of(gen_step)
        sp = SamplingParams(greedy=True)
        prompts = tokenize_prompts(self.tok, [r[data.prompt_key] for r in rows], self.s.workload.prompt_len)
        src = Sharded((ray.put(prompts),), (len(rows),))
        args = {"n": 1, "sampling": sp, "max_tokens": self.s.workload.response_len, "step": -1}
        out = self._generate_call(wg, e, src, args)
        texts = [t for m in wg.get([o[1] for o in out], "evaluation") for t in m["texts"]]
        cols = {k: [r[k] for r in rows] for k in rows[0] if k != data.prompt_key}
        scores = call_reward(
            self.s.rewards[role], self.s.reward_names.get(role, role), [r[data.prompt_key] for r in rows], texts, cols
        )
        return {
            "eval/reward": float(scores.mean()),
            "eval/accuracy": float((scores >= 1.0).float().mean()),
            "eval/size": float(len(rows)),
        }

    def _evaluate_pairs(self, upd: Step, data: Records) -> dict[str, float]:
        """Held-out preference pairs: how often, and by how much, the policy prefers the chosen response
        over the rejected one relative to the reference (DPO's implicit reward)."""
        node = self.s.graph[upd.node]
        ref = node.kwargs["ref_logprobs"]
        ref_step = next((st for st in self.s.program.steps if st.node == ref.node and st.op == "logprobs"), None)
        if ref_step is None or ref.path:
            return {}  # the reference's log-probabilities are computed, not read: nothing to compare against
        rows = data.head(self.cfg.eval_size)
        w = self.s.workload
        pairs = tokenize_pairs(
            self.tok,
            [r[data.prompt_key] for r in rows],
            [r["chosen"] for r in rows],
            [r["rejected"] for r in rows],
            w.prompt_len,
            w.response_len,
        )
        src = Sharded((ray.put(pairs),), (num_rows(pairs),))
        ref_lp, _ = self._forward(ref_step, src)
        act_lp, _ = self._forward(replace(upd, op="logprobs"), src)
        _, st = dpo_loss(node.kwargs["loss"], self._materialize(act_lp), self._materialize(ref_lp), pairs.response_mask)
        return {
            "eval/dpo_accuracy": st["dpo_accuracy"],
            "eval/dpo_margin": st["dpo_margin"],
            "eval/dpo_loss": st["dpo_loss"],
            "eval/size": float(len(rows)),
        }

    # ----------------------------------------------------------- checkpoints
    def save(self, step: int, extra: dict[str, Any]) -> Path:
        """Write a checkpoint atomically: into a temporary directory, then rename."""
        root = self.s.out_dir / "checkpoints"
        tmp = root / f".tmp-{step:06d}-{os.getpid()}"
        final = root / f"step-{step:06d}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        for g in self.s.program.groups:
            wg = self.groups[g.name]
            for e in g.engines:
                if e.engine == "train":
                    wg.get(wg.call("save", self._key(e), str(tmp)), f"saving {e.role}")
        state = {"step": step, "metrics": self.history, **extra}
        (tmp / "controller.json").write_text(json.dumps(state))
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        latest = root / "latest"
        (root / ".latest.tmp").write_text(final.name)
        os.replace(root / ".latest.tmp", latest)
        kept = sorted(p for p in root.glob("step-*") if p.is_dir())
        for old in kept[: -self.cfg.keep_checkpoints]:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def restore(self, run_dir: Path) -> dict[str, Any]:
        """Load the latest checkpoint of ``run_dir`` into the engines; returns its controller state."""
        root = run_dir / "checkpoints"
        latest = root / "latest"
        if not latest.exists():
            raise DataError(f"{run_dir} has no checkpoint to resume from", fix="resume a run directory written by flowc run")
        ckpt = root / latest.read_text().strip()
        state = json.loads((ckpt / "controller.json").read_text())
        for g in self.s.program.groups:
            wg = self.groups[g.name]
            for e in g.engines:
                if e.engine == "train":
                    wg.get(wg.call("load", self._key(e), str(ckpt)), f"loading {e.role}")
        for st in self.s.program.steps:  # the rollout engines get the restored weights
            if st.op == "weight_sync":
                self._wait(st, self._sync(st), "weight sync")
        self.history = state.get("metrics", [])
        return state

    def sync_error(self, role: str, step: int = 10**6) -> float:
        """Largest |trainer − rollout engine| log-probability of the same sampled
        tokens: zero (to rounding) when the last weight sync delivered the
        trained weights."""
        gen = next(st for st in self.s.program.steps if st.op == "generate" and st.engine == f"{role}/rollout")
        rows = self.s.data.batch(0, self.s.workload.prompts, self.cfg.seed)
        prompts = Local(tokenize_prompts(self.tok, [r[self.s.data.prompt_key] for r in rows], self.s.workload.prompt_len))
        rollout, metas = self._generate(gen, prompts, 2, step)
        self._wait(gen, metas, "generate")
        tg, _ = self.s.program.engine(role, "train")
        trained, tmeta = self._forward(Step(-1, "logprobs", "check", tg.name, f"{role}/train", ()), rollout)
        self._wait(gen, tmeta, "trainer log-probabilities")
        gg, ge = self.s.program.engine(role, "rollout")
        wg = self.groups[gg.name]
        per, tp = self._per_rank({"rollout": rollout}, ge.layout.dp), ge.layout.tp
        refs = [w.rollout_logprobs.remote(self._key(ge), per[r // tp]) for r, w in enumerate(wg.workers)]
        engine_lp = wg.get(refs, "rollout log-probabilities")[::tp]
        a = torch.cat(engine_lp, dim=0)
        b = self._materialize(trained)
        mask = self._materialize(rollout.project("response_mask"))
        return float(((a - b).abs() * mask).max())

    def export_policy(self, path: Path) -> None:
        for g in self.s.program.groups:
            for e in g.engines:
                if e.engine == "train" and e.kind == "policy":
                    wg = self.groups[g.name]
                    wg.get(wg.call("export_hf", self._key(e), str(path), self.s.tokenizer), "exporting the policy")
                    return


def init_ray(address: str | None, *, temp_dir: str | None = None) -> bool:
    """Connect to (address) or start (None: this machine) a Ray cluster; True when started here."""
    if ray.is_initialized():
        return False
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}}
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=True)
        return True
    cpus = max(8, 2 * (os.cpu_count() or 1))
    tmp = temp_dir or f"/tmp/flowc-ray-{os.getpid()}"
    ray.init(num_cpus=cpus, include_dashboard=False, _temp_dir=tmp, runtime_env=env, log_to_driver=True)
    return True


__all__ = ["Controller", "PromptBatch", "RunSpec", "init_ray"]
