"""Megatron's rank classes per expert load: each class's memory at its own load.

The program is built once with the busiest EP rank's experts (:mod:`.moe_ranks` then splits
it into a class per stage and load and gives each its own expert time). What an MoE layer
holds that follows the tokens a rank receives is, in Megatron-Core:

* the grouped experts' saved tensors (``TEGroupedMLP``: fc1's input, fc1's output / the
  activation's input, the probs, fc2's input), held from the layer's forward to its backward
  (:attr:`.moe.MoEPlan.saved_bytes`, and what ``recompute_modules`` ``moe`` / ``moe_act``
  drop and re-create: :mod:`.recompute`);
* the ``alltoall`` dispatcher's receive buffers (``MoEAlltoAllTokenDispatcher``: the
  dispatch all-to-all's output of ``sum(output_splits)`` rows, the counts it gathered in
  ``preprocess``; the combine's send buffer of the same rows; their gradients), see
  :mod:`.moe_memory`; the ``flex`` dispatcher's ``recv_x`` and the experts' restored output
  (DeepEP's dispatch returns the tokens this rank receives, :func:`.moe_flex.attach_flex`).

With ``moe_pad_expert_input_to_capacity`` every size is the padded capacity whatever the
routing: there is no skew to follow and no split.

Rather than patch each of those numbers where :class:`~.layer.UnitBuilder` put them, the
stage's units (one micro-batch's) are laid out again on a shape whose MoE plan carries the
class's own load (:func:`own_load_shape`), and each unit op's memory fields (``alloc``,
``free``, ``transient`` and their parts) are copied onto the class's op at the same place
where they differ from the busiest's: the same
code sizes every class, so a light class holds exactly what a job whose every EP rank had
its load would. Times, FLOPs and collectives stay as the split set them. The classes at the
busiest load are left as built, so the job's peak does not move (with ``flex`` they keep the
busiest receiver's buffers, as before: an upper bound where that is another EP rank).

Cost: one micro-batch's units of a stage laid out again per class (at most
:data:`~sim.frameworks.common.moe_ranks.MAX_CLASSES`), and one pass over the classes' ops.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace

from sim.frameworks.common.moe_ranks import RankExperts
from sim.frameworks.megatron.layer import KeySeq, UnitBuilder, UnitKey, UnitOps, layer_costs
from sim.frameworks.megatron.shape import MegatronShape
from sim.hardware.compute import ComputeModel
from sim.program.ir import Op, Program, RankClass
from sim.program.mesh import RankMesh

MEMORY_FIELDS = ("alloc", "free", "transient", "transient_parts", "alloc_parts")
"""The :class:`~sim.program.ir.Op` fields the engine's memory accounting reads."""
_MB0 = re.compile(r"\bmb0\b")
Places = dict[tuple[str, int, int], list[tuple[str, int, int]]]
"""(pass, virtual stage, position in the unit) -> each micro-batch's (stream, position,
micro-batch) in a class."""


def own_load_shape(s: MegatronShape, load: RankExperts, ep_rank: int) -> MegatronShape:
    """``s`` with the MoE plan's pace-setting experts replaced by ``load``'s, EP rank
    ``ep_rank``'s (its expert block and its layer ops: saved tensors, receive sizes; with
    the ``flex`` dispatcher the tokens its first expert-TP rank receives, the same on each
    of them); the per-peer matrix stays."""
    pl = s.moe
    assert pl is not None and pl.pace is not None and load.ops is not None
    pace = replace(pl.pace, ops=load.ops, experts=load.cost)
    flex = pl.flex
    if flex is not None and flex.skew is not None:
        flex = replace(flex, receiver=ep_rank * pl.etp)
    return replace(s, moe=replace(pl, pace=pace, flex=flex))


def stage_units(s: MegatronShape, cm: ComputeModel, cpu_call: float, st: int
                ) -> dict[tuple[str, int], UnitOps]:
    """The forward and backward unit of each of stage ``st``'s virtual stages for micro-batch
    0, laid out on ``s`` (collective keys of their own: only the memory fields are read).
    Every micro-batch's units hold the same memory at the same places (the sizes are per
    micro-batch; what differs by unit is the virtual stage: embedding, head, receives)."""
    ub = UnitBuilder(s, layer_costs(s, cm, cpu_call), KeySeq(), cm)
    return {(kind, v): ub.build_unit(kind, v, 0)
            for v in s.place.stage_virtuals(st) for kind in ("F", "B")}


def own_memory(program: Program, s: MegatronShape, cm: ComputeModel, cpu_call: float,
               units: dict[UnitKey, UnitOps], built: list[RankClass]) -> int:
    """Give every split class below the busiest load its own load's memory (see the module
    docstring); ``units`` are the job's units as built, ``built[st]`` the class stage ``st``
    was built as (its ops are the units' own). Returns the classes changed."""
    pl = s.moe
    if pl is None or pl.pace is None or not pl.ranks:
        return 0
    ranks = pl.ranks
    busiest = ranks[pl.pace.rank].counts
    stage_of = {r: st for st in range(s.p) for r in s.members(st)}
    ep_of = _ep_index(pl.mesh, program)
    # The memory of micro-batch 0's units as built (the busiest load), read before any class
    # changes: the built classes' ops are the units' own.
    ref = {(kind, v): [_memory(op) for op in u.ops] for (kind, v, mb), u in units.items()
           if mb == 0}
    places: dict[int, Places] = {}
    relaid: dict[tuple[int, int], dict[tuple[str, int], dict[int, Op]]] = {}
    changed = 0
    for cls in program.classes:
        ep_rank = ep_of[cls.members[0]]
        load = ranks[ep_rank]
        if load.counts == busiest or load.ops is None:
            continue
        st = stage_of[cls.members[0]]
        if st not in places:
            places[st] = _unit_places(built[st], units, st, s.place.stage)
        mine = relaid.get((ep_rank, st))
        if mine is None:
            laid = stage_units(own_load_shape(s, load, ep_rank), cm, cpu_call, st)
            mine = relaid[(ep_rank, st)] = {key: _differing(u.ops, ref[key])
                                            for key, u in laid.items()}
        for (kind, v), ops in mine.items():
            for j, src in ops.items():
                for stream, i, mb in places[st].get((kind, v, j), ()):
                    _copy_memory(src, cls.streams[stream][i], mb)
        changed += 1
    return changed


def _memory(op: Op) -> tuple[object, ...]:
    return tuple(getattr(op, f) for f in MEMORY_FIELDS)


def _differing(ops: list[Op], ref: list[tuple[object, ...]]) -> dict[int, Op]:
    """The ops (by position) whose memory differs from ``ref``'s, the busiest load's."""
    if len(ops) != len(ref):     # the same code laid both out: a bug here, not bad input
        raise AssertionError("moe_rank_memory: a unit relaid with other ops")
    return {j: op for j, op in enumerate(ops) if _memory(op) != ref[j]}


def _ep_index(mesh: RankMesh, program: Program) -> dict[int, int]:
    return {r: mesh.coords(r).get("ep", 0) for c in program.classes for r in c.members}


def _unit_places(cls: RankClass, units: dict[UnitKey, UnitOps], st: int,
                 stage: Callable[[int], int]) -> Places:
    """Where stage ``st``'s unit ops sit in ``cls``'s streams: by (pass, virtual stage,
    position in the unit), each micro-batch's (stream, position, micro-batch). A class split
    from ``cls`` has its ops at the same places (:func:`sim.program.split.split_ranks` copies
    the streams in order)."""
    at = {id(op): (kind, v, j, mb) for (kind, v, mb), u in units.items() if stage(v) == st
          for j, op in enumerate(u.ops)}
    out: Places = {}
    for stream, ops in cls.streams.items():
        for i, op in enumerate(ops):
            hit = at.get(id(op))
            if hit is not None:
                out.setdefault(hit[:3], []).append((stream, i, hit[3]))
    return out


def _copy_memory(src: Op, dst: Op, mb: int) -> None:
    """``src`` (micro-batch 0's op) sized ``dst`` (the same op of micro-batch ``mb``)."""
    # (Not the stream: the combined 1F1B schedule moves some onto its own, a2a_overlap.)
    if (src.kind, src.phase, src.layer) != (dst.kind, dst.phase, dst.layer) \
            or _MB0.sub(f"mb{mb}", src.name) != dst.name:
        # The same code laid both out: a mismatch is a bug here, not bad input.
        raise AssertionError(f"moe_rank_memory: {dst.name!r} relaid as {src.name!r}")
    for f in MEMORY_FIELDS:
        setattr(dst, f, getattr(src, f))
