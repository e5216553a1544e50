"""The recorder: listens to the engine and the network and keeps what happened.

Every op's ready/start/end time, memory allocations and frees per rank class by category,
the bytes/s per link class after every rate change, what NCCL ran for each collective, and
(when asked: it costs memory on large fabrics) the rate of every busy link after every
change. Metrics, plots and exports read it; it computes nothing itself beyond running totals.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sim.analysis.memory_overheads import Overheads
from sim.engine.allocator import CachingAllocator, TensorLedger
from sim.engine.core import EngineObserver
from sim.fabric.collectives.runner import Choice
from sim.program.ir import MEMORY_CATEGORIES, Op, RankClass


@dataclass
class OpRecord:
    cls: int
    op: Op
    ready: float
    start: float
    end: float
    step: int
    held: float = 0.0
    """Seconds between the op's dependencies being met and its host issuing it, ending at
    ``ready`` (0 when the host had issued it already): the host, not the GPU, held it."""


@dataclass
class MemoryTrack:
    """Memory of one rank class over time."""

    current: dict[str, float] = field(default_factory=lambda: dict.fromkeys(MEMORY_CATEGORIES,
                                                                               0.0))
    peak: float = 0.0
    peak_time: float = 0.0
    peak_breakdown: dict[str, float] = field(default_factory=dict)
    series: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    ledger: TensorLedger = field(default_factory=lambda: TensorLedger(CachingAllocator()))
    """The caching allocator this class's tensors go through (:mod:`sim.engine.allocator`)."""
    reserved_peak_time: float = 0.0
    reserved_series: list[tuple[float, float]] = field(default_factory=list)
    """(time, bytes the caching allocator reserves) after every change."""

    @property
    def reserved_peak(self) -> float:
        """Peak bytes the caching allocator reserved (``torch.cuda.max_memory_reserved``)."""
        return float(self.ledger.allocator.peak_reserved)

    @property
    def total(self) -> float:
        return sum(self.current.values())


class Recorder(EngineObserver):
    """Keeps the engine's and network's reports."""

    def __init__(self, keep_memory_series: bool = True, keep_link_series: bool = False,
                 allocator_capacity: dict[int, float] | None = None,
                 expandable_segments: bool = False) -> None:
        self.ops: list[OpRecord] = []
        # Ops of background streams (an asynchronous checkpoint's write), kept apart: they
        # run on past the step that issued them, so they bound no step.
        self.background_ops: list[OpRecord] = []
        self.memory: dict[int, MemoryTrack] = {}
        self.rate_series: list[tuple[float, np.ndarray]] = []
        # Per rate change: (time, indices of the links whose rate changed, their new bytes/s),
        # each link's rate piecewise constant from one of its changes to the next (zero before
        # its first). Kept as changes, not as every busy link's rate at every change: a
        # 1,024-GPU MoE step has some 300,000 changes over thousands of busy links, which as
        # snapshots held a billion rates (8 GB). A folded collective's flows stand for several
        # groups on disjoint links, so only the representative group's links show.
        self.link_series: list[tuple[float, np.ndarray, np.ndarray]] = []
        self._link_now = np.zeros(0, dtype=np.float32)  # every link's rate after the last
        # The rates the last change of link_series replaced, on its links (to undo it).
        self._undo = np.zeros(0, dtype=np.float32)
        # Per link, the sum over its changes of (new rate - old rate) x time: a step function's
        # integral to T is T x its last value minus this (:meth:`link_bytes`).
        self._link_moment = np.zeros(0)
        # What NCCL ran for each collective and point-to-point op, by ``Op.key``.
        self.collective_choices: dict[str, Choice] = {}
        self.transfers_finished = 0
        self.transfer_bytes = 0.0
        self.keep_memory_series = keep_memory_series
        self.keep_link_series = keep_link_series
        # Bytes each rank class's caching allocator may reserve before cudaMalloc fails.
        self.allocator_capacity = allocator_capacity or {}
        self.expandable_segments = expandable_segments
        # What each rank class's GPUs hold outside the tensors (set by the caller).
        self.overheads: dict[int, Overheads] = {}

    def track(self, cls: int) -> MemoryTrack:
        """The memory track of rank class ``cls`` (created on first use)."""
        track = self.memory.get(cls)
        if track is None:
            alloc = CachingAllocator(self.allocator_capacity.get(cls, float("inf")),
                                     self.expandable_segments)
            track = self.memory[cls] = MemoryTrack(ledger=TensorLedger(alloc))
        return track

    def workspace(self, cls: int, nbytes: float, stream: str = "compute") -> None:
        """A buffer a library takes from the caching allocator for good (cuBLAS's workspace):
        reserved and allocated by PyTorch, outside the model's tensor categories."""
        self.track(cls).ledger.alloc("workspace", nbytes, stream)

    # engine
    def on_op(self, cls: RankClass, op: Op, ready: float, start: float, end: float,
              step: int, held: float = 0.0) -> None:
        self.ops.append(OpRecord(cls.id, op, ready, start, end, step, held))

    def on_background_op(self, cls: RankClass, op: Op, ready: float, start: float, end: float,
                         step: int, held: float = 0.0) -> None:
        self.background_ops.append(OpRecord(cls.id, op, ready, start, end, step, held))

    def on_memory(self, cls: RankClass, t: float, category: str, delta: float,
                  op: Op | None = None) -> None:
        track = self.memory.get(cls.id) or self.track(cls.id)
        track.current[category] = track.current.get(category, 0.0) + delta
        ledger = track.ledger
        allocator = ledger.allocator
        before = allocator.peak_reserved
        if op is None:
            if delta > 0:
                ledger.alloc(category, delta)
            else:
                ledger.free(category, -delta)
        else:
            # An op's working set reaches the allocator as the tensors it is made of.
            where = (op.micro_batch, op.layer)
            parts: tuple[float, ...] = ()
            if category == "buffers" and op.transient_parts and abs(
                    abs(delta) - op.transient) <= 1.0:
                parts = op.transient_parts
            elif category == "activations" and delta > 0 and op.alloc_parts and abs(
                    delta - sum(op.alloc_parts)) <= 1.0:
                parts = op.alloc_parts
            if delta > 0:
                for part in parts or (delta,):
                    ledger.alloc(category, part, op.stream, op.index, where)
            else:
                for part in parts or (-delta,):
                    ledger.free(category, part, op.index, where)
        if allocator.peak_reserved > before:
            track.reserved_peak_time = t
        if self.keep_memory_series:
            rs = track.reserved_series
            reserved = float(allocator.reserved)
            if rs and rs[-1][0] == t:
                rs[-1] = (t, reserved)
            elif not rs or rs[-1][1] != reserved:
                rs.append((t, reserved))
        total = track.total
        if total > track.peak:
            track.peak = total
            track.peak_time = t
            track.peak_breakdown = dict(track.current)
        if self.keep_memory_series:
            if track.series and track.series[-1][0] == t:
                track.series[-1] = (t, dict(track.current))
            else:
                track.series.append((t, dict(track.current)))

    def on_collective(self, op: Op, choice: Choice | None) -> None:
        if choice is not None:
            self.collective_choices[op.key] = choice

    # network
    def on_rates(self, t: float, class_rates: np.ndarray, link_rates: np.ndarray) -> None:
        self._record_class_rates(t, class_rates)
        if self.keep_link_series:
            self._record_link_rates(t, link_rates, None)

    def on_rates_changed(self, t: float, class_rates: np.ndarray, link_rates: np.ndarray,
                         changed: np.ndarray) -> None:
        self._record_class_rates(t, class_rates)
        if self.keep_link_series:
            self._record_link_rates(t, link_rates, changed)

    def _record_class_rates(self, t: float, class_rates: np.ndarray) -> None:
        if self.rate_series and self.rate_series[-1][0] == t:
            self.rate_series[-1] = (t, class_rates.copy())
        else:
            self.rate_series.append((t, class_rates.copy()))

    def _record_link_rates(self, t: float, link_rates: np.ndarray,
                           candidates: np.ndarray | None) -> None:
        """One change of :attr:`link_series`: the links whose rate differs from the last
        report's, among ``candidates`` (ascending; None: every link, compared one by one).
        A replayed step sends some 200,000 reports over tens of thousands of links: comparing
        only the named ones keeps each report's cost to the links it touched."""
        n_links = len(link_rates)
        if len(self._link_now) != n_links:
            self._link_now = np.zeros(n_links, dtype=np.float32)
            self._link_moment = np.zeros(n_links)
            self._undo = np.zeros(0, dtype=np.float32)
        now, moment = self._link_now, self._link_moment
        if self.link_series and self.link_series[-1][0] == t:
            # A second solve at the same moment replaces the first: one change from the
            # rates before it.
            _, gone, rates = self.link_series.pop()
            moment[gone] -= (rates.astype(float) - self._undo) * t
            now[gone] = self._undo
            if candidates is not None:
                candidates = np.union1d(gone, candidates)
        if candidates is None:
            # Rates below a byte per second are solver rounding of links just emptied.
            new = np.where(link_rates > 1.0, link_rates, 0.0).astype(np.float32)
            changed = np.flatnonzero(new != now).astype(np.int32)
            rates = new[changed]
        else:
            raw = link_rates[candidates]
            new = np.where(raw > 1.0, raw, 0.0).astype(np.float32)
            differ = new != now[candidates]
            changed, rates = candidates[differ].astype(np.int32), new[differ]
        if len(changed):
            before = now[changed]
            moment[changed] += (rates.astype(float) - before) * t
            now[changed] = rates
            self._undo = before
            self.link_series.append((t, changed, rates))

    def link_bytes(self, t_end: float) -> np.ndarray:
        """Bytes each link carried from the start to ``t_end`` (at or after the last change of
        :attr:`link_series`), by the rates recorded there; empty without a link series."""
        return t_end * self._link_now.astype(float) - self._link_moment

    def on_transfer_end(self, t: float, tag: object, nbytes: float) -> None:
        self.transfers_finished += 1
        self.transfer_bytes += nbytes
