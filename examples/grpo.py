"""GRPO (Shao et al., 2024): group-relative advantages, no critic.

For each prompt, sample n responses; each response's advantage is its reward
normalised within its group. A low-variance KL to the reference is added to
the loss.

    flowc graph examples/grpo.py
"""

import flowc as fc


@fc.flow
def grpo(prompts: fc.Prompts, actor: fc.Policy, ref: fc.Reference, reward: fc.Reward,
         *, n: int = 8, clip: float = 0.2, kl: float = 0.001):
    rollout = actor.generate(prompts, n=n)              # sampling params from config
    old_logp = actor.logprobs(rollout)
    ref_logp = ref.logprobs(rollout)
    scores = reward(rollout)
    adv = fc.ops.group_normalize(scores, group_size=n)  # plain tensor math is traced too
    actor.update(rollout, advantages=adv, old_logprobs=old_logp,
                 ref_logprobs=ref_logp, loss=fc.losses.ppo_clip(clip), kl_coef=kl)
