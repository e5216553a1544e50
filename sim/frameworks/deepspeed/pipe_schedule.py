"""DeepSpeed's ``TrainSchedule``: the instruction stream each pipeline stage executes.

``deepspeed/runtime/pipe/schedule.py`` (commit 38327e07) drives ``PipelineEngine.train_batch``
with ``2 x (m + p - 1)`` steps per stage. Stage ``s`` runs forward on the steps whose parity
is its own and backward on the others, so neighbouring stages alternate and their blocking
sends and receives pair up without deadlock:

* forward micro-batch on step ``k``: ``k // 2 - s // 2``; backward: ``k // 2 - p + 1 + s // 2``
  (``_step_to_micro_batch``), each only when it names a valid micro-batch;
* a forward step first sends the gradient of the previous (backward) step's micro-batch to
  the previous stage, then receives its own input activation; a backward step first receives
  the output gradient, then sends the previous (forward) step's activation on
  (``SendGrad``/``RecvActivation``, ``RecvGrad``/``SendActivation``): a stage's output is
  sent one step after it is computed;
* the first and last stage load the micro-batch (``LoadMicroBatch``) before a forward;
* after the last step: ``ReduceTiedGrads``, ``ReduceGrads``, ``OptimizerStep``.

The instructions are re-derived here from that description (not copied) and checked against
the properties the schedule guarantees: every micro-batch forward then backward once per
stage, every send matched by a receive, at most ``min(p - s, m)`` micro-batches in flight
(``num_pipe_buffers``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["load", "fwd", "bwd", "send_act", "recv_act", "send_grad", "recv_grad",
               "reduce_tied", "reduce_grads", "optimizer"]


@dataclass(frozen=True)
class Instr:
    """One pipeline instruction; ``mb`` is the micro-batch it concerns (-1 for the step's
    reductions and optimizer)."""

    kind: Kind
    mb: int = -1


def _micro_batch(step: int, p: int, s: int) -> tuple[int, bool]:
    """(micro-batch, is_forward) of stage ``s``'s step ``step``."""
    forward = step % 2 == s % 2
    if forward:
        return step // 2 - s // 2, True
    return step // 2 - p + 1 + s // 2, False


def train_schedule(m: int, p: int, s: int) -> list[list[Instr]]:
    """Stage ``s``'s steps (each a list of instructions) for ``m`` micro-batches over ``p``
    stages.

    Examples
    --------
    Two stages, two micro-batches; the last stage runs F0 B0 F1 B1:

    >>> [" ".join(f"{i.kind}{i.mb}" for i in st) for st in train_schedule(2, 2, 1)][:3]
    ['', 'recv_act0 load0 fwd0', 'bwd0']
    >>> sum(i.kind == "fwd" for st in train_schedule(8, 4, 0) for i in st)
    8
    """
    steps: list[list[Instr]] = []
    total = 2 * (m + p - 1)
    prev = -1
    first, last = s == 0, s == p - 1

    def valid(mb: int) -> bool:
        return 0 <= mb < m

    for k in range(total):
        mb, forward = _micro_batch(k, p, s)
        cmds: list[Instr] = []
        if forward:
            if valid(prev) and not first:
                cmds.append(Instr("send_grad", prev))
            if valid(mb) and not first:
                cmds.append(Instr("recv_act", mb))
        else:
            if valid(mb) and not last:
                cmds.append(Instr("recv_grad", mb))
            if valid(prev) and not last:
                cmds.append(Instr("send_act", prev))
        if (first or last) and forward and valid(mb):
            cmds.append(Instr("load", mb))
        if valid(mb):
            cmds.append(Instr("fwd" if forward else "bwd", mb))
        if k == total - 1:
            cmds += [Instr("reduce_tied"), Instr("reduce_grads"), Instr("optimizer")]
        prev = mb
        steps.append(cmds)
    return steps


def pipe_buffers(m: int, p: int, s: int) -> int:
    """``TrainSchedule.num_pipe_buffers``: micro-batches whose activations stage ``s`` may hold
    at once, ``max(2, min(p - s, m))``."""
    return max(2, min(p - s, m))
