"""PPO for language models (Ouyang et al., 2022), as verl and OpenRLHF run it.

A critic estimates per-token values; a reward model scores each response; the
KL to the reference is subtracted from the reward token by token; advantages
come from GAE and are whitened; policy and critic are both trained.

    flowc graph examples/ppo.py
"""

import flowc as fc


@fc.flow
def ppo(prompts: fc.Prompts, actor: fc.Policy, critic: fc.Critic, ref: fc.Reference, rm: fc.RewardModel,
        *, clip: float = 0.2, value_clip: float = 0.2, kl: float = 0.05, gamma: float = 1.0, lam: float = 0.95):
    rollout = actor.generate(prompts)                       # one sample per prompt
    old_logp = actor.logprobs(rollout)
    ref_logp = ref.logprobs(rollout)
    values = critic.values(rollout)
    scores = rm.score(rollout)

    # reward shaping: the sequence score on the last token, minus a per-token KL penalty
    mask = rollout.response_mask
    rewards = fc.ops.token_level(scores, rollout) - kl * fc.ops.kl(old_logp, ref_logp, kind="k1")
    adv, returns = fc.ops.gae(rewards, values, mask, gamma=gamma, lam=lam)
    adv = fc.ops.whiten(adv, mask)

    actor.update(rollout, advantages=adv, old_logprobs=old_logp, loss=fc.losses.ppo_clip(clip))
    critic.update(rollout, returns=returns, old_values=values, loss=fc.losses.value_clip(value_clip))
