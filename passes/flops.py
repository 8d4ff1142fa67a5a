"""FLOPs of the model ops.

Conventions (per token, one forward pass):

* matmuls: ``2 × matmul parameters`` — the active parameters minus the input
  embedding, which is a lookup (a tied LM head still multiplies);
* causal attention at context ``c``: ``QKᵀ`` and ``AV`` cost
  ``2 · c · H · (d_qk + d_v)`` per layer, where ``c`` is the number of keys a
  token attends to (``s/2`` on average over a sequence of length ``s``).

Training is forward + backward = 3 × forward (+1 forward when activations are
recomputed). Generation is a prefill (a forward over the prompt) plus a decode
that runs one forward per generated token at growing context.
"""

from __future__ import annotations

from dataclasses import dataclass

from flowc.ir.models import ModelSpec
from flowc.passes.response_lengths import LengthDist


def matmul_params(m: ModelSpec) -> int:
    """Active parameters that take part in matmuls."""
    lookup = 0 if m.tie_word_embeddings else m.vocab_size * m.hidden_size
    return m.params_active - lookup


def attention_flops_per_token(m: ModelSpec, context: float) -> float:
    """Forward attention FLOPs of one token attending to ``context`` keys."""
    return 2.0 * context * m.attention_width


def forward_flops(m: ModelSpec, tokens: float, seq_len: float) -> float:
    """One forward pass over ``tokens`` tokens in sequences of ``seq_len``."""
    return tokens * (2.0 * matmul_params(m) + attention_flops_per_token(m, seq_len / 2.0))


def train_flops(m: ModelSpec, tokens: float, seq_len: float, *, recompute: bool = False) -> float:
    """Forward + backward (+ recomputed forward)."""
    return forward_flops(m, tokens, seq_len) * (4.0 if recompute else 3.0)


def useful_train_flops(m: ModelSpec, tokens: float, seq_len: float) -> float:
    """The FLOPs MFU counts (no recomputation)."""
    return train_flops(m, tokens, seq_len, recompute=False)


@dataclass(frozen=True)
class Demand:
    """The work of one model op of one iteration (what the cost model prices).

    Attributes:
        sequences: sequences the op processes (``B·n``).
        prompt_len, response_len: ``P`` and ``R`` (padded limits).
        mean_response_len: expected generated length.
        passes: how many times the op runs over the data per step (epochs).
        updates: optimizer updates per step (``mini_batches × epochs``).
        percentiles: measured response lengths (min, p50, p90, p99, max), when the workload
            gives them; otherwise :attr:`lengths` is an exponential body with the mean whose
            last percent spreads up to the limit.
        agent, turns: a multi-turn generate, and its policy turns per trajectory.
        obs_len: tokens of one environment observation between turns.
        env_latency_s: seconds of one environment step.
        group: rows that share one prompt (the ``n`` of the rollout an update or forward op
            reads), which a layout with ``share_prompts`` computes once.
        idle: an update's rows it does not compute, their advantages all zero (the workload's
            ``idle_rows``): part of the batch it trains on, not of :attr:`sequences`.
    """

    sequences: int
    prompt_len: int
    response_len: int
    mean_response_len: float
    passes: int = 1
    updates: int = 1
    percentiles: tuple[float, ...] | None = None
    agent: bool = False  # a multi-turn generate (with an environment)
    turns: float = 1.0
    obs_len: float = 0.0
    env_latency_s: float = 0.0
    group: int = 1
    idle: int = 0

    @property
    def lengths(self) -> LengthDist:
        """The response-length distribution generation is priced over."""
        return LengthDist.of(self.response_len, self.mean_response_len, self.percentiles)

    @property
    def seq_len(self) -> float:
        """Mean tokens per sequence after padding removal."""
        return self.prompt_len + self.mean_response_len

    @property
    def tokens(self) -> float:
        return self.sequences * self.seq_len * self.passes
