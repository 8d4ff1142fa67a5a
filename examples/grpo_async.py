"""GRPO with rollouts that may lag the trainer: AReaL's decoupled PPO (Fu et al., 2025).

The same loop as examples/grpo.py, with a loss that corrects for the rollout engine's policy:
the clipped ratio is taken against the trainer's log-probabilities before the update (the
proximal policy, ``old_logprobs``), and each token is weighted by proximal/behaviour — the
trainer's probability over the engine's — masked above 5. Safe lock-step, and the loss that
``--staleness K`` requires. ``max_staleness=2`` declares the most lag this algorithm accepts
(decoupled PPO learned as well as lock-step at staleness 1 and 2 in docs/async.md); a run that
does not set ``--staleness`` lets the planner choose it in 0 … 2 with the placement:

    flowc run examples/grpo_async.py                 # the planner chooses lock-step or one-step-off
    flowc run examples/grpo_async.py --staleness 1   # asks for it
    flowc plan examples/grpo_async.py --cluster 2x8xH100 --staleness 1

docs/async.md explains the corrections, the checked weight sync and the pipelined loop.
"""

import flowc as fc


@fc.flow(max_staleness=2)
def grpo_async(prompts: fc.Prompts, actor: fc.Policy, ref: fc.Reference, reward: fc.Reward,
               *, n: int = 8, clip: float = 0.2, kl: float = 0.001):
    rollout = actor.generate(prompts, n=n)
    old_logp = actor.logprobs(rollout)                  # the proximal policy
    ref_logp = ref.logprobs(rollout)
    scores = reward(rollout)
    adv = fc.ops.group_normalize(scores, group_size=n)
    actor.update(rollout, advantages=adv, old_logprobs=old_logp, ref_logprobs=ref_logp,
                 loss=fc.losses.decoupled_ppo(clip), kl_coef=kl)
