"""A reward in TRL's convention (``reward_funcs`` of ``GRPOTrainer``): flowc recognises it by its
``completions`` parameter and passes every extra dataset column (here ``answer``) as a keyword.

    flowc run examples/grpo.py --data examples/data/arith_trl.jsonl --reward reward=examples/rewards/trl_style.py:exact_answer
"""


def exact_answer(prompts, completions, answer, **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if t.strip() == a else 0.0 for t, a in zip(texts, answer, strict=True)]
