"""Options the planner tries only where they can change the answer: memory levers (Megatron's
bf16 Adam moments, then Megatron-FSDP or its activation offloading, for a mixture-of-experts
layout that does not fit; Megatron-FSDP for a dense one without pipeline parallelism), and
options that only
save host time (Megatron's CUDA graphs) where they shorten the lower bound of the layout's
eager twin. Part of ``fabricsim plan`` (:mod:`sim.apps.plan`; docs/planner.md).

* **Memory lever**: a layout that does not fit (its family's model states, its estimate, an
  implied verdict or its simulation) gets a twin with the search space's
  :attr:`~sim.frameworks.common.entry.SearchSpace.memory_lever` options, searched like any
  other candidate (its own family, the same layer profile and bound). A layout that fits
  never gets one: the lever trades nothing for memory it does not need, and the search stays
  as long as before wherever everything fits.
* **Host twins**: a layout whose options only save host time
  (:attr:`~sim.frameworks.common.entry.SearchSpace.host_twin`) is built only once its eager
  twin is, and only where that fits and its host issues for at least :data:`HOST_GAIN` of
  its bound (graphs take at most the host's time off any path of the schedule, so off the
  bound); it is simulated only if its own built lower bound (which runs the host clock,
  :func:`sim.apps.plan.bound._earliest_schedule`) beats the eager twin's by that share;
  otherwise the host does not bind and the twin, simulated already or soon, stands for
  both.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from sim.apps.plan.layouts import Layout, _shape, _space

if TYPE_CHECKING:
    from sim.apps.plan.search import Candidate
    from sim.scenario import Scenario

HOST_GAIN = 0.01
"""Share of the step by which a host twin's lower bound must beat its eager twin's to be
simulated. Graphs always shave the few microseconds of host issue before the first kernel
off the bound; where the host does not bind that is all they save, and a simulation of the
budget spent on it would only rank the same layout twice."""


class Levers:
    """Memory-lever twins spawned during the search, and host twins waiting for their eager
    twin's build."""

    def __init__(self, cands: list[Candidate], make: Callable[..., Candidate],
                 base: Scenario | None = None) -> None:
        self.cands = cands
        self.kept = base.framework if base is not None else None
        """The scenario's framework options (its layouts of that framework keep them)."""
        self.shape = _shape(base) if base is not None else None
        """The scenario's model as the search points need it (None: no lever applies)."""
        self.make = make
        """``Candidate``'s constructor (passed in: this module is imported by its own)."""
        self.index_of: dict[Layout, int] = {c.layout: c.index for c in cands}
        self.spawned: set[int] = set()
        self.waiting: list[tuple[int, int]] = []
        """(index, stage) of host twins whose eager twin is not settled yet."""

    def spawn(self, c: Candidate) -> Candidate | None:
        """The memory-lever twin of ``c``, which does not fit (once; None where there is
        none: a framework without a lever, a layout the lever does not apply to, a layout
        with every lever). A twin that does not fit either gets the next lever's twin in
        turn."""
        x = c.layout
        space = _space(x.framework)
        if space is None or self.shape is None or c.index in self.spawned:
            return None
        opts = x.options
        if self.kept is not None and self.kept.name == x.framework:
            # The scenario's own options hold: a lever it already pulls is not pulled again.
            own = {k: True for k in ("use_precision_aware_optimizer",
                                     "fine_grained_activation_offloading",
                                     "use_megatron_fsdp")
                   if getattr(self.kept, k, False) and k not in dict(opts)}
            if own:
                opts = tuple(sorted({**dict(opts), **own}.items()))
        # The lever also sees the scenario's options it cannot stand beside (Megatron-FSDP:
        # CUDA graphs, delayed weight gradients); the twin keeps only its own.
        seen = dict(opts)
        shown = {k: getattr(self.kept, k) for k in ("cuda_graph_impl", "delay_wgrad_compute")
                 if self.kept is not None and self.kept.name == x.framework
                 and k not in seen and hasattr(self.kept, k)}
        point = self.shape.point(x.tp, x.pp, x.vp, x.dp, x.cp, x.ep, x.etp if x.moe else 1)
        pulled = space.memory_lever(point, tuple(sorted({**seen, **shown}.items())))
        if pulled is None:
            return None
        options = tuple((k, v) for k, v in pulled if k not in shown or shown[k] != v)
        self.spawned.add(c.index)
        layout = replace(x, options=options)
        if layout in self.index_of:
            return None
        twin = self.make(len(self.cands), layout, c.micro_batches, bound0_s=c.bound0_s)
        self.cands.append(twin)
        self.index_of[layout] = twin.index
        return twin

    def _eager(self, c: Candidate) -> Candidate | None:
        x = c.layout
        space = _space(x.framework)
        eager = space.host_twin(x.options) if space is not None else None
        j = self.index_of.get(replace(x, options=eager)) if eager is not None else None
        return self.cands[j] if j is not None else None

    def host_verdict(self, c: Candidate, stage: int, force: bool = False
                     ) -> tuple[str, str] | None:
        """Before building (stage 0) or simulating (1) ``c``: ``("wait", "")`` while its
        eager twin is unsettled, ``(status, reason)`` to drop it, or None (go on). Built:
        dropped unless its bound beats the twin's (:data:`HOST_GAIN`); before: dropped where
        the twin does not fit (graphs keep their pools beside every eager buffer). With
        ``force`` it never waits."""
        t = self._eager(c)
        if t is None:
            return None
        ev = t.evaluation
        if t.status in ("pending", "building") and ev is None:
            return None if force else ("wait", "")
        if t.status in ("memory", "oom"):
            return ("memory", "implied (the same layout without CUDA graphs does not fit)")
        if ev is None or ev.refused is not None or t.status == "refused":
            return None
        if stage == 0:
            # Graphs take at most the host's issue time off any path of the schedule.
            if math.isfinite(t.lower_bound_s) and ev.host_s < HOST_GAIN * t.lower_bound_s:
                return ("bound", "CUDA graphs cannot gain (the host issues for under "
                        f"{HOST_GAIN:.0%} of the step)")
            return None
        mine, theirs = c.lower_bound_s, t.lower_bound_s
        if math.isfinite(theirs) and mine >= theirs * (1.0 - HOST_GAIN):
            return ("bound", "no faster than without CUDA graphs (the host does not bind)")
        return None
