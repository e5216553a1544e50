"""torchtitan's AsyncTP (``parallelism.enable_async_tensor_parallel``): the layers'
tensor-parallel all-gathers and reduce-scatters micro-pipelined with the matmuls next to them.

torchtitan turns it on with ``torch._inductor.config._micro_pipeline_tp = True`` and
``enable_symm_mem_for_group`` on the TP group (``maybe_enable_async_tp``; it raises "Async TP
requires torch.compile" without compile). Inductor's post-grad pass
(``torch/_inductor/fx_passes/micro_pipeline_tp.py``) then rewrites, in every compiled graph
(forward, and backward with its recomputation):

* an all-gather whose output feeds matmuls (``_find_consumer_matmuls``: ``mm`` on the gathered
  tensor) into ``symm_mem.fused_all_gather_matmul``: here the gathered norm output before
  ``wq/wk/wv`` and ``w1/w3`` (one fused op with several ``Bs``), and in backward the gathered
  output gradient before ``wo``'s and ``w2``'s dgrad (their wgrad reads it transposed and
  stays a plain matmul on the gathered tensor);
* a reduce-scatter whose input a matmul produces (``_find_producer_matmul``) into
  ``symm_mem.fused_matmul_reduce_scatter``: forward ``wo`` and ``w2``. The backward
  reduce-scatters (of the norm input's gradient) take the *sum* of the colwise linears'
  dgrads, not a matmul, and stay NCCL collectives, as do the embedding's and the output
  layer's (outside the compiled blocks). Under op-level SAC the re-gathers before a layer's
  backward are fused with the matmuls that run again (:func:`sac_spans`).

How torch runs them (``torch/distributed/_symmetric_memory/__init__.py``):

* ``_pipelined_multi_all_gather_and_consume``: the local shard is copied into the symmetric
  p2p buffer ("mv") and a barrier passes; the matmul runs on the local shard first while
  step 1's copy of a peer's shard (``copy_`` from the peer's buffer: a copy engine over NVLink)
  runs on the backend stream; each step's chunk matmul waits for its copy. With ``n`` ranks,
  copies of ``p`` seconds each and chunk matmuls of ``c`` the op ends after
  ``max((n-1) c, (n-1) p) + c``: nothing of the exchange is exposed when ``p <= c``.
* ``_pipelined_produce_and_all2all``: for steps 1..n-1 the chunk destined to peer ``r+s`` is
  produced into a p2p buffer, then pulled by that peer (copies serialised, double-buffered);
  the local chunk is produced last, then ``reduce_partials`` sums the n partials. The op ends
  after ``c + max((n-1) c, (n-1) p)`` plus the reduction: what stays exposed is the first
  chunk's latency and the final sum.

Here each fused exchange is one op on its own stream (:data:`ASYNC_STREAM`), the matmuls are
split where those closed forms put the boundaries (the head chunks beside the exchange, the
rest after it), and the chunked GEMMs are priced at their chunk shape (``tokens / n`` rows:
the quantisation loss torch's comments mention). The all-gather's bytes are NCCL's
all-gather's; the matmul-reduce-scatter moves unreduced bf16 partials, an all-to-all of the
whole output (``nbytes / n`` to each peer). Both are priced as NCCL collectives on the
fabric (symmetric-memory copies use the copy engines, not SMs: the SM share they are charged
is an approximation on the pessimistic side).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sim.hardware.compute import ComputeModel
from sim.program.ir import Op
from sim.workload.block_pricing import kernel_time
from sim.workload.layer_ops import BF16, Block

ASYNC_STREAM = "tp-async"
"""The stream the fused exchanges run on (torch's ``_get_backend_stream``)."""

AG_GEMMS = {"attn_main": ("wq", "wk", "wv"), "attn_qkv": ("wq", "wk", "wv"),
            "mlp_main": ("w1", "w3")}
"""Forward: the matmuls fused with the all-gather before them, by segment."""
RS_GEMMS = {"attn_main": "wo", "attn_o": "wo", "mlp_main": "w2"}
"""Forward: the matmul fused with the reduce-scatter after it; backward: the matmul whose
dgrad is fused with the all-gather of its output gradient, by segment."""


@dataclass(frozen=True)
class Span:
    """Where a fused matmul sits in a segment's kernels: seconds before it, its seconds
    unfused (``whole_s``) and as ``n`` row chunks (``chunked_s``), seconds after it."""

    before_s: float
    whole_s: float
    chunked_s: float
    after_s: float
    local_s: float = 0.0
    """Of ``before_s``, kernels on this rank's shard that the exchange sends (float8 TP's
    cast of the local output gradient, ``*_local``): they run before the copy-in."""


def chunked_gemm_s(cm: ComputeModel, gemm: tuple[float, float, float, str], fp8: bool,
                   n: int) -> float:
    """Seconds of ``n`` GEMMs of ``tokens / n`` rows each (one per rank's shard)."""
    m, k, nn, pass_ = gemm
    return n * cm.gemm_time(m / n, k, nn, pass_, fp8=fp8)  # type: ignore[arg-type]


def span(block: Block, cm: ComputeModel, names: tuple[str, ...], backward: bool, n: int
         ) -> Span:
    """The :class:`Span` of the matmuls ``names`` (e.g. ``wq.fwd``) in ``block``'s forward
    or backward kernels (unfused: the GEMMs are what compile leaves alone)."""
    ks = block.backward if backward else block.forward
    idx = [i for i, k in enumerate(ks) if k.name in names]
    if not idx:
        raise ValueError(f"{block.name}: no {names} to fuse")
    ts = [kernel_time(cm, k) for k in ks]
    chunked = 0.0
    for i in idx:
        g = ks[i].gemm
        assert g is not None
        chunked += chunked_gemm_s(cm, g, ks[i].fp8, n)
    return Span(before_s=sum(ts[:idx[0]]), whole_s=sum(ts[i] for i in idx),
                chunked_s=chunked, after_s=sum(ts[idx[-1] + 1:]),
                local_s=sum(ts[i] for i in range(idx[0]) if ks[i].name.endswith("_local")))


def spans(segs: dict[str, Block], cm: ComputeModel, n: int
          ) -> dict[tuple[str, str, bool], Span]:
    """Every fused matmul's :class:`Span`, keyed ``(segment, "ag" | "rs", backward)``."""
    out: dict[tuple[str, str, bool], Span] = {}
    for key, ws in AG_GEMMS.items():
        if key in segs:
            out[(key, "ag", False)] = span(segs[key], cm, tuple(f"{w}.fwd" for w in ws),
                                           False, n)
    for key, w in RS_GEMMS.items():
        if key in segs:
            out[(key, "rs", False)] = span(segs[key], cm, (f"{w}.fwd",), False, n)
            out[(key, "ag", True)] = span(segs[key], cm, (f"{w}.dgrad",), True, n)
    return out


def sac_spans(segs: dict[str, Block], order: list[str], cm: ComputeModel, n: int
              ) -> dict[str, Span]:
    """Op-level SAC re-runs every second matmul of a layer (counted in forward order over
    its segments but the ring steps, as :func:`sim.workload.layer_ops.op_sac_costs` counts
    them): where a re-run matmul reads a re-gathered input (``wk`` of wq/wk/wv, ``w3`` of
    w1/w3) Inductor fuses the all-gather with it in the backward graph. The :class:`Span`
    of those matmuls in each consumer segment's re-run kernels, by segment."""
    out: dict[str, Span] = {}
    mm = 0
    for key in order:
        if key.startswith("attn_ring"):
            continue
        rerun = []
        for k in segs[key].forward:
            if k.klass == "gemm":
                mm += 1
                if mm % 2 == 1:
                    continue
            elif k.klass == "attention":
                continue
            rerun.append(k)
        fused = tuple(f"{w}.fwd" for w in AG_GEMMS.get(key, ()))
        names = tuple(k.name for k in rerun if k.name in fused)
        if names:
            out[key] = span(Block(key, forward=rerun), cm, names, False, n)
    return out


def _cut(op: Op, seconds: float) -> float:
    """Take ``seconds`` off ``op``; return the share of its hardware FLOPs that goes too."""
    share = seconds / op.duration if op.duration > 0 else 0.0
    flops = op.hw_flops * share
    op.duration -= seconds
    op.hw_flops -= flops
    return flops


def _like(op: Op, name: str, duration: float, hw_flops: float = 0.0) -> Op:
    return Op(name=name, kind="compute", stream=op.stream, phase=op.phase, duration=duration,
              layer=op.layer, micro_batch=op.micro_batch, hw_flops=hw_flops,
              category=op.category)


def fuse_all_gather(gather: Op, main: Op, sp: Span, n: int, shard_bytes: float,
                    cm: ComputeModel) -> list[Op]:
    """``fused_all_gather_matmul``: ``main`` (a segment whose fused matmuls follow
    ``sp.before_s`` of other kernels) consumes the all-gather ``gather``. Returns the ops
    that replace ``[gather, main]``: the copy of the local shard into the p2p buffer, the
    exchange on :data:`ASYNC_STREAM`, the kernels before the matmuls with the first
    ``n - 1`` chunks (beside the exchange), and ``main`` with the last chunk and the rest,
    which waits for the exchange; kernels on the local shard that the exchange sends
    (``sp.local_s``) run with the copy-in, before it. ``main`` keeps its frees and its
    transient memory; the head takes its allocation and host time."""
    main.duration = max(0.0, main.duration + sp.chunked_s - sp.whole_s)
    local_s = min(main.duration, sp.local_s)
    mv = _like(main, f"{main.name} (symm-mem copy-in)",
               cm.membound_time(2.0 * shard_bytes) + local_s)
    mv.hw_flops = _cut(main, local_s)
    head_s = min(main.duration, sp.before_s - local_s + sp.chunked_s * (n - 1) / n)
    head = _like(main, f"{main.name} (async-TP chunks)", head_s)
    head.hw_flops = _cut(main, head_s)
    head.alloc, main.alloc = main.alloc, ()
    head.cpu_s, main.cpu_s = main.cpu_s, 0.0
    head.deps, main.deps = list(main.deps), [gather]
    gather.stream = ASYNC_STREAM
    gather.deps = [mv]
    return [mv, gather, head, main]


def fuse_reduce_scatter(main: Op, scatter: Op, sp: Span, n: int, out_bytes: float,
                        exchange: Callable[[float], Op], cm: ComputeModel) -> list[Op]:
    """``fused_matmul_reduce_scatter``: ``main`` ends with the matmul (``sp``) whose output
    ``scatter`` reduce-scatters. Returns the ops that replace ``[main, scatter]``: ``main``
    up to the first chunk, the exchange of the ``n - 1`` remote partials (an all-to-all of
    the ``out_bytes`` output, built by ``exchange``) beside the other chunks, the sum of the
    partials once the exchange is in, and the kernels after the matmul. The scatter's
    allocation (a saved output under SAC) goes to the sum; ``main``'s frees to the last op."""
    main.duration = max(0.0, main.duration + sp.chunked_s - sp.whole_s)
    rest_s = min(main.duration, sp.chunked_s * (n - 1) / n + sp.after_s)
    after_s = min(sp.after_s, rest_s)
    chunks = _like(main, f"{main.name} (async-TP chunks)", rest_s - after_s)
    chunks.hw_flops = _cut(main, rest_s - after_s)
    after_flops = _cut(main, after_s)
    a2a = exchange(out_bytes)
    a2a.stream = ASYNC_STREAM
    a2a.deps = [main]
    a2a.category = "reduce_scatter"
    # reduce_partials: read the n partials of this rank's rows, write the sum (bf16).
    total = _like(main, f"{main.name} (sum of partials)",
                  cm.membound_time(out_bytes + out_bytes / n))
    total.deps = [a2a]
    total.alloc = scatter.alloc
    ops = [main, a2a, chunks, total]
    last = total
    if after_s > 0:
        last = _like(main, f"{main.name} (after reduce-scatter)", after_s, after_flops)
        ops.append(last)
    else:
        main.hw_flops += after_flops
    last.free, main.free = main.free, ()
    return ops


class AsyncTp:
    """Rewrites the ops of one block of :class:`~sim.frameworks.fsdp2.tp_pass.TitanPass` the
    way Inductor's micro-pipeline pass rewrites the compiled graph (see the module doc).

    ``tags`` maps ``id(op)`` to ``("seg", key)`` for a segment's compute op or
    ``("ag" | "rs", what)`` for a fusable layer collective (attention, dense MLP)."""

    def __init__(self, segs: dict[str, Block], cm: ComputeModel, tp: int, tokens: int,
                 hidden: int, exchange: Callable[[float, Op], Op],
                 sac_order: list[str] | None = None) -> None:
        self.n = tp
        self.cm = cm
        self.spans = spans(segs, cm, tp)
        self.sac_spans = sac_spans(segs, sac_order, cm, tp) if sac_order else {}
        """Under op-level SAC (``sac_order``: the layer's segments), the re-run matmuls
        fused with the re-gathers (:func:`sac_spans`)."""
        self.out_bytes = float(tokens * hidden * BF16)
        self.exchange = exchange
        """(bytes, reduce-scatter it replaces) -> the all-to-all of the partials."""

    def fuse_recompute(self, ops: list[Op], tags: dict[int, tuple[str, str]]) -> list[Op]:
        """SAC's re-run of a layer: each re-gather ``("ag", what)`` followed by its
        segment's re-run ``("seg", key)`` becomes a fused all-gather-matmul."""
        out: list[Op] = []
        i = 0
        while i < len(ops):
            op, nxt = ops[i], ops[i + 1] if i + 1 < len(ops) else None
            sp = self.sac_spans.get(tags.get(id(nxt), ("", ""))[1]) if nxt is not None \
                else None
            if tags.get(id(op), ("", ""))[0] == "ag" and nxt is not None and sp is not None:
                out += fuse_all_gather(op, nxt, sp, self.n, op.nbytes / self.n, self.cm)
                i += 2
                continue
            out.append(op)
            i += 1
        return out

    def fuse(self, ops: list[Op], tags: dict[int, tuple[str, str]], backward: bool
             ) -> list[Op]:
        out: list[Op] = []
        i = 0
        while i < len(ops):
            op = ops[i]
            role = tags.get(id(op), ("", ""))[0]
            nxt = ops[i + 1] if i + 1 < len(ops) else None
            key = tags.get(id(nxt), ("", ""))[1] if nxt is not None else ""
            sp = self.spans.get((key, "ag", backward))
            if role == "ag" and out and nxt is not None and sp is not None:
                shard = op.nbytes / self.n
                out += fuse_all_gather(op, nxt, sp, self.n, shard, self.cm)
                i += 2
                continue
            if role == "rs" and not backward and out:
                prev_key = tags.get(id(out[-1]), ("", ""))[1]
                sp = self.spans.get((prev_key, "rs", False))
                if sp is not None:
                    main = out.pop()

                    def exchange(nbytes: float, rs: Op = op) -> Op:
                        return self.exchange(nbytes, rs)
                    out += fuse_reduce_scatter(main, op, sp, self.n, self.out_bytes, exchange,
                                               self.cm)
                    i += 1
                    continue
            out.append(op)
            i += 1
        return out
