"""What torch.compile (TorchInductor) does to a run of memory-bound kernels between two
GEMM or attention kernels.

Inductor lowers GEMMs and SDPA to extern kernels (cuBLAS, FlashAttention) and, without
``max-autotune``, fuses nothing into them (no prologue or epilogue fusion): each run of
memory-bound kernels between two of them is scheduled on its own. Inside a run the scheduler
(``torch/_inductor/scheduler.py``) fuses:

* only nodes that share a buffer: ``Scheduler.get_possible_fusions`` pairs nodes grouped by
  the buffers they read or write, and ``config.aggressive_fusion`` (which would also pair
  unrelated nodes) is off by default. Independent chains in one run (autocast's weight casts
  beside the activations) stay separate kernels, each paying a launch;
* only nodes of one iteration space: a reduction over the tokens (a weight or bias gradient:
  ``sum`` over dim 0) cannot share a kernel with reductions along rows (a norm's mean) or
  with the row-wise elementwise work (``can_fuse`` compares the (numel, rnumel) groups). It
  becomes its own kernel with the pointwise producers that feed only it, and reads their
  inputs again;
* a reduction along rows too wide to hold in registers (the 128k-entry vocabulary rows of
  the loss; persistent reductions only up to a few thousand elements,
  ``codegen/triton.py`` ``should_use_persistent_reduction``) is a looped reduction: one loop
  for the running max and sum (``config.online_softmax`` merges the two) and one for the
  output, so what it reads repeatedly (the logits) comes from HBM once per loop: two passes.

What a fused kernel writes: the tensors something outside it still needs (saved for
backward, block outputs, inputs of the GEMMs, of the other fused kernels). AOTAutograd's
min-cut partitioner (``torch/_functorch/partitioners.py``) may save fewer activations and
recompute cheap pointwise ops in backward; the builders model it where it was measured (the
MLP's ``silu(gate)``, :func:`sim.workload.layer_ops.mlp_projections`; one bf16 cast of an
input shared by several linears, :meth:`sim.workload.layer_builder._Builder.linear`) and keep
the eager saved set elsewhere. CUDA graphs are not modelled (``mode="reduce-overhead"``):
every fused kernel still pays a launch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sim.workload.layer_ops import Kernel, Tensor

STREAMING_ROW_ELEMENTS = 16384
"""Rows up to this many elements: a fused kernel whose row reductions are all this narrow
streams at the elementwise rate. Measured on the lent H200 (h200-train-steps-profiled.json,
1b-compile and 8b4l-compile): each RMSNorm's fused backward over 2,048- and 4,096-wide rows
took 135-160 us, what its bytes take at the elementwise rate (142-173 us; 228-279 at the
short-row reduction rate of PyTorch's eager norm kernel), while the loss's looped reduction
over 128,256-wide rows ran at about the reduction rate (3.18 ms forward). The limit between
is assumed: the widest hidden size of the catalogue's models (16,384, Llama 3 405B)."""

LOOPED_REDUCTION_PASSES = 2
"""HBM passes of a looped softmax-style reduction under ``config.online_softmax`` (max and
sum of exponentials in one loop, the output in a second)."""


def fuse_run(run: Sequence[Kernel], keep: set[int], token_reduction: set[int]) -> list[Kernel]:
    """Fused kernels of one run of memory-bound kernels (in the order of their first kernel).

    ``keep``: ids of tensors needed outside the run. ``token_reduction``: ids of the tensors
    that reductions over the token dimension write (weight and bias gradients).
    """
    n = len(run)
    groups = _groups(run, token_reduction)
    owner = {i: g for g, members in enumerate(groups) for i in members}
    readers: dict[int, set[int]] = {}
    for i, k in enumerate(run):
        for t in k.reads:
            readers.setdefault(id(t), set()).add(owner[i])
    out: list[Kernel] = []
    for g, members in enumerate(groups):
        ks = [run[i] for i in sorted(members)]
        made = {id(t) for k in ks for t in k.writes}
        reads: list[Tensor] = []
        seen: set[int] = set()
        for k in ks:
            for t in k.reads:
                if id(t) not in made and id(t) not in seen:
                    seen.add(id(t))
                    reads.append(t)
        reads += _extra_passes(ks, made)
        writes = {id(t): t for k in ks for t in k.writes
                  if id(t) in keep or readers.get(id(t), set()) - {g}}
        out.append(_fused_kernel(ks, tuple(reads), tuple(writes.values())))
    assert sum(len(m) for m in groups) == n
    return out


def _fused_kernel(ks: list[Kernel], reads: tuple[Tensor, ...], writes: tuple[Tensor, ...]
                  ) -> Kernel:
    from sim.workload.layer_ops import Kernel, is_reduction

    # No activation_elements: the eager GELU kernel's math-bound rate
    # (ComputeModel.gelu_time) is not Triton's. Measured on the H200
    # (h200-train-steps-profiled.json, 1b-compile): inductor's fused silu(gate) * up moves its
    # 805 MB at 4.39 TB/s, 91% of HBM peak, where eager's SiLU runs at about a fifth of it.
    rows = [k.row_elements for k in ks if is_reduction(k)]
    narrow = bool(rows) and all(0 < r <= STREAMING_ROW_ELEMENTS for r in rows)
    return Kernel("fused[" + ",".join(k.name for k in ks) + "]", "elementwise", reads, writes,
                  reduction=bool(rows) and not narrow, streams=narrow)


def _groups(run: Sequence[Kernel], token_reduction: set[int]) -> list[set[int]]:
    """Kernel indices of each fused kernel: token reductions with their exclusive pointwise
    producers, then the connected components (by shared tensors) of the rest."""
    n = len(run)
    consumers: dict[int, set[int]] = {}
    for i, k in enumerate(run):
        for t in k.reads:
            consumers.setdefault(id(t), set()).add(i)
    taken: set[int] = set()
    groups: list[set[int]] = []
    for r, k in enumerate(run):
        if not any(id(t) in token_reduction for t in k.writes):
            continue
        group = {r}
        # Producers whose every output is consumed inside the group (walk backwards).
        for i in range(r - 1, -1, -1):
            p = run[i]
            if i in taken or not p.writes:
                continue
            users = set().union(*(consumers.get(id(t), set()) for t in p.writes))
            if users and users <= group:
                group.add(i)
        taken |= group
        groups.append(group)
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first_user: dict[int, int] = {}
    for i, k in enumerate(run):
        if i in taken:
            continue
        for t in (*k.reads, *k.writes):
            j = first_user.setdefault(id(t), i)
            parent[find(i)] = find(j)
    comps: dict[int, set[int]] = {}
    for i in range(n):
        if i not in taken:
            comps.setdefault(find(i), set()).add(i)
    groups += list(comps.values())
    groups.sort(key=min)
    return groups


def _extra_passes(ks: list[Kernel], made: set[int]) -> list[Tensor]:
    """The external tensors a looped reduction reads again: a kernel that reads a tensor
    more than once (a softmax over rows too wide for registers) makes each further pass
    re-read that tensor, or, when it is produced inside the fused kernel, the external
    tensors it is computed from."""
    producers = {id(t): k for k in ks for t in k.writes}
    extra: list[Tensor] = []
    for k in ks:
        ids = [id(t) for t in k.reads]
        repeated = [t for i, t in enumerate(k.reads) if ids.index(id(t)) == i and
                    ids.count(id(t)) > 1]
        for t in repeated:
            for src in _sources(t, producers, made):
                extra += [src] * (LOOPED_REDUCTION_PASSES - 1)
    return extra


def _sources(t: Tensor, producers: dict, made: set[int]) -> list[Tensor]:
    if id(t) not in made:
        return [t]
    out: list[Tensor] = []
    for r in producers[id(t)].reads:
        out += _sources(r, producers, made)
    return out
