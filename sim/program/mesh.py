"""Rank meshes: global ranks laid out over named parallel dimensions.

Every framework numbers its ranks the same way: a row-major grid over its parallel dimensions
(tensor, context, data, pipeline, ...), one dimension's peers ``stride`` ranks apart. They
differ only in the order of the dimensions:

* Megatron-Core (``megatron/core/parallel_state.py``, ``RankGenerator``) names the order
  innermost first, ``"tp-cp-ep-dp-pp"`` by default: tensor-parallel peers adjacent, pipeline
  stages outermost (:meth:`RankMesh.from_order`).
* torchtitan (``torchtitan/distributed/parallel_dims.py``, ``ParallelDims``) builds a
  ``DeviceMesh`` over ``["pp", "dp_replicate", "dp_shard", "cp", "tp"]``, outermost first.
* DeepSpeed (``deepspeed/runtime/pipe/topology.py``, ``ProcessTopology``) lays ``axes`` out
  row-major, outermost first: ``PipeModelDataParallelTopology`` is ``["pipe", "data",
  "model"]``.

:class:`RankMesh` is that grid, parameterised by the dimension names and sizes: rank <->
coordinates, the groups along one or several dimensions, the group a rank is in, the pairs
of peers two coordinates apart. The builders keep their framework's names and order and ask
the mesh for their groups; the order of ranks inside a group and of the groups themselves is
what the caller asks for (``along`` and ``over``, each outermost first), so a builder
reproduces its framework's collectives rank for rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Group = tuple[int, ...]
Groups = tuple[Group, ...]
Pairs = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class RankMesh:
    """Global ranks laid out row-major over named dimensions, the first outermost.

    Rank ``r`` has coordinate ``(r // stride[d]) % size[d]`` on dimension ``d``, where a
    dimension's stride is the product of the sizes of the dimensions after it.

    Parameters
    ----------
    names
        Dimension names, outermost (largest stride) first, as ``torch.distributed``'s
        ``init_device_mesh(mesh_dim_names=...)`` and DeepSpeed's ``ProcessTopology(axes=...)``
        take them. Use :meth:`from_order` for Megatron-Core's innermost-first order string.
    sizes
        Ranks along each dimension (at least 1).

    Examples
    --------
    Megatron-Core's worked example (``parallel_state.initialize_model_parallel``): 16 GPUs,
    tp=2, pp=4, so dp=2.

    >>> m = RankMesh.from_order("tp-dp-pp", {"tp": 2, "dp": 2, "pp": 4})
    >>> m.names, m.world
    (('pp', 'dp', 'tp'), 16)
    >>> m.groups(["dp"])[:4]
    ((0, 2), (1, 3), (4, 6), (5, 7))
    >>> m.groups(["pp"])
    ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15))
    >>> m.coords(13), m.rank(pp=3, dp=0, tp=1)
    ({'pp': 3, 'dp': 0, 'tp': 1}, 13)
    >>> m.group_of(13, ["tp"]), m.members(pp=1)
    ((12, 13), (4, 5, 6, 7))
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    _strides: dict[str, int] = field(init=False, repr=False, compare=False)
    _size: dict[str, int] = field(init=False, repr=False, compare=False)
    _memo: dict[tuple[object, ...], Any] = field(
        init=False, repr=False, compare=False, default_factory=dict)
    """Answers already computed: builders ask for the same groups once per op, and the mesh
    is immutable, so each answer (a tuple of ints) is computed once."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "names", tuple(self.names))
        object.__setattr__(self, "sizes", tuple(int(n) for n in self.sizes))
        if len(self.names) != len(self.sizes):
            raise ValueError(f"{len(self.names)} dimension names for {len(self.sizes)} sizes")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"dimension names repeat: {self.names}")
        if any(n < 1 for n in self.sizes):
            raise ValueError(f"dimension sizes must be at least 1: "
                             f"{dict(zip(self.names, self.sizes, strict=True))}")
        strides: dict[str, int] = {}
        stride = 1
        for name, n in zip(reversed(self.names), reversed(self.sizes), strict=True):
            strides[name] = stride
            stride *= n
        object.__setattr__(self, "_strides", strides)
        object.__setattr__(self, "_size", dict(zip(self.names, self.sizes, strict=True)))

    @classmethod
    def from_order(cls, order: str, sizes: Mapping[str, int]) -> RankMesh:
        """The mesh of an innermost-first order string, Megatron-Core's convention
        (``RankGenerator(order="tp-cp-ep-dp-pp")``: the first name varies fastest).

        >>> RankMesh.from_order("tp-cp-ep-dp-pp", {"tp": 2, "cp": 1, "ep": 1, "dp": 2,
        ...                                        "pp": 2}).names
        ('pp', 'dp', 'ep', 'cp', 'tp')
        """
        names = order.split("-")
        if set(names) != set(sizes):
            raise ValueError(f"order {order!r} names other dimensions than {sorted(sizes)}")
        inner_first = [(name, sizes[name]) for name in names]
        return cls(tuple(n for n, _ in reversed(inner_first)),
                   tuple(s for _, s in reversed(inner_first)))

    # ------------------------------------------------------------------ sizes
    @property
    def world(self) -> int:
        """Ranks in the mesh: the product of the sizes."""
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def size(self, *dims: str) -> int:
        """Ranks along ``dims`` together (the product of their sizes)."""
        n = 1
        for d in self._known(dims):
            n *= self._size[d]
        return n

    # ------------------------------------------------------------------ rank <-> coordinates
    def rank(self, **coords: int) -> int:
        """The rank at the given coordinates (every dimension of size > 1 named)."""
        return self._base(coords, self._unnamed(coords, ()))

    def coords(self, rank: int) -> dict[str, int]:
        """The coordinates of ``rank``, in mesh order (outermost first)."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is outside a mesh of {self.world} ranks")
        return {d: (rank // self._strides[d]) % self._size[d] for d in self.names}

    # ------------------------------------------------------------------ groups
    def ranks(self, along: Sequence[str], **fixed: int) -> Group:
        """The ranks whose coordinates on ``along`` vary (the first listed outermost, the last
        fastest) while every other dimension stays at ``fixed`` (dimensions of size 1 may be
        left out)."""
        base = self._base(fixed, self._unnamed(fixed, along))
        return tuple(base + o for o in self._offsets(along))

    def groups(self, along: Sequence[str], over: Sequence[str] | None = None,
               **fixed: int) -> Groups:
        """The groups along ``along``: one per point of the ``over`` dimensions (enumerated
        outermost first), the others at ``fixed``. ``over`` defaults to every remaining
        dimension in mesh order, which lists the groups by their first rank; pass it to list
        them in another order."""
        key = ("groups", tuple(along), None if over is None else tuple(over),
               tuple(sorted(fixed.items())))
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        rest = self._unnamed(fixed, along)
        if over is None:
            over = rest
        elif not set(self._known(over)) <= set(rest):
            raise ValueError(f"over={list(over)} may name only the dimensions left free: {rest}")
        base = self._base(fixed, [d for d in rest if d not in over])
        inner = self._offsets(along)
        out = tuple(tuple(base + o + i for i in inner) for o in self._offsets(over))
        self._memo[key] = out
        return out

    def group_of(self, rank: int, along: Sequence[str]) -> Group:
        """The group along ``along`` that ``rank`` is in (in :meth:`ranks` order)."""
        c = self.coords(rank)
        for d in self._known(along):
            del c[d]
        return self.ranks(along, **c)

    def members(self, **fixed: int) -> Group:
        """Every rank at the ``fixed`` coordinates, ascending (a pipeline stage's ranks)."""
        return self.ranks(self._unnamed(fixed, ()), **fixed)

    def peer_pairs(self, dim: str, a: int, b: int, over: Sequence[str] | None = None,
                   **fixed: int) -> Pairs:
        """(rank at ``dim = a``, the rank with the same other coordinates at ``dim = b``) for
        every point of ``over`` (default: the free dimensions in mesh order): a pipeline
        transfer between stages ``a`` and ``b``, for example."""
        key = ("peer_pairs", dim, a, b, None if over is None else tuple(over),
               tuple(sorted(fixed.items())))
        hit = self._memo.get(key)
        if hit is None:
            self._known([dim])
            ia, ib = self._index(dim, a), self._index(dim, b)
            hit = self._memo[key] = tuple((g[ia], g[ib])
                                          for g in self.groups([dim], over, **fixed))
        return hit

    def ring_pairs(self, along: Sequence[str], over: Sequence[str] | None = None,
                   **fixed: int) -> Pairs:
        """(rank, the next rank of its group along ``along``, wrapping around) for every
        rank: one step of a ring over each group (:meth:`groups` order)."""
        return tuple((g[i], g[(i + 1) % len(g)]) for g in self.groups(along, over, **fixed)
                     for i in range(len(g)))

    # ------------------------------------------------------------------ helpers
    def _known(self, dims: Sequence[str]) -> Sequence[str]:
        for d in dims:
            if d not in self._size:
                raise ValueError(f"no dimension {d!r} in the mesh {list(self.names)}")
        if len(set(dims)) != len(dims):
            raise ValueError(f"dimensions repeat: {list(dims)}")
        return dims

    def _index(self, dim: str, i: int) -> int:
        if not 0 <= i < self._size[dim]:
            raise ValueError(f"coordinate {dim}={i} is outside 0..{self._size[dim] - 1}")
        return i

    def _unnamed(self, fixed: Mapping[str, int], along: Sequence[str]) -> list[str]:
        """The dimensions neither fixed nor varied, in mesh order."""
        self._known(list(fixed))
        self._known(along)
        if set(fixed) & set(along):
            raise ValueError(f"{sorted(set(fixed) & set(along))} both fixed and varied")
        return [d for d in self.names if d not in fixed and d not in along]

    def _base(self, fixed: Mapping[str, int], free: Sequence[str]) -> int:
        """The rank offset of the ``fixed`` coordinates; ``free`` dimensions must be size 1."""
        wide = [d for d in free if self._size[d] > 1]
        if wide:
            raise ValueError(f"no coordinate given for {wide} (mesh {list(self.names)})")
        return sum(self._index(d, i) * self._strides[d] for d, i in fixed.items())

    def _offsets(self, dims: Sequence[str]) -> list[int]:
        """Rank offsets of every point of ``dims``, the first listed outermost."""
        out = [0]
        for d in self._known(dims):
            stride, n = self._strides[d], self._size[d]
            out = [o + i * stride for o in out for i in range(n)]
        return out
