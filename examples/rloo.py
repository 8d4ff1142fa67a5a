"""RLOO (Ahmadian et al., 2024): REINFORCE with a leave-one-out baseline.

Each of the k samples of a prompt is compared with the mean reward of the
other k-1; no critic. The KL to the reference is a loss term.

    flowc graph examples/rloo.py
"""

import flowc as fc


@fc.flow
def rloo(prompts: fc.Prompts, actor: fc.Policy, ref: fc.Reference, reward: fc.Reward,
         *, k: int = 4, clip: float = 0.2, kl: float = 0.01):
    rollout = actor.generate(prompts, n=k)
    old_logp = actor.logprobs(rollout)
    ref_logp = ref.logprobs(rollout)
    scores = reward(rollout)
    adv = scores - fc.ops.rloo_baseline(scores, group_size=k)
    actor.update(rollout, advantages=adv, old_logprobs=old_logp, ref_logprobs=ref_logp,
                 loss=fc.losses.ppo_clip(clip), kl_coef=kl)
