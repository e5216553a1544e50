"""Split a rank out of its rank class: a rank that a fault makes different runs on its own.

A rank class (:class:`~sim.program.ir.RankClass`) stands for ranks that run the same ops at
the same times. A straggler GPU breaks that for one rank: :func:`split_rank` takes it out of
its class into a class of its own, a copy of the class's streams (new ops, new indices,
dependencies inside the class remapped to the copies, dependencies on other classes kept),
and gives it the straggler's ``compute_factor`` (:attr:`RankClass.compute_factor`, read by the
engine). Every other class is left as it is, so a program with one slow rank has one class
more than without.

Each copied collective, send and receive keeps its ``key`` and its groups (or pairs): the
engine's rendezvous (:meth:`sim.engine.core.Engine._collective`) then waits for both the
original class and the new one, so the class's other members wait at every collective they
share with the straggler, as NCCL's kernels do. Ops of other classes that depended on an op of
the split class keep depending on the original op; for a collective or send that ends no
earlier than its copy (both run as one transfer), and for the rest it keeps the fast ranks'
timing. Modelled simplification: members of the original class that share no group with the
straggler also wait for it at the class's collectives (a class is simulated once); in a
synchronous data-parallel job every rank waits for it at the gradient reduction anyway.

Works after any framework's builder (it only reads the IR), so no framework knows about faults.
"""

from __future__ import annotations

import dataclasses

from sim.program.ir import Op, Program, RankClass

__all__ = ["split_rank"]


def split_rank(program: Program, rank: int, compute_factor: float = 1.0) -> RankClass:
    """Give ``rank`` a rank class of its own with ``compute_factor``; returns that class.

    When ``rank`` is already alone in its class, that class just takes the factor (multiplied
    with any it had). The program is changed in place and still validates.

    Parameters
    ----------
    program : Program
        A built program.
    rank : int
        Global rank to split out, ``0 <= rank < program.n_ranks``.
    compute_factor : float
        How many times longer the rank's compute kernels take (>= 1 for a straggler).

    Examples
    --------
    >>> p = Program(classes=[], n_ranks=4, tokens_per_step=1, model_flops_per_step=1,
    ...             hw_flops_per_step=1)
    >>> c = RankClass(0, (0, 1, 2, 3)); p.classes.append(c)
    >>> f = p.add(c, Op("fwd", "compute", "compute", "fwd", duration=1.0))
    >>> ar = p.add(c, Op("ar", "collective", "comm", "comm", deps=[f], collective="all_reduce",
    ...                  group=(0, 1, 2, 3), nbytes=1e6, key="ar0"))
    >>> slow = split_rank(p, 2, 1.5)
    >>> [k.members for k in p.classes], slow.compute_factor, slow.label
    ([(0, 1, 3), (2,)], 1.5, 'rank 2 (slow GPU x1.5; of class 0)')
    >>> copy = slow.streams["comm"][0]
    >>> copy.key, copy.deps[0] is slow.streams["compute"][0], copy.index
    ('ar0', True, 3)
    >>> p.validate()
    """
    if not 0 <= rank < program.n_ranks:
        raise IndexError(f"rank {rank} out of range [0, {program.n_ranks})")
    cls = next(c for c in program.classes if rank in c.members)
    mark = f"slow GPU x{compute_factor:g}" if compute_factor != 1 else "split"
    if len(cls.members) == 1:
        cls.compute_factor *= compute_factor
        cls.label = f"{cls.label} ({mark})" if cls.label else f"rank {rank} ({mark})"
        return cls
    # The label marks the straggler on the timeline (Perfetto's process name, plots).
    new = RankClass(id=max(c.id for c in program.classes) + 1, members=(rank,),
                    initial_memory=dict(cls.initial_memory),
                    label=f"rank {rank} ({mark}; of {cls.label or f'class {cls.id}'})",
                    compute_factor=cls.compute_factor * compute_factor)
    cls.members = tuple(r for r in cls.members if r != rank)
    program.classes.append(new)
    # Copy in program order so each stream keeps its order and the host keeps its issue order
    # (sim.engine.host_clock.issue_order sorts a class's ops by index).
    mine = sorted((op for ops in cls.streams.values() for op in ops), key=lambda o: o.index)
    copies: dict[int, Op] = {}
    for op in mine:
        copies[id(op)] = dataclasses.replace(op, deps=list(op.deps), index=-1)
    for op in mine:
        twin = copies[id(op)]
        twin.deps = [copies.get(id(d), d) for d in op.deps]
        program.add(new, twin)
    # Keep the class's stream order (dict order) as the original's, for deterministic output.
    new.streams = {name: new.streams.get(name, []) for name in cls.streams}
    return new
