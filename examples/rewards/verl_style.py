"""A reward in verl's per-sample convention (verl.utils.reward_score): flowc recognises it by its
parameter names and calls it once per response, with ``ground_truth`` from the row's
``reward_model.ground_truth``.

    flowc run examples/grpo.py --data examples/data/arith_verl.parquet --reward reward=examples/rewards/verl_style.py:compute_score
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    correct = solution_str.strip() == str(ground_truth)
    return {"score": 1.0 if correct else 0.0, "acc": correct}
