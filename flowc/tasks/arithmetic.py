"""The built-in task: integer arithmetic with an exact-match reward.

Problems are ``a+b=`` and ``a-b=`` with ``a, b`` in 0–99 (20,000 in all).
A fixed, seeded set of 1,000 is held out for evaluation; training draws from
the rest. The response is the answer's digits (with a leading ``-`` when
negative) followed by EOS; the reward is 1.0 for an exact match, else 0.0.

The tokenizer is character-level (built with ``tokenizers``) and saved with
the shipped model, so ``AutoTokenizer.from_pretrained`` loads it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

SPECIALS = ("<pad>", "<s>", "</s>")
CHARS = tuple("0123456789+-=")
VOCAB = (*SPECIALS, *CHARS)
EVAL_SIZE = 1000
# chat-format prompts (verl's layout) render to the same text a string prompt is: the messages' contents
CHAT_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
SEED = 20261202


@dataclass(frozen=True)
class Problem:
    prompt: str  # e.g. "12+34="
    answer: str  # e.g. "46"


def all_problems() -> list[Problem]:
    out = []
    for a in range(100):
        for b in range(100):
            out.append(Problem(f"{a}+{b}=", str(a + b)))
            out.append(Problem(f"{a}-{b}=", str(a - b)))
    return out


def split(seed: int = SEED) -> tuple[list[Problem], list[Problem]]:
    """(train, eval): a fixed, seeded hold-out of EVAL_SIZE problems."""
    problems = all_problems()
    rng = random.Random(seed)
    rng.shuffle(problems)
    return problems[EVAL_SIZE:], problems[:EVAL_SIZE]


def records(problems: Sequence[Problem]) -> list[dict[str, str]]:
    """Rows of a dataset: a ``prompt`` column and the ``answer`` the reward reads."""
    return [{"prompt": p.prompt, "answer": p.answer} for p in problems]


def preference_records(problems: Sequence[Problem], seed: int = SEED) -> list[dict[str, str]]:
    """Preference pairs for offline training (DPO): the right answer is ``chosen``, a near miss
    (off by 1–10, seeded per problem) ``rejected``."""
    rows = []
    for p in problems:
        rng = random.Random(f"{seed}:{p.prompt}")
        wrong = int(p.answer) + rng.choice([-1, 1]) * rng.randint(1, 10)
        rows.append({"prompt": p.prompt, "chosen": p.answer, "rejected": str(wrong), "answer": p.answer})
    return rows


def exact_match(prompts: list[str], responses: list[str], answer: list[str], **_: object) -> list[float]:
    """Reward: 1.0 when the response (up to EOS) is exactly the answer."""
    return [1.0 if r.strip() == a else 0.0 for r, a in zip(responses, answer, strict=True)]


def build_tokenizer(vocab: Sequence[str] = VOCAB):
    """A character-level fast tokenizer over ``vocab`` (VOCAB unless given; the specials first,
    then one token per character; BOS prepended, EOS appended by the task)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(vocab)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    out = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", padding_side="left", model_max_length=64
    )
    out.chat_template = CHAT_TEMPLATE
    return out


def asset_dir() -> Path:
    """The shipped warm-started model (HF format: config, safetensors, tokenizer)."""
    return Path(str(resources.files("flowc.tasks").joinpath("assets/arith-tiny")))


def reward_model_dir() -> Path:
    """The shipped reward model of the task (a one-label sequence classifier on the same
    trunk; ``python -m flowc.tasks.make_reward_model`` builds it)."""
    return Path(str(resources.files("flowc.tasks").joinpath("assets/arith-tiny-rm")))
