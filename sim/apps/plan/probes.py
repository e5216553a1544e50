"""Each family's lightest layout is built first: the planner's family probes.

Part of ``fabricsim plan`` (:mod:`sim.apps.plan`; docs/planner.md); moved out of
:mod:`sim.apps.plan.search` unchanged.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

from sim.apps.plan.recompute import weight

if TYPE_CHECKING:
    from sim.apps.plan.search import Candidate


def _lightness(c: Candidate) -> tuple[int, int, int, int]:
    """Order of a family's layouts by the memory they need, least first."""
    rank, modules = weight(c.layout)
    return (c.layout.micro_batch_size, -rank, -modules, c.index)


class _FamilyProbes:
    """Each family's lightest pending layout is built first (its probe): if even that does
    not fit, no layout of the family does. The family's other layouts wait for it."""

    def __init__(self, cands: list[Candidate]) -> None:
        self.cands = cands
        self.families: dict[tuple[Any, ...], list[int]] = defaultdict(list)
        for c in cands:
            if c.status == "pending":
                self.families[c.family].append(c.index)
        self.probed: set[tuple[Any, ...]] = set()
        self.probing: set[tuple[Any, ...]] = set()
        self.waiting: dict[tuple[Any, ...], list[int]] = defaultdict(list)

    def to_build(self, c: Candidate) -> Candidate | None:
        """The candidate to build when ``c`` is next: ``c``, its family's probe, or None
        (``c`` waits for the probe being built)."""
        fam = c.family
        if fam in self.probing:
            self.waiting[fam].append(c.index)
            return None
        if fam not in self.probed:
            probe = min((x for x in self.families[fam] if self.cands[x].status == "pending"),
                        key=lambda x: _lightness(self.cands[x]))
            self.probed.add(fam)
            if probe != c.index:
                self.probing.add(fam)
                self.waiting[fam].append(c.index)
                return self.cands[probe]
        return c

    def release(self, family: tuple[Any, ...]) -> list[int]:
        """The candidates that waited for the family's probe, now built."""
        if family not in self.probing:
            return []
        self.probing.discard(family)
        return self.waiting.pop(family, [])
