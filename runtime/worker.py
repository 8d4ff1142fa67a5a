"""Workers (one Ray actor per device) and worker groups (one per pool).

A ``WorkerGroup`` is created in a placement group of its pool's bundles,
joins its workers into one torch.distributed world, hosts the engines the
program gives it, and runs the same call on every rank. Every wait has a
timeout; a worker that raises or dies becomes a ``WorkerError`` naming the
group, the role and the rank.
"""

from __future__ import annotations

import collections
import os
import socket
import time
from datetime import timedelta
from typing import Any

import ray
import torch

from flowc.errors import RuntimeFailure, WorkerError, WorkerTimeout
from flowc.runtime.batches import Piece, assemble


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@ray.remote
class Worker:
    """One device's process: a rank of its pool's world and its engines."""

    def __init__(self, group: str, rank: int, world: int, threads: int) -> None:
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        torch.set_num_threads(threads)
        self.group, self.rank, self.world = group, rank, world
        self.engines: dict[str, Any] = {}
        self.tokenizer: Any = None

    # ----------------------------------------------------------------- setup
    def where(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}

    def port(self) -> int:
        return free_port()

    def init_dist(self, master: str, port: int, backend: str, timeout_s: float) -> bool:
        import torch.distributed as dist

        if self.world == 1:
            return True
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master}:{port}",
            rank=self.rank,
            world_size=self.world,
            timeout=timedelta(seconds=timeout_s),
        )
        return True

    def add_engine(self, key: str, kind: str, engine: str, source: str, layout: Any, options: dict[str, Any]) -> str:
        from flowc.runtime.engines import ForwardEngine, RolloutEngine, TrainEngine

        role = key.split("/")[0]
        dtype = getattr(torch, options["dtype"])
        seed = options["seed"]
        if engine in ("train", "forward") and layout.backend == "megatron":
            from flowc.runtime.megatron_engine import MegatronEngine

            optim = options["optim"] if engine == "train" else None
            self.engines[key] = MegatronEngine(
                role=role, kind=kind, source=source, layout=layout, dtype=dtype, seed=seed, optim=optim
            )
        elif engine == "train":
            self.engines[key] = TrainEngine(
                role=role, kind=kind, source=source, layout=layout, optim=options["optim"], dtype=dtype, seed=seed
            )
        elif engine == "forward":
            self.engines[key] = ForwardEngine(role=role, kind=kind, source=source, layout=layout, dtype=dtype, seed=seed)
        elif layout.backend == "vllm":
            from flowc.runtime.vllm_rollout import VllmRolloutEngine

            self.engines[key] = VllmRolloutEngine(
                role=role,
                source=source,
                dtype=dtype,
                tokenizer=options["tokenizer"],
                seed=seed,
                tp=layout.tp,
                max_model_len=options["max_model_len"],
                sleep_between=options.get("colocated", False),
            )
        else:
            self.engines[key] = RolloutEngine(role=role, source=source, dtype=dtype, tokenizer=options["tokenizer"], seed=seed)
        return key

    # ------------------------------------------------------------------ ops
    def _fetch(self, pieces: list[Piece]) -> Any:
        return assemble(pieces, lambda refs: ray.get(list(refs), timeout=600))

    def run(self, key: str, method: str, inputs: dict[str, list[Piece]], args: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """Run ``method`` of engine ``key`` on this rank's rows; returns the
        bulk result (kept in the object store) and small metadata."""
        t0 = time.perf_counter()
        eng = self.engines[key]
        values = {name: self._fetch(p) for name, p in inputs.items()}
        meta: dict[str, Any] = {}
        bulk: Any = None
        if method == "generate":
            r, texts = eng.generate(
                values["prompts"],
                n=args["n"],
                sp=args["sampling"],
                max_tokens=args["max_tokens"],
                step=args["step"],
                rank=self.rank,
            )
            bulk, meta["texts"] = r, texts
            meta["tokens"] = int(r.response_mask.sum())
            meta["slept"] = eng.sleep()  # free the KV cache for training (vLLM on CUDA)
        elif method in ("logprobs", "values", "score"):
            bulk = eng.forward(values["rollout"], args["micro"])
        elif method == "update":
            r = values.pop("rollout")
            meta["stats"] = eng.update(r, values, **args)
        else:
            raise RuntimeFailure(f"unknown engine method {method!r}")
        meta["seconds"] = time.perf_counter() - t0
        if torch.cuda.is_available():  # the whole device's use (vLLM's own allocations included)
            free, total = torch.cuda.mem_get_info()
            meta["device_gb"] = (total - free) / 1e9
        return bulk, meta

    # ----------------------------------------------------------------- sync
    def sync_local(self, src: str, dst: str) -> dict[str, float]:
        """Co-located weight sync: the trained weights stream out of the training
        engine (a collective: every rank iterates) into this rank's rollout engine."""
        t0 = time.perf_counter()
        eng = self.engines[src]
        stream = eng.weights()
        copied = self.engines[dst].load(stream) if dst in self.engines else 0.0
        _drain(stream)  # a rank without a rollout engine still takes part in the collectives
        return {"bytes": eng.last_received, "copied": copied, "seconds": time.perf_counter() - t0}

    def export_weights(self, src: str, bucket_bytes: float) -> tuple[list[Any], dict[str, float]]:
        """Separate pools: the weights stream out of the training engine (every
        rank takes part); rank 0 puts them in the object store in buckets."""
        t0 = time.perf_counter()
        eng = self.engines[src]
        stream = eng.weights()
        refs = [ray.put(bucket) for bucket in _buckets(stream, bucket_bytes)] if self.rank == 0 else []
        _drain(stream)  # the other ranks take part in the collectives only
        return refs, {"bytes": eng.last_received, "seconds": time.perf_counter() - t0}

    def import_weights(self, dst: str, refs: list[Any]) -> dict[str, float]:
        """Separate pools: the buckets, fetched one after another, feed one reload."""
        t0 = time.perf_counter()
        stream = (pair for ref in refs for pair in ray.get(ref, timeout=600).items())
        received = self.engines[dst].load(stream)
        return {"bytes": received, "seconds": time.perf_counter() - t0}

    def rollout_logprobs(self, key: str, inputs: dict[str, list[Piece]]) -> Any:
        return self.engines[key].logprobs(self._fetch(inputs["rollout"]))

    # ----------------------------------------------------------- checkpoint
    def save(self, key: str, path: str) -> str:
        os.makedirs(path, exist_ok=True)
        f = os.path.join(path, f"{key.replace('/', '.')}.rank{self.rank}.pt")
        torch.save(self.engines[key].state(), f)
        return f

    def load(self, key: str, path: str) -> bool:
        f = os.path.join(path, f"{key.replace('/', '.')}.rank{self.rank}.pt")
        self.engines[key].load_state(torch.load(f, weights_only=False))
        return True

    def export_hf(self, key: str, path: str, tokenizer: str | None) -> bool:
        self.engines[key].export_hf(path, tokenizer)
        return True

    def shutdown(self) -> bool:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        return True


class WorkerGroup:
    """The workers of one pool."""

    def __init__(
        self, name: str, size: int, *, gpus: bool, cpus_per_worker: float, strategy: str, timeout_s: float, roles: str
    ) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.name, self.size, self.timeout, self.roles = name, size, timeout_s, roles
        bundle = {"GPU": 1, "CPU": cpus_per_worker} if gpus else {"CPU": cpus_per_worker}
        self.pg = placement_group([dict(bundle) for _ in range(size)], strategy=strategy)
        try:
            ray.get(self.pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise WorkerTimeout(
                f"worker group {name}: {size} bundles of {bundle} could not be placed within {timeout_s:.0f} s",
                fix="give the cluster more CPUs/GPUs (ray status shows what it has) or plan for fewer devices",
            ) from e
        threads = max(1, int(cpus_per_worker))
        self.workers = [
            Worker.options(
                num_cpus=cpus_per_worker,
                num_gpus=1 if gpus else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=i),
                name=f"flowc-{name}-{i}-{os.getpid()}",
            ).remote(name, i, size, threads)
            for i in range(size)
        ]

    def get(self, refs: Any, what: str) -> Any:
        """``ray.get`` with the run's timeout; failures name the group, roles and rank."""
        single = not isinstance(refs, list)
        lst = [refs] if single else refs
        try:
            out = ray.get(lst, timeout=self.timeout)
        except ray.exceptions.GetTimeoutError as e:
            raise WorkerTimeout(
                f"{what} on worker group {self.name} ({self.roles}) did not finish within {self.timeout:.0f} s",
                fix="raise timeout_s in the run config, or look for a hung worker",
            ) from e
        except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as e:
            rank = _rank_of(e, lst, self)
            raise WorkerError(
                f"a worker of group {self.name} ({self.roles}) died during {what}{rank}",
                fix="see the worker's log above; the cluster was shut down",
            ) from e
        except ray.exceptions.RayTaskError as e:
            rank = _rank_of(e, lst, self)
            cause = e.cause if getattr(e, "cause", None) is not None else e
            if isinstance(cause, RuntimeFailure):
                raise cause from None
            raise WorkerError(
                f"{what} failed on worker group {self.name} ({self.roles}){rank}: {type(cause).__name__}: {cause}"
            ) from e
        return out[0] if single else out

    def call(self, method: str, *args: Any, per_rank: list[tuple] | None = None, num_returns: int = 1) -> list[Any]:
        """Call ``method`` on every worker (with per-rank arguments when given); returns refs."""
        out = []
        for i, w in enumerate(self.workers):
            a = per_rank[i] if per_rank is not None else args
            fn = getattr(w, method)
            out.append(fn.options(num_returns=num_returns).remote(*a) if num_returns != 1 else fn.remote(*a))
        return out

    def shutdown(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:
                pass
        try:
            remove_placement_group(self.pg)
        except Exception:
            pass


def _drain(stream: Any) -> None:
    """Run a weight stream to its end (its collectives), keeping nothing."""
    collections.deque(stream, maxlen=0)


def _buckets(weights: Any, bucket_bytes: float) -> Any:
    """(name, tensor) pairs grouped into dicts of about ``bucket_bytes``."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0.0
    for name, t in weights:
        bucket[name] = t.contiguous()
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = {}, 0.0
    if bucket:
        yield bucket


def _rank_of(e: Exception, refs: list[Any], group: WorkerGroup) -> str:
    """ ", rank N" when the failing call can be told apart."""
    for i, r in enumerate(refs):
        try:
            ray.get(r, timeout=0)
        except ray.exceptions.GetTimeoutError:
            continue
        except Exception:
            return f", rank {i % group.size}"
    return ""
