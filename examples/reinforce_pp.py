"""REINFORCE++ (Hu, 2025): PPO's tricks without a critic.

The KL to the reference is subtracted from the reward token by token, the
return is the reward-to-go, and advantages are whitened over the whole batch
(not per prompt group), then trained with PPO's clipped objective.

    flowc graph examples/reinforce_pp.py
"""

import flowc as fc


@fc.flow
def reinforce_pp(prompts: fc.Prompts, actor: fc.Policy, ref: fc.Reference, reward: fc.Reward,
                 *, n: int = 4, clip: float = 0.2, kl: float = 0.01, gamma: float = 1.0):
    rollout = actor.generate(prompts, n=n)
    old_logp = actor.logprobs(rollout)
    ref_logp = ref.logprobs(rollout)
    mask = rollout.response_mask
    rewards = fc.ops.token_level(reward(rollout), rollout) - kl * fc.ops.kl(old_logp, ref_logp, kind="k1")
    returns = fc.ops.discounted_returns(rewards, mask, gamma=gamma)
    adv = fc.ops.whiten(returns, mask)                       # global, not per group
    actor.update(rollout, advantages=adv, old_logprobs=old_logp, loss=fc.losses.ppo_clip(clip))
