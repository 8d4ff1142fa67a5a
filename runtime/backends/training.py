"""The one training loop, shared by every training backend.

:class:`TrainEngine` wraps a :class:`~flowc.runtime.backends.Trainer` and owns
everything about an update that is not the backend's: epochs × mini-batches
(mini-batch k is the same global rows on any layout), micro-batches (their
count agreed by every rank; how rows are cut: :mod:`.micro_batches`), the
loss denominator of each mini-batch (summed over the replicas, so that the
averaged gradients equal one process's), the objective of every role kind,
the statistics, and the learning-rate schedule. Forward ops (log-probs,
values, scores) are one pass over micro-batches here too.

A backend supplies only: run these micro-batches under this function
(forward, and backward when training), step the optimizer at this learning
rate, and stream its weights.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import torch

from flowc.errors import DataError
from flowc.ir.functional import Rollout, kl
from flowc.ir.losses import (
    PREFERENCE_LOSSES,
    aggregate,
    denominator_kind,
    dpo_loss,
    idle_rows,
    mismatch,
    policy_loss,
    value_loss,
)
from flowc.ir.ops import RoleKind
from flowc.ir.run_config import OptimConfig
from flowc.runtime.backends import Score, Trainer, built_backend
from flowc.runtime.backends.micro_batches import (
    chunk_ranges,
    minibatch_bounds,
    packs_rows,
    pad_right,
    shares_prompt,
    token_bins,
    trim,
)
from flowc.runtime.batches import num_rows, slice_rows, take_rows
from flowc.runtime.packing import shared_lines_pay

# statistics a micro-batch reports as its share of the mini-batch's loss (divided by the whole
# mini-batch's denominator): they add up over micro-batches, where the others are averaged
LOSS_SHARES = ("pg_loss", "vf_loss")


def lr_at(cfg: OptimConfig, update: int, total: int) -> float:
    """The learning rate of optimizer update ``update`` (0-based) of a run of ``total`` updates:
    ``cfg``'s warm-up, then its schedule (constant, linear or cosine; see :class:`OptimConfig`)."""
    return cfg.lr_at(update, total)


def objective(
    kind: RoleKind,
    role: str,
    r: Rollout,
    t: dict[str, torch.Tensor],
    spec: Any,
    kl_coef: float,
    kl_kind: str,
    entropy_coef: float,
    denom: float,
    score: Score,
    max_len: int | None = None,
    behaviour: bool = False,
    first_pass: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """A role's training objective on one micro-batch and its statistics:
    ``score(with_entropy)`` runs the model (log-probabilities and entropy for a
    policy, values for a critic). ``max_len``: the response limit a constant
    normaliser divides by (``seq-mean-token-sum-norm``), the same for every
    micro-batch however its padding was trimmed (default: this micro-batch's width).
    ``behaviour``: the rollout's log-probabilities are the engine's of the distribution the
    trainer scores (plain sampling), so a correction may weigh them and the rollout/trainer
    mismatch is reported — against ``old_logprobs``, or without them on the ``first_pass``
    (the first mini-batch of the first epoch, before any optimizer step)."""
    mask = r.response_mask
    max_len = max_len or r.response_ids.shape[1]
    if kind == RoleKind.POLICY and isinstance(spec, PREFERENCE_LOSSES):
        if "ref_logprobs" not in t:
            raise DataError(f"{role}.update with {spec} got no ref_logprobs")
        return dpo_loss(spec, score(False), t["ref_logprobs"], mask, pairs=denom / 2)
    if kind == RoleKind.POLICY:
        logp, entropy = score(True)
        if "advantages" not in t:
            raise DataError(f"{role}.update got no advantages")
        old = t.get("old_logprobs")
        behav = r.logprobs if behaviour else None
        pg, st = policy_loss(spec, logp, old, t["advantages"], mask, denom=denom, max_len=max_len, behaviour_logp=behav)
        if behav is not None and (old is not None or first_pass):
            st |= mismatch(logp if old is None else old, behav, mask)
        obj = pg
        m = mask.to(logp.dtype)
        st = {"pg_loss": float(pg.detach()), **st}
        ent = aggregate(entropy, mask, spec.agg, denom=denom, max_len=max_len)
        st["entropy"] = float(((entropy * m).sum() / m.sum().clamp(min=1)).item())
        if entropy_coef:
            obj = obj - entropy_coef * ent
        if kl_coef and "ref_logprobs" in t:
            k = kl(logp, t["ref_logprobs"], kl_kind)
            obj = obj + kl_coef * aggregate(k, mask, spec.agg, denom=denom, max_len=max_len)
            st["kl"] = float(((k.detach() * m).sum() / m.sum().clamp(min=1)).item())
        return obj, st
    values = score(False)
    if "returns" not in t:
        raise DataError(f"{role}.update got no returns")
    vl, st = value_loss(spec, values, t.get("old_values"), t["returns"], mask, denom=denom, max_len=max_len)
    return vl, {"vf_loss": float(vl.detach().item()), **st}


class TrainEngine:
    """A trained or frozen role on a training backend, driven by the shared loop."""

    def __init__(self, backend: Trainer) -> None:
        self.b = backend
        self.init = backend.init
        self.updates = 0
        self.micro_batches = 0  # of the last op: what the plan's micro_batch made of this replica's rows
        self.shared_prompts = 0  # of those, the micro-batches that computed each distinct prompt once
        self.packed = 0  # and those that ran their rows packed, without padding

    # -------------------------------------------------------- micro-batches
    def split(
        self,
        r: Rollout,
        micro: int,
        unit: int = 1,
        tokens: int = 0,
        overhead: float = 0.0,
        share: bool = False,
        pack: bool = False,
    ) -> tuple[list[Rollout], list[torch.Tensor], list[torch.Tensor | None], list[bool]]:
        """This replica's rows in micro-batches, padding trimmed: ``micro`` rows each in order,
        or with a token budget ``tokens`` binned by length (:func:`token_bins`, with a
        micro-batch's fixed cost of ``overhead`` tokens). Their count is
        agreed by every rank of the pool (a replica with fewer runs one-row padding
        micro-batches). Returns the micro-batches, the rows of ``r`` each holds (empty
        for padding), and for each its prompt groups when the backend computes each distinct
        prompt once there (with ``share``, the plan's ``share_prompts``, where the backend can
        and it pays on every rank of the pool: :func:`shares_prompt`; None: one pass over every
        row), and whether each runs its rows packed without their padding (with ``pack``, the
        plan's ``pack_sequences``, where the backend can and the micro-batch has padding and
        does not share its prompts: :func:`packs_rows`)."""
        rows = num_rows(r)
        # packed lines that compute each prompt once in the same pass: no second pass for the ranks to agree on
        tree = share and pack and self.packs and bool(getattr(self.b, "packs_shared", False))
        share = share and (self.shares_prompts or tree)
        pack = pack and self.packs
        if tokens:
            # packed, a budget counts a prompt once only where the lines will compute it once
            bins = token_bins(r, tokens, unit, overhead, share=share and (tree or not pack), pack=pack)
        else:
            k = max(1, math.ceil(rows // unit / max(1, micro // unit)))
            bins = [torch.arange(lo, hi) for lo, hi in chunk_ranges(rows, k, unit)]
        k = self.b.agree(max(1, len(bins)))
        bins += [torch.arange(0)] * (k - len(bins))
        parts = [trim(take_rows(r, idx) if len(idx) else slice_rows(r, 0, unit)) for idx in bins]
        if tree:  # a micro-batch whose rows share a prompt computes it once in its packed lines, where that is cheaper
            ratio = float(getattr(self.b, "attention_ratio", 0.0))
            groups = [shares_prompt(part, 0.0) if len(idx) else None for part, idx in zip(parts, bins, strict=True)]
            groups = [
                g if g is not None and shared_lines_pay(part.prompt_mask, part.present, g, ratio) else None
                for part, g in zip(parts, groups, strict=True)
            ]
            packed = [g is not None or packs_rows(part) for part, g in zip(parts, groups, strict=True)]
        else:
            groups = [
                shares_prompt(part, overhead, pack) if share and len(idx) else None for part, idx in zip(parts, bins, strict=True)
            ]
            if share:  # the ranks of a sharded pool gather the same layers the same times: every rank shares, or none
                agreed = self.b.agree_flags([g is not None for g in groups])
                groups = [g if ok else None for g, ok in zip(groups, agreed, strict=True)]
            # packing changes no collective (one pass per micro-batch either way): each rank decides its own
            packed = [pack and g is None and packs_rows(part) for part, g in zip(parts, groups, strict=True)]
        self.micro_batches = k
        self.shared_prompts = sum(g is not None for g in groups)
        self.packed = sum(packed)
        return parts, bins, groups, packed

    @property
    def shares_prompts(self) -> bool:
        """Whether the backend can compute a prompt once for the rows that share it."""
        return bool(getattr(self.b, "shares_prompts", False))

    @property
    def packs(self) -> bool:
        """Whether the backend can run a micro-batch's rows packed without their padding."""
        return bool(getattr(self.b, "packs", False))

    # -------------------------------------------------------------- forward
    def probe(self, r: Rollout) -> torch.Tensor | None:
        """The weight sync check's probe scored as :meth:`forward` scores rows, leaving the engine
        as the step's ops left it: the micro-batches :meth:`describe` reports, and FSDP2's
        parameters resharded (a forward-only call keeps the root's gathered in the compute dtype)."""
        kept = self.micro_batches, self.shared_prompts, self.packed
        try:
            return self.forward(r, 1)
        finally:
            self.micro_batches, self.shared_prompts, self.packed = kept
            reshard = getattr(self.b.model, "reshard", None)
            if callable(reshard):
                reshard()

    @torch.no_grad()
    def forward(
        self,
        r: Rollout,
        micro: int,
        tokens: int = 0,
        overhead: float = 0.0,
        share_prompts: bool = False,
        pack_sequences: bool = False,
    ) -> torch.Tensor | None:
        """Log-probabilities (policy, reference) or values (critic) ``[n, R]`` of the rows, or a
        reward model's scores ``[n]`` (its value at the last response token); None on ranks
        whose outputs the controller does not keep."""
        width = r.response_ids.shape[1]
        parts, bins, groups, packed = self.split(
            r, micro, tokens=tokens, overhead=overhead, share=share_prompts, pack=pack_sequences
        )
        real = [len(idx) for idx in bins]
        # each micro-batch's outputs leave the device as soon as they exist (the rest of the batch runs beside them)
        got = self.b.run(
            parts, real, lambda i, part, score: (None, {"out": _host(score(False))}), train=False, **_how(groups, packed)
        )
        if got is None:
            return None
        scores = self.init.kind == RoleKind.REWARD_MODEL
        rows = num_rows(r)
        out_all = torch.zeros(rows) if scores else torch.zeros((rows, width))
        for idx, part, g in zip(bins, parts, got, strict=True):
            n = len(idx)
            if n == 0:
                continue
            out = g["out"][:n].float()
            if scores:  # a reward model scores a sequence at its last response token
                last = (part.present[:n].long().sum(-1) - 1).clamp(min=0)
                out_all[idx] = out.gather(1, last.unsqueeze(-1)).squeeze(-1)
            else:
                out_all[idx] = pad_right(out, width)
        return out_all

    # --------------------------------------------------------------- update
    def update(
        self,
        r: Rollout,
        tensors: dict[str, torch.Tensor],
        *,
        loss: Any,
        kl_coef: float,
        kl_kind: str,
        entropy_coef: float,
        mini_sizes: list[int],
        epochs: int,
        micro: int,
        micro_tokens: int = 0,
        micro_overhead: float = 0.0,
        share_prompts: bool = False,
        pack_sequences: bool = False,
        behaviour: bool = False,
        skip_idle: bool = False,
    ) -> dict[str, float]:
        """Optimizer updates over this replica's rows: ``mini_sizes[k]`` rows (in order) belong
        to mini-batch k (see ``runtime.batches.minibatch_rows``), each epoch visits them all.
        ``behaviour``: the rollout's log-probabilities are comparable with the trainer's (see
        :func:`objective`). ``skip_idle``: the loss adds nothing for a row whose advantages are
        all zero (``ir.losses.idle_without_advantage``), so those rows are not computed — the
        mini-batch's denominator still counts them, and a replica left with none runs one padding
        row (zero gradients through the optimizer step, collectives in step): the same update.
        ``idle_rows`` reports their share; the other statistics are then over the rows computed
        (the padding row, where a mini-batch has no live row: every step keeps its metrics)."""
        cfg, role = self.init.optim, self.init.role
        if cfg is None:
            raise DataError(f"{role} is frozen; it has no update")
        t0 = time.perf_counter()
        bounds = minibatch_bounds(role, mini_sizes, num_rows(r))
        unit = 2 if isinstance(loss, PREFERENCE_LOSSES) else 1  # DPO's (chosen, rejected) rows stay together
        count_tokens = denominator_kind(loss.agg) == "tokens"
        max_len = r.response_ids.shape[1]  # the generation limit the rollout is padded to, before any trimming
        sums: dict[str, float] = {}
        losses: dict[str, float] = {}
        minis = 0
        weight: dict[str, float] = {}
        norm_sum, lr = 0.0, lr_at(cfg, self.updates, self.init.total_updates)
        adv = tensors.get("advantages")
        idle = idle_rows(adv, r.response_mask) if skip_idle and adv is not None else None
        for epoch in range(epochs):
            for mini, (mlo, mhi) in enumerate(bounds):
                mb = slice_rows(r, mlo, mhi)
                ts = {k: slice_rows(v, mlo, mhi) for k, v in tensors.items()}
                local = float(mb.response_mask.sum()) if count_tokens else float(mhi - mlo)
                denom = max(self.b.dp_sum(local), 1.0)  # every row of the mini-batch once: replicas hold disjoint rows
                none_live = False
                if idle is not None and bool(idle[mlo:mhi].any()):  # computed: the live rows (denominator as counted)
                    live = (~idle[mlo:mhi]).nonzero().squeeze(-1)
                    none_live = len(live) == 0
                    # none: one padding row, zero-weighted (its longest: its statistics stand for the step's)
                    keep = live if len(live) else mb.response_mask.sum(-1).argmax().reshape(1)
                    mb, ts = take_rows(mb, keep), {k: take_rows(v, keep) for k, v in ts.items()}
                parts, bins, groups, packed = self.split(
                    mb, micro, unit, micro_tokens, micro_overhead, share_prompts, pack_sequences
                )
                if none_live:
                    bins = [torch.arange(0)] * len(bins)
                real = [len(idx) for idx in bins]

                first = epoch == 0 and mini == 0

                def fn(i: int, part: Rollout, score: Score, ts=ts, denom=denom, bins=bins, first=first):
                    idx = bins[i]
                    width = part.response_ids.shape[1]
                    pt = {k: take_rows(v, idx) if len(idx) else slice_rows(v, 0, unit) for k, v in ts.items()}
                    pt = {k: (v[:, :width] if v.dim() == 2 else v).to(part.response_ids.device) for k, v in pt.items()}
                    kind = self.init.kind
                    return objective(
                        kind, role, part, pt, loss, kl_coef, kl_kind, entropy_coef, denom, score, max_len, behaviour, first
                    )

                self.b.zero_grad()
                got = self.b.run(parts, real, fn, train=True, **_how(groups, packed)) or []
                lr = lr_at(cfg, self.updates, self.init.total_updates)
                norm_sum += self.b.step(lr) * (mhi - mlo)
                self.updates += 1
                shares: dict[str, float] = {}
                # the other statistics are means over a micro-batch's tokens (over its pairs for DPO): weigh them so
                # a mini-batch with no live row reports its zero-weighted row's statistics (entropy, the
                # importance weights, the mismatch): measured on a row it holds, they keep every step's metrics
                seen = [1 if none_live and i == 0 else n for i, n in enumerate(real)]
                weights = [
                    float(n if unit == 2 else (part.response_mask.sum() if n else 0)) for n, part in zip(seen, parts, strict=True)
                ]
                for n, w, g in zip(seen, weights, got, strict=False):
                    if n == 0:  # a padding micro-batch (it re-runs a real row to keep collectives in step)
                        continue
                    for key, val in g.items():
                        if key in LOSS_SHARES:
                            shares[key] = shares.get(key, 0.0) + val
                        else:  # weighed over the micro-batches that report it (the mismatch: the first pass only)
                            sums[key] = sums.get(key, 0.0) + val * w
                            weight[key] = weight.get(key, 0.0) + w
                for key, val in shares.items():
                    losses[key] = losses.get(key, 0.0) + val
                minis += 1
        # the replicas' shares add up to each mini-batch's loss; the controller averages what every rank reports
        # (a replica's ranks report the same), so each reports its shares × the replicas
        replicas = self.init.layout.dp
        stats = {k: v / max(weight[k], 1.0) for k, v in sums.items()} | {
            k: v * replicas / max(minis, 1) for k, v in losses.items()
        }
        if idle is not None:
            stats["idle_rows"] = float(idle.float().mean()) if len(idle) else 0.0
        out = self.b.share(stats)
        out["grad_norm"] = norm_sum / max(num_rows(r) * epochs, 1)
        out["lr"] = lr
        out["updates"] = float(self.updates)
        out["update_s"] = time.perf_counter() - t0
        return out

    # --------------------------------------------------- weights, checkpoints
    @property
    def last_received(self) -> float:
        return self.b.last_received

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return self.b.weights()

    def lendable(self) -> dict[str, torch.Tensor] | None:
        """This rank's parameters by HF name, when a rollout engine in this process may run them
        as they are (:meth:`RolloutEngine.alias`): a causal LM whose parameters are whole plain
        tensors in the dtype it samples in — no sharding (DTensors), no LoRA (the engine runs the
        merged weights), no mixed precision (fp32 master weights, bf16 engine). None otherwise."""
        b = self.b
        if getattr(b, "lora", None) is not None or getattr(b, "compute", None) is not None or not getattr(b, "lm_head", False):
            return None
        params = dict(b.model.named_parameters())
        if not all(type(p) is torch.nn.Parameter for p in params.values()):
            return None
        return params

    def state(self) -> dict[str, Any]:
        return {"backend": self.b.state(), "updates": self.updates}

    def load_state(self, state: dict[str, Any]) -> None:
        self.b.load_state(state["backend"])
        self.updates = int(state["updates"])

    def export_hf(self, path: str, tokenizer: str | None) -> None:
        self.b.export_hf(path, tokenizer)

    def describe(self) -> dict[str, Any]:
        """What runs, as built: backend, compute dtype (with mixed precision, the master weights'
        dtype too), whether parameters are sharded over the pool, whether it trains, and the
        micro-batches its last op ran (with LoRA, the adapters and how many parameters train)."""
        params = list(self.b.model.parameters())
        held = str(params[0].dtype).removeprefix("torch.") if params else None
        compute = getattr(self.b, "compute", None)  # mixed precision: bf16 matmuls over fp32 master weights
        out = {
            "backend": built_backend(self.b),
            "dtype": str(compute).removeprefix("torch.") if compute is not None else held,
            "sharded": any(hasattr(p, "to_local") for p in params),
            "trains": self.init.optim is not None,
            "micro_batches": self.micro_batches,
            "shared_prompts": self.shared_prompts,
            "packed": self.packed,
        }
        if held != out["dtype"]:
            out["master_dtype"] = held
        lora = getattr(self.b, "lora", None)
        if lora is not None:  # the adapters built, and what the optimizer steps (this rank's share when sharded)
            out["lora"] = lora.short()
            out["trained_params"] = _numel(p for p in params if p.requires_grad)
        return out


def _how(groups: list[torch.Tensor | None], packed: list[bool]) -> dict[str, Any]:
    """How the backend runs each micro-batch: only what some micro-batch asks (a backend that
    neither shares prompts nor packs is never passed the keywords)."""
    out: dict[str, Any] = {}
    if any(g is not None for g in groups):
        out["groups"] = groups
    if any(packed):
        out["packed"] = packed
    return out


def _numel(params: Iterator[torch.Tensor]) -> int:
    return sum(int(p.to_local().numel() if hasattr(p, "to_local") else p.numel()) for p in params)


def _host(x: torch.Tensor | None) -> torch.Tensor | None:
    """A forward output in host memory (None: a rank whose outputs are not kept)."""
    return None if x is None else x.detach().cpu()
