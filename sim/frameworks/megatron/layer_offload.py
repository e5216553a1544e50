"""Megatron-Core's layer-level activation CPU offloading (``cpu_offloading`` with
``cpu_offloading_num_layers``, activations only), as NVIDIA's GB200 Llama 3 70B and 405B
recipes run it beside Megatron-FSDP.

Source: Megatron-Core ``TransformerBlock`` (``get_cpu_offload_context`` around each layer's
forward) over Transformer Engine's ``cpu_offload.py`` (``AsyncDoubleBufferGroupOffloadHandler``,
one group a layer); Megatron-Bridge ``scripts/performance/utils/helpers.py``
``set_recompute_overrides`` at a28844195 (``cpu_offloading`` on, ``cpu_offloading_weights``
off, ``cpu_offloading_num_layers`` from the perf matrix); Megatron-Core's
``TransformerConfig`` refuses it beside pipeline parallelism and recomputation.

* **Forward**: when an offloaded layer's forward ends, the D2H stream waits for the compute
  stream and copies the tensors the layer saved for its backward to pinned host memory; their
  GPU memory is released when the copy ends. The compute stream waits for that copy at the
  end of the next layer's forward (the double buffer: at most one layer's copy in flight
  beside the compute).
* **Backward**: each offloaded layer's tensors are copied back on the H2D stream when the
  backward of the layer above it begins (one layer prefetched), and the layer's backward
  waits for them.
* The first ``cpu_offloading_num_layers`` layers of the model are offloaded; the rest keep
  their activations (TE needs at least the last one on the GPU).

A layer's saved activations are the allocation its forward makes (the attention op's), freed
and allocated again whole. The host calls of the hooks are priced as the fine-grained
offloading's per group and per tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sim.frameworks.common.base import JobContext
from sim.frameworks.megatron.activation_offload import (
    D2H_STREAM,
    GROUP_CALLS,
    H2D_STREAM,
    TENSOR_CALLS_D2H,
    TENSOR_CALLS_H2D,
)
from sim.hardware.compute import EAGER_FWD_OP_CPU_S
from sim.program.ir import Op

if TYPE_CHECKING:
    from sim.frameworks.megatron.shape import MegatronShape
    from sim.frameworks.megatron.unit_ops import UnitOps
    from sim.scenario import MegatronOptions

KEY = "framework.cpu_offloading_num_layers"


def check_layer_offload(ctx: JobContext, opts: MegatronOptions) -> None:
    """Refuse, by key, what Megatron-Core refuses beside CPU offloading and what this model
    of it does not cover."""
    n = opts.cpu_offloading_num_layers
    if n == 0:
        return
    par = ctx.scenario.parallelism
    ctx.require(par.pp == 1, KEY, "Megatron-Core refuses CPU offloading with pipeline "
                "parallelism")
    ctx.require(n < ctx.model.layers, KEY,
                f"at most {ctx.model.layers - 1} of the model's {ctx.model.layers} layers "
                "(Transformer Engine keeps the last one on the GPU)")
    ctx.require(ctx.scenario.training.activation_checkpointing == "none"
                and not opts.recompute_modules, KEY,
                "Megatron-Core refuses CPU offloading with activation recomputation")
    ctx.require(ctx.model.moe is None and ctx.model.mla is None and ctx.model.mtp_layers == 0,
                KEY, "layer offloading is modelled for dense layers only")
    ctx.require(not opts.fine_grained_activation_offloading, KEY,
                "one activation offloading at a time")
    ctx.require(not opts.delay_wgrad_compute and opts.cuda_graph_impl == "none", KEY,
                "layer offloading is modelled without delayed weight gradients and CUDA graphs")


def _layer_bytes(op: Op) -> float:
    held = [b for cat, b in op.alloc if cat == "activations"]
    assert len(held) == 1, op.name
    return held[0]


def add_layer_offload(s: MegatronShape, units: dict[tuple[str, int, int], UnitOps],
                      launch_after: dict[int, list[Op]], insert_before: dict[int, list[Op]]
                      ) -> list[Op]:
    """Every micro-batch's D2H copies and reloads of the offloaded layers, hooked into the
    single stage's units (module doc); returns them."""
    n = s.opts.cpu_offloading_num_layers
    layers = s.chunks[0]
    tensors = sum(len(s.blocks[k].saved) for k in ("attn_pre", "attn_main", "mlp_pre",
                                                    "mlp_main") if k in s.blocks)
    out: list[Op] = []
    for mb in range(s.chunk_micro_batches):
        f_unit, b_unit = units[("F", 0, mb)], units[("B", 0, mb)]
        f_pos, b_pos = f_unit.positions(), b_unit.positions()
        f_first = [f_unit.part_op[la] for la in layers] + [f_unit.part_op["head"]]
        b_last: dict[int | str, Op] = {la: b_unit.part_op[la] for la in layers}
        b_last["head"] = b_unit.part_op["head"]
        for i, layer in enumerate(layers[:n]):
            nbytes = _layer_bytes(f_first[i])
            end = f_unit.neighbour(f_first[i + 1], -1, f_pos)   # the layer's last op
            d2h = Op(name=f"cpu offload L{layer} mb{mb}", kind="copy", stream=D2H_STREAM,
                     phase="fwd", deps=[end], host_transfer="d2h", nbytes=nbytes,
                     category="copy", micro_batch=mb, layer=layer, kernels=0,
                     cpu_s=(GROUP_CALLS + TENSOR_CALLS_D2H * tensors) * EAGER_FWD_OP_CPU_S,
                     free=(("activations", nbytes),))
            launch_after.setdefault(id(end), []).append(d2h)
            # The next layer's forward ends waiting for this copy (the double buffer).
            waiter = f_first[i + 2]
            waiter.deps = [*waiter.deps, d2h]
            # Backward: reloaded when the layer above starts its backward.
            above = layers[i + 1]
            above_prev: int | str = layers[i + 2] if i + 2 < len(layers) else "head"
            issue_at = b_unit.neighbour(b_last[above_prev], 1, b_pos)
            mine = b_unit.neighbour(b_last[above], 1, b_pos)
            # The H2D stream waits for the compute stream to reach that point.
            h2d = Op(name=f"cpu reload L{layer} mb{mb}", kind="copy", stream=H2D_STREAM,
                     phase="bwd", deps=[d2h, b_last[above_prev]], host_transfer="h2d",
                     nbytes=nbytes,
                     category="copy", micro_batch=mb, layer=layer, kernels=0,
                     cpu_s=(GROUP_CALLS + TENSOR_CALLS_H2D * tensors) * EAGER_FWD_OP_CPU_S,
                     alloc=(("activations", nbytes),))
            insert_before.setdefault(id(issue_at), []).append(h2d)
            mine.deps = [*mine.deps, h2d]
            out += [d2h, h2d]
    return out


