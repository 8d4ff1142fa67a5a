"""What the controller measures outside the training loop: greedy responses to held-out prompts
(or held-out preference pairs), and how far a rollout engine's log-probabilities are from the
trainer's after a weight sync.

:class:`HeldOut` is a part of :class:`~flowc.runtime.controller.Controller` (its base): it runs
through the controller's groups and step helpers (``_group_of``, ``_generate``, ``_forward``, …)
and reads its program, config, data, tokenizer and reward functions.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from flowc.ir.losses import PREFERENCE_LOSSES, dpo_loss
from flowc.ir.ops import Op
from flowc.ir.sampling import SamplingParams
from flowc.runtime.data import Records, tokenize_pairs, tokenize_prompts
from flowc.runtime.iteration import Local
from flowc.runtime.program import EngineKey, EngineKind, Step, micro_args
from flowc.runtime.run_checks import sampling_of
from flowc.runtime.step_metrics import agent_metrics


class HeldOut:
    """Evaluation and the weight-sync error, as controller methods."""

    def evaluate(self) -> dict[str, float]:
        """Greedy responses to held-out prompts, scored by the first reward function."""
        data = self.s.eval_data
        if data is None:
            return {}
        dpo = [st for st in self.p.steps_of(Op.UPDATE) if isinstance(self.p.graph[st.node].kwargs["loss"], PREFERENCE_LOSSES)]
        if dpo:
            return self._evaluate_pairs(dpo[0], data)
        gen = self.p.steps_of(Op.GENERATE)[0]
        env = gen.args.get("env")
        if not self.rewards and env is None:
            return {}
        rows = data.head(self.cfg.eval_size)
        wg, e = self._group_of(gen.engine)
        prompts = tokenize_prompts(self.tok, [r[data.prompt_key] for r in rows], self.p.workload.prompt_len)
        src = self._sharded(Local(prompts))
        args: dict[str, Any] = {
            "n": 1,
            "sampling": SamplingParams(greedy=True),
            "max_tokens": self.p.workload.response_len,
            "step": -1,
            "round": 0,
        }
        if env is not None:  # the flow's environment, greedy, up to the flow's turns
            binding = self._binding(gen)
            args.update(
                env=binding,
                records=[{"prompt": r[data.prompt_key], **r} for r in rows],
                turn_tokens=sampling_of(gen, self.cfg).max_tokens or self.p.workload.response_len,  # as in training
                max_turns=int(gen.args.get("max_turns") or binding.max_turns),
            )
        out = self._generate_call(wg, e, src, args)
        metas = wg.get([o[1] for o in out], "evaluation")
        texts = [t for m in metas for t in m["texts"]]
        cols = {k: [r[k] for r in rows] for k in rows[0] if k != data.prompt_key}
        if self.rewards:
            role = next(iter(self.rewards))
            where = f"evaluation of {data.name}"
            scores = self.rewards.score(role, [r[data.prompt_key] for r in rows], texts, cols, where=where)
        else:  # scored by the environment
            scores = torch.tensor([v for m in metas for v in m["env_rewards"]], dtype=torch.float32)
        m = {
            "eval/reward": float(scores.mean()),
            "eval/accuracy": float((scores >= 1.0).float().mean()),
            "eval/size": float(len(rows)),
        }
        if env is not None:
            m.update({f"eval/{k}": v for k, v in agent_metrics(metas, len(rows)).items() if k != "agent/errors"})
        return m

    def _evaluate_pairs(self, upd: Step, data: Records) -> dict[str, float]:
        """Held-out preference pairs: how often, and by how much, the policy prefers the chosen response
        over the rejected one relative to the reference (DPO's implicit reward)."""
        node = self.p.graph[upd.node]
        ref = node.kwargs["ref_logprobs"]
        ref_step = next((st for st in self.p.steps_of(Op.LOGPROBS) if st.node == ref.node), None)
        if ref_step is None or ref.path:
            return {}  # the reference's log-probabilities are computed, not read: nothing to compare against
        rows = data.head(self.cfg.eval_size)
        w = self.p.workload
        cols = [[r[c] for r in rows] for c in (data.prompt_key, "chosen", "rejected")]
        pairs = tokenize_pairs(self.tok, *cols, w.prompt_len, w.response_len)
        src = self._sharded(Local(pairs))
        ref_lp, _ = self._forward(ref_step, src)
        act_lp, _ = self._forward(replace(upd, op=Op.LOGPROBS), src)
        _, st = dpo_loss(node.kwargs["loss"], self._materialize(act_lp), self._materialize(ref_lp), pairs.response_mask)
        return {
            "eval/dpo_accuracy": st["dpo_accuracy"],
            "eval/dpo_margin": st["dpo_margin"],
            "eval/dpo_loss": st["dpo_loss"],
            "eval/size": float(len(rows)),
        }

    def sync_error(self, role: str, step: int = 10**6) -> float:
        """Largest |trainer − rollout engine| log-probability of the same sampled
        tokens: zero (to rounding) when the last weight sync delivered the
        trained weights."""
        gen = next(st for st in self.p.steps_of(Op.GENERATE) if st.engine.role == role)
        rows = self.s.data.batch(0, self.p.workload.prompts, self.cfg.seed)
        prompts = Local(tokenize_prompts(self.tok, [r[self.s.data.prompt_key] for r in rows], self.p.workload.prompt_len))
        records = [{"prompt": r[self.s.data.prompt_key], **r} for r in rows]
        rollout, metas = self._generate(gen, prompts, 2, step, records=records)
        self._wait(gen, metas, "generate")
        train_key = EngineKey(role, EngineKind.TRAIN)
        tg, te = self.p.engine(train_key)
        check = Step(-1, Op.LOGPROBS, "check", tg.name, train_key, (), micro_args(te.layout))
        trained, tmeta = self._forward(check, rollout)
        self._wait(gen, tmeta, "trainer log-probabilities")
        wg, ge = self._group_of(gen.engine)
        per, tp = self._per_rank({"rollout": rollout}, ge.layout.dp), ge.layout.tp
        refs = wg.call("rollout_logprobs", per_rank=[(ge.key, per[r // tp]) for r in range(wg.size)])
        engine_lp = wg.get(refs, "rollout log-probabilities")[::tp]
        a = torch.cat(engine_lp, dim=0)
        b = self._materialize(trained)
        mask = self._materialize(rollout.project("response_mask"))
        return float(((a - b).abs() * mask).max())
