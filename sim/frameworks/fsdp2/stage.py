"""The state of one pipeline stage's step (the whole job without pipeline parallelism) while
its ops are issued, and the few helpers every part of the builder uses on it.

The FSDP2 builder is split by what each part of ``torch/distributed/fsdp/_fully_shard/`` does
(:mod:`.unshard`, :mod:`.reduce`, :mod:`.offload`), by pipeline composition
(:mod:`.pipeline`), and by pass (:mod:`.passes`, :mod:`.step`); each is a set of functions of
one :class:`Stage`, which holds all the state they share.
"""

from __future__ import annotations

from sim.frameworks.common.nccl_dtype import half
from sim.frameworks.fsdp2.async_tp import AsyncTp
from sim.frameworks.fsdp2.moe import MoEPass
from sim.frameworks.fsdp2.tp_pass import Comms, TitanPass
from sim.frameworks.fsdp2.units import BlockOps, Job, Unit
from sim.program.ir import NcclType, Op, Program, RankClass
from sim.program.mesh import Groups
from sim.workload.layer_ops import BF16


class Stage:
    """One pipeline stage's step (the whole job without pipeline parallelism): the rank class
    it fills, its process groups, and the FSDP state that carries from one op to the next."""

    def __init__(self, job: Job, program: Program, cls: RankClass, st: int) -> None:
        self.job = job
        self.program = program
        self.cls = cls
        self.st = st
        mesh = job.mesh
        self.shard_groups = mesh.shard_groups(st)
        self.rep_groups = mesh.replicate_groups(st)
        # Built once per stage: every tensor- and context-parallel op names these groups.
        self.tp_groups = mesh.tp_groups(st)
        self.cp_groups = mesh.cp_groups(st)
        self.cp_ring_pairs = mesh.cp_ring_pairs(st)
        self.efsdp_groups = mesh.efsdp_groups(st) if job.moe is not None else ()
        # Activations (and their gradients) are 16-bit (sim.frameworks.fsdp2.tp counts them so).
        self.act_dtype = half(job.ctx.scenario.training.precision)
        self._keys = 0
        self.gathered: dict[str, bool] = {}
        self.last_rs: Op | None = None          # ReduceScatterState: one input buffer
        self.rs_held = 0.0                      # ... its bytes, until the state is dropped
        self.last_ar: dict[str, Op] = {}        # each unit's _all_reduce_state
        self.reduces: list[Op] = []
        self.offloads: list[Op] = []
        self.accumulated: dict[str, float] = {}
        self.sent: list[Op] = []
        self.fwd_sent: list[Op] = []
        self.per_mb: dict[int, tuple[BlockOps, BlockOps]] = {}
        tb = job.titan
        atp = AsyncTp(tb.seg, job.ctx.compute, tb.tp, tb.tokens, tb.hidden, self._partials,
                      tb.layer_segments() if tb.sac is not None else None
                      ) if tb is not None and tb.tp > 1 and job.opts.async_tp else None
        self.titan = TitanPass(tb, Comms(self.tp_op, self.cp_gather, self.cp_shift),
                               job.ctx.recompute, atp) if tb is not None else None
        moe = job.moe
        self.moe = MoEPass(moe, mesh.ep_groups(st), self.key, job.ctx.recompute,
                           job.attn_cost, grad_bytes=BF16 * moe.dense_numel,
                           expert_grad_bytes=BF16 * moe.expert_numel, titan=self.titan
                           ) if moe is not None else None
        """The MoE layers' op maker (:mod:`.moe`); None for a dense model."""

    def groups_of(self, u: Unit) -> Groups:
        """The FSDP groups a unit is gathered and reduced over: ``efsdp`` for routed experts
        (torchtitan's ``edp_mesh``), else dp_shard x cp."""
        return self.efsdp_groups if u.expert else self.shard_groups

    def key(self, prefix: str) -> str:
        """A collective's key, unique in the program."""
        self._keys += 1
        return f"fsdp2/{self.st}/{prefix}#{self._keys}"

    def add(self, op: Op) -> Op:
        """Issue ``op`` on this stage's rank class."""
        return self.program.add(self.cls, op)

    def tp_op(self, kind: str, nbytes: float, name: str, mb: int, layer: int | None,
              dtype: NcclType | None = None) -> Op:
        """A tensor-parallel collective, on the compute stream (DTensor waits for it); of
        16-bit activations unless ``dtype`` says otherwise."""
        groups = self.tp_groups
        return Op(name=name, kind="collective", stream="compute", phase="comm",
                  collective=kind, group=groups[0], groups=groups, nbytes=nbytes,  # type: ignore[arg-type]
                  dtype=dtype or self.act_dtype,
                  key=self.key("tp"), category=kind, micro_batch=mb, layer=layer)

    def _partials(self, nbytes: float, scatter: Op) -> Op:
        """AsyncTP's exchange of a matmul's unreduced partials (:mod:`.async_tp`), in place
        of the reduce-scatter ``scatter``."""
        return self.tp_op("all_to_all", nbytes, scatter.name.replace(
            "reduce_scatter", "matmul-reduce-scatter"), scatter.micro_batch or 0,
            scatter.layer)

    def cp_gather(self, nbytes: float, name: str, mb: int, layer: int | None) -> Op:
        """A context-parallel all-gather of keys and values."""
        groups = self.cp_groups
        return Op(name=name, kind="collective", stream="cp", phase="comm",
                  collective="all_gather", group=groups[0], groups=groups, nbytes=nbytes,
                  dtype=self.act_dtype, key=self.key("cp"), category="all_gather",
                  micro_batch=mb, layer=layer)

    def cp_shift(self, nbytes: float, name: str, mb: int, layer: int | None) -> Op:
        """One shift of the context-parallel ring (each rank to the next)."""
        return Op(name=name, kind="send", stream="cp", phase="comm",
                  pairs=self.cp_ring_pairs, nbytes=nbytes, dtype=self.act_dtype,
                  key=self.key("cp-shift"), category="send_recv", micro_batch=mb, layer=layer)
