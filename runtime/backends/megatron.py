"""The ``megatron`` training backend: a trained or frozen role on Megatron-core
with the plan's tensor (tp), pipeline (pp), expert (ep) and data (dp)
parallelism.

One engine per worker process; the pool's torch.distributed world is
Megatron's world. Its parallel state is initialised once per process in
Megatron's rank order (tp fastest, then dp, pp slowest: ``tp-cp-ep-dp-pp``),
which ``runtime.ranks`` mirrors so the controller sends every rank of a
data-parallel replica the same rows and keeps the output of one rank
(tp rank 0 of the last stage).

Training uses Megatron's DistributedDataParallel and distributed optimizer
(Adam, gradient clipping) and its forward-backward schedules (1F1B when
pp > 1) to run the micro-batches the shared loop (``backends.training``)
gives it, under the loop's objective, on log-probabilities taken over the
vocabulary as tp splits it. Megatron's optimizer and schedules allocate CUDA tensors, so this
backend needs GPUs; its model, tensor parallelism and weight mapping also run
on CPU under the test shim (``tests/megatron_cpu.py``), which is how CI checks
them.

Weight sync streams HF tensors one parameter at a time: each tp shard is
broadcast from the rank that holds it, every rank merges it (no rank ever holds
more than one whole parameter beyond what it already has), and the consumer
(a rollout engine, or the object-store buckets) takes it from there.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from flowc.errors import DataError, SpecError
from flowc.ir.functional import Rollout
from flowc.ir.models import ModelSpec
from flowc.ir.ops import LM_KINDS, RoleKind
from flowc.ir.plan import Layout
from flowc.ir.run_config import OptimConfig
from flowc.runtime.backends import EngineInit, MicroFn
from flowc.runtime.backends.collectives import allreduce, compute_device, to_device
from flowc.runtime.megatron_model import at_responses, build_model, pack, vocab_parallel_logprobs
from flowc.runtime.megatron_weights import (
    Degrees,
    HFCheckpoint,
    check_degrees,
    fuse_experts,
    hf_params,
    megatron_spec,
    shard_shape,
    to_megatron,
)
from flowc.runtime.modeling import SCORE_HEAD, has_score_head, save_hf

# Megatron keeps its parallel state (process groups, ranks) in module globals of
# ``megatron.core.parallel_state``. Roles a plan co-locates may use different
# degrees (a policy on dp2·pp8 beside a reference on pp16), so each set of
# degrees gets its own state, built once, and an engine switches it in before
# it runs (the groups stay alive; switching is a dict update).
_STATES: dict[tuple[int, ...], dict[str, Any]] = {}
_ACTIVE: list[tuple[int, ...] | None] = [None]
_PRISTINE: dict[str, Any] = {}


def _globals() -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    return {k: v for k, v in vars(ps).items() if k.startswith("_") and k[1:2].isupper() and k.upper() == k}


def _device() -> torch.device:
    if not torch.cuda.is_available() and not getattr(torch.cuda, "flowc_cpu_shim", False):
        raise SpecError(
            "the megatron backend needs CUDA GPUs: Megatron-core's optimizer and schedules allocate CUDA tensors",
            fix="on CPUs train with backend=fsdp2 (the planner's choice there)",
        )
    return compute_device()


def check_layout(arch: ModelSpec | None, layout: Layout, world: int) -> None:
    """The plan's degrees cover the pool and split the model evenly (the layout limits,
    cp = 1 among them, are the registry's: ``BACKENDS['megatron']``)."""
    if layout.dp * layout.tp * layout.pp * layout.cp != world:
        raise SpecError(
            f"megatron layout dp({layout.dp})*tp({layout.tp})*pp({layout.pp})*cp({layout.cp}) != world({world})",
            fix="re-plan: the layout does not cover its pool",
        )
    if layout.ep > 1 and (layout.dp * layout.cp * layout.tp) % layout.ep:
        raise SpecError(f"megatron layout: ep={layout.ep} does not divide the {layout.dp * layout.tp} ranks of a stage")
    if arch is not None:
        check_degrees(arch, Degrees(tp=layout.tp, pp=layout.pp, ep=layout.ep))


def activate(key: tuple[int, ...]) -> None:
    """Switch Megatron's parallel state to the one built for ``key``."""
    from megatron.core import parallel_state as ps

    if _ACTIVE[0] != key:
        vars(ps).update(_STATES[key])
        _ACTIVE[0] = key


def init_parallel(layout: Layout, seed: int) -> tuple[tuple[int, ...], Degrees]:
    """Megatron's parallel state for this layout's degrees (built once per
    process and set of degrees, every rank of the pool in the same order), active."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not dist.is_initialized():  # a one-worker pool has no process group of its own: Megatron needs one
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    check_layout(None, layout, dist.get_world_size())
    key = (layout.tp, layout.pp, layout.cp, layout.ep)
    if key not in _STATES:
        if not _PRISTINE:
            _PRISTINE.update(_globals())
        vars(ps).update(_PRISTINE)
        ps.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp,
            pipeline_model_parallel_size=layout.pp,
            expert_model_parallel_size=layout.ep,
            expert_tensor_parallel_size=1,  # experts split whole over ep, as the planner prices them
        )
        tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
        _STATES[key] = _globals()
        _ACTIVE[0] = key
    activate(key)
    return key, Degrees(
        tp=layout.tp,
        pp=layout.pp,
        ep=layout.ep,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
    )


class MegatronTrainer:
    """A role on Megatron-core: trained (``init.optim`` set) or frozen (reference, reward model)."""

    def __init__(self, init: EngineInit) -> None:
        from megatron.core import parallel_state as ps
        from transformers import AutoConfig

        self.device = _device()
        self.init = init
        layout, source, optim = init.layout, init.source, init.optim
        self.hf = AutoConfig.from_pretrained(source)
        self.arch = megatron_spec(self.hf)
        self.key, self.deg = init_parallel(layout, init.seed)
        self.critic = init.kind not in LM_KINDS  # a value head: critic, reward model
        model = build_model(
            self.hf,
            self.arch,
            self.deg,
            dtype=init.torch_dtype,
            value_head=self.critic,
            cuda=torch.cuda.is_available(),
            recompute=layout.activation_checkpointing,
        )
        get: Any = HFCheckpoint(source)
        if self.critic and not has_score_head(source, scores=init.kind == RoleKind.REWARD_MODEL):
            ckpt = get  # a critic from a causal LM: its head starts at zero
            get = lambda n: torch.zeros(1, self.arch.hidden_size) if n == SCORE_HEAD else ckpt(n)  # noqa: E731
        state = to_megatron(get, self.arch, self.deg, lm_head=not self.critic)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise DataError(
                f"{init.role}: Megatron weights do not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})"
            )
        # a frozen role with offloaded weights keeps them in host memory between its ops
        self.resident = optim is not None or not layout.offload_params
        self.model: Any = model.to(self.device) if self.resident else model
        self.dp_group = ps.get_data_parallel_group()
        self.dp = ps.get_data_parallel_world_size()
        self.last_stage = self.deg.pp_rank == self.deg.pp - 1
        self.is_output = self.last_stage and self.deg.tp_rank == 0
        # (tp, pp, ep) coordinates of every rank: where each shard of a parameter lives
        coords: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(coords, (self.deg.tp_rank, self.deg.pp_rank, self.deg.ep_rank))
        self.coords = coords
        self.last_received = 0.0
        if optim is not None:
            self._make_trainable(optim, init.torch_dtype)
        else:
            self.model.eval()

    def _make_trainable(self, optim: OptimConfig, dtype: torch.dtype) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg = self.model.config
        self.model = DistributedDataParallel(
            cfg,
            DistributedDataParallelConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False),
            self.model,
        )
        cfg.finalize_model_grads_func = finalize_model_grads  # the data-parallel (and tied-embedding) gradient reduction
        cfg.no_sync_func = self.model.no_sync
        self.opt = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=optim.lr,
                weight_decay=optim.weight_decay,
                adam_beta1=optim.betas[0],
                adam_beta2=optim.betas[1],
                clip_grad=optim.max_grad_norm if optim.max_grad_norm > 0 else 0.0,
                bf16=dtype == torch.bfloat16,
                fp16=dtype == torch.float16,
                params_dtype=dtype,
                use_distributed_optimizer=True,
                optimizer_cpu_offload=self.init.layout.offload_optimizer,  # Adam's state and step on the host
            ),
            [self.model],
        )
        self.model.train()

    # ------------------------------------------------------------ the model
    def score(self, output: torch.Tensor, part: Rollout, packed: Any, *, with_entropy: bool = False) -> Any:
        """The last stage's outputs at the response positions: log-probabilities
        (and entropy) for a policy or reference, values for a critic or reward model."""
        activate(self.key)
        out = at_responses(output, packed, at_tokens=self.init.kind == RoleKind.REWARD_MODEL)
        if self.critic:
            return out.squeeze(-1).float()
        return vocab_parallel_logprobs(out, part.response_ids.to(out.device), self.arch.vocab_size, with_entropy=with_entropy)

    # ------------------------------------------------------------ the loop's
    def agree(self, count: int) -> int:
        # every rank of the pool: expert parallelism exchanges tokens across replicas
        return int(allreduce(float(count), "max"))

    def dp_sum(self, x: float) -> float:
        return allreduce(x, group=self.dp_group)

    def run(
        self,
        parts: list[Rollout],
        rows: list[int],
        fn: MicroFn,
        *,
        train: bool,
        groups: list[torch.Tensor | None] | None = None,
        packed: list[bool] | None = None,
    ) -> list[dict[str, Any]] | None:
        """Megatron's schedule over the micro-batches; ``fn`` runs on the last stage. Megatron
        divides each loss by the micro-batch count and averages gradients over the replicas,
        so the objective is scaled back by both. It drops the prompts' left padding itself but does
        not pack rows (``packed`` is never set: it has no ``packs``) and never computes a shared
        prompt once (nor ``groups``: it has no ``shares_prompts``)."""
        activate(self.key)
        scale = float(len(parts) * self.dp)

        def on_last_stage(i: int, part: Rollout, packed: Any, output: torch.Tensor):
            p = to_device(part, output.device)
            obj, st = fn(i, p, lambda e: self.score(output, p, packed, with_entropy=e))
            if not train:
                return output.new_zeros(()), st
            return obj * (scale if rows[i] else 0.0), st

        if train:
            return self._schedule(parts, on_last_stage, forward_only=False)
        self.model.eval()
        if not self.resident:
            self.model.to(self.device)  # swapped in for the op
        got = self._schedule(parts, on_last_stage, forward_only=True)
        if not self.resident:
            self.model.to("cpu")
        if self.init.optim is not None:
            self.model.train()
        return got if self.is_output else None

    def _schedule(self, parts: list[Rollout], loss_fn: Any, *, forward_only: bool) -> list[dict[str, Any]]:
        """Megatron's schedule over the micro-batches ``parts``; ``loss_fn(i, part,
        packed, output)`` runs on the last stage and returns (loss, stats)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        packs = [pack(p.prompt_ids, p.prompt_mask, p.response_ids) for p in parts]
        dev = self.device
        if forward_only and self.deg.pp == 1:  # no pipeline: the schedule would only loop over micro-batches
            out = []
            for i, (part, packed) in enumerate(zip(parts, packs, strict=True)):
                s = packed.ids.shape[1]
                ids = packed.ids.to(dev)
                pos = torch.arange(s, device=dev).unsqueeze(0).expand_as(ids)
                out.append(loss_fn(i, part, packed, self.model(ids, pos, packed.causal.to(dev)))[1])
            return out

        items = iter(list(enumerate(zip(parts, packs, strict=True))))
        # pipeline stages exchange [S, B, H] activations of one fixed shape: pad every micro-batch to it;
        # without a pipeline each runs at its own shape (token-budget micro-batches differ in rows and width)
        shape = (max(p.ids.shape[0] for p in packs), max(p.ids.shape[1] for p in packs))
        fixed = self.deg.pp > 1

        def step(data: Iterator[Any], model: Any) -> tuple[torch.Tensor, Any]:
            i, (part, packed) = next(data)
            n, s = packed.ids.shape
            rows, width = shape if fixed else (n, s)
            ids = torch.zeros((rows, width), dtype=packed.ids.dtype)
            ids[:n, :s] = packed.ids
            ids = ids.to(dev)
            pos = torch.arange(width, device=dev).unsqueeze(0).expand_as(ids)
            causal = torch.ones((1, 1, width, width), dtype=torch.bool, device=dev).triu(1)
            out = model(ids, pos, causal)
            return out, lambda o, i=i, part=part, packed=packed, n=n: loss_fn(i, part, packed, o[:n])

        return get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=items,
            model=[self.model],
            num_microbatches=len(parts),
            seq_length=shape[1],
            micro_batch_size=shape[0],
            forward_only=forward_only,
        )

    def share(self, stats: dict[str, float]) -> dict[str, float]:
        """The last stage computed the statistics; every rank of the replica reports them."""
        if self.deg.pp == 1:
            return stats
        from megatron.core import parallel_state as ps

        box = [stats]
        dist.broadcast_object_list(
            box, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
        )
        return dict(box[0])

    def zero_grad(self) -> None:
        activate(self.key)
        self.model.zero_grad_buffer()
        self.opt.zero_grad()

    def step(self, lr: float) -> float:
        activate(self.key)
        for g in self.opt.param_groups:
            g["lr"] = lr
        ok, grad_norm, _ = self.opt.step()
        if not ok:
            raise DataError(f"{self.init.role}: Megatron's optimizer skipped a step (non-finite gradients)")
        return float(grad_norm or 0.0)

    # ---------------------------------------------------------------- sync
    def _holder(self, tp_rank: int, pp_rank: int, ep_rank: int | None) -> int:
        """The first global rank holding shard ``tp_rank`` of stage ``pp_rank`` (and expert rank)."""
        for g, (t, p, e) in enumerate(self.coords):
            if t == tp_rank and p == pp_rank and (ep_rank is None or e == ep_rank):
                return g
        raise AssertionError((tp_rank, pp_rank, ep_rank))

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every HF parameter, one at a time, on every rank (a collective: all
        ranks iterate to the end). ``last_received`` counts the bytes this rank
        received from others."""
        activate(self.key)
        own = dict(self._module().named_parameters())
        dtype = next(iter(own.values())).dtype
        me = dist.get_rank()
        self.last_received = 0.0
        experts = bool(self.arch.num_experts)
        for p in range(self.deg.pp):
            for e in range(self.deg.ep if experts else 1):
                d = self.deg.at(0, p, e)

                def gather(rule: Any, p=p, e=e, d=d) -> list[torch.Tensor]:
                    expert = rule.kind.startswith("expert")
                    tps = [0] if rule.kind == "rep" or expert else range(self.deg.tp)
                    out = []
                    for t in tps:
                        src = self._holder(t, p, e if expert else None)
                        mine = p == self.deg.pp_rank and (t == self.deg.tp_rank or rule.kind == "rep")
                        mine = mine and (not expert or e == self.deg.ep_rank)
                        if src == me or mine:  # this rank holds the same tensor: nothing to receive
                            buf = own[rule.megatron].detach().contiguous()
                        else:
                            buf = torch.empty(shard_shape(rule, self.arch, d.at(t, p, e)), dtype=dtype, device=self.device)
                            self.last_received += buf.numel() * buf.element_size()
                        dist.broadcast(buf, src=src)
                        out.append(buf)
                    return out

                # every rank walks the rules in the same order, so the broadcasts match
                yield from hf_params(self.arch, d, gather, lm_head=not self.critic, experts_only=e > 0)

    def full_params(self) -> tuple[dict[str, torch.Tensor], float]:
        """Every HF parameter whole (for export); prefer ``weights()`` for syncs."""
        out = dict(self.weights())
        return out, self.last_received

    def _module(self) -> Any:
        return self.model.module if hasattr(self.model, "module") else self.model

    # ---------------------------------------------------------- checkpoint
    def state(self) -> dict[str, Any]:
        activate(self.key)
        st: dict[str, Any] = {"model": self._module().state_dict()}
        if self.init.optim is not None:
            st["optim"] = self.opt.state_dict()
            st["optim_params"] = self.opt.get_parameter_state_dp_reshardable()
        return st

    def load_state(self, state: dict[str, Any]) -> None:
        activate(self.key)
        self._module().load_state_dict(state["model"], strict=False)
        if self.init.optim is not None:
            self.opt.load_state_dict(state["optim"])
            self.opt.load_parameter_state_from_dp_reshardable(state["optim_params"])

    def export_hf(self, path: str, tokenizer: str | None) -> None:
        params, _ = self.full_params()
        if dist.get_rank() != 0:
            return
        state = fuse_experts({name: t.cpu() for name, t in params.items()})  # transformers 5's module layout
        save_hf(self.init.source, state, path, tokenizer, value=self.critic, what=self.init.role)
