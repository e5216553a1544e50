"""What Transformer Engine runs FP8 attention under (``framework.fp8_dot_product_attention``,
TE's ``fp8_dpa``), refused here naming the key where it runs none.

From ``transformer_engine/pytorch/attention/dot_product_attention/utils.py``
(``get_attention_backend``, TransformerEngine @ d0067d0): FP8 training disables FlashAttention
2, 3 and 4 and the unfused path (unless emulated), so only cuDNN's FusedAttention can run it;
FusedAttention is disabled for ``Float8BlockScaling`` (and NVFP4) recipes, and for a sliding
window in FP8 on a GPU before sm100 or under cuDNN < 9.21. Megatron's local attention path
(``flash_attention: false``) never reaches TE's DotProductAttention.
"""

from __future__ import annotations

from sim.frameworks.common.base import JobContext
from sim.scenario import MegatronOptions
from sim.workload.model import ModelSpec

KEY = "framework.fp8_dot_product_attention"


def check_fp8_attention(ctx: JobContext, opts: MegatronOptions, precision: str,
                        m: ModelSpec, seq: int) -> None:
    """Refuse ``fp8_dot_product_attention`` where Transformer Engine has no backend for it
    (module docstring); nothing to check without it."""
    if not opts.fp8_dot_product_attention:
        return
    ctx.require(opts.flash_attention, KEY,
                "fp8_dot_product_attention needs the fused attention (flash_attention true)")
    ctx.require(ctx.compute.attention_backend != "unfused", KEY,
                "fp8_dot_product_attention needs Transformer Engine's fused attention, which "
                "does not train these head dims under the scenario's training."
                "transformer_engine_version / cudnn_version (sim/hardware/te_fused_attention.py)")
    ctx.require(precision == "fp8" and opts.fp8_recipe != "blockwise", KEY,
                "fp8_dot_product_attention requires FP8 training with an fp8_recipe Transformer "
                "Engine runs FP8 attention under (tensorwise, delayed or mxfp8; TE disables "
                "FusedAttention for Float8BlockScaling)")
    windowed = m.sliding_window is not None and m.sliding_window < seq
    ctx.require(not windowed or ctx.compute.gpu.arch == "blackwell", KEY,
                "Transformer Engine runs no FP8 attention with a sliding window before sm100 "
                f"({ctx.compute.gpu.name}: FusedAttention needs sm100 and cuDNN >= 9.21 for it, "
                "and no FlashAttention runs FP8 training)")
