"""Split a rank out of its rank class: a rank that a fault makes different runs on its own.

A rank class (:class:`~sim.program.ir.RankClass`) stands for ranks that run the same ops at
the same times. A straggler GPU breaks that for one rank: :func:`split_rank` takes it out of
its class into a class of its own (:func:`split_ranks` takes several ranks of one class that
are slowed alike, a throttled server's GPUs, into one new class), a copy of the class's
streams (new ops, new indices, dependencies inside the class remapped to the copies,
dependencies on other classes kept),
and gives it the straggler's ``compute_factor`` (:attr:`RankClass.compute_factor`, read by the
engine). Every other class is left as it is, so a program with one slow rank has one class
more than without. :func:`split_slow` groups any set of slow ranks that way: one new class
per (original class, factor).

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

__all__ = ["split_rank", "split_ranks", "split_slow"]


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
    return split_ranks(program, (rank,), compute_factor)


def split_ranks(program: Program, ranks: tuple[int, ...], compute_factor: float = 1.0
                ) -> RankClass:
    """Take ``ranks`` (members of one class) into one new class with ``compute_factor``.

    When they are the whole class, that class just takes the factor. Returns the class
    that holds them.
    """
    if not ranks:
        raise ValueError("split_ranks: no rank")
    for r in ranks:
        if not 0 <= r < program.n_ranks:
            raise IndexError(f"rank {r} out of range [0, {program.n_ranks})")
    cls = next(c for c in program.classes if ranks[0] in c.members)
    if not set(ranks) <= set(cls.members):
        raise ValueError(f"split_ranks: ranks {sorted(ranks)[:4]} are not all of class {cls.id}")
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_span(ranks)}"
    mark = f"slow GPU x{compute_factor:g}" if compute_factor != 1 else "split"
    if set(ranks) == set(cls.members):
        cls.compute_factor *= compute_factor
        cls.label = f"{cls.label} ({mark})" if cls.label else f"{who} ({mark})"
        return cls
    # The label marks the straggler on the timeline (Perfetto's process name, plots).
    new = RankClass(id=max(c.id for c in program.classes) + 1,
                    members=tuple(sorted(ranks)), initial_memory=dict(cls.initial_memory),
                    label=f"{who} ({mark}; of {cls.label or f'class {cls.id}'})",
                    compute_factor=cls.compute_factor * compute_factor)
    out = set(ranks)
    cls.members = tuple(r for r in cls.members if r not in out)
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


def split_slow(program: Program, factors: dict[int, float]) -> list[RankClass]:
    """Split every slow rank (``rank -> factor``) out of its class: ranks of one class with one
    factor run identically, so they share one new class; returns the new (or re-factored)
    classes in a deterministic order (by original class, then factor).

    Examples
    --------
    >>> p = Program(classes=[RankClass(0, tuple(range(16)))], n_ranks=16, tokens_per_step=1,
    ...             model_flops_per_step=1, hw_flops_per_step=1)
    >>> f = p.add(p.classes[0], Op("fwd", "compute", "compute", "fwd", duration=1.0))
    >>> out = split_slow(p, {r: 1.2 for r in range(8, 16)} | {3: 2.0})
    >>> [(c.members[:2], len(c.members), c.compute_factor) for c in p.classes]
    [((0, 1), 7, 1.0), ((8, 9), 8, 1.2), ((3,), 1, 2.0)]
    """
    class_of = program.class_of_rank()
    groups: dict[tuple[int, float], list[int]] = {}
    for rank in sorted(factors):
        if not 0 <= rank < program.n_ranks:
            raise IndexError(f"rank {rank} out of range [0, {program.n_ranks})")
        groups.setdefault((class_of[rank], factors[rank]), []).append(rank)
    return [split_ranks(program, tuple(groups[k]), k[1]) for k in sorted(groups)]


def _span(ranks: tuple[int, ...]) -> str:
    """``0-7`` for a contiguous run, else the first few and a count."""
    rs = sorted(ranks)
    if rs == list(range(rs[0], rs[-1] + 1)):
        return f"{rs[0]}-{rs[-1]}"
    return ",".join(map(str, rs[:4])) + (f",... ({len(rs)})" if len(rs) > 4 else "")
