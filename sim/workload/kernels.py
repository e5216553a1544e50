"""The vocabulary of a block's kernels: tensors, kernels, execution styles and blocks.

A :class:`Block` is one part of a training step (embedding, attention or MLP half of a layer,
head) as lists of forward and backward :class:`Kernel` objects, each reading and writing
:class:`Tensor` objects identified by object identity. :mod:`sim.workload.layer_builder` writes
them,
:mod:`sim.workload.block_pricing` prices them, :mod:`sim.workload.layer_ops` (the import surface)
assembles the
blocks of Hugging Face's and torchtitan's Llama, :mod:`sim.workload.megatron_ops` those of
Megatron-LM.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

FP32 = 4
BF16 = 2
BOOL = 1  # torch.bool: a mask
IDX = 8  # int64 token ids

KernelClass = Literal["gemm", "attention", "elementwise", "norm_fused", "tiny"]


@dataclass(frozen=True, eq=False)
class Tensor:
    """A tensor of a block, identified by object identity."""

    name: str
    nbytes: float


@dataclass(frozen=True, eq=False)
class Kernel:
    """One GPU kernel: what it reads and writes, and how it is priced.

    A write into a tensor that already exists is in place (the output aliases it) and
    allocates nothing: a tensor the kernel sequence read before (the same kernel's reads
    count: ``Kernel("mul_", ..., (s,), (s,))``), a saved tensor in the backward, or one held
    elsewhere (:func:`sim.workload.block_pricing.in_place_targets`). A kernel that makes a
    new tensor writes a new :class:`Tensor` object.
    """

    name: str
    klass: KernelClass
    reads: tuple[Tensor, ...] = ()
    writes: tuple[Tensor, ...] = ()
    flops: float = 0.0
    gemm: tuple[float, float, float, str] | None = None      # (m, k, n, pass)
    attn: tuple[int, int, int, int, str] | None = None       # (batch, heads, seq, head_dim, pass)
    attn_kv_seq: int = 0
    """Keys per query when they outnumber the local queries (context parallelism: each rank
    attends its seq/cp queries to the whole sequence, half of it on average under causal
    load balancing); 0 = the same sequence, causal."""
    attn_window: int | None = None
    """A causal sliding window: keys each query sees at most (GPT-OSS's windowed layers);
    the kernel runs only the band's tiles (:func:`sim.hardware.attention_cost.causal_tiles`)."""
    attn_block: tuple[int, int] | None = None
    """(queries, keys) of one non-causal block (a step of torch's ring attention,
    :mod:`sim.frameworks.fsdp2.cp`); the kernel runs exactly that rectangle."""
    attn_dropout: bool = False
    """Dropout inside the fused kernel (Megatron's ``attention_dropout`` with flash attention):
    the mask drawn in the forward and drawn again in the backward
    (:func:`sim.hardware.attention_cost.attention_dropout_factor`)."""
    attn_masked: bool = False
    """SDPA handed an explicit causal mask tensor rather than ``is_causal``: the whole score
    rectangle at the masked call's rate (:mod:`sim.hardware.masked_attention`)."""
    activation_elements: float = 0.0
    """Elements through an eager GELU (:meth:`sim.hardware.compute.ComputeModel.gelu_time`),
    forward or backward by ``activation_pass``."""
    activation_pass: Literal["fwd", "bwd"] = "fwd"
    fp8: bool = False
    """A GEMM on FP8 operands (Transformer Engine, torchao float8): runs at the FP8 rate. An
    attention kernel: FP8 attention (``fp8_dpa``) at cuDNN's measured gain."""
    fp8_block: bool = False
    """An FP8 GEMM with block scales (MXFP8, or 1x128 / 128x128 blocks): on Hopper, whose
    tensor cores apply none, it promotes its partial sums on the CUDA cores
    (:meth:`sim.hardware.compute.ComputeModel.gemm_time`, ``block_scaled``). An FP8
    attention kernel: MXFP8 attention."""
    reduction: bool = False
    """A fused kernel (torch.compile) that contains a reduction (see :func:`is_reduction`)."""
    row_elements: float = 0.0
    """Elements of each row a row reduction reduces along (a norm's mean over the hidden
    size), where the builder knows it; 0 otherwise (:mod:`sim.workload.inductor`)."""
    streams: bool = False
    """A reduction to one value whose kernel streams its input like an elementwise loop
    (grid-stride vector loads, one atomic per block: Transformer Engine's amax,
    :func:`sim.workload.layer_rules.te_scaled_cast`): not a row reduction."""
    group: tuple[float, ...] = ()
    """A grouped GEMM (Transformer Engine ``GroupedLinear`` over the local experts): the rows
    of each of its GEMMs, which ``gemm``'s m adds up; priced by
    :func:`sim.workload.grouped_gemm.grouped_gemm_time`. Empty for one GEMM."""
    legacy_elements: float = 0.0
    """Elements it runs over in PyTorch's non-vectorised elementwise loop, taken when an
    operand is not contiguous (``.contiguous()`` of a transposed view, an op on a slice or a
    broadcast operand): latency-bound
    (:meth:`sim.hardware.compute.ComputeModel.legacy_loop_time`); 0 for any other kernel."""
    legacy_operands: int = 2
    """Operands each element of that loop loads or stores, output included: 2 for a copy or
    a unary op, 3 for a binary one (a broadcast operand counts: the loop computes its offset
    and loads it like the others)."""
    cast_elements: float = 0.0
    """Elements it converts between dtypes in TensorIterator's dynamic-casting path, taken by
    an op whose operands' dtypes differ (a bf16-to-fp32 copy, an fp32 + bf16 add, an fp32
    ``cos`` times a bf16 ``q``), but not by the fp32-to-bf16 copy PyTorch special-cases
    (:meth:`sim.hardware.compute.ComputeModel.cast_loop_time`); 0 for any other kernel."""
    grouped_impl: Literal["cublas", "torch"] = "cublas"
    """A grouped GEMM (``group``): ``cublas``, priced as its per-expert cuBLAS GEMMs
    (:func:`sim.workload.grouped_gemm.grouped_gemm_time`); ``torch``, ``torch._grouped_mm``
    (torchtitan's ``GroupedExperts``) at its measured slowdown over that
    (:func:`sim.workload.grouped_gemm.torch_grouped_mm_slowdown`)."""
    launches: int = 1
    """Kernel launches the host issues for it: Transformer Engine's default grouped GEMM
    (``multi_stream_cublas_gemm``, ``transformer_engine/common/gemm/cublaslt_gemm.cu``) calls
    cuBLASLt once per expert, so a grouped GEMM over ``n`` local experts is ``n`` launches
    (``torch._grouped_mm`` is one)."""

    @property
    def nbytes(self) -> float:
        return sum(t.nbytes for t in self.reads) + sum(t.nbytes for t in self.writes)

    @property
    def fusible(self) -> bool:
        return self.klass in ("elementwise", "tiny", "norm_fused")


@dataclass(frozen=True)
class Style:
    """How a framework runs the model's math (the styles are described in
    :mod:`sim.workload.layer_ops`)."""

    name: Literal["autocast", "bf16", "hf_bf16"]
    compile: bool = False
    float8: bool = False
    """torchao's Float8Linear (dynamic tensorwise scaling) on the transformer blocks' linears,
    as torchtitan's ``float8`` model converter applies it (all but the output layer)."""
    float8_weights: bool = False
    """The weights arrive in FP8 (FSDP2's float8 all-gather casts the shards before the
    gather): the linears cast no weights."""
    float8_recipe: Literal["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8"] = "tensorwise"
    """With ``float8``: torchao's scaling recipe; the rowwise ones are
    :mod:`sim.workload.float8_rowwise`, MXFP8 :mod:`sim.workload.float8_mx`."""
    sdpa_mask: bool = False
    """Hugging Face's code traced whole by ``torch.compile``: its causal mask is built as a
    tensor, so SDPA gets that mask and keys and values repeated to every query head
    (:mod:`sim.hardware.masked_attention`)."""
    fused_rmsnorm: bool = True
    """``bf16`` (torchtitan): RMSNorm is PyTorch's fused kernel (``nn.RMSNorm`` on PyTorch
    2.8 and later); False: torchtitan's own eager RMSNorm of its 2024-25 code (``x.float()``,
    pow, mean, rsqrt, the products, ``type_as``), the same kernels as Hugging Face's
    (:func:`sim.workload.hf_ops.hf_rmsnorm_bf16`)."""
    fused_loss: bool = False
    """The cross-entropy is one fused softmax-and-loss kernel on the 16-bit logits (flash-attn's
    ``xentropy_cuda_lib``, which llm-foundry's MPT runs as ``loss_fn: fused_crossentropy``):
    no fp32 copy of the logits (:func:`sim.workload.layer_ops.fused_cross_entropy`)."""
    bf16_loss: bool = False
    """Eager ``F.cross_entropy`` on the 16-bit logits themselves, without the fp32 copy
    torchtitan's loss makes (NeMo AutoModel's ``MaskedCrossEntropy(fp32_upcast=False)``):
    PyTorch's log-softmax kernel accumulates in fp32 but reads and writes 16-bit rows."""

    @property
    def autocast(self) -> bool:
        return self.name == "autocast"

    @property
    def hf(self) -> bool:
        """Hugging Face's model code (transformers' modeling_llama.py), not torchtitan's."""
        return self.name in ("autocast", "hf_bf16")

    @property
    def act_bytes(self) -> int:
        return FP32 if self.autocast else BF16

    @property
    def grad_bytes(self) -> int:
        """dtype of weight gradients as autograd produces them."""
        return FP32 if self.autocast else BF16


@dataclass
class Block:
    """One block's kernels and tensors."""

    name: str
    forward: list[Kernel] = field(default_factory=list)
    backward: list[Kernel] = field(default_factory=list)
    saved: list[Tensor] = field(default_factory=list)
    forward_scoped: list[Tensor] = field(default_factory=list)
    """Live from this block's forward until the whole forward pass (and loss) returns."""
    weight_casts: list[Tensor] = field(default_factory=list)
    """Autocast's bf16 copies of the weights (saved for backward unless recomputed)."""
    inputs: list[Tensor] = field(default_factory=list)
    outputs: list[Tensor] = field(default_factory=list)
    weight_grads: list[Tensor] = field(default_factory=list)
    """Weight gradients as autograd produces them (fp32 under autocast, bf16 otherwise)."""
    params: int = 0
    flops_fwd: float = 0.0
    flops_bwd: float = 0.0
    exposed_host_s: float = 0.0
    """Host seconds the GPU waits through in the forward: a call that synchronises (a
    device-to-host copy) drains the GPU, which then idles while the host issues the next
    kernels one by one."""




def drop_kernels(b: Block, names: frozenset[str]) -> None:
    """Remove the kernels named ``names`` from a block's forward and backward, with the saved
    tensors only they read: what a framework path never runs (Hybrid-EP's fused permutes,
    DeepEP's missing chunk sort).

    Examples
    --------
    >>> x, y = Tensor("x", 1.0), Tensor("y", 1.0)
    >>> b = Block("b", forward=[Kernel("keep", "elementwise", (x,), ()),
    ...                         Kernel("gone", "elementwise", (y,), ())], saved=[x, y])
    >>> drop_kernels(b, frozenset({"gone"}))
    >>> [k.name for k in b.forward], [t.name for t in b.saved]
    (['keep'], ['x'])
    """
    b.forward = [k for k in b.forward if k.name not in names]
    b.backward = [k for k in b.backward if k.name not in names]
    used = {id(t) for k in b.forward + b.backward for t in k.reads + k.writes}
    b.saved = [t for t in b.saved if id(t) in used]

def accumulating(k: Kernel, into: Tensor) -> Kernel:
    """``k`` adding its result into ``into`` in place (a GEMM with beta = 1): it reads the
    tensor it writes, so the tensor must exist already and nothing new is allocated.
    Megatron-Core's weight gradients (``gradient_accumulation_fusion``): the wgrad GEMM
    accumulates into the parameter's persistent ``main_grad``
    (``tensor_parallel/layers.py``, ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32``,
    or ``_fp16`` for 16-bit main grads; Transformer Engine's ``fuse_wgrad_accumulation``).

    Examples
    --------
    >>> g = Tensor("main_grad", 4e6)
    >>> k = accumulating(Kernel("wgrad", "gemm", (Tensor("x", 1e6),), (g,)), g)
    >>> k.reads[-1] is g and k.writes == (g,)
    True
    """
    assert any(t is into for t in k.writes), f"{k.name} does not write {into.name}"
    return replace(k, reads=k.reads + (into,))


def is_reduction(k: Kernel) -> bool:
    """A memory-bound kernel that reduces: it reads a tensor more than once (a softmax's
    max, sum and output passes over a row too wide for shared memory), or writes less than a
    quarter of what it reads (a mean over the hidden size, a gradient summed over tokens, an
    amax). A fused kernel containing one (``Kernel.reduction``) is one too: inductor's
    reduction kernels hold a row per block like the eager ones.

    Examples
    --------
    >>> x, y = Tensor("x", 4e6), Tensor("y", 4e3)
    >>> is_reduction(Kernel("mean", "elementwise", (x,), (y,)))
    True
    >>> is_reduction(Kernel("mul", "elementwise", (x, y), (Tensor("z", 4e6),)))
    False
    """
    if k.klass not in ("elementwise", "norm_fused") or not k.reads:
        return False
    if k.reduction:
        return True
    if k.streams:
        return False
    ids = [id(t) for t in k.reads]
    read = sum(t.nbytes for t in k.reads)
    written = sum(t.nbytes for t in k.writes)
    return len(set(ids)) < len(ids) or written < 0.25 * read

