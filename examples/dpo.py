"""DPO (Rafailov et al., 2023): preference training without a reward model or sampling.

Each pair holds a prompt with a chosen and a rejected response. The policy's
log-probability margin between them, measured against a frozen reference,
is pushed up through a logistic loss; nothing is generated.

    flowc graph examples/dpo.py
"""

import flowc as fc


@fc.flow
def dpo(pairs: fc.Preferences, actor: fc.Policy, ref: fc.Reference, *, beta: float = 0.1):
    ref_logp = ref.logprobs(pairs)                    # rows 2i chosen, 2i+1 rejected
    actor.update(pairs, ref_logprobs=ref_logp, loss=fc.losses.dpo(beta))
