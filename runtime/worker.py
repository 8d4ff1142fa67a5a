"""Workers (one process per device) and worker groups (one per pool).

A :class:`Worker` is a plain class: :data:`RayWorker` is it as a Ray actor, and the inline
executor (:mod:`flowc.runtime.inline`) holds one in the controller's own process.
A ``WorkerGroup`` is created in a placement group of its pool's bundles,
joins its workers into one torch.distributed world, hosts the engines the
program gives it (built by the backend registry from the layout's backend),
and runs the same call on every rank. Every wait has the plan's timeout; a
worker that raises or dies becomes a ``WorkerError`` naming the group, the
role and the rank.
"""

from __future__ import annotations

import collections
import os
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import ray
import torch

from flowc.errors import RuntimeFailure, WorkerError, WorkerTimeout
from flowc.ir.functional import Rollout
from flowc.ir.ops import Op
from flowc.runtime.backends import EngineInit, backend
from flowc.runtime.backends.rollout import RolloutEngine
from flowc.runtime.backends.training import TrainEngine
from flowc.runtime.batches import Piece, assemble
from flowc.runtime.checkpoint_io import load_legacy_pt, load_state, save_state
from flowc.runtime.program import EngineKey


def make_engine(init: EngineInit) -> TrainEngine | RolloutEngine:
    """The engine of ``init``'s layout backend: the backend wrapped in the shared training loop or rollout engine."""
    info = backend(init.layout.backend)
    impl = info.load()(init)
    return TrainEngine(impl) if info.role == "trainer" else RolloutEngine(impl, init)


class Worker:
    """One device's process: a rank of its pool's world and its engines."""

    def __init__(self, group: str, rank: int, world: int, threads: int, timeout_s: float) -> None:
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        torch.set_num_threads(threads)
        self.group, self.rank, self.world, self.timeout = group, rank, world, timeout_s
        self.engines: dict[EngineKey, Any] = {}
        self._loads: dict[EngineKey, int] = {}  # weight syncs each rollout engine has loaded (its weight version)
        self._ops: dict[Op, Callable[..., tuple[Any, dict[str, Any]]]] = {
            Op.GENERATE: self._generate,
            Op.LOGPROBS: self._forward,
            Op.VALUES: self._forward,
            Op.SCORE: self._forward,
            Op.UPDATE: self._update,
        }

    # ----------------------------------------------------------------- setup
    def where(self) -> dict[str, Any]:
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}

    def port(self) -> int:
        """A port for the rank-0 rendezvous store, bound on this node's address (not every
        interface) and held open until :meth:`init_dist` hands the socket to the store."""
        if self.world == 1:
            return 0
        self._store_socket = socket.create_server((ray.util.get_node_ip_address(), 0))
        return int(self._store_socket.getsockname()[1])

    def init_dist(self, master: str, port: int, backend_name: str) -> bool:
        import torch.distributed as dist

        if self.world == 1:
            return True
        # a collective outlasts the controller's deadline for the call around it, so a stopped peer shows as
        # "rank N did not answer" (the cause) before the survivors' collectives time out (the symptom)
        timeout = timedelta(seconds=collective_timeout(self.timeout))
        held = getattr(self, "_store_socket", None)
        # rank 0 serves the store on the socket port() bound; left to itself, TCPStore listens on all interfaces
        store = dist.TCPStore(
            master,
            port,
            self.world,
            is_master=self.rank == 0,
            timeout=timeout,
            **({"master_listen_fd": held.detach()} if self.rank == 0 and held is not None else {}),
        )
        self._store_socket = None
        dist.init_process_group(backend_name, store=store, rank=self.rank, world_size=self.world, timeout=timeout)
        return True

    def add_engine(self, key: EngineKey, init: EngineInit) -> str:
        self.engines[key] = make_engine(init)
        return str(key)

    def describe(self) -> dict[str, Any]:
        """What this worker actually runs: its engines as built, its threads and timeout."""
        return {
            "threads": torch.get_num_threads(),
            "timeout_s": self.timeout,
            "engines": {str(k): e.describe() for k, e in self.engines.items()},
        }

    # ------------------------------------------------------------------ ops
    def _fetch(self, pieces: list[Piece]) -> Any:
        return assemble(pieces, lambda refs: ray.get(list(refs), timeout=self.timeout))

    def run(self, key: EngineKey, op: Op, inputs: dict[str, list[Piece]], args: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """Run ``op`` on engine ``key`` over this rank's rows; returns the bulk result
        (kept in the object store) and small metadata (``start``: the wall-clock time it began,
        ``seconds``: how long it took; the controller's overhead is the step outside them)."""
        start, t0 = time.time(), time.perf_counter()
        try:
            handler = self._ops[Op(op)]
        except (KeyError, ValueError):
            raise RuntimeFailure(f"a worker cannot run op {op!r}") from None
        values = {name: self._fetch(p) for name, p in inputs.items()}
        bulk, meta = handler(self.engines[key], values, args)
        if handler == self._generate:  # the weights it sampled with, as the engine counts them
            meta["weights_loaded"] = self._loads.get(key, 0)
        meta["seconds"] = time.perf_counter() - t0
        meta["start"] = start
        if torch.cuda.is_available():  # the whole device's use (vLLM's own allocations included)
            free, total = torch.cuda.mem_get_info()
            meta["device_gb"] = (total - free) / 1e9
        return bulk, meta

    def _generate(self, eng: RolloutEngine, values: dict[str, Any], args: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """Responses, or with ``env`` multi-turn trajectories (:mod:`flowc.runtime.agent`); the
        metadata: texts, the policy's tokens, per-row lengths (the whole trajectory's) and, after
        generating, whether the engine slept (freed its KV cache: vLLM on CUDA)."""
        common = dict(
            n=args["n"], sp=args["sampling"], step=args["step"], round_=args.get("round", 0), row_offset=args["row_offset"]
        )
        extra: dict[str, Any] = {}
        if args.get("env") is not None:
            out = eng.generate_agent(
                values["prompts"],
                args["records"],
                turn_tokens=args["turn_tokens"],
                budget=args["max_tokens"],
                max_turns=args["max_turns"],
                binding=args["env"],
                **common,
            )
            r, texts = out.rollout, out.texts
            extra = {"agent": out.metrics, "agent_errors": out.errors[:3], "env_rewards": r.env_reward.tolist()}  # type: ignore[union-attr]
        else:
            r, texts = eng.generate(values["prompts"], max_tokens=args["max_tokens"], **common)
        # lengths: the policy's tokens per row (what mean_response_len prices; a trajectory's observations are not)
        meta = {"texts": texts, "tokens": int(r.response_mask.sum()), "lengths": r.response_mask.sum(dim=1).tolist(), **extra}
        meta["slept"] = eng.sleep()
        return r, meta

    def _forward(self, eng: TrainEngine, values: dict[str, Any], args: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        micro = (
            args.get("micro_tokens", 0),
            args.get("micro_overhead", 0.0),
            args.get("share_prompts", False),
            args.get("pack_sequences", False),
        )
        return eng.forward(values["rollout"], args["micro"], *micro), {}

    def _update(self, eng: TrainEngine, values: dict[str, Any], args: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        r = values.pop("rollout")
        return None, {"stats": eng.update(r, values, **args)}

    # ----------------------------------------------------------------- sync
    def sync_local(self, src: EngineKey, dst: EngineKey, probe: Rollout | None = None, alias: bool = False) -> dict[str, Any]:
        """Co-located weight sync: the trained weights stream out of the training
        engine (a collective: every rank iterates) into this rank's rollout engine.
        With a ``probe`` both engines then score it (see ``runtime.sync_check``).

        With ``alias`` (lock-step: the engine never samples while the trainer steps) a rollout
        engine that can run the trainer's parameters themselves does (``RolloutEngine.alias``):
        nothing is copied, and the check is that every parameter is the trainer's storage
        (``aliased``), not a probe."""
        start, t0 = time.time(), time.perf_counter()
        eng = self.engines[src]
        if dst in self.engines and self.engines[dst].alias(eng.lendable() if alias else None):
            self._loads[dst] = self._loads.get(dst, 0) + 1
            return {"bytes": 0.0, "copied": 0.0, "seconds": time.perf_counter() - t0, "start": start, "aliased": True}
        stream = eng.weights()
        copied = self.engines[dst].load(stream) if dst in self.engines else 0.0
        if dst in self.engines:
            self._loads[dst] = self._loads.get(dst, 0) + 1
        _drain(stream)  # a rank without a rollout engine still takes part in the collectives
        out = {"bytes": eng.last_received, "copied": copied, "seconds": time.perf_counter() - t0, "start": start}
        if probe is not None:
            out["probe_trainer"] = _probe_of(eng.probe(probe), probe)
            out["probe_engine"] = _probe_of(self.engines[dst].logprobs(probe), probe) if dst in self.engines else None
        return out

    def export_weights(
        self, src: EngineKey, bucket_bytes: float, probe: Rollout | None = None
    ) -> tuple[list[Any], dict[str, Any]]:
        """Separate pools: the weights stream out of the training engine (every
        rank takes part); rank 0 puts them in the object store in buckets. With a
        ``probe`` the trainer scores it too (every rank: a collective)."""
        start, t0 = time.time(), time.perf_counter()
        eng = self.engines[src]
        stream = eng.weights()
        refs = [ray.put(bucket) for bucket in _buckets(stream, bucket_bytes)] if self.rank == 0 else []
        _drain(stream)  # the other ranks take part in the collectives only
        meta: dict[str, Any] = {"bytes": eng.last_received, "seconds": time.perf_counter() - t0, "start": start}
        if probe is not None:
            meta["probe_trainer"] = _probe_of(eng.probe(probe), probe)
        return refs, meta

    def import_weights(self, dst: EngineKey, refs: list[Any], probe: Rollout | None = None) -> dict[str, Any]:
        """Separate pools: the buckets, fetched one after another, feed one reload; then the
        engine scores the ``probe`` (when given)."""
        start, t0 = time.time(), time.perf_counter()
        stream = (pair for ref in refs for pair in ray.get(ref, timeout=self.timeout).items())
        received = self.engines[dst].load(stream)
        self._loads[dst] = self._loads.get(dst, 0) + 1
        out = {"bytes": received, "buckets": len(refs), "seconds": time.perf_counter() - t0, "start": start}
        if probe is not None:
            out["probe_engine"] = _probe_of(self.engines[dst].logprobs(probe), probe)
        return out

    def rollout_logprobs(self, key: EngineKey, inputs: dict[str, list[Piece]]) -> Any:
        return self.engines[key].logprobs(self._fetch(inputs["rollout"]))

    # ----------------------------------------------------------- checkpoint
    def _stem(self, key: EngineKey, path: str) -> str:
        return os.path.join(path, f"{key.role}.{key.kind}.rank{self.rank}")

    def save(self, key: EngineKey, path: str) -> list[str]:
        """This rank's state of ``key`` as safetensors + JSON (no pickle); the files written."""
        os.makedirs(path, exist_ok=True)
        return save_state(self.engines[key].state(), self._stem(key, path))

    def load(self, key: EngineKey, path: str) -> bool:
        """Load what :meth:`save` wrote (a checkpoint of an older flowc: its .pt file, never unpickling objects)."""
        stem, eng = self._stem(key, path), self.engines[key]
        if os.path.exists(stem + ".pt") and not os.path.exists(stem + ".json"):
            eng.load_state(load_legacy_pt(stem + ".pt"))
        else:
            eng.load_state(load_state(stem, mesh=_mesh_of(eng)))
        return True

    def export_hf(self, key: EngineKey, path: str, tokenizer: str | None) -> bool:
        self.engines[key].export_hf(path, tokenizer)
        return True

    def shutdown(self) -> bool:
        """Close the engines (the inline executor's worker; a Ray worker's process is killed instead)
        and leave the process group."""
        import torch.distributed as dist

        for eng in self.engines.values():
            close = getattr(eng, "close", None)
            if close is not None:
                close()
        self.engines.clear()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        return True


RayWorker = ray.remote(Worker)  # a Worker in a Ray actor of its own


def _mesh_of(eng: Any) -> Any:
    """The device mesh of an engine's sharded (DTensor) parameters, or None."""
    model = getattr(getattr(eng, "b", None), "model", None)
    for prm in model.parameters() if model is not None else ():
        if hasattr(prm, "device_mesh"):
            return prm.device_mesh
    return None


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
                fix="give the cluster more CPUs/GPUs (ray.cluster_resources() shows what it has) or plan for fewer devices",
            ) from e
        threads = max(1, int(cpus_per_worker))
        self.workers = [
            RayWorker.options(
                num_cpus=cpus_per_worker,
                num_gpus=1 if gpus else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=i),
                name=f"flowc-{name}-{i}-{os.getpid()}",
            ).remote(name, i, size, threads, timeout_s)
            for i in range(size)
        ]

    def join(self, collective: str) -> list[dict[str, Any]]:
        """Join the workers into one torch.distributed world (rank 0 serves the rendezvous store);
        returns where each rank runs (node, address, pid)."""
        where = self.get(self.call("where"), "start")
        port = self.get(self.workers[0].port.remote(), "start")
        self.get(self.call("init_dist", where[0]["ip"], port, collective), "joining the process group")
        return where

    def get(self, refs: Any, what: str) -> Any:
        """``ray.get`` with the run's timeout; failures name the group, roles and rank."""
        single = not isinstance(refs, list)
        lst = [refs] if single else refs
        try:
            out = ray.get(lst, timeout=self.timeout)
        except ray.exceptions.GetTimeoutError as e:
            raise WorkerTimeout(
                f"{what} on worker group {self.name} ({self.roles}) did not finish within {self.timeout:.0f} s{_silent(lst, len(self.workers))}",
                fix="raise timeout_s in the run config, or look for a hung or stopped worker (its pid is in placement.json)",
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
            dead = _dead_rank(lst, self, wait_s=min(10.0, self.timeout))
            if dead is not None:  # a peer's death breaks the survivors' collectives: name the cause, not the symptom
                raise WorkerError(
                    f"a worker of group {self.name} ({self.roles}) died during {what}, rank {dead}"
                    f" (then {what} failed{rank}: {type(cause).__name__}: {str(cause).splitlines()[0][:300]})",
                    fix="see the worker's log above; the cluster was shut down",
                ) from e
            if isinstance(cause, RuntimeFailure):
                raise cause from None
            silent = _silent(lst, len(self.workers))
            if silent:  # a survivor's collective gave up on a peer that never answered: name the peer
                raise WorkerTimeout(
                    f"{what} on worker group {self.name} ({self.roles}) did not finish within {self.timeout:.0f} s{silent}"
                    f" (then {what} failed{rank}: {type(cause).__name__}: {str(cause).splitlines()[0][:300]})",
                    fix="raise timeout_s in the run config, or look for a hung or stopped worker (its pid is in placement.json)",
                ) from e
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


def _probe_of(lp: torch.Tensor | None, probe: Rollout) -> list[float] | None:
    """The probe's per-token log-probabilities (None: a rank whose outputs are not kept)."""
    return None if lp is None else lp[0, : probe.response_ids.shape[1]].float().tolist()


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


def _silent(refs: list[Any], ranks: int) -> str:
    """Which ranks have not answered (when ``refs`` holds one call per each of ``ranks`` ranks)."""
    if len(refs) != ranks:
        return ""
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=0)
    late = [i for i, r in enumerate(refs) if r in pending]
    return f": rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} of {len(refs)} did not answer" if late else ""


def collective_timeout(call_timeout_s: float) -> float:
    """The process group's timeout for a run whose calls time out after ``call_timeout_s``: longer, so
    the controller's deadline (which names the rank that did not answer) fires first."""
    return 2.0 * call_timeout_s + 10.0


def _dead_rank(refs: list[Any], group: WorkerGroup, wait_s: float) -> int | None:
    """The rank whose worker died while answering ``refs``, if one did: waits up to ``wait_s`` for the
    other calls to settle, since a dead peer shows first as a collective error on the survivors."""
    if len(refs) < 2:
        return None
    ray.wait(refs, num_returns=len(refs), timeout=wait_s)
    for i, r in enumerate(refs):
        try:
            ray.get(r, timeout=0)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError):
            return i % group.size
        except Exception:
            continue
    return None


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
