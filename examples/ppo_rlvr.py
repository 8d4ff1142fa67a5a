"""PPO with a verifiable reward (RLVR), as verl runs it on GSM8K-style tasks.

PPO's machinery — a critic, GAE, KL to the reference subtracted from the
reward token by token, whitened advantages, value clipping — with a Python
scoring function in place of a learned reward model (compare
examples/ppo.py, which uses one).

    flowc graph examples/ppo_rlvr.py
"""

import flowc as fc


@fc.flow
def ppo_rlvr(prompts: fc.Prompts, actor: fc.Policy, critic: fc.Critic, ref: fc.Reference, reward: fc.Reward,
             *, clip: float = 0.2, value_clip: float = 0.2, kl: float = 0.01, gamma: float = 1.0, lam: float = 0.95):
    rollout = actor.generate(prompts)
    old_logp = actor.logprobs(rollout)
    ref_logp = ref.logprobs(rollout)
    values = critic.values(rollout)
    mask = rollout.response_mask
    rewards = fc.ops.token_level(reward(rollout), rollout) - kl * fc.ops.kl(old_logp, ref_logp, kind="k1")
    adv, returns = fc.ops.gae(rewards, values, mask, gamma=gamma, lam=lam)
    actor.update(rollout, advantages=fc.ops.whiten(adv, mask), old_logprobs=old_logp, loss=fc.losses.ppo_clip(clip))
    critic.update(rollout, returns=returns, old_values=values, loss=fc.losses.value_clip(value_clip))
