"""NeMo AutoModel's own model code under FSDP2 (``framework.model_code: automodel``): the
kernels of its "TE + DeepEP" backend.

NeMo AutoModel (NVIDIA-NeMo/Automodel) trains its custom MoE models (``nemo_automodel/
components/models/{qwen3_moe,deepseek_v3,...}``) with PyTorch FSDP2, expert parallelism and
``torch.distributed.pipelining``, as torchtitan does, but builds each layer from its
``BackendConfig`` (``components/moe/utils.py`` at 79d0ccf, 2025-10, the commit of its
published benchmark configs ``examples/benchmark/configs/*_te_deepep.yaml``; later
``components/models/common``):

* ``attn: te``, ``linear: te``, ``rms_norm: te``: Transformer Engine's ``DotProductAttention``
  (cuDNN's fused attention on Hopper and Blackwell, flash-attn 2 below, as TE picks:
  :func:`sim.hardware.attention_cost.resolve`), ``Linear`` and ``RMSNorm``: the kernels of a
  Megatron-Core layer with Transformer Engine at tensor parallelism 1, priced by
  :mod:`sim.workload.megatron_ops` (Multi-head Latent Attention by
  :mod:`sim.workload.megatron_mla`); its ``pre`` (norm) and ``main`` parts run back to back
  here (no tensor-parallel communication between them);
* ``enable_deepep`` (later ``dispatcher: deepep``): the MoE layer is Megatron-Core's
  ``MoEFlexTokenDispatcher`` with DeepEP's fused dispatch and combine, copied into
  ``components/moe/megatron/`` (``token_dispatcher.py``, ``fused_a2a.py``: ``Buffer.
  set_num_sms(DEEP_EP_SM_NUMS``, default 20)): no permutation before the send, one permute
  into local-expert order after it, the probs travel with the tokens
  (:func:`sim.frameworks.megatron.moe_flex.deepep_plan`); the grouped expert GEMMs and the
  router's unfused PyTorch ops as :func:`sim.workload.moe_ops.moe_layer_ops` prices them;
* parameters in bf16: ``from_config`` builds the model in ``config.torch_dtype`` or
  bf16 and ``init_weights`` casts it (``self.to(dtype)``), so FSDP2 shards bf16 parameters,
  reduces gradients in fp32 (``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32)``) into bf16 shards, and ``torch.optim.Adam`` keeps bf16 moments:
  8 bytes of state a parameter, not torchtitan's 16.

Embedding and output layer are plain ``nn.Embedding`` and ``nn.Linear``: torchtitan's blocks
(:mod:`sim.workload.layer_ops`) price them, with PyTorch's cross entropy on the bf16 logits
(``MaskedCrossEntropy(fp32_upcast=False)``: ``Style.bf16_loss``, no fp32 copy). The
benchmark configs also set ``fake_balanced_gate``: ``training.routing.distribution:
round_robin`` (:mod:`sim.workload.routing`).

GPT-OSS (``attn: flex``, the only attention its model code took until 2026): AutoModel's own
attention module with FlexAttention and the learned sinks applied after it
(:mod:`sim.workload.automodel_attention`); its ``GroupedExpertsDeepEP`` adds both expert
biases per expert in eager PyTorch after ``grouped_gemm``'s bias-less GEMMs (fc1's plain,
``MoELayout.eager_fc1_bias``; fc2's times the routing probs, as Megatron-Core's
``TEGroupedMLP._apply_bias``: :mod:`sim.workload.gpt_oss_ops`) and clamps inside its
compiled activation.

Not modelled: AutoModel's tensor and context parallel plans, Transformer Engine's sink
attention (its later GPT-OSS configs' ``attn: te``), FP8, ``torch.compile``.
"""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

from sim.frameworks.common.accounting import WINDOWED_ATTN
from sim.hardware.compute import ComputeModel
from sim.workload.automodel_attention import flex_sink_attention_block
from sim.workload.block_pricing import BlockCost, price_block
from sim.workload.kernels import BF16, Block, Kernel, Tensor
from sim.workload.megatron_ops import STYLE, MegatronLayout, megatron_blocks
from sim.workload.model import ModelSpec

TE_LAYOUT = MegatronLayout(tp=1, flash_attention=True, grad_accumulation_fusion=True,
                           main_grad_bytes=BF16)
"""A Transformer Engine layer as AutoModel runs it: no tensor parallelism, fused attention,
no dropout; each wgrad GEMM writes the 16-bit gradient FSDP2 reduces (no fp32
``main_grad``)."""


def chain_blocks(name: str, first: Block, second: Block) -> Block:
    """One block running ``first`` then ``second``, whose input is ``first``'s output: the
    second's input tensor becomes the first's output (one tensor, saved once), the kernels
    and tensors of both in order (backward kernels stay listed in forward order: the
    builder runs them reversed, the second's first).

    Examples
    --------
    >>> x, y, y2, z = Tensor("x", 1.0), Tensor("y", 1.0), Tensor("y_in", 1.0), Tensor("z", 1.0)
    >>> a = Block("a", forward=[Kernel("f", "elementwise", (x,), (y,))], inputs=[x],
    ...           outputs=[y], params=1)
    >>> b = Block("b", forward=[Kernel("g", "elementwise", (y2,), (z,))], saved=[y2],
    ...           inputs=[y2], outputs=[z], params=2)
    >>> c = chain_blocks("c", a, b)
    >>> c.forward[1].reads[0] is y, c.saved[0] is y, c.params, [t.name for t in c.inputs]
    (True, True, 3, ['x'])
    """
    assert len(first.outputs) == 1 and len(second.inputs) == 1
    src, dst = second.inputs[0], first.outputs[0]

    def sub(ts: tuple[Tensor, ...] | list[Tensor]) -> tuple[Tensor, ...]:
        return tuple(dst if t is src else t for t in ts)

    def kern(k: Kernel) -> Kernel:
        return replace(k, reads=sub(k.reads), writes=sub(k.writes))

    return Block(
        name, forward=first.forward + [kern(k) for k in second.forward],
        backward=first.backward + [kern(k) for k in second.backward],
        saved=first.saved + list(sub(second.saved)),
        forward_scoped=first.forward_scoped + list(sub(second.forward_scoped)),
        weight_casts=first.weight_casts + second.weight_casts,
        inputs=list(first.inputs), outputs=list(sub(second.outputs)),
        weight_grads=first.weight_grads + second.weight_grads,
        params=first.params + second.params, flops_fwd=first.flops_fwd + second.flops_fwd,
        flops_bwd=first.flops_bwd + second.flops_bwd,
        exposed_host_s=first.exposed_host_s + second.exposed_host_s)


@lru_cache(maxsize=64)
def te_layer_blocks(m: ModelSpec, batch: int, seq: int) -> tuple[Block, Block]:
    """(attention, MLP) blocks of one micro-batch as AutoModel's ``te`` backend runs them."""
    b = megatron_blocks(m, TE_LAYOUT, batch, seq)
    return (chain_blocks("attn", b["attn_pre"], b["attn_main"]),
            chain_blocks("mlp", b["mlp_pre"], b["mlp_main"]))


def te_layer_costs(m: ModelSpec, cm: ComputeModel, batch: int, seq: int
                   ) -> dict[str, BlockCost]:
    """The priced ``attn`` and ``mlp`` blocks (:func:`te_layer_blocks`); GPT-OSS's attention
    (learned sinks, ``attn: flex``) is AutoModel's own module
    (:func:`~sim.workload.automodel_attention.flex_sink_attention_block`), with its
    sliding layers' block as ``attn_window`` when the window is shorter than the sequence."""
    attn, mlp = te_layer_blocks(m, batch, seq)
    costs = {"mlp": price_block(mlp, STYLE, cm)}
    if not m.attention_sinks:
        costs["attn"] = price_block(attn, STYLE, cm)
        return costs
    costs["attn"] = price_block(flex_sink_attention_block(m, batch, seq), STYLE, cm)
    if m.sliding_window is not None and m.sliding_window < seq:
        costs[WINDOWED_ATTN] = price_block(
            flex_sink_attention_block(m, batch, seq, m.sliding_window), STYLE, cm)
    return costs
