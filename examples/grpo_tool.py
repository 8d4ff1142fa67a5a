"""GRPO for a tool-using agent: each sample is a multi-turn trajectory with an environment.

The policy may call a tool (the built-in task's calculator: ``(37*48)``), reads its answer and
continues; only the policy's tokens are trained on (``rollout.response_mask``), the tool's
output is masked out of the loss and the KL. The environment scores the trajectory
(``rollout.env_reward``); everything after ``generate`` is plain GRPO.

    flowc run examples/grpo_tool.py                       # the built-in calculator task
    flowc run examples/grpo_tool.py --env calc=my_env.py:MyEnv --data my.jsonl --model actor=…
"""

import flowc as fc


@fc.flow
def grpo_tool(prompts: fc.Prompts, actor: fc.Policy, ref: fc.Reference, calc: fc.Environment,
              *, n: int = 8, clip: float = 0.2, kl: float = 0.001, turns: int = 3):
    rollout = actor.generate(prompts, n=n, env=calc, max_turns=turns)
    old_logp = actor.logprobs(rollout)
    ref_logp = ref.logprobs(rollout)
    adv = fc.ops.group_normalize(rollout.env_reward, group_size=n)
    actor.update(rollout, advantages=adv, old_logprobs=old_logp,
                 ref_logprobs=ref_logp, loss=fc.losses.ppo_clip(clip), kl_coef=kl)
