"""The ``hf`` rollout backend: flowc's own KV-cache decode loop over an HF
causal LM (:mod:`flowc.runtime.sampling`), one model copy per replica."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from flowc.errors import DataError
from flowc.ir.functional import PromptBatch, Rollout
from flowc.ir.sampling import SamplingParams
from flowc.runtime.backends import EngineInit
from flowc.runtime.backends.collectives import compute_device
from flowc.runtime.batches import repeat_rows
from flowc.runtime.modeling import load_causal_lm, response_logprobs
from flowc.runtime.sampling import Sampled, sample


class HfRollout:
    """Generation with the ``hf`` backend."""

    def __init__(self, init: EngineInit) -> None:
        self.init = init
        self.device = compute_device()
        self.model = load_causal_lm(init.source, dtype=init.torch_dtype).to(self.device)
        self.model.eval()
        self.vocab_size = int(self.model.config.vocab_size)
        self.tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        self.lent = False  # runs a trainer's parameters (see :meth:`alias`)

    def sample(
        self, prompts: PromptBatch, *, n: int, sp: SamplingParams, max_tokens: int, seeds: torch.Tensor, eos_id: int, pad_id: int
    ) -> Sampled:
        ids = repeat_rows(prompts.input_ids, n).to(self.device)
        mask = repeat_rows(prompts.attention_mask, n).to(self.device)
        out = sample(self.model, ids, mask, sp, max_tokens=max_tokens, eos_id=eos_id, pad_id=pad_id, seeds=seeds.to(self.device))
        return Sampled(out.response_ids.cpu(), out.response_mask.cpu(), out.logprobs.cpu())

    @torch.no_grad()
    def logprobs(self, r: Rollout) -> torch.Tensor:
        args = (x.to(self.device) for x in (r.prompt_ids, r.prompt_mask, r.response_ids, r.present))
        return response_logprobs(self.model, *args).cpu()

    @torch.no_grad()
    def load(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy new weights in; every parameter must arrive, and nothing the model lacks
        (a tied LM head is the embedding, so its name may come and is skipped)."""
        own = dict(self.model.named_parameters())
        got: set[str] = set()
        for name, t in weights:
            if name not in own:
                if self.tied and name == "lm_head.weight":
                    continue
                raise DataError(f"{self.init.role}: the weight stream holds {name!r}, which the rollout model does not have")
            own[name].copy_(t.to(device=own[name].device, dtype=own[name].dtype))
            got.add(name)
        missing = sorted(set(own) - got)
        if missing:
            raise DataError(f"{self.init.role}: the weight stream lacked {len(missing)} parameters ({', '.join(missing[:3])}, …)")

    def alias(self, params: dict[str, torch.Tensor] | None) -> bool:
        """Run the trainer's own parameters (``params``: its plain tensors by HF name, in this
        process) instead of a copy of them: every optimizer step is in the model at once, with
        nothing to copy, and the storage itself is the check. True when every parameter of the
        model is now the one of that name in ``params`` (same shape, dtype and device); otherwise
        (None, a mismatch) the model runs its own copy again — a sync then copies into it."""
        own = dict(self.model.named_parameters())
        names = set(params or ()) - ({"lm_head.weight"} if self.tied else set())
        fits = params is not None and names == set(own)
        fits = fits and all(
            params[n].shape == p.shape and params[n].dtype == p.dtype and params[n].device == p.device for n, p in own.items()
        )
        if not fits:
            if self.lent:  # its own storage again, holding the weights it ran last
                for p in own.values():
                    p.data = p.data.clone()
                self.lent = False
            return False
        for n, p in own.items():
            if p.data_ptr() != params[n].data_ptr():
                p.data = params[n].data
        self.lent = True
        return True

    def turns(self, sp: SamplingParams, eos_id: int, pad_id: int, stop_ids: tuple[int, ...]) -> HfTurns:
        """The agent loop's engine (:mod:`flowc.runtime.agent`): the turns waiting at each call, as one batch."""
        return HfTurns(self, sp, eos_id, pad_id, stop_ids)

    def sleep(self) -> bool:
        """Nothing to free between rollouts (the ``vllm`` backend's sleep mode); says so."""
        return False


class HfTurns:
    """Turns of agent trajectories on the ``hf`` backend: :meth:`advance` decodes every turn
    submitted since the last call as one left-padded batch, each row with its own seed and limit.
    Lock-step (:mod:`flowc.runtime.agent`): a batch holds every trajectory still going, in order."""

    lockstep = True

    def __init__(self, hf: HfRollout, sp: SamplingParams, eos_id: int, pad_id: int, stop_ids: tuple[int, ...]) -> None:
        self.hf, self.sp, self.eos_id, self.pad_id, self.stop_ids = hf, sp, eos_id, pad_id, stop_ids
        self.queue: list[tuple[int, list[int], int, int]] = []

    def submit(self, key: int, tokens: list[int], max_tokens: int, seed: int) -> None:
        self.queue.append((key, tokens, max_tokens, seed))

    def pending(self) -> int:
        return len(self.queue)

    def abort(self) -> None:
        self.queue = []

    def advance(self) -> list[tuple[int, list[int], list[float]]]:
        batch, self.queue = self.queue, []
        if not batch:
            return []
        width = max(len(t) for _, t, _, _ in batch)
        ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (_, t, _, _) in enumerate(batch):
            ids[i, width - len(t) :] = torch.tensor(t, dtype=torch.long)
            mask[i, width - len(t) :] = 1
        dev = self.hf.device
        out = sample(
            self.hf.model,
            ids.to(dev),
            mask.to(dev),
            self.sp,
            max_tokens=max(m for _, _, m, _ in batch),
            eos_id=self.eos_id,
            pad_id=self.pad_id,
            seeds=torch.tensor([s for *_, s in batch], dtype=torch.long, device=dev),
            stop_ids=self.stop_ids,
        )
        got = []
        for i, (key, _, limit, _) in enumerate(batch):
            k = min(int(out.response_mask[i].sum()), limit)
            got.append((key, out.response_ids[i, :k].tolist(), out.logprobs[i, :k].tolist()))
        return got
