"""Collectives slowed by the compute beside them: the engine's bookkeeping of HBM shares.

The rule is :func:`sim.hardware.interference.comm_rate_share` (one home for the physics): while
compute ops with a memory-bound share run on a rank class's GPUs, the collectives of that
class keep only their share of HBM, hence of their rate. This module tracks, per rank class,
the memory-bound share of the compute running now and the collectives moving data, and caps
each collective's flows on the fabric (:meth:`sim.fabric.network.FlowNetwork.scale_caps`) at the
least share over the classes it spans: NCCL's ring and tree steps run in lock-step, so the
slowest GPU paces them all. A folded rank class stands for ranks that run the same ops at
the same times, so its share applies to all its flows (the folded copies included). The caps
change piecewise, whenever a compute op or a collective starts or ends on a class, and only
when a share actually moves: a collective beside tensor-core math, or with an HBM demand its
share covers (network collectives: 4 x 50 GB/s beside 3.35 TB/s), never re-solves the fabric.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sim.fabric.network import FlowNetwork
from sim.hardware.interference import comm_rate_share


@dataclass
class _Collective:
    tag: object
    classes: tuple[int, ...]
    scale: float = 1.0


class HbmShare:
    """Per-class memory-bound compute and the caps it puts on the class's collectives.

    Parameters
    ----------
    net : the flow network the collectives run on
    sm_count, hbm_bytes_per_s : the GPU's SMs and HBM bandwidth
    load : callable giving a class's (CTAs, HBM bytes/s) its running collectives hold
    """

    def __init__(self, net: FlowNetwork, sm_count: int, hbm_bytes_per_s: float,
                 load: Callable[[int], tuple[int, float]]) -> None:
        self.net = net
        self.sm_count = sm_count
        self.hbm_bytes_per_s = hbm_bytes_per_s
        self._load = load
        self._memory: dict[int, float] = {}
        self._class_scale: dict[int, float] = {}
        # A class's live collectives, in the order they started: a dict, not a set, because a
        # set of strings iterates in an order that changes with each process's hash seed, and
        # _update rescales them in that order (same scenario, same numbers).
        self._keys: dict[int, dict[str, None]] = {}
        self._coll: dict[str, _Collective] = {}
        self.changes = 0
        """Times a collective's cap moved (each one a partial rate solve)."""

    # ------------------------------------------------------------------ events
    def compute_started(self, cls_id: int, memory_share: float) -> None:
        """A compute op spending ``memory_share`` of its time memory-bound starts."""
        if memory_share > 0:
            self._memory[cls_id] = self._memory.get(cls_id, 0.0) + memory_share
            self._update(cls_id)

    def compute_ended(self, cls_id: int, memory_share: float) -> None:
        if memory_share > 0:
            left = self._memory.get(cls_id, 0.0) - memory_share
            if left <= 1e-12:
                self._memory.pop(cls_id, None)
            else:
                self._memory[cls_id] = left
            self._update(cls_id)

    def load_changed(self, cls_id: int) -> None:
        """The collectives a class holds changed (CTAs or HBM demand)."""
        if cls_id not in self._memory and cls_id not in self._class_scale:
            return   # no memory-bound compute and a share of 1: a load change cannot move it
        self._update(cls_id)

    def collective_started(self, key: str, tag: object, classes: Iterable[int]) -> None:
        """A collective (its flows tagged ``tag``) is about to move data for ``classes``."""
        coll = _Collective(tag, tuple(sorted(classes)))
        self._coll[key] = coll
        for c in coll.classes:
            self._keys.setdefault(c, {})[key] = None
        coll.scale = min((self._class_scale.get(c, 1.0) for c in coll.classes), default=1.0)
        if coll.scale < 1.0:
            self.changes += 1
            self.net.scale_caps(tag, coll.scale)

    def collective_ended(self, key: str) -> None:
        coll = self._coll.pop(key, None)
        if coll is None:
            return
        for c in coll.classes:
            keys = self._keys.get(c)
            if keys is not None:
                keys.pop(key, None)
                if not keys:
                    del self._keys[c]
                    self._class_scale.pop(c, None)
        if coll.scale < 1.0:
            self.net.scale_caps(coll.tag, 1.0)

    def class_state(self, cls_id: int) -> tuple[float, float]:
        """The class's running memory-bound compute share and its collectives' rate share
        (1.0: not capped), for :meth:`sim.engine.core.Engine.accumulators`."""
        return self._memory.get(cls_id, 0.0), self._class_scale.get(cls_id, 1.0)

    # ------------------------------------------------------------------ internals
    def share(self, cls_id: int) -> float:
        """The share of their rate the class's collectives keep now."""
        m = self._memory.get(cls_id, 0.0)
        if m <= 0:
            return 1.0
        ctas, hbm = self._load(cls_id)
        return comm_rate_share(self.sm_count, self.hbm_bytes_per_s, m, ctas, hbm)

    def _update(self, cls_id: int) -> None:
        keys = self._keys.get(cls_id)
        if not keys:
            return
        new = self.share(cls_id)
        old = self._class_scale.get(cls_id, 1.0)
        if abs(new - old) <= 1e-12 * old:
            return
        if new >= 1.0:
            self._class_scale.pop(cls_id, None)
        else:
            self._class_scale[cls_id] = new
        for key in keys:
            coll = self._coll[key]
            if new < coll.scale:
                scale = new
            elif old <= coll.scale * (1 + 1e-12):
                # This class was (one of) the slowest: the least share may have risen.
                scale = min(self._class_scale.get(c, 1.0) for c in coll.classes)
            else:
                continue
            if scale != coll.scale:
                coll.scale = scale
                self.changes += 1
                self.net.scale_caps(coll.tag, scale)
