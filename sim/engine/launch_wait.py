"""A communication kernel launched beside running compute waits for it (Hopper, Blackwell).

On Hopper a GEMM's CTAs fill every SM's register file while it runs, so a kernel that
becomes ready on another stream gets no SM until the running kernels' CTAs retire: measured
on the lent H200 (``h200-overlap.json``, ``tools/measure_overlap.py``; docs/calibration.md,
"A GEMM beside an NCCL-like copy"): a copy kernel of 16 or 32 CTAs launched on a second
stream beside looping cuBLAS GEMMs ran only between them, never beside one. NCCL's kernels
and DeepEP's or Hybrid-EP's fused kernels are such kernels, and Megatron-Bridge's launch
script says the same of Hopper (``perf_plugins.py`` @ da98070,
``_set_num_cuda_device_max_connections``: with more than one connection "communication
kernel will be pushed to the end of the GEMM kernel, failing to overlap"). Once a
communication kernel holds its SMs it keeps them, and compute launched after it runs on the
rest (:mod:`sim.hardware.interference`).

The rule, at the engine's granularity (an op): a collective marked
``Op.launch_behind_compute`` that becomes ready while compute ops of its rank class run on
other streams starts when the last of them ends. An op is a schedule node's run of kernels
queued back to back, and why the whole op and not only its running kernel: Megatron-Bridge's
Nsight comparison of its 16-H100 Qwen3-30B-A3B runs with and without the combined 1F1B
(skills/nemo-mbridge-perf-moe-comm-overlap/SKILL.md @ 7ded17dae; HybridEP, EP 16) measured
3.96 s of communication concurrent with GEMM or attention in a 21.0 s step, 36.55% of it;
with the wait per kernel (the op's kernels taken as equally long) the simulation overlapped
7.07 s (76%), with the wait per op 4.75 s (51%). That comparison chose the rule: the row is
circular for it, the suite's other overlapped Hopper rows are not (docs/calibration.md).

Which collectives: those a builder marks, today the expert all-to-alls Megatron-Core's
combined 1F1B runs on its communication stream with more than one hardware queue, the case
the launch script's warning names. With one queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``) kernels
launch in the host's order; Transformer Engine's tensor-parallel overlap issues its
communication before the GEMM it hides behind; the data-parallel and pipeline collectives of
other schedules are not marked (no step measured with and without them says how much they
wait).

Blackwell too, since the fortieth session. Its cuBLAS GEMMs are persistent as Hopper's are
(cluster launch control only hands a running CTA the tiles of its own grid's CTAs not yet
launched), and Megatron-Core's combined 1F1B creates its communication stream at the default
priority (``pipeline_parallel/utils.py`` ``set_streams``; the high-priority stream of
``high_priority_a2a_comm_stream``, Megatron-LM #4694, 2026-05, is opt-in and no modelled run
sets it), so nothing lets a dispatch take SMs before the GEMM's CTAs retire. No Blackwell
kernel pair was measured; the published overlapped Blackwell steps were the check, not a
fit (no constant): all nine moved toward their measurements, the three DeepEP B200 rows
from +11.8 / +18.5 / +51.0% to +4.3 / +11.0 / +46.6%, the six Hybrid-EP GB200 rows by 0.2
to 2.4 points (docs/calibration.md, fortieth session). Ampere keeps the old rule (a
collective starts as soon as it is ready): nothing says how its GEMMs share the SMs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import simpy

from sim.program.ir import Op

BLOCKING_ARCHS = frozenset({"hopper", "blackwell"})
"""Architectures whose running compute kernels hold the SMs from a kernel launched beside
them (measured on an H200; Blackwell's persistent GEMMs by the same mechanism, module
docstring)."""


@dataclass
class RunningCompute:
    """The compute ops each rank class runs now, and what a communication kernel that becomes
    ready beside them waits for (the engine asks only for collectives marked
    ``Op.launch_behind_compute``). An op's end event is made only when a collective asks for
    it: most compute ends with nothing waiting.

    Examples
    --------
    >>> import simpy
    >>> from sim.program.ir import Op
    >>> env = simpy.Environment()
    >>> rc = RunningCompute(enabled=True)
    >>> experts = Op(name="experts", kind="compute", stream="compute", phase="fwd",
    ...              duration=1.0)
    >>> rc.started(0, experts)
    >>> a2a = Op(name="dispatch", kind="collective", stream="moe_a2a", phase="comm")
    >>> done = rc.beside(0, a2a, env)
    >>> len(done), done[0].triggered
    (1, False)
    >>> rc.ended(0, experts)
    >>> done[0].triggered, rc.beside(0, a2a, env)
    (True, [])
    """

    enabled: bool
    _running: dict[int, dict[int, list]] = field(default_factory=dict)
    """Per rank class, per running op: ``[op, its end event or None]``."""

    def started(self, cls_id: int, op: Op) -> None:
        if self.enabled and op.kind == "compute" and op.duration > 0:
            self._running.setdefault(cls_id, {})[id(op)] = [op, None]

    def ended(self, cls_id: int, op: Op) -> None:
        running = self._running.get(cls_id)
        if running:
            entry = running.pop(id(op), None)
            if entry is not None and entry[1] is not None:
                entry[1].succeed()

    def beside(self, cls_id: int, op: Op, env: simpy.Environment) -> list[simpy.Event]:
        """The end events of the class's compute ops running now on another stream than
        ``op``'s: what its kernel waits for before it gets SMs."""
        running = self._running.get(cls_id) if self.enabled else None
        if not running:
            return []
        out = []
        for entry in running.values():
            if entry[0].stream != op.stream:
                if entry[1] is None:
                    entry[1] = env.event()
                out.append(entry[1])
        return out
