"""DAPO (Yu et al., 2025): GRPO tuned for long reasoning, four changes.

Clip-higher (a wider upper clip keeps exploration alive), a token-level loss
(long responses weigh by their tokens), soft overlong punishment (responses
near the length limit lose reward), and dynamic sampling: groups whose
samples all score alike carry no gradient, so they are dropped and the
runtime generates on fresh prompts until the batch is full. No KL term.

    flowc graph examples/dapo.py
"""

import flowc as fc


@fc.flow
def dapo(prompts: fc.Prompts, actor: fc.Policy, reward: fc.Reward,
         *, n: int = 8, clip: float = 0.2, clip_high: float = 0.28, overlong_cache: float = 0.2):
    rollout = actor.generate(prompts, n=n)
    scores = reward(rollout) + fc.ops.overlong_penalty(rollout, cache=overlong_cache)  # last 20 % of R
    rollout, scores = fc.ops.filter_groups(rollout, scores, group_size=n)   # runtime re-generates
    old_logp = actor.logprobs(rollout)
    adv = fc.ops.group_normalize(scores, group_size=n)
    actor.update(rollout, advantages=adv, old_logprobs=old_logp,
                 loss=fc.losses.ppo_clip(clip, clip_high, agg="token-mean"))
