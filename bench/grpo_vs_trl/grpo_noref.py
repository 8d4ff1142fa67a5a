"""GRPO without a reference model: the algorithm TRL's GRPOTrainer runs with beta=0.

Group-normalised rewards as the advantage, PPO's clipped surrogate with
token-mean aggregation, one update per generated batch (so the ratio is 1 and
no old log-probabilities are needed).
"""

import flowc as fc


@fc.flow
def grpo_noref(prompts: fc.Prompts, actor: fc.Policy, reward: fc.Reward, *, n: int = 8, clip: float = 0.2):
    rollout = actor.generate(prompts, n=n)
    adv = fc.ops.group_normalize(reward(rollout), group_size=n)
    actor.update(rollout, advantages=adv, loss=fc.losses.ppo_clip(clip))
