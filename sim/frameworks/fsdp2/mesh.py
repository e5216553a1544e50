"""torchtitan's device mesh and its split of the layers over pipeline stages.

* Mesh (``torchtitan/distributed/parallel_dims.py``, ``ParallelDims``): dimensions
  ``pp, dp_replicate, dp_shard, cp, tp`` laid out row-major, tensor-parallel peers adjacent
  (inside a node), pipeline stages outermost. FSDP shards over ``dp_shard x cp`` flattened
  (``apply_fsdp`` gets the ``["dp_replicate", "fsdp"]`` mesh), HSDP all-reduces over
  ``dp_replicate``. :class:`Mesh` gives every group of a stage.
* Expert parallelism (torchtitan v0.2.2 ``ParallelDims.build_mesh``): a second, "sparse"
  view of the same ranks, ``[pp, dp_replicate, efsdp, ep, etp]`` row-major, with
  ``efsdp = dp_shard x cp x tp / (ep x etp)``: EP borrows the innermost ranks of the FSDP
  (and tensor-parallel) dimensions, and the routed experts are sharded by FSDP over what is
  left (``efsdp``; older torchtitan called it ``dp_shard_mod_ep``).
* Pipeline parallelism (``torchtitan/distributed/pipeline_parallel.py``,
  ``_generate_llm_fqn_per_model_part``): the layers are split over pp x vp model chunks with the
  embedding weighted as ``pipeline_parallel_first_stage_less_layers`` layers and the output as
  ``..._last_stage_less_layers`` (both 1 by default): see :func:`stage_layers`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from sim.program.mesh import Groups, Pairs, RankMesh

# ---------------------------------------------------------------------- mesh

DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""torchtitan's mesh dimensions, outermost first (``parallel_dims.py``,
``ParallelDims._build_mesh_without_ep``: ``init_device_mesh`` over these names)."""

SPARSE_DIMS = ("pp", "dp_replicate", "efsdp", "ep", "etp")
"""torchtitan's mesh of the expert region, outermost first (``parallel_dims.py``,
``build_mesh``: the ``sparse_mesh``)."""


@dataclass(frozen=True)
class Mesh:
    """torchtitan's device mesh ``[pp, dp_replicate, dp_shard, cp, tp]``, row-major, over
    the generic :class:`~sim.program.mesh.RankMesh`; every group of a pipeline stage."""

    pp: int
    replicate: int
    shard: int
    cp: int
    tp: int
    ep: int = 1
    """Expert parallelism (the routed experts split over ``ep`` ranks); etp is 1 here."""

    @cached_property
    def grid(self) -> RankMesh:
        """The rank mesh with torchtitan's dimension names and order."""
        return RankMesh(DIMS, (self.pp, self.replicate, self.shard, self.cp, self.tp))

    def rank(self, pi: int, ri: int, si: int, ci: int, ti: int) -> int:
        return self.grid.rank(pp=pi, dp_replicate=ri, dp_shard=si, cp=ci, tp=ti)

    def members(self, st: int) -> tuple[int, ...]:
        return self.grid.members(pp=st)

    def tp_groups(self, st: int) -> Groups:
        return self.grid.groups(["tp"], pp=st)

    def cp_groups(self, st: int) -> Groups:
        return self.grid.groups(["cp"], pp=st)

    def shard_groups(self, st: int) -> Groups:
        """FSDP's all-gather / reduce-scatter groups: dp_shard x cp flattened
        (torchtitan's ``dp_shard_cp`` mesh)."""
        return self.grid.groups(["dp_shard", "cp"], pp=st)

    def loss_groups(self, st: int) -> Groups:
        """torchtitan's ``loss`` mesh: dp_replicate x dp_shard x cp flattened."""
        return self.grid.groups(["dp_replicate", "dp_shard", "cp"], pp=st)

    def replicate_groups(self, st: int) -> Groups:
        """HSDP's all-reduce groups: the same shard on every replica."""
        return self.grid.groups(["dp_replicate"], pp=st)

    @cached_property
    def sparse(self) -> RankMesh:
        """torchtitan's sparse mesh ``[pp, dp_replicate, efsdp, ep, etp]`` over the same ranks
        (``unflatten_mesh(world, ("pp", "dp_replicate", "efsdp", "ep", "etp"), ...)``)."""
        efsdp = self.shard * self.cp * self.tp // self.ep
        return RankMesh(SPARSE_DIMS, (self.pp, self.replicate, efsdp, self.ep, 1))

    @property
    def efsdp(self) -> int:
        """Ranks each expert shard is split over by FSDP: dp_shard x cp x tp / ep."""
        return self.shard * self.cp * self.tp // self.ep

    def ep_groups(self, st: int) -> Groups:
        """The expert-parallel groups: the token all-to-alls run here."""
        return self.sparse.groups(["ep"], pp=st)

    def efsdp_groups(self, st: int) -> Groups:
        """FSDP's groups for the routed experts (``edp_mesh["efsdp"]``): their all-gathers
        and reduce-scatters."""
        return self.sparse.groups(["efsdp"], pp=st)

    def stage_pairs(self, st: int, dst: int) -> Pairs:
        """Pipeline p2p: every rank of stage ``st`` sends to its peer on stage ``dst``."""
        return self.grid.peer_pairs("pp", st, dst)

    def cp_ring_pairs(self, st: int) -> Pairs:
        """Context-parallel ring shift: each rank sends to the next in its cp group."""
        return self.grid.ring_pairs(["cp"], pp=st)


# ---------------------------------------------------------------------- pipeline split


def stage_layers(layers: int, stages: int, first_less: int = 1, last_less: int = 1
                 ) -> list[list[int]]:
    """Layers of each pipeline model chunk, as torchtitan's ``_generate_llm_fqn_per_model_part``
    splits them: the embedding counts as ``first_less`` layers and the norm + output as
    ``last_less``; ``layers + first_less + last_less`` effective layers are spread evenly, the
    first chunks taking one more when they do not divide.

    Examples
    --------
    >>> stage_layers(8, 2)
    [[0, 1, 2, 3], [4, 5, 6, 7]]
    >>> stage_layers(8, 4)
    [[0, 1], [2, 3, 4], [5, 6], [7]]
    >>> stage_layers(8, 4, 0, 0)
    [[0, 1], [2, 3], [4, 5], [6, 7]]
    """
    if stages == 1:
        return [list(range(layers))]
    effective = layers + first_less + last_less
    per, extra = divmod(effective, stages)
    if per == 0 or first_less > per or last_less > per:
        raise ValueError(f"{layers} layers (+{first_less} +{last_less} for embedding and "
                         f"output) do not fill {stages} pipeline stages")
    out: list[list[int]] = []
    current = 0
    for st in range(stages):
        n = per + (1 if st < extra else 0)
        if st == 0:
            n -= first_less
        elif st == stages - 1:
            n -= last_less
        take = list(range(current, min(layers, current + n)))
        current += len(take)
        out.append(take)
    # torchtitan leaves any layers that do not fit unassigned; with these weights none are.
    return out
