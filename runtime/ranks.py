"""Which rows each rank of a pool works on, and whose output the controller keeps.

Every training and forward backend numbers a pool's ranks as Megatron-core
does (``tp-cp-ep-dp-pp``: tensor-parallel ranks are consecutive, pipeline
stages are farthest apart):

    rank = tp_rank + tp · (cp_rank + cp · (dp_rank + dp · pp_rank))

(expert parallelism is carved out of the data-parallel ranks and does not
change which rows a rank sees). All ranks of one data-parallel replica get the
same rows; the replica's result is read from tp rank 0, cp rank 0 of its last
pipeline stage. For ``fsdp2`` (tp = cp = pp = 1) both maps are the identity.
"""

from __future__ import annotations

from flowc.ir.plan import Layout


def replica_of(layout: Layout) -> list[int]:
    """The data-parallel replica of every rank of the pool."""
    size = layout.dp * layout.tp * layout.cp * layout.pp
    return [(r // (layout.tp * layout.cp)) % layout.dp for r in range(size)]


def output_ranks(layout: Layout) -> list[int]:
    """For each replica, the rank whose result the controller keeps."""
    last = (layout.pp - 1) * layout.tp * layout.cp * layout.dp
    return [last + i * layout.tp * layout.cp for i in range(layout.dp)]
