"""The data of Megatron's units as :mod:`sim.frameworks.megatron.layer` lays them out: a
unit's ops, the collective keys, one block's spec, and the compute-op maker."""

from __future__ import annotations

from dataclasses import dataclass, field

from sim.program.ir import Op

UnitKey = tuple[str, int, int]
"""(F|B, virtual stage, micro-batch)."""


@dataclass
class UnitOps:
    """The compute and communication ops of one (virtual stage, micro-batch, pass)."""

    ops: list[Op] = field(default_factory=list)
    first: Op | None = None
    last: Op | None = None
    layer_bwd: dict[int, Op] = field(default_factory=dict)
    part_op: dict[int | str, Op] = field(default_factory=dict)
    """Forward: the first op of each part (layer number, ``embed``, ``head``: where its
    forward pre-hook runs); backward: the last op of each part (its gradients are ready)."""
    carry: list[Op] = field(default_factory=list)
    """Ops the unit's next compute op waits for (an overlapped reduce-scatter's handle)."""
    key: UnitKey | None = None
    """(F|B, virtual stage, micro-batch)."""

    def neighbour(self, op: Op, offset: int, index: dict[int, int] | None = None) -> Op:
        """The op ``offset`` places after ``op`` in the unit (before it when negative);
        ``index``: :meth:`positions`, when the caller looks up many."""
        pos = index if index is not None else self.positions()
        return self.ops[pos[id(op)] + offset]

    def positions(self) -> dict[int, int]:
        """id(op) -> its place in :attr:`ops`."""
        return {id(o): i for i, o in enumerate(self.ops)}


class KeySeq:
    """Collective keys, numbered in the order the builder creates the ops (the same order on
    every stage's rank class, so matching collectives get the same key)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}#{self.n}"


@dataclass(frozen=True)
class BlockSpec:
    """One block (attention or MLP) of a layer's forward, recompute or backward."""

    names: tuple[str, str]
    """(pre, main) op names in execution order: ("norm", "attention") forward."""
    dur_pre: float
    dur_main: float
    label: str
    mb: int
    layer: int
    phase: str
    alloc: float = 0.0
    free: float = 0.0
    flops: float = 0.0
    cpu_pre: float = 0.0
    cpu_main: float = 0.0
    column: str | None = None
    """A backward ending with this column-parallel linear, whose input re-gather and
    gradient reduce-scatter overlap its GEMMs under sequence parallelism."""
    ring: str | None = None
    """``fwd`` / ``bwd``: core attention, run as the context-parallel ring."""


def compute(name: str, dur: float, **kw: object) -> Op:
    """A compute-stream op."""
    return Op(name=name, kind="compute", stream="compute", duration=dur, **kw)  # type: ignore[arg-type]


def op_category(phase: str) -> str:
    """The op category of a pass: ``fwd`` -> forward, ``bwd`` -> backward."""
    return {"fwd": "forward", "bwd": "backward", "recompute": "recompute"}.get(phase, phase)
