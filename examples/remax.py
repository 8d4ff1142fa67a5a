"""ReMax (Li et al., 2024): REINFORCE with the greedy response's reward as baseline.

Two generations per prompt: a sample, which is trained on, and a greedy
decode, whose reward is the baseline. No critic.

    flowc graph examples/remax.py
"""

import flowc as fc


@fc.flow
def remax(prompts: fc.Prompts, actor: fc.Policy, ref: fc.Reference, reward: fc.Reward,
          *, kl: float = 0.01):
    rollout = actor.generate(prompts)                 # the sample we learn from
    greedy = actor.generate(prompts, greedy=True)     # the baseline
    adv = reward(rollout) - reward(greedy)
    actor.update(rollout, advantages=adv, old_logprobs=actor.logprobs(rollout),
                 ref_logprobs=ref.logprobs(rollout), kl_coef=kl)
