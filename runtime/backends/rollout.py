"""What every rollout backend shares: the tokenizer, seeding, decoding, and
assembling the rollout; and the bytes a weight stream carries.

:class:`RolloutEngine` wraps a :class:`~flowc.runtime.backends.RolloutBackend`.
A sample's seed is a function of (run seed, step, round, global prompt row,
sample) only, so a run draws the same samples whatever the number of
generation replicas, the batch a row shares, or the backend's own scheduling
order (each backend makes a sequence's tokens a function of its seed).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from flowc.errors import SpecError
from flowc.ir.functional import PromptBatch, Rollout
from flowc.ir.sampling import SamplingParams
from flowc.runtime.agent import AgentJob, AgentResult, run_agents, run_harnesses, stop_token_ids
from flowc.runtime.backends import EngineInit, RolloutBackend, built_backend
from flowc.runtime.batches import repeat_rows
from flowc.runtime.modeling import rollout_tokenizer


def request_seed(seed: int, step: int, round_: int, row: int, sample: int, turn: int = 0) -> int:
    """A sample's seed: stable across processes, Python versions and layouts
    (FNV-1a over the five numbers; an agent trajectory's later turns mix their turn in)."""
    x = 1469598103934665603
    for v in (seed, step, round_, row, sample, *((turn,) if turn else ())):
        x = ((x ^ (v & 0xFFFFFFFFFFFFFFFF)) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return x % (2**31 - 1)


def eos_token_ids(tok: Any, source: str) -> tuple[int, ...]:
    """The tokenizer's EOS first, then the other end-of-sequence ids of the model's
    ``generation_config.json`` (an instruct model's ``<|endoftext|>`` beside ``<|im_end|>``)."""
    import json
    from pathlib import Path

    out = [int(tok.eos_token_id)]
    try:
        extra = json.loads((Path(source) / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError):
        extra = None
    for i in extra if isinstance(extra, list) else [extra]:
        if isinstance(i, int) and i not in out and i < len(tok):
            out.append(i)
    return tuple(out)


class Counted:
    """A weight stream that tallies the bytes it hands over."""

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.weights = weights
        self.bytes = 0.0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self.weights:
            self.bytes += t.numel() * t.element_size()
            yield name, t


class RolloutEngine:
    """A generation engine: the shared part around one backend."""

    def __init__(self, backend: RolloutBackend, init: EngineInit) -> None:
        self.b = backend
        self.init = init
        self.tok = rollout_tokenizer(init.tokenizer, backend.vocab_size)
        self.pools: dict[str, Any] = {}  # environment role → its EnvPool or HarnessPool (started on first use)
        self.server: Any = None  # server mode's OpenAI-compatible endpoint (started on first use)
        self._tid = 0  # trajectory ids: unique over the engine's life

    @torch.no_grad()
    def generate(
        self, prompts: PromptBatch, *, n: int, sp: SamplingParams, max_tokens: int, step: int, round_: int, row_offset: int
    ) -> tuple[Rollout, list[str]]:
        """``n`` responses to each prompt row; ``row_offset`` is the global index of this
        replica's first prompt (seeds follow global rows)."""
        if sp.stop:
            raise SpecError(
                f"{self.init.role}.generate: stop strings {sp.stop} are not supported by the rollout backends",
                fix="end responses with the tokenizer's EOS token instead",
            )
        rows = prompts.input_ids.shape[0]
        seeds = torch.tensor(
            [request_seed(self.init.seed, step, round_, row_offset + i, j) for i in range(rows) for j in range(n)],
            dtype=torch.long,
        )
        s = self.b.sample(
            prompts, n=n, sp=sp, max_tokens=max_tokens, seeds=seeds, eos_id=self.tok.eos_token_id, pad_id=self.tok.pad_token_id
        )
        r = Rollout(
            repeat_rows(prompts.input_ids, n),
            repeat_rows(prompts.attention_mask, n).bool(),
            s.response_ids,
            s.response_mask,
            s.logprobs,
        )
        return r, self.decode(r)

    @torch.no_grad()
    def generate_agent(
        self,
        prompts: PromptBatch,
        records: list[dict[str, Any]],
        *,
        n: int,
        sp: SamplingParams,
        turn_tokens: int,
        budget: int,
        max_turns: int,
        binding: Any,
        step: int,
        round_: int,
        row_offset: int,
    ) -> AgentResult:
        """``n`` multi-turn trajectories per prompt row with the environment ``binding``
        (:mod:`flowc.runtime.agent`); ``budget`` tokens per trajectory after its prompt, at most
        ``turn_tokens`` per policy turn."""
        from flowc.runtime.envs import EnvPool, HarnessPool

        lay = self.init.layout
        if lay.tp > 1 or lay.pp > 1:
            raise SpecError(
                f"{self.init.role}.generate with environment {binding.role} on a replica of several ranks "
                f"(tp={lay.tp}, pp={lay.pp}): multi-turn generation runs on single-rank replicas only (each rank would "
                "run environments of its own and could diverge)",
                fix=f"plan it with tp 1 and pp 1 (drop the pins {self.init.role}.generate.tp/pp, or pin them to 1)",
            )
        held = self.pools.get(binding.role)
        if held is not None and held.b != binding:  # another class or pool size for this role: a pool of its own
            held.close()
            held = None
        if held is None:
            self.pools[binding.role] = (HarnessPool if binding.harness else EnvPool)(binding)
        stop = stop_token_ids(self.tok, binding.stop, f"environment {binding.role} ({binding.name})")
        eos = eos_token_ids(self.tok, self.init.source)
        # the model's other end-of-sequence tokens end a turn too (and the trajectory), on both backends
        engine = self.b.turns(sp, eos[0], self.tok.pad_token_id, (*stop, *eos[1:]))  # type: ignore[attr-defined]
        seed = self.init.seed
        job = AgentJob(
            self.tok,
            prompts,
            records,
            n=n,
            max_turns=max_turns,
            budget=budget,
            turn_tokens=turn_tokens,
            eos_ids=eos,
            pad_id=self.tok.pad_token_id,
            seed_of=lambda row, j, turn: request_seed(seed, step, round_, row, j, turn),
            row_offset=row_offset,
            first_tid=self._tid,
            stop_ids=tuple(stop),
        )
        if binding.harness:  # server mode: the user's harness drives each trajectory through an OpenAI endpoint
            from flowc.runtime.serve import TrajectoryServer

            if self.server is None:
                self.server = TrajectoryServer()
            out = run_harnesses(engine, self.pools[binding.role], self.server, binding, job)
        else:
            out = run_agents(engine, self.pools[binding.role], binding, job)
        self._tid += prompts.input_ids.shape[0] * n
        return out

    def decode(self, r: Rollout) -> list[str]:
        ids = r.response_ids.masked_fill(~r.present, self.tok.pad_token_id)
        return self.tok.batch_decode(ids, skip_special_tokens=True)

    @torch.no_grad()
    def logprobs(self, r: Rollout) -> torch.Tensor:
        return self.b.logprobs(r)

    def alias(self, params: dict[str, torch.Tensor] | None) -> bool:
        """Run a co-located trainer's parameters themselves where the backend can (``hf``, see
        ``HfRollout.alias``); False: the weights must be loaded (``params`` None: stop aliasing)."""
        fn = getattr(self.b, "alias", None)
        return bool(fn(params)) if fn is not None else False

    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> float:
        """New weights in one reload; returns the bytes handed over."""
        stream = Counted(weights)
        self.b.load(stream)
        return stream.bytes

    def sleep(self) -> bool:
        return self.b.sleep()

    def close(self) -> None:
        """Release what the backend holds beyond its Python objects (vLLM: its engine core), once."""
        for pool in self.pools.values():
            pool.close()
        self.pools = {}
        if self.server is not None:
            self.server.close()
            self.server = None
        close = getattr(self.b, "close", None)
        if close is not None:
            close()

    def describe(self) -> dict[str, Any]:
        """The engine as built; a backend adds what it sized itself (vLLM: its KV cache)."""
        own = getattr(self.b, "describe", None)
        return {"backend": built_backend(self.b), "dtype": self.init.dtype, "tp": self.init.layout.tp, **(own() if own else {})}
