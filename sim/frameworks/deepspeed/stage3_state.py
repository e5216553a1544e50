"""The state ZeRO-3's builder keeps while it replays a step: the parameters, the
coordinator's status of each, in-flight gathers, gradient buckets and the caching allocator's
budget. The coordinator, gradient and step units (:mod:`.stage3_coordinator`,
:mod:`.stage3_grads`, :mod:`.stage3_step`) are written over it."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from sim.frameworks.common.base import JobContext
from sim.frameworks.deepspeed.constants import OFFLOAD_PARAM_MAX_IN_CPU
from sim.frameworks.deepspeed.emitter import _Emitter
from sim.frameworks.deepspeed.resolve import _Zero, kernel_style
from sim.frameworks.deepspeed.stage3_trace import _tree
from sim.hardware.host import HostSpec
from sim.program.ir import Op, Program
from sim.workload.layer_ops import model_blocks


@dataclass
class _Gather:
    """One ``all_gather_coalesced`` call and its handle."""

    pids: list[int]
    ag: list[Op]
    single: bool
    quant: bool
    out_elems: int
    scale_bytes: float
    remaining: set[int]
    complete: bool = False
    done: Op | None = None
    buffer_bytes: float = 0.0
    """Flat buffers the handle keeps referenced until its last parameter is waited for."""


class _Stage3State:
    """What a ZeRO-3 step replay holds; set up from the scenario."""

    e: _Emitter
    program: Program
    order: list[str]
    """Modules in the order their pre-hooks fire in one micro-batch (the recorded trace)."""
    param_order: list[tuple[int, int]]
    """(parameter, trace step) in fetch order: the prefetcher's queue at reset_step."""
    mb: int
    """The micro-batch being emitted."""

    def __init__(self, ctx: JobContext, z: _Zero) -> None:
        self.ctx, self.z = ctx, z
        m = ctx.model
        self.m = m
        self.W = ctx.n_ranks
        self.cm = ctx.compute
        s = ctx.scenario
        self.gpn = min(s.cluster.gpus_per_node, self.W)
        self.nodes = max(1, self.W // self.gpn)
        self.style = kernel_style(m)
        self.costs = ctx.block_costs(self.style, kv_cache=False)
        self.blocks = dict(zip(("embed", "attn", "mlp", "head"),
                               model_blocks(m, self.style, ctx.micro_batch, ctx.seq, False),
                               strict=True))
        self.params, self.modules = _tree(m, self.W, z.persistence)
        self.P = {p.pid: p for p in self.params}
        self.part_total = sum(p.aligned // self.W for p in self.params)
        self.ag_side = "ag" if z.overlap else "compute"
        self.rs = "rs" if z.overlap else "compute"
        ranks = range(self.W)
        self.hpz_groups = tuple(tuple(ranks[i:i + z.hpz]) for i in range(0, self.W, z.hpz))
        self.local_groups = tuple(tuple(ranks[i:i + self.gpn])
                                  for i in range(0, self.W, self.gpn))
        self.global_groups = tuple(tuple(range(j, self.W, self.gpn)) for j in range(self.gpn))
        self.qgz_active = z.qgz and self.nodes > 1
        self.host = (HostSpec.from_scenario(s)
                     if z.offload_opt != "none" or z.offload_param != "none" else None)
        # offload_param nvme: partitions beyond max_in_cpu elements stay on NVMe.
        self.param_nvme_share = (max(0, self.part_total - OFFLOAD_PARAM_MAX_IN_CPU)
                                 / self.part_total if z.offload_param == "nvme" else 0.0)
        # coordinator state
        self.status = {p.pid: ("AV" if p.persist else "NA") for p in self.params}
        self.registry: dict[int, _Gather] = {}
        self.n_available = 0
        self.fetch_events: deque[Op] = deque()
        self.reduce_events: deque[Op] = deque()
        self.secondary: set[int] = set()
        self.active: dict[int, set[str]] = {p.pid: set() for p in self.params}
        self.held: dict[int, tuple[float, Op | None]] = {}
        """GPU bytes of each gathered parameter and the op that produced them."""
        self.step_id = 0
        self.most_recent: dict[int, int] = {}
        self.queue: deque[tuple[int, int]] = deque()
        self._release_cache: dict[tuple[str, int], frozenset[int]] = {}
        # gradient bucket state
        self.bucket: list[int] = []
        self.bucket_elems = 0
        self.bucket_kept: list[int] = []
        self.micro_step = 0
        self.n_buckets = 0
        self.gathers: list[tuple[Op, str, bool]] = []
        """(all-gather op, phase, hpZ) of every parameter gather, for tests and reports."""
        # CUDA caching allocator under memory pressure (see issue_gather)
        self.budget: float | None = None
        self.live = 0.0
        """Gathered bytes the host still holds (gathered or in flight, not yet released)."""
        self.pending = 0.0
        """Bytes the host released whose blocks the GPU may still be using (record_stream)."""
        self.allocator_syncs = 0
