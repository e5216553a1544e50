"""Zones filled in blocks (``cluster.az_placement: blocks``): only what crosses the blocks
crosses the zone link, and its bytes are the closed form."""

from __future__ import annotations

from sim.api import simulate
from sim.scenario import Scenario


def _pipeline_over_two_zones(placement: str) -> dict:
    # Llama 3 8B, Megatron TP8 x PP2 x DP2 on 4 DGX H100 nodes in 2 zones. Megatron's rank
    # order puts the pipeline outermost: stage 0 on nodes 0-1, stage 1 on nodes 2-3.
    s = Scenario(model="llama3-8b", cluster={"nodes": 4, "azs": 2, "az_placement": placement},
                 framework={"name": "megatron"}, parallelism={"tp": 8, "pp": 2},
                 training={"seq_len": 2048, "micro_batch_size": 1, "global_batch_size": 8})
    return simulate(s).summary


def test_blocks_send_only_the_pipeline_across_the_zones() -> None:
    blocks = _pipeline_over_two_zones("blocks")
    # Each stage in a zone of its own: the zone link carries the pipeline's sends alone. Per
    # micro-batch (4: 8 sequences over DP 2), each of the DP 2 x TP 8 ranks of the boundary
    # sends its [seq, mbs, hidden] bf16 activation forward and receives its gradient back
    # (Megatron-Core's p2p sends the whole tensor from every TP rank without sequence
    # parallelism): 4 x 2 x 2 x 8 x 2,048 x 4,096 x 2 bytes.
    assert blocks["micro_batches"] == 4
    assert blocks["bytes"]["cross_az"] == 4 * 2 * 2 * 8 * 2048 * 4096 * 2
    # Round robin alternates the nodes (zone 0: nodes 0 and 2): each stage's data-parallel
    # group spans both zones, so its gradient reduction crosses too, and the step waits on
    # the zone link.
    robin = _pipeline_over_two_zones("round_robin")
    assert robin["bytes"]["cross_az"] > 10 * blocks["bytes"]["cross_az"]
    assert robin["step_time_s"] > blocks["step_time_s"]
