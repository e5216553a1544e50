"""torchtitan's memory as its train loop allocates it (issue 11, item 7): closed forms for the
allocations the published Grand Teton rows showed missing."""

from __future__ import annotations

import pytest
from conftest import make_scenario

from sim import catalog
from sim.api import simulate
from sim.frameworks.fsdp2.tp import titan_blocks
from sim.hardware.compute import ComputeModel
from sim.workload.layer_ops import FP32, Style, head_block, price_block
from sim.workload.model import ModelSpec

M = ModelSpec.from_ref("llama3-8b")
CM = ComputeModel(catalog.gpu("h100-sxm"), "bf16")

# Llama 3 8B under torchtitan's FSDP2 on one Grand Teton node (8 x H100): the base the
# whole-run tests below override.
GT_8B: dict = {
    "name": "t", "model": "llama3-8b",
    "cluster": {"topology": "meta-grand-teton", "nodes": 1},
    "framework": {"name": "fsdp2"},
    "training": {"seq_len": 2048, "micro_batch_size": 1, "global_batch_size": 8,
                 "precision": "bf16", "activation_checkpointing": "full"}}


def test_eager_loss_buffers_closed_form() -> None:
    """torchtitan 9dec370 train.py: ``cross_entropy(pred.flatten(0, 1).float(), labels)``
    uncompiled. log_softmax's fp32 output (tokens x vocab x 4 B) is saved; its backward holds
    nll_loss's zero-filled fp32 gradient and log_softmax's fp32 gradient at once."""
    tokens = 2 * 8192
    n = tokens * M.vocab
    eager = Style("bf16")
    c = price_block(head_block(M, eager, 2, 8192), eager, CM)
    assert max(c.saved_parts) == n * FP32
    assert c.bwd_transient_bytes == 2 * n * FP32
    # The compiled loss fuses them away: the eager head must be priced apart.
    comp = Style("bf16", compile=True)
    assert price_block(head_block(M, comp, 2, 8192), comp, CM).bwd_transient_bytes < n * FP32


def test_titan_blocks_eager_head_only() -> None:
    """compile_loss false keeps the blocks compiled and the head eager (apply_compile wraps
    model.layers only)."""
    comp = Style("bf16", compile=True)
    a = titan_blocks(M, comp, CM, 1, 65536, 1, 2, "allgather")
    b = titan_blocks(M, comp, CM, 1, 65536, 1, 2, "allgather", eager_head=True)
    n = 32768 * M.vocab
    assert b.cost["head_main"].bwd_transient_bytes == 2 * n * FP32
    assert a.cost["head_main"].bwd_transient_bytes < n * FP32
    assert a.cost["mlp_main"].fwd_s == b.cost["mlp_main"].fwd_s


def _run(**fw: object) -> dict:
    sc = make_scenario(GT_8B, framework={"name": "fsdp2", "compile": True, **fw},
                       training__seq_len=8192)
    return simulate(sc).summary


def test_uncompiled_loss_raises_peak_by_its_buffers() -> None:
    """At the start of backward the eager loss holds log_softmax + both fp32 gradients
    (3 x tokens x vocab x 4 B); the compiled one (fused, nothing beyond what it saves) far
    less: the allocated peak rises by more than one such buffer (8192 tokens: 3.9 GiB) and
    by no more than three plus slack."""
    n = 8192 * M.vocab * FP32 / 2**30
    lo, hi = _run()["peak_memory_gib"], _run(compile_loss=False)["peak_memory_gib"]
    assert hi - lo > 1.5 * n
    assert hi - lo < 3 * n + 4.0


def test_eager_loss_allocations_in_forward_order() -> None:
    """The eager loss reaches the allocator as PyTorch creates the tensors: bf16 logits
    (tokens x vocab x 2 B), their fp32 copy (x 4 B, freed when the forward returns), then
    log_softmax's saved fp32 output (x 4 B) on top."""
    from sim.frameworks.common.steps import ordered_forward_allocs

    n = 8192 * M.vocab
    eager = Style("bf16")
    ordered = ordered_forward_allocs(price_block(head_block(M, eager, 1, 8192), eager, CM))
    assert ordered is not None
    alloc, free = ordered
    assert alloc[-3:] == (("buffers", 2.0 * n), ("buffers", 4.0 * n), ("activations", 4.0 * n))
    assert free == (("buffers", 4.0 * n),)
    comp = Style("bf16", compile=True)
    assert ordered_forward_allocs(price_block(head_block(M, comp, 1, 8192), comp, CM)) is None


def test_freed_logits_leave_a_hole_below_log_softmax() -> None:
    """``del pred`` (torchtitan train.py) and the dead fp32 copy free 1.5 x L below the saved
    log_softmax output (L = tokens x vocab x 4 B); backward's nll gradient (L) fills it and
    log_softmax's gradient (L) grows the expandable segment: at the backward's peak the
    allocator reserves L / 2 more than is allocated (up to its 2 MiB page rounding)."""
    from sim.engine.allocator import CachingAllocator, TensorLedger
    from sim.frameworks.common.steps import ordered_forward_allocs

    eager = Style("bf16")
    c = price_block(head_block(M, eager, 1, 8192), eager, CM)
    ordered = ordered_forward_allocs(c)
    assert ordered is not None
    ledger = TensorLedger(CachingAllocator(expandable_segments=True))
    for cat, nbytes in ordered[0]:
        ledger.alloc(cat, nbytes)
    for cat, nbytes in ordered[1] + (("buffers", c.forward_scoped_bytes),):
        ledger.free(cat, nbytes)
    for part in c.bwd_transient_parts:
        ledger.alloc("buffers", part)
    a = ledger.allocator
    half = 8192 * M.vocab * FP32 / 2
    assert half <= a.reserved - a.allocated <= half + 2 * 2**20
    # In a whole step other blocks fill part of that hole: the reserved-allocated gap grows
    # by a positive amount no larger than it.
    g_comp, g_eager = (s["peak_reserved_gib"] - s["peak_memory_gib"]
                       for s in (_run(), _run(compile_loss=False)))
    assert 0 < g_eager - g_comp <= half / 2**30 + 0.01


def test_loss_parallel_buffers_closed_form() -> None:
    """torch loss_parallel, eager (torch/distributed/tensor/parallel/loss.py), on this rank's
    vocabulary shard, L = tokens x vocab/tp x 4 B: forward holds the fp32 copy, ``shifted``
    and the saved output at once (3 L besides the bf16 logits); ``nll_loss_backward`` holds
    ``zeros_like(x)``, ``exp(x)`` / their sum and the product beside the saved output (4 L)."""
    m70 = ModelSpec.from_ref("llama3-70b")
    comp = Style("bf16", compile=True)
    tb = titan_blocks(m70, comp, CM, 2, 8192, 8, 1, "allgather", eager_head=True)
    c = tb.cost["head_main"]
    big = 2 * 8192 * (m70.vocab // 8) * FP32
    assert c.late_saved_parts == (big,)
    assert sorted(c.fwd_transient_parts) == [big, big]
    assert sorted(c.bwd_transient_parts) == [big, big, big]


def test_foreach_adamw_sqrt_temporary() -> None:
    """torch's _multi_tensor_adamw holds exp_avg_sq.sqrt() for every local parameter (fp32)
    during the step; the fused kernel holds nothing. 8B over 8 ranks: 4 B x params / 8."""
    def opt(optimizer: str) -> float:
        sc = make_scenario(GT_8B, training__optimizer=optimizer)
        ops = simulate(sc).program.ops
        return next(o.transient for o in ops if o.name.startswith("optimizer step"))

    assert opt("adamw_fused") == 0.0
    assert opt("adamw_foreach") == FP32 * M.total_params / 8


def test_reduce_scatter_input_held_until_next_post_backward() -> None:
    """foreach_reduce allocates the fp32 reduce-scatter input (unit parameters x 4 B) on the
    compute stream and returns it in ReduceScatterState: it is released when the next
    unit's post_backward (or finalize_backward) waits for the collective, not when the
    collective ends. One drop per reduce-scatter, each freeing the previous unit's input."""
    sc = make_scenario(GT_8B)
    ops = simulate(sc).program.ops
    rs = [o for o in ops if o.collective == "reduce_scatter"]
    drops = [o for o in ops if o.name.startswith("wait reduce-scatter")]
    assert rs and len(drops) == len(rs)
    assert all(not o.free for o in rs)
    for r, d in zip(rs, drops, strict=True):
        assert d.deps == [r] and d.free == (("buffers", r.nbytes),)
    # wq, wo (4096 x 4096); wk, wv (4096 x 1024, GQA); w1, w2, w3; two norms
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert any(r.nbytes == FP32 * layer for r in rs)


def test_compile_loss_without_compile_is_refused() -> None:
    import pytest

    from sim.api import simulate as sim_

    sc = make_scenario(GT_8B, framework__compile_loss=True,
                       training={"seq_len": 2048, "micro_batch_size": 1, "global_batch_size": 8})
    with pytest.raises(Exception, match="compile_loss"):
        sim_(sc)


@pytest.mark.parametrize(("tp", "compile_"), [(8, False), (8, True), (1, False)])
def test_tp_head_output_gradient_is_the_losses(tp: int, compile_: bool) -> None:
    """The output layer's input-gradient and weight-gradient GEMMs read the very
    [tokens, vocabulary shard] bf16 gradient the loss's backward writes (autograd hands the
    loss's grad_input to the linear's backward), as ``layer_ops.head_block`` links it: one
    tensor live across both GEMMs, not a second one that nothing writes."""
    style = Style("bf16", compile=compile_)
    tb = titan_blocks(M, style, CM, 1, 8192, tp, 1, "allgather", eager_head=True)
    block = tb.seg["head_main"]
    written = {id(t) for k in block.backward for t in k.writes}
    gemms = [k for k in block.backward if k.name in ("output.dgrad", "output.wgrad")]
    assert len(gemms) == 2
    for k in gemms:
        grads = [t for t in k.reads if t.nbytes == 8192 * (M.vocab // tp) * 2]
        assert grads and all(id(t) in written for t in grads), k.name
