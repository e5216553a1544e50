"""Background traffic as a program: transfers between a job's nodes on a fixed period (an
inference fleet's or a data pipeline's traffic, bulk copies between servers), to share a
fabric with training jobs (:mod:`sim.apps.multijob`).

Every ``period_s`` from its start, ``count`` times, every GPU of the job's node ``j`` sends
``nbytes`` to the GPU of the same local index on the next node (``ring``: node ``j+1 mod n``;
``chain``: ``j+1`` for all but the last node), rail to rail, as NCCL ``send``/``recv`` pairs
(one flow per pair on its route, Simple protocol). A transfer that outlasts its period delays
the next (one stream runs in order): the traffic backs off as a real sender would. All the
job's GPUs do the same at the same times: one rank class.
"""

from __future__ import annotations

from sim.program.ir import CPU_STREAM, Op, Program, RankClass

TRAFFIC_STREAM = "traffic"
TICK = "traffic-period"
"""Name of the host ops that pace the transfers (one period each)."""


def traffic_pairs(n_nodes: int, gpus_per_node: int, direction: str) -> tuple[tuple[int, int], ...]:
    """(source, destination) job ranks of one transfer round.

    Examples
    --------
    >>> traffic_pairs(2, 2, "ring")
    ((0, 2), (1, 3), (2, 0), (3, 1))
    >>> traffic_pairs(3, 1, "chain")
    ((0, 1), (1, 2))
    """
    last = n_nodes if direction == "ring" else n_nodes - 1
    return tuple((j * gpus_per_node + g, ((j + 1) % n_nodes) * gpus_per_node + g)
                 for j in range(last) for g in range(gpus_per_node))


def traffic_program(n_nodes: int, gpus_per_node: int, nbytes: float, period_s: float,
                    count: int, direction: str = "ring") -> Program:
    """The program of a background-traffic job on ``n_nodes`` nodes (job ranks 0..)."""
    if n_nodes < 2:
        raise ValueError("background traffic needs two nodes at least")
    n = n_nodes * gpus_per_node
    cls = RankClass(id=0, members=tuple(range(n)), label="traffic")
    p = Program(classes=[cls], n_ranks=n, tokens_per_step=0.0, model_flops_per_step=0.0,
                hw_flops_per_step=0.0, meta={"kind": "traffic"})
    pairs = traffic_pairs(n_nodes, gpus_per_node, direction)
    tick: Op | None = None
    for k in range(count):
        if k:
            tick = p.add(cls, Op(TICK, "host", CPU_STREAM, "comm", duration=period_s,
                                 kernels=0, category="wait"))
        p.add(cls, Op(f"traffic send {k}", "send", TRAFFIC_STREAM, "comm",
                      deps=[tick] if tick is not None else [], pairs=pairs, nbytes=nbytes,
                      key=f"traffic/{k}", category="send_recv"))
    p.validate()
    return p
