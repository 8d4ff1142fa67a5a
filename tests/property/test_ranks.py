"""runtime.ranks mirrors Megatron-core's own rank order: the ranks it puts in
one data-parallel replica are the ranks Megatron puts in one model-parallel
group, and the rank whose output is kept is tp rank 0 of the last stage."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowc.ir.plan import Layout
from flowc.runtime.ranks import output_ranks, replica_of

ps = pytest.importorskip("megatron.core.parallel_state", reason="megatron-core is not installed")


@settings(max_examples=60, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), pp=st.sampled_from([1, 2, 4]), dp=st.sampled_from([1, 2, 3, 4]))
def test_replicas_match_megatron_groups(tp, pp, dp):
    lay = Layout(dp=dp, tp=tp, pp=pp, backend="megatron")
    gen = ps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    replica = replica_of(lay)
    # Megatron's data-parallel groups: one rank of each replica, the same (tp, pp) position
    for group in gen.get_ranks("dp"):
        assert sorted(replica[r] for r in group) == list(range(dp))
    # its model-parallel (tp·pp) groups: all ranks of one replica
    for group in gen.get_ranks("tp-pp"):
        assert len({replica[r] for r in group}) == 1
    last_stage = {r for g in gen.get_ranks("pp") for r in g[-1:]}
    tp_first = {g[0] for g in gen.get_ranks("tp")}
    assert set(output_ranks(lay)) == last_stage & tp_first
    assert [replica[r] for r in output_ranks(lay)] == list(range(dp))
