"""torchao's float8 tensor-parallel plans as torchtitan applies them (used by
:mod:`sim.frameworks.fsdp2.tp`).

With float8 linears (tensorwise scaling) and tensor parallelism, torchtitan's ``apply_tp``
(``torchtitan/models/llama3/infra/parallelize.py``; ``parallelize_llama.py`` in 2024-12)
replaces the plan's styles by torchao's (``torchao/float8/float8_tensor_parallel.py``):

* ``PrepareFloat8ModuleInput`` on ``attention`` and ``feed_forward``: the sequence-sharded
  norm output is cast to float8 (e4m3, dynamic tensorwise scale: a local amax, all-reduced)
  on this rank's tokens *before* it is all-gathered, so the all-gather carries one byte per
  element and the colwise linears (``wq/wk/wv``, ``w1/w3``; ``Float8ColwiseParallel``) get
  an input already in float8: ``Float8Linear`` casts no input, and its backward reuses the
  saved float8 input (transposed for the weight-gradient GEMM) instead of casting the bf16
  input again.
* ``Float8RowwiseParallel`` (``wo``, ``w2``): the input is local and cast as any
  ``Float8Linear`` does; the output is reduce-scattered in bf16. Its ``_prepare_output_fn``
  wraps the output in ``NoopFwToFloat8BwDynamic`` after the redistribute, so in backward the
  output gradient is cast to float8 (e5m2) on the local tokens *before* the all-gather that
  is the reduce-scatter's backward: that all-gather carries one byte per element and the
  linear gets its gradient already in float8 (only the transposed copy for the weight
  gradient remains).
* The output layer stays bf16 (torchtitan's converter skips it), so the head's all-gather
  and the embedding's reduce-scatter stay bf16, as do every reduce-scatter of activations
  and input gradients.
"""

from __future__ import annotations

from dataclasses import replace

from sim.workload.layer_ops import BF16, Kernel, Style, Tensor, _Builder

FP8 = 1
COLWISE = frozenset({"wq", "wk", "wv", "w1", "w3"})
"""torchtitan's colwise linears: their input is the all-gathered (float8) module input."""
ROWWISE = frozenset({"wo", "w2"})
"""torchtitan's rowwise linears: their output gradient arrives all-gathered in float8."""


def tp_all_gather_bytes_per_element(fp8_tp: bool, what: str) -> int:
    """Bytes per element of a tensor-parallel all-gather of a layer (``attn``/``mlp``: the
    module input in forward and recompute, the rowwise output's gradient in backward) or
    of the head/embedding (always bf16)."""
    return FP8 if fp8_tp and what in ("attn", "mlp") else BF16


class Float8TpBuilder(_Builder):
    """A segment builder whose float8 linears follow torchao's float8 TP styles (see the
    module docstring): colwise linears take a float8 input, rowwise ones a float8 output
    gradient; ``local_tokens`` (tokens / tp) is where the rowwise gradient cast runs."""

    def __init__(self, name: str, style: Style, local_tokens: float) -> None:
        super().__init__(name, style)
        self.local_tokens = local_tokens

    def float8_linear(self, x: Tensor, tokens: float, n_in: int, n_out: int, name: str,
                      bias: bool = False) -> Tensor:
        y = super().float8_linear(x, tokens, n_in, n_out, name, bias)
        bwd = self._bwd_ops[-1]
        by_name = {k.name: k for k in bwd}
        if name in COLWISE:
            fwd = self.block.forward
            gemm_i = next(i for i, k in enumerate(fwd) if k.name == f"{name}.fwd")
            fwd[gemm_i] = replace(fwd[gemm_i], reads=(x, *fwd[gemm_i].reads[1:]))
            fwd[:] = [k for k in fwd if k.name not in (f"{name}.amax_in", f"{name}.cast_in")]
            x8b = by_name[f"{name}.cast_in_bwd"].writes[0]
            trans = Kernel(f"{name}.in_fp8_t", "elementwise", (x,), (x8b,))
            bwd[:] = [trans if k.name == f"{name}.cast_in_bwd" else k for k in bwd
                      if k.name != f"{name}.amax_in_bwd"]
        elif name in ROWWISE:
            g8a = by_name[f"{name}.cast_g"].writes[0]
            g8b = by_name[f"{name}.cast_g_t"].writes[0]
            g_loc = self.t(f"{name}.g_out_local", self.local_tokens * n_out, BF16)
            g_loc8 = self.t(f"{name}.g_out_local_fp8", self.local_tokens * n_out, FP8)
            # NoopFwToFloat8BwDynamic: amax and cast of the local gradient (before the
            # all-gather, which the segment sees as its float8 input g8a).
            pre = [Kernel(f"{name}.amax_g_local", "elementwise", (g_loc,), ()),
                   Kernel(f"{name}.cast_g_local", "elementwise", (g_loc,), (g_loc8,))]
            trans = Kernel(f"{name}.g_out_fp8_t", "elementwise", (g8a,), (g8b,))
            rest = [trans if k.name == f"{name}.cast_g_t" else k for k in bwd
                    if k.name not in (f"{name}.amax_g", f"{name}.cast_g")]
            bwd[:] = pre + rest
        return y


def builder(name: str, style: Style, fp8_tp: bool, local_tokens: float) -> _Builder:
    """The builder of a segment holding tensor-parallel linears."""
    return Float8TpBuilder(name, style, local_tokens) if fp8_tp else _Builder(name, style)


def cast_module_input(b: _Builder, y: Tensor, local: float, h: int) -> None:
    """PrepareFloat8ModuleInput: amax (all-reduced over the tensor-parallel group: a few
    bytes) and float8 cast of the local norm output, before its all-gather."""
    y8 = b.t("in_fp8", local * h, FP8)
    b.fwd(Kernel("fp8_amax", "elementwise", (y,), ()))
    b.fwd(Kernel("fp8_cast", "elementwise", (y,), (y8,)))
