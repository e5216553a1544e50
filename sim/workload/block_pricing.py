"""Time and memory of a block's kernels under a compute model.

* time: every kernel priced by :class:`~sim.hardware.compute.ComputeModel` (GEMM, attention,
  memory-bound by class), with the CPU issue cost as a floor (:func:`price_block`);
* memory: saved activations per block, and the transient peak inside each block's forward
  and backward from tensor lifetimes (a tensor lives from the kernel that writes it to the last
  kernel that reads it);
* torch.compile: the runs of memory-bound kernels between two GEMM/attention kernels fused
  as inductor's scheduler fuses them (:mod:`sim.workload.inductor`);
* torchtitan's op-level selective activation checkpointing (:func:`op_sac_costs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sim.hardware.attention_cost import attention_dropout_factor, deterministic_backward_factor
from sim.hardware.compute import (
    COMPILED_OP_CPU_S,
    EAGER_BWD_OP_CPU_S,
    EAGER_FWD_OP_CPU_S,
    KERNEL_BOUNDARY_S,
    ComputeModel,
)
from sim.hardware.fp8_attention import Format
from sim.workload.grouped_gemm import grouped_gemm_time, torch_grouped_mm_slowdown
from sim.workload.kernels import Block, Kernel, Style, is_reduction

CPP_LAUNCH_CPU_S = EAGER_BWD_OP_CPU_S
"""Host seconds per extra kernel launch issued from C++ with no Python between launches
(TE's per-expert quantizations, and each per-expert C++ object of ``GroupedLinear``): the
per-kernel cost of PyTorch's C++ autograd engine
(:data:`sim.hardware.compute.EAGER_BWD_OP_CPU_S`), not a Python op's. A per-expert GEMM
is a cuBLASLt call and costs :data:`CUBLASLT_CALL_CPU_S` instead."""

CUBLASLT_CALL_CPU_S = 10e-6
"""Host seconds of one cuBLASLt GEMM call as Transformer Engine makes it, once per expert in
its grouped GEMM loop (``nvte_multi_stream_cublas_gemm`` -> ``cublas_gemm``,
``transformer_engine/common/gemm/cublaslt_gemm.cu``, v2.7 to today's main): every call
creates the operation descriptor, the matrix layouts and the preference, sets their
attributes, queries ``cublasLtMatmulAlgoGetHeuristic``, launches, and destroys them; nothing
is memoized. NVIDIA/raft PR 1736 (2023) measured exactly that unmemoized cuBLASLt path at
about 10 us from entering the wrapper to the kernel's launch, and about 5 us once the
heuristics, layouts and descriptor are memoized. Not fitted: no measured MoE row sets it."""


@dataclass(frozen=True)
class BlockCost:
    """Time, FLOPs and memory of one block for one micro-batch."""

    name: str
    fwd_s: float
    bwd_s: float
    fwd_kernels: int
    bwd_kernels: int
    flops_fwd: float
    flops_bwd: float
    saved_bytes: float
    input_saved_bytes: float
    """Of the saved bytes, those of the block's input."""
    input_bytes: float
    """The block's inputs, saved by an op or not: what a checkpoint around the layer keeps
    (``torch.utils.checkpoint`` holds the function's inputs), which an op that saves only a
    copy of the input (an eager RMSNorm's fp32 ``x.float()``) does not hold."""
    forward_scoped_bytes: float
    weight_cast_bytes: float
    fwd_transient_bytes: float
    """Peak bytes held during the forward beyond saved, scoped and weight-cast tensors."""
    fwd_transient_unsaved_bytes: float
    """The same when nothing is saved (a checkpointed forward: saved tensors die after their
    last forward use)."""
    bwd_transient_bytes: float
    """Peak bytes held during the backward beyond what was saved (may release saved ones)."""
    weight_grad_bytes: float
    params: int
    early_stop_fwd_s: float
    """Forward time minus the kernels after the last saved tensor (the part a non-reentrant
    checkpoint recomputes: torch.utils.checkpoint stops recomputation early)."""
    fwd_gpu_s: float = 0.0
    """GPU time of the forward kernels alone (fwd_s also bounds it by CPU issue time)."""
    bwd_gpu_s: float = 0.0
    fwd_extra_launches: int = 0
    """Launches beyond one per forward kernel (:func:`extra_launches`): host time of
    :data:`CPP_LAUNCH_CPU_S` each (:data:`CUBLASLT_CALL_CPU_S` a GEMM), on top of the
    framework's per-op cost."""
    bwd_extra_launches: int = 0
    fwd_extra_gemm_launches: int = 0
    """Of ``fwd_extra_launches``, the per-expert cuBLASLt GEMM calls
    (:func:`extra_gemm_launches`)."""
    bwd_extra_gemm_launches: int = 0
    fwd_transient_parts: tuple[float, ...] = ()
    """The tensors making up ``fwd_transient_bytes`` (they add up to it), largest first."""
    fwd_transient_unsaved_parts: tuple[float, ...] = ()
    bwd_transient_parts: tuple[float, ...] = ()
    saved_parts: tuple[float, ...] = ()
    """The saved tensors making up ``saved_bytes``, then the weight casts making up
    ``weight_cast_bytes``, in the order the forward creates them."""
    late_saved_parts: tuple[float, ...] = ()
    """Eager forward only: the saved tensors (of ``saved_parts``) created after the block's
    first forward-scoped tensor, i.e. above it and above the transients of the same span in
    the caching allocator's segment (the loss's ``log_softmax`` output sits above the bf16
    logits and their fp32 copy; freeing those leaves a hole below it)."""

    @property
    def checkpoint_only_input_bytes(self) -> float:
        """Of the block's inputs, what only a checkpoint around the layer holds (no op saved
        it): freed with the layer's backward beside its saved bytes."""
        return self.input_bytes - self.input_saved_bytes


def _fuse(kernels: list[Kernel], keep: set[int], block: Block | None = None) -> list[Kernel]:
    """torch.compile: each run of memory-bound kernels between GEMM/attention kernels becomes
    the fused kernels inductor makes of it (:func:`sim.workload.inductor.fuse_run`).

    A fused kernel reads the inputs produced outside it and writes the outputs that something
    outside it still needs (``keep`` holds ids of such tensors needed outside the run).
    ``block``: its weight gradients written by reductions are reductions over the tokens.
    """
    from sim.workload.inductor import fuse_run

    grads = {id(t) for t in block.weight_grads} if block is not None else set()
    token = {id(t) for k in kernels if is_reduction(k) for t in k.writes if id(t) in grads}
    out: list[Kernel] = []
    run: list[Kernel] = []
    for k in kernels:
        if k.fusible:
            run.append(k)
            continue
        if run:
            out += fuse_run(run, keep, token)
            run = []
        out.append(k)
    if run:
        out += fuse_run(run, keep, token)
    return out


def _needed_outside(kernels: list[Kernel], block: Block) -> set[int]:
    keep = {id(t) for t in block.saved + block.forward_scoped + block.outputs
            + block.weight_grads + block.weight_casts}
    for k in kernels:
        if not k.fusible:
            keep.update(id(t) for t in k.reads)
    return keep



def kernel_time(cm: ComputeModel, k: Kernel) -> float:
    """GPU time of one kernel."""
    if k.klass == "gemm":
        assert k.gemm is not None
        m_, kk, n, p = k.gemm
        if k.group:
            t = grouped_gemm_time(cm, k.group, kk, n, p, fp8=k.fp8,  # type: ignore[arg-type]
                                  block_scaled=k.fp8_block)
            if k.grouped_impl == "torch":
                t *= torch_grouped_mm_slowdown(cm.gpu.arch)
        else:
            t = cm.gemm_time(m_, kk, n, p, fp8=k.fp8,  # type: ignore[arg-type]
                             block_scaled=k.fp8_block)
        if any(r is w for w in k.writes for r in k.reads):
            # Accumulating (beta = 1, :func:`~sim.workload.kernels.accumulating`): the
            # epilogue reads and writes its output, a main_grad under Megatron's
            # gradient-accumulation fusion (8 bytes an element in fp32, 4 in 16 bits, where
            # the GEMM's own floor counts a 16-bit write). Its HBM floor counts the kernel's
            # own tensors; it binds for a wgrad over few tokens (a local expert's few
            # hundred rows).
            t = max(t, cm.membound_time(k.nbytes))
        return t
    if k.klass == "attention":
        assert k.attn is not None
        bsz, heads, seq, hd, p = k.attn
        # FP8 attention (fp8_dpa): MXFP8 when block-scaled, per-tensor FP8 otherwise.
        fp8: Format | None = ("mxfp8" if k.fp8_block else "fp8") if k.fp8 else None
        if k.attn_block is not None:
            q_len, kv_len = k.attn_block
            t = cm.attention_time(bsz, heads, q_len, hd, p,  # type: ignore[arg-type]
                                  kv_seq=kv_len, causal=False, fp8=fp8)
        elif k.attn_kv_seq and k.attn_kv_seq != seq:
            # Megatron splits each sequence in 2 x cp chunks so every rank gets an equal
            # share of the causal triangle: half of its queries x all keys.
            t = cm.cp_attention_time(bsz, heads, seq, hd, p,  # type: ignore[arg-type]
                                     kv_seq=k.attn_kv_seq, fp8=fp8)
        else:
            t = cm.attention_time(bsz, heads, seq, hd, p,  # type: ignore[arg-type]
                                  window=k.attn_window, fp8=fp8, masked=k.attn_masked)
        # Whatever the call's shape, its backward orders dQ under determinism and the kernel
        # draws its own dropout mask in both passes.
        if cm.deterministic and p == "bwd":
            t *= deterministic_backward_factor(cm.attention_backend)
        return t * attention_dropout_factor(cm.gpu.arch) if k.attn_dropout else t
    # A memory-bound kernel launched once per piece (Transformer Engine's per-expert
    # quantization, :func:`sim.workload.layer_rules.te_scaled_cast`) pays the fixed cost of
    # each launch; its bytes stream once.
    fixed = (k.launches - 1) * cm.kernel_min_s
    if k.klass == "tiny":
        return cm.kernel_min_s + fixed
    if k.legacy_elements:
        return cm.legacy_loop_time(k.legacy_elements, k.nbytes, k.legacy_operands,
                                   cast=k.cast_elements > 0) + fixed
    if k.cast_elements:
        return cm.cast_loop_time(k.cast_elements, k.nbytes) + fixed
    klass = "reduction" if k.klass == "elementwise" and is_reduction(k) else k.klass
    t = cm.membound_time(k.nbytes, klass)  # type: ignore[arg-type]
    if k.activation_elements:
        t = max(t, cm.kernel_min_s + cm.gelu_time(k.activation_elements, k.activation_pass))
    return t + fixed


def _gpu_time(cm: ComputeModel, kernels: list[Kernel]) -> float:
    # Each kernel's own time, plus the moment the stream idles between two of them.
    return sum(kernel_time(cm, k) for k in kernels) + len(kernels) * KERNEL_BOUNDARY_S


def _cpu_time(kernels: list[Kernel], cpu_per_op: float, attn_cpu: float) -> float:
    return (sum(attn_cpu if k.klass == "attention" else cpu_per_op for k in kernels)
            + extra_launch_cpu_s(kernels))


def extra_launches(kernels: Sequence[Kernel]) -> int:
    """Launches the host issues for ``kernels`` beyond one per kernel: a grouped GEMM of
    Transformer Engine's multi-stream cuBLAS path is one cuBLASLt call per expert
    (:attr:`Kernel.launches`), issued from C++ in one Python call.

    Examples
    --------
    >>> g = Kernel("fc1.fwd", "gemm", (), (), group=(512.0,) * 16, launches=16)
    >>> extra_launches([Kernel("act", "elementwise", (), ()), g])
    15
    """
    return sum(k.launches - 1 for k in kernels)


def extra_gemm_launches(kernels: Sequence[Kernel]) -> int:
    """Of :func:`extra_launches`, those of GEMMs: cuBLASLt calls, each paying
    :data:`CUBLASLT_CALL_CPU_S` (a per-piece quantization launch pays
    :data:`CPP_LAUNCH_CPU_S`).

    Examples
    --------
    >>> g = Kernel("fc1.fwd", "gemm", (), (), group=(512.0,) * 16, launches=16)
    >>> q = Kernel("fc1.cast_in", "elementwise", (), (), launches=16)
    >>> extra_launches([g, q]), extra_gemm_launches([g, q])
    (30, 15)
    """
    return sum(k.launches - 1 for k in kernels if k.klass == "gemm")


def launch_cpu_s(extra: int, gemm: int) -> float:
    """Host seconds of ``extra`` launches issued from C++, ``gemm`` of them cuBLASLt GEMM
    calls (:data:`CUBLASLT_CALL_CPU_S`), the rest kernel launches
    (:data:`CPP_LAUNCH_CPU_S`).

    Examples
    --------
    >>> round(launch_cpu_s(30, 15) * 1e6, 6)
    225.0
    """
    return gemm * CUBLASLT_CALL_CPU_S + (extra - gemm) * CPP_LAUNCH_CPU_S


def extra_launch_cpu_s(kernels: Sequence[Kernel]) -> float:
    """Host seconds of the launches of ``kernels`` beyond one per kernel
    (:func:`launch_cpu_s` of :func:`extra_launches` and :func:`extra_gemm_launches`)."""
    return launch_cpu_s(extra_launches(kernels), extra_gemm_launches(kernels))


def _stream_time(cm: ComputeModel, kernels: list[Kernel], cpu_per_op: float, attn_cpu: float
                 ) -> float:
    # The CPU issues kernels while the GPU runs them: a block takes the longer of the two
    # (bound by the GPU when kernels are long, by Python dispatch when they are short).
    return max(_gpu_time(cm, kernels), _cpu_time(kernels, cpu_per_op, attn_cpu))


def in_place_targets(kernels: Sequence[Kernel], held: set[int]) -> set[int]:
    """Ids of the tensors that exist before a kernel sequence creates them, so that a kernel
    writing one writes it in place and allocates nothing (:class:`~sim.workload.kernels.Kernel`
    describes the convention): ``held``, the tensors accounted elsewhere (in a backward, the
    block's saved tensors until autograd frees them: Megatron-Core's cross-entropy turns its
    saved softmax into the gradient in place, ``tensor_parallel/cross_entropy.py``
    ``calculate_gradients``; Transformer Engine's ``element_mul_kernel`` scales the saved
    logits in place), and every tensor the sequence reads before its first write (it was made
    outside the sequence: an accumulator the framework holds, an incoming gradient).

    Examples
    --------
    >>> from sim.workload.kernels import Tensor
    >>> s, g = Tensor("softmax", 4e6), Tensor("g_bf16", 2e6)
    >>> ks = [Kernel("mul_", "elementwise", (s,), (s,)), Kernel("cast", "elementwise", (s,), (g,))]
    >>> in_place_targets(ks, set()) == {id(s)}
    True
    """
    out = set(held)
    written: set[int] = set()
    for k in kernels:
        out.update(id(t) for t in k.reads if id(t) not in written)
        written.update(id(t) for t in k.writes)
    return out


def _transient_parts(kernels: list[Kernel], persistent: set[int],
                     releasable: dict[int, float]) -> tuple[float, ...]:
    """The tensors alive at the peak of bytes alive during a kernel sequence, over those held
    anyway, largest first, trimmed so they add up to the peak (released saved tensors make
    room for the first ones): the separate requests the caching allocator sees
    (:mod:`sim.engine.allocator`); their sum is the transient peak.

    ``persistent``: tensors accounted elsewhere (saved, parameters, block inputs).
    ``releasable``: saved tensors that autograd frees after their last backward read; their
    release lowers the running total.

    Only a write into a tensor that does not exist yet allocates (:func:`in_place_targets`
    says which exist: a kernel writing one of those writes in place).
    """
    last_use: dict[int, int] = {}
    for i, k in enumerate(kernels):
        for t in k.reads + k.writes:
            last_use[id(t)] = i
    existing = in_place_targets(kernels, persistent | releasable.keys())
    live: dict[int, float] = {}
    released = 0.0
    peak = 0.0
    at_peak: list[float] = []
    for i, k in enumerate(kernels):
        for t in k.writes:
            if id(t) not in existing:
                live[id(t)] = t.nbytes
        if sum(live.values()) - released > peak:
            peak = sum(live.values()) - released
            at_peak = sorted(live.values(), reverse=True)
        for t in k.reads + k.writes:
            if last_use.get(id(t)) == i:
                live.pop(id(t), None)
                if id(t) in releasable:
                    released += releasable.pop(id(t))
    parts: list[float] = []
    left = peak
    for size in at_peak:
        if left <= 0:
            break
        parts.append(min(size, left))
        left -= parts[-1]
    return tuple(parts)


def priced_kernels(block: Block, style: Style) -> tuple[list[Kernel], list[Kernel]]:
    """The forward and backward kernels ``style`` runs for ``block``: the block's own, or
    inductor's fused ones when compiled."""
    if not style.compile:
        return block.forward, block.backward
    return (_fuse(block.forward, _needed_outside(block.forward, block), block),
            _fuse(block.backward, _needed_outside(block.backward, block), block))


def gpu_time_by_class(cm: ComputeModel, kernels: Sequence[Kernel]
                      ) -> tuple[float, float, float, float, float]:
    """GPU seconds of ``kernels`` in GEMMs, in fused attention, in fused attention handed a
    mask tensor, in memory-bound kernels reading one tensor into one (copies, casts, unary
    ops) and in the other memory-bound ones: what the step's power draw and so its clock
    depend on (:func:`sim.hardware.power.balanced_sm_clock_mhz`)."""
    gemm = attention = masked = copy = other = 0.0
    for k in kernels:
        t = kernel_time(cm, k)
        if k.klass == "gemm":
            gemm += t
        elif k.klass == "attention" and k.attn_masked:
            masked += t
        elif k.klass == "attention":
            attention += t
        elif len(k.reads) <= 1 and len(k.writes) == 1 and not is_reduction(k):
            copy += t
        else:
            other += t
    return gemm, attention, masked, copy, other


def price_block(block: Block, style: Style, cm: ComputeModel,
                cpu_per_op: tuple[float, float] | None = None) -> BlockCost:
    """Time and memory of a block under a compute model.

    ``cpu_per_op``: (forward, backward) CPU seconds to issue one kernel, when the framework's
    Python costs differ from plain PyTorch eager's.
    """
    fwd, bwd = priced_kernels(block, style)
    if style.compile:
        fwd_cpu = bwd_cpu = COMPILED_OP_CPU_S
    else:
        fwd_cpu, bwd_cpu = cpu_per_op or (EAGER_FWD_OP_CPU_S, EAGER_BWD_OP_CPU_S)
    fwd_s = (_stream_time(cm, fwd, fwd_cpu, cm.attention_cpu_s("fwd"))
             + block.exposed_host_s)
    bwd_s = _stream_time(cm, bwd, bwd_cpu, cm.attention_cpu_s("bwd"))
    # Early stop: recomputation ends once the last saved tensor exists again.
    # Autograd packs an op's saved inputs before its kernel runs, so the kernel after the
    # last one that writes a saved tensor (or weight copy) is already past the stop.
    saved_ids = {id(t) for t in block.saved + block.weight_casts}
    last = max((i for i, k in enumerate(fwd) if any(id(t) in saved_ids for t in k.writes)),
               default=len(fwd) - 1)
    early = _stream_time(cm, fwd[: last + 1], fwd_cpu, cm.attention_cpu_s("fwd"))
    held = saved_ids | {id(t) for t in block.inputs + block.forward_scoped}
    fwd_parts = _transient_parts(fwd, held, {})
    unsaved_parts = _transient_parts(
        fwd, {id(t) for t in block.inputs + block.forward_scoped + block.weight_casts}, {})
    releasable = {id(t): t.nbytes for t in block.saved}
    bwd_parts = _transient_parts(bwd, set(), releasable)
    fwd_peak, unsaved_peak, bwd_peak = sum(fwd_parts), sum(unsaved_parts), sum(bwd_parts)
    late: tuple[float, ...] = ()
    if not style.compile and block.forward_scoped:
        # Eager kernels allocate their outputs in forward order (a compiled graph keeps its
        # own buffers; its loss saves the logits it was given).
        first: dict[int, int] = {}
        for i, k in enumerate(fwd):
            for t in k.writes:
                first.setdefault(id(t), i)
        scoped_at = min(first.get(id(t), len(fwd)) for t in block.forward_scoped)
        late = tuple(t.nbytes for t in block.saved if first.get(id(t), -1) > scoped_at)
    return BlockCost(
        name=block.name,
        fwd_s=fwd_s,
        bwd_s=bwd_s,
        fwd_kernels=len(fwd),
        bwd_kernels=len(bwd),
        flops_fwd=block.flops_fwd,
        flops_bwd=block.flops_bwd,
        saved_bytes=sum(t.nbytes for t in block.saved),
        input_saved_bytes=sum(t.nbytes for t in block.saved
                              if any(t is i for i in block.inputs)),
        input_bytes=sum(t.nbytes for t in block.inputs),
        forward_scoped_bytes=sum(t.nbytes for t in block.forward_scoped),
        weight_cast_bytes=sum(t.nbytes for t in block.weight_casts),
        fwd_transient_bytes=fwd_peak,
        fwd_transient_unsaved_bytes=unsaved_peak,
        bwd_transient_bytes=bwd_peak,
        weight_grad_bytes=sum(t.nbytes for t in block.weight_grads),
        params=block.params,
        early_stop_fwd_s=early,
        fwd_extra_launches=extra_launches(fwd),
        bwd_extra_launches=extra_launches(bwd),
        fwd_extra_gemm_launches=extra_gemm_launches(fwd),
        bwd_extra_gemm_launches=extra_gemm_launches(bwd),
        fwd_gpu_s=_gpu_time(cm, fwd),
        bwd_gpu_s=_gpu_time(cm, bwd),
        fwd_transient_parts=fwd_parts,
        fwd_transient_unsaved_parts=unsaved_parts,
        bwd_transient_parts=bwd_parts,
        saved_parts=tuple(t.nbytes for t in block.saved + block.weight_casts),
        late_saved_parts=late,
    )


@dataclass(frozen=True)
class SacCost:
    """One block under torchtitan's op-level selective activation checkpointing."""

    cached_bytes: float
    """Outputs the policy keeps from the forward (every other matmul, attention)."""
    recompute_s: float
    """Time to re-run the rest of the block's forward before its backward."""
    recompute_flops: float


def op_sac_costs(blocks: Sequence[Block], style: Style, cm: ComputeModel
                 ) -> dict[str, SacCost]:
    """Price the layer's blocks (attention, then MLP, in forward order) under op-level SAC.

    torchtitan (``torchtitan/distributed/activation_checkpoint.py``, ``_apply_op_sac``) wraps
    each transformer layer in a checkpoint whose policy saves the outputs of the ops in its
    save list -- matmuls and scaled-dot-product attention -- except every second matmul
    (``mm_count % 2 == 0`` is recomputed), counting the layer's matmuls in forward order;
    everything else (norms, RoPE, activations, residual adds, the other matmuls) runs again
    in backward from those saved outputs.

    Examples
    --------
    >>> from sim import catalog
    >>> from sim.hardware.compute import ComputeModel
    >>> from sim.workload.layer_ops import model_blocks
    >>> from sim.workload.model import ModelSpec
    >>> m = ModelSpec.from_ref("llama3-8b")
    >>> st = Style("bf16")
    >>> cm = ComputeModel(catalog.gpu("h100-sxm"), "bf16")
    >>> _, attn, mlp, _ = model_blocks(m, st, 1, 8192, False)
    >>> sac = op_sac_costs((attn, mlp), st, cm)
    >>> # saved: q (mm 1), v (mm 3), attention out + logsumexp; gate (mm 5), down (mm 7)
    >>> round(sac["mlp"].cached_bytes / (8192 * 2))   # gate (14336) + down (4096) wide
    18432
    """
    out: dict[str, SacCost] = {}
    mm = 0
    fwd_cpu = COMPILED_OP_CPU_S if style.compile else EAGER_FWD_OP_CPU_S
    for block in blocks:
        cached = 0.0
        rerun: list[Kernel] = []
        for k in block.forward:
            if k.klass == "gemm":
                mm += 1
                if mm % 2 == 1:
                    cached += sum(t.nbytes for t in k.writes)
                    continue
            elif k.klass == "attention":
                cached += sum(t.nbytes for t in k.writes)
                continue
            rerun.append(k)
        if style.compile:
            rerun = _fuse(rerun, _needed_outside(rerun, block), block)
        out[block.name] = SacCost(
            cached_bytes=cached,
            recompute_s=_stream_time(cm, rerun, fwd_cpu, cm.attention_cpu_s("fwd")),
            recompute_flops=sum(k.flops for k in rerun))
    return out

