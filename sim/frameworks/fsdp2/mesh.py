"""torchtitan's device mesh and its split of the layers over pipeline stages.

* Mesh (``torchtitan/distributed/parallel_dims.py``, ``ParallelDims``): dimensions
  ``pp, dp_replicate, dp_shard, cp, tp`` laid out row-major, tensor-parallel peers adjacent
  (inside a node), pipeline stages outermost. FSDP shards over ``dp_shard x cp`` flattened
  (``apply_fsdp`` gets the ``["dp_replicate", "fsdp"]`` mesh), HSDP all-reduces over
  ``dp_replicate``. :class:`Mesh` gives every group of a stage.
* Pipeline parallelism (``torchtitan/distributed/pipeline_parallel.py``,
  ``_generate_llm_fqn_per_model_part``): the layers are split over pp x vp model chunks with the
  embedding weighted as ``pipeline_parallel_first_stage_less_layers`` layers and the output as
  ``..._last_stage_less_layers`` (both 1 by default): see :func:`stage_layers`.
"""

from __future__ import annotations

from dataclasses import dataclass

# ---------------------------------------------------------------------- mesh


@dataclass(frozen=True)
class Mesh:
    """torchtitan's device mesh ``[pp, dp_replicate, dp_shard, cp, tp]``, row-major."""

    pp: int
    replicate: int
    shard: int
    cp: int
    tp: int

    def rank(self, pi: int, ri: int, si: int, ci: int, ti: int) -> int:
        return ti + self.tp * (ci + self.cp * (si + self.shard * (ri + self.replicate * pi)))

    def _coords(self) -> list[tuple[int, int, int, int]]:
        return [(ri, si, ci, ti) for ri in range(self.replicate) for si in range(self.shard)
                for ci in range(self.cp) for ti in range(self.tp)]

    def members(self, st: int) -> tuple[int, ...]:
        return tuple(sorted(self.rank(st, *c) for c in self._coords()))

    def tp_groups(self, st: int) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(self.rank(st, ri, si, ci, ti) for ti in range(self.tp))
                     for ri in range(self.replicate) for si in range(self.shard)
                     for ci in range(self.cp))

    def cp_groups(self, st: int) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(self.rank(st, ri, si, ci, ti) for ci in range(self.cp))
                     for ri in range(self.replicate) for si in range(self.shard)
                     for ti in range(self.tp))

    def shard_groups(self, st: int) -> tuple[tuple[int, ...], ...]:
        """FSDP's all-gather / reduce-scatter groups: dp_shard x cp flattened."""
        return tuple(tuple(self.rank(st, ri, si, ci, ti) for si in range(self.shard)
                           for ci in range(self.cp))
                     for ri in range(self.replicate) for ti in range(self.tp))

    def replicate_groups(self, st: int) -> tuple[tuple[int, ...], ...]:
        """HSDP's all-reduce groups: the same shard on every replica."""
        return tuple(tuple(self.rank(st, ri, si, ci, ti) for ri in range(self.replicate))
                     for si in range(self.shard) for ci in range(self.cp)
                     for ti in range(self.tp))

    def stage_pairs(self, st: int, dst: int) -> tuple[tuple[int, int], ...]:
        """Pipeline p2p: every rank of stage ``st`` sends to its peer on stage ``dst``."""
        return tuple((self.rank(st, *c), self.rank(dst, *c)) for c in self._coords())

    def cp_ring_pairs(self, st: int) -> tuple[tuple[int, int], ...]:
        """Context-parallel ring shift: each rank sends to the next in its cp group."""
        return tuple((g[i], g[(i + 1) % len(g)]) for g in self.cp_groups(st)
                     for i in range(len(g)))


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
