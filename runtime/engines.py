"""The engines a worker hosts: training (FSDP2), frozen forward, and rollout (HF).

Every engine runs inside one worker process of a pool; all workers of a pool
share one ``torch.distributed`` world (gloo on CPU, NCCL on GPU). Collective
calls (FSDP's gathers and reductions, the weight gather of a sync) are made by
every rank in the same order: the controller sends each rank the same
instructions, and micro-batch counts are agreed with an all-reduce.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flowc.errors import DataError
from flowc.ir.functional import PromptBatch, Rollout, kl
from flowc.ir.losses import PREFERENCE_LOSSES, aggregate, denominator_kind, dpo_loss, policy_loss, value_loss
from flowc.ir.plan import Layout
from flowc.ir.run_config import OptimConfig
from flowc.ir.sampling import SamplingParams
from flowc.runtime.batches import even_split, num_rows, repeat_rows, slice_rows
from flowc.runtime.modeling import ValueModel, load_causal_lm, response_logprobs, response_values, rollout_tokenizer
from flowc.runtime.sampling import sample


def compute_device() -> torch.device:
    """This worker's device: its GPU (Ray sets CUDA_VISIBLE_DEVICES per worker) or the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def to_device(r: Rollout, device: torch.device) -> Rollout:
    if r.prompt_ids.device == device:
        return r
    return Rollout(*(x.to(device) for x in (r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask, r.logprobs)))


def _collective_device() -> torch.device:
    """Where small collective tensors live: NCCL takes CUDA tensors only."""
    return compute_device() if dist.get_backend() == "nccl" else torch.device("cpu")


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _allreduce(x: float, op: str = "sum") -> float:
    world, _ = _world()
    if world == 1:
        return x
    t = torch.tensor([x], dtype=torch.float64, device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return float(t.item())


def _layers(model: nn.Module) -> list[nn.Module]:
    trunk = model.trunk if isinstance(model, ValueModel) else model.model
    return list(trunk.layers)


def shard(model: nn.Module, layout: Layout) -> nn.Module:
    """FSDP2 over the pool's data-parallel world: each decoder layer, then the root."""
    world, _ = _world()
    if world == 1 or not layout.fsdp:
        return model
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    kw: dict[str, Any] = {}
    if layout.offload_params and torch.cuda.is_available():
        kw["offload_policy"] = CPUOffloadPolicy()
    for layer in _layers(model):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def trim(r: Rollout) -> Rollout:
    """Drop columns that are padding in every row (left of the prompts, right of the responses)."""
    p_keep = int(r.prompt_mask.long().sum(-1).max().item()) if r.prompt_mask.numel() else 0
    r_keep = int(r.response_mask.long().sum(-1).max().item()) if r.response_mask.numel() else 0
    p_keep, r_keep = max(p_keep, 1), max(r_keep, 1)
    p = r.prompt_ids.shape[1]
    return Rollout(
        r.prompt_ids[:, p - p_keep :],
        r.prompt_mask[:, p - p_keep :],
        r.response_ids[:, :r_keep],
        r.response_mask[:, :r_keep],
        r.logprobs[:, :r_keep],
    )


def _pad_right(x: torch.Tensor, width: int, value: float = 0.0) -> torch.Tensor:
    if x.shape[1] == width:
        return x
    pad = torch.full((x.shape[0], width - x.shape[1]), value, dtype=x.dtype)
    return torch.cat([x, pad], dim=1)


def _chunks(rows: int, micro: int) -> int:
    """Micro-batches of this step, agreed by all ranks (the largest count wins)."""
    return int(_allreduce(float(max(1, math.ceil(rows / micro))), "max"))


def _chunk_ranges(rows: int, k: int, unit: int = 1) -> Iterator[tuple[int, int]]:
    """``k`` near-equal row ranges that never split a group of ``unit`` rows."""
    for lo, hi in even_split(rows // unit, k):
        yield lo * unit, hi * unit


def minibatch_bounds(role: str, mini_sizes: list[int], rows: int) -> list[tuple[int, int]]:
    """Row ranges of the mini-batches: ``mini_sizes[k]`` rows, in order, belong to mini-batch k."""
    bounds, start = [], 0
    for size in mini_sizes:
        bounds.append((start, start + size))
        start += size
    if start != rows:
        raise DataError(f"{role}.update: mini-batches of {start} rows for {rows} rows")
    return bounds


def objective(
    kind: str,
    role: str,
    r: Rollout,
    t: dict[str, torch.Tensor],
    spec: Any,
    kl_coef: float,
    kl_kind: str,
    entropy_coef: float,
    denom: float,
    score: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """A role's training objective on one micro-batch and its statistics, for
    every training backend: ``score(with_entropy)`` runs the model and returns
    log-probabilities (with entropy when asked) for a policy, values for a critic."""
    mask = r.response_mask
    max_len = r.response_ids.shape[1]
    if kind == "policy" and isinstance(spec, PREFERENCE_LOSSES):
        if "ref_logprobs" not in t:
            raise DataError(f"{role}.update with {spec} got no ref_logprobs")
        logp = score(False)
        obj, st = dpo_loss(spec, logp, t["ref_logprobs"], mask, pairs=denom / 2)
        return obj, st
    if kind == "policy":
        logp, entropy = score(True)
        if "advantages" not in t:
            raise DataError(f"{role}.update got no advantages")
        pg, st = policy_loss(spec, logp, t.get("old_logprobs"), t["advantages"], mask, denom=denom, max_len=max_len)
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
    """A trained role: policy (LM) or critic (LM trunk + value head), FSDP2 over the pool."""

    def __init__(
        self, *, role: str, kind: str, source: str, layout: Layout, optim: OptimConfig, dtype: torch.dtype, seed: int
    ) -> None:
        torch.manual_seed(seed)
        lm = load_causal_lm(source, dtype=dtype)
        self.role, self.kind, self.layout, self.optim_cfg, self.source_dir = role, kind, layout, optim, source
        self.device = compute_device()
        self.model: nn.Module = (lm if kind == "policy" else ValueModel(lm)).to(self.device)
        if layout.activation_checkpointing and hasattr(lm, "gradient_checkpointing_enable"):
            lm.gradient_checkpointing_enable()
        self.model = shard(self.model, layout)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)
        warm = max(optim.warmup_steps, 0)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
        self.updates = 0
        self.last_received = 0.0

    # ------------------------------------------------------------- forward
    @torch.no_grad()
    def forward(self, r: Rollout, micro: int) -> torch.Tensor:
        """Log-probabilities (policy) or values (critic) ``[n, R]`` of the rollout rows."""
        self.model.eval()
        width = r.response_ids.shape[1]
        outs = []
        for lo, hi in _chunk_ranges(num_rows(r), _chunks(num_rows(r), micro)):
            part = trim(slice_rows(r, lo, hi)) if hi > lo else trim(slice_rows(r, 0, 1))
            out = self._score(part).cpu()
            outs.append(_pad_right(out, width) if hi > lo else out[:0])
        self.model.train()
        return torch.cat(outs, dim=0) if outs else torch.zeros((0, width))

    def _score(self, r: Rollout, with_entropy: bool = False):
        r = to_device(r, self.device)
        args = (r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask)
        if self.kind == "policy":
            return response_logprobs(self.model, *args, with_entropy=with_entropy)
        return response_values(self.model, *args)

    # -------------------------------------------------------------- update
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
    ) -> dict[str, float]:
        """Optimizer updates over this rank's rows: ``mini_sizes[k]`` rows (in order)
        belong to mini-batch k (see ``runtime.batches.minibatch_rows``)."""
        world, _ = _world()
        rows = num_rows(r)
        stats: dict[str, float] = {}
        weight_sum = 0.0
        t0 = time.perf_counter()
        bounds = minibatch_bounds(self.role, mini_sizes, rows)
        for _epoch in range(epochs):
            for mlo, mhi in bounds:
                mb = slice_rows(r, mlo, mhi)
                ts = {k: slice_rows(v, mlo, mhi) for k, v in tensors.items()}
                count_tokens = denominator_kind(loss.agg) == "tokens"
                local = float(mb.response_mask.sum()) if count_tokens else float(mhi - mlo)
                denom = max(_allreduce(local), 1.0)
                unit = 2 if isinstance(loss, PREFERENCE_LOSSES) else 1  # DPO's (chosen, rejected) rows stay together
                k = _chunks((mhi - mlo) // unit, max(1, micro // unit))
                self.opt.zero_grad(set_to_none=True)
                for i, (lo, hi) in enumerate(_chunk_ranges(mhi - mlo, k, unit)):
                    if hasattr(self.model, "set_requires_gradient_sync"):
                        self.model.set_requires_gradient_sync(i == k - 1)  # reduce gradients once per update
                    empty = hi <= lo
                    part = trim(slice_rows(mb, lo, hi) if not empty else slice_rows(mb, 0, unit))
                    width = part.response_ids.shape[1]
                    pt = {name: (slice_rows(v, lo, hi) if not empty else slice_rows(v, 0, unit)) for name, v in ts.items()}
                    pt = {name: (v[:, :width] if v.dim() == 2 else v).to(self.device) for name, v in pt.items()}
                    obj, st = self._loss(to_device(part, self.device), pt, loss, kl_coef, kl_kind, entropy_coef, denom)
                    scale = 0.0 if empty else float(world)  # gradients are averaged over ranks
                    (obj * scale).backward()
                    w = 0.0 if empty else float(hi - lo)
                    for key, val in st.items():
                        stats[key] = stats.get(key, 0.0) + val * w
                    weight_sum += w
                self._allreduce_grads()
                gn = self._clip()
                stats["grad_norm"] = stats.get("grad_norm", 0.0) + gn * (mhi - mlo)
                self.opt.step()
                self.sched.step()
                self.updates += 1
        out = {k: v / max(weight_sum, 1.0) for k, v in stats.items()}
        out["grad_norm"] = stats.get("grad_norm", 0.0) / max(rows * epochs, 1)
        out["lr"] = self.sched.get_last_lr()[0]
        out["updates"] = float(self.updates)
        out["update_s"] = time.perf_counter() - t0
        return out

    def _loss(
        self, r: Rollout, t: dict[str, torch.Tensor], spec: Any, kl_coef: float, kl_kind: str, entropy_coef: float, denom: float
    ):
        return objective(
            self.kind, self.role, r, t, spec, kl_coef, kl_kind, entropy_coef, denom, lambda e: self._score(r, with_entropy=e)
        )

    def _clip(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        norm = torch.nn.utils.clip_grad_norm_(
            params, self.optim_cfg.max_grad_norm if self.optim_cfg.max_grad_norm > 0 else float("inf")
        )
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return float(norm)

    # ---------------------------------------------------------------- sync
    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter whole, as (name, tensor) pairs (a collective: every rank
        iterates); ``last_received`` is the bytes this rank received for them."""
        params, self.last_received = self.full_params()
        yield from params.items()

    def full_params(self) -> tuple[dict[str, torch.Tensor], float]:
        """Every parameter whole, and the bytes this rank received to get them.

        Sharded (FSDP2) parameters are gathered in one collective over a flat
        buffer of every local shard (not one call per tensor); replicated
        parameters are already whole."""
        named = [(n, p) for n, p in self.model.named_parameters()]
        if not any(hasattr(p, "to_local") for _, p in named):
            return {n: p.detach() for n, p in named}, 0.0
        world, _ = _world()
        locals_ = [p.to_local().detach().reshape(-1) for _, p in named]
        flat = torch.cat(locals_)
        counts = [torch.zeros(1, dtype=torch.long, device=flat.device) for _ in range(world)]
        dist.all_gather(counts, torch.tensor([flat.numel()], device=flat.device))
        width = max(int(c) for c in counts)
        padded = torch.zeros(width, dtype=flat.dtype, device=flat.device)
        padded[: flat.numel()] = flat
        bufs = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(bufs, padded)
        out: dict[str, torch.Tensor] = {}
        offsets = [0] * world
        for name, p in named:
            shape = tuple(p.shape)
            sizes = [c.numel() for c in torch.empty(shape, device="meta").chunk(world, dim=0)]
            sizes += [0] * (world - len(sizes))  # FSDP2 shards dim 0 as torch.chunk does
            pieces = []
            for r in range(world):
                pieces.append(bufs[r][offsets[r] : offsets[r] + sizes[r]])
                offsets[r] += sizes[r]
            out[name] = torch.cat(pieces).view(shape)
        received = (sum(t.numel() for t in out.values()) - flat.numel()) * flat.element_size()
        return out, float(received)

    def _allreduce_grads(self) -> None:
        """Replicated data parallelism: average the gradients over the ranks in one flat all-reduce."""
        world, _ = _world()
        if world == 1 or self.layout.fsdp:
            return
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= world
        i = 0
        for g in grads:
            g.copy_(flat[i : i + g.numel()].view_as(g))
            i += g.numel()

    # ---------------------------------------------------------- checkpoint
    def state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        return {
            "model": get_model_state_dict(self.model),
            "optim": get_optimizer_state_dict(self.model, self.opt),
            "sched": self.sched.state_dict(),
            "updates": self.updates,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.opt, state["optim"])
        self.sched.load_state_dict(state["sched"])
        self.updates = state["updates"]

    def export_hf(self, path: str, tokenizer_source: str | None) -> None:
        """The trained model in HF format (rank 0 writes)."""
        params, _ = self.full_params()
        _, rank = _world()
        if rank != 0:
            return
        from transformers import AutoTokenizer

        lm = load_causal_lm(self.source_dir, dtype=next(iter(params.values())).dtype)
        target = lm
        if self.kind != "policy":
            params = {k.removeprefix("trunk."): v for k, v in params.items() if k.startswith("trunk.")}
            target = lm.model
        missing, unexpected = target.load_state_dict(params, strict=False)
        tied = {"lm_head.weight"} if getattr(lm.config, "tie_word_embeddings", False) else set()
        if unexpected or set(missing) - tied:
            raise DataError(
                f"exporting {self.role}: weights do not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        lm.save_pretrained(path, safe_serialization=True)
        if tokenizer_source:
            AutoTokenizer.from_pretrained(tokenizer_source).save_pretrained(path)


class ForwardEngine:
    """A frozen role: reference (log-probabilities) or reward model (scores)."""

    def __init__(self, *, role: str, kind: str, source: str, layout: Layout, dtype: torch.dtype, seed: int) -> None:
        torch.manual_seed(seed)
        lm = load_causal_lm(source, dtype=dtype)
        self.role, self.kind = role, kind
        self.device = compute_device()
        self.model: nn.Module = (lm if kind == "reference" else ValueModel(lm)).to(self.device)
        self.model = shard(self.model, layout)
        self.model.eval()

    @torch.no_grad()
    def forward(self, r: Rollout, micro: int) -> torch.Tensor:
        width = r.response_ids.shape[1]
        outs = []
        for lo, hi in _chunk_ranges(num_rows(r), _chunks(num_rows(r), micro)):
            part = to_device(trim(slice_rows(r, lo, hi) if hi > lo else slice_rows(r, 0, 1)), self.device)
            args = (part.prompt_ids, part.prompt_mask, part.response_ids, part.response_mask)
            if self.kind == "reference":
                out = response_logprobs(self.model, *args)
            else:  # a reward model scores a sequence at its last response token
                v = response_values(self.model, *args)
                last = (part.response_mask.long().sum(-1) - 1).clamp(min=0)
                out = v.gather(1, last.unsqueeze(-1)).squeeze(-1)
            if hi > lo:
                out = out.cpu()
                outs.append(_pad_right(out, width) if out.dim() == 2 else out)
        if not outs:
            return torch.zeros((0, width)) if self.kind == "reference" else torch.zeros(0)
        return torch.cat(outs, dim=0)


class RolloutEngine:
    """Generation with the ``hf`` backend: a full model copy per replica."""

    def __init__(self, *, role: str, source: str, dtype: torch.dtype, tokenizer: str, seed: int) -> None:
        self.role = role
        self.model = load_causal_lm(source, dtype=dtype)
        self.model.eval()
        self.tok = rollout_tokenizer(tokenizer, self.model.config.vocab_size)
        self.seed = seed

    @torch.no_grad()
    def generate(
        self, prompts: PromptBatch, *, n: int, sp: SamplingParams, max_tokens: int, step: int, rank: int
    ) -> tuple[Rollout, list[str]]:
        ids = repeat_rows(prompts.input_ids, n)
        mask = repeat_rows(prompts.attention_mask, n)
        gen = torch.Generator().manual_seed(hash((self.seed, step, rank, n, sp.greedy)) % (2**31))
        out = sample(
            self.model,
            ids,
            mask,
            sp,
            max_tokens=max_tokens,
            eos_id=self.tok.eos_token_id,
            pad_id=self.tok.pad_token_id,
            generator=gen,
        )
        r = Rollout(ids, mask.bool(), out.response_ids, out.response_mask, out.logprobs)
        texts = self.tok.batch_decode(
            out.response_ids.masked_fill(~out.response_mask, self.tok.pad_token_id), skip_special_tokens=True
        )
        return r, texts

    @torch.no_grad()
    def logprobs(self, r: Rollout) -> torch.Tensor:
        return response_logprobs(self.model, r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask)

    def sleep(self) -> bool:
        """Nothing to free between rollouts (the ``vllm`` backend's sleep mode); says so."""
        return False

    @torch.no_grad()
    def load(self, params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> float:
        """Copy new weights in (a dict or a stream of pairs); returns the bytes copied."""
        own = dict(self.model.named_parameters())
        copied = 0.0
        for name, t in params.items() if isinstance(params, Mapping) else params:
            if name not in own:
                continue
            own[name].copy_(t.to(own[name].dtype))
            copied += t.numel() * t.element_size()
        return copied
