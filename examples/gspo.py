"""GSPO (Zheng et al., 2025, "Group Sequence Policy Optimization").

GRPO's group-relative advantages with a sequence-level importance ratio: each
response's ratio is the geometric mean of its token ratios,
exp(mean_t(logp - old_logp)), clipped as a whole (the paper's clip range is
tiny, 3e-4 below and 4e-4 above). No KL term.

    flowc graph examples/gspo.py
"""

import flowc as fc


@fc.flow
def gspo(prompts: fc.Prompts, actor: fc.Policy, reward: fc.Reward,
         *, n: int = 8, clip: float = 3e-4, clip_high: float = 4e-4):
    rollout = actor.generate(prompts, n=n)
    old_logp = actor.logprobs(rollout)
    adv = fc.ops.group_normalize(reward(rollout), group_size=n)
    actor.update(rollout, advantages=adv, old_logprobs=old_logp,
                 loss=fc.losses.ppo_clip(clip, clip_high, ratio="sequence", agg="seq-mean-token-mean"))
