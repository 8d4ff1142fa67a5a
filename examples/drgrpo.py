"""Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training"): GRPO without its biases.

Two changes to GRPO remove the length and difficulty biases: advantages are
centred within the group but not divided by its standard deviation, and the
loss sums each response's tokens and divides by a constant (the response
length limit) instead of by the response's own length. As in the paper, no
reference model and no KL term.

    flowc graph examples/drgrpo.py
"""

import flowc as fc


@fc.flow
def drgrpo(prompts: fc.Prompts, actor: fc.Policy, reward: fc.Reward,
           *, n: int = 8, clip: float = 0.2):
    rollout = actor.generate(prompts, n=n)
    old_logp = actor.logprobs(rollout)
    adv = fc.ops.group_normalize(reward(rollout), group_size=n, scale=False)  # no std division
    actor.update(rollout, advantages=adv, old_logprobs=old_logp,
                 loss=fc.losses.ppo_clip(clip, agg="seq-mean-token-sum-norm"))  # constant normaliser
