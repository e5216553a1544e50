"""The kernels a transformer training step runs, block by block, as a framework issues them.

Each block (embedding, attention half of a layer, MLP half, final norm + LM head + loss) is
built once as a list of forward kernels and a list of backward kernels, each reading and
writing named tensors, plus the set of tensors autograd saves from forward to backward. From
that one description come:

* time: every kernel priced by :class:`~sim.compute.ComputeModel` (GEMM, attention,
  memory-bound by class), with the eager CPU issue cost as a floor;
* memory: saved activations per block, and the transient peak inside each block's forward
  and backward from tensor lifetimes (a tensor lives from the kernel that writes it to the last
  kernel that reads it);
* torch.compile: the runs of memory-bound kernels between two GEMM/attention kernels fused
  as inductor's scheduler fuses them (:mod:`sim.inductor`): each fused kernel reads what
  comes from outside it and writes what leaves it.

Two execution styles cover the frameworks of this version:

``autocast``
    Plain PyTorch with fp32 parameters under ``torch.autocast(bfloat16)`` running Hugging Face
    ``LlamaForCausalLM`` (transformers 5.x, SDPA attention): fp32 residual stream (the
    embedding output is fp32 and adds promote), RMSNorm as six fp32 kernels, every linear
    casting its input to bf16 separately and its weight once per forward (autocast's weight
    cache, saved for backward), rotary embedding in fp32 (bf16 q times fp32 cos promotes), and a
    KV cache built in training (``use_cache`` defaults on) that copies k and v and lives until
    the forward returns. Sources: ``transformers/models/llama/modeling_llama.py``,
    ``integrations/sdpa_attention.py``, ``loss/loss_utils.py``; PyTorch
    ``aten/src/ATen/autocast_mode.cpp`` (cast cache only for fp32 leaf tensors that require
    grad; SDPA on the lower-precision list).
``bf16``
    torchtitan's Llama under FSDP2 mixed precision: parameters gathered in bf16, no autocast,
    bf16 residual stream, fused RMSNorm kernel, rotary embedding by complex multiply in fp32,
    no KV cache. Sources: ``torchtitan/models/llama3/model.py``,
    ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``.
``hf_bf16``
    Hugging Face ``LlamaForCausalLM`` under FSDP2 mixed precision: bf16 parameters and
    activations, no autocast, the model's own eager RMSNorm (eight kernels through fp32) and
    ``rotate_half`` rotary embedding in bf16, and the KV cache of ``use_cache``
    (:mod:`sim.hf_ops`).

Loss (both): logits in bf16, ``.float()`` copy, ``log_softmax`` (output saved) and
``nll_loss``; backward materialises the fp32 gradient of the logits twice (nll and
log_softmax) before casting it back to bf16.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Literal

from sim.compute import (
    COMPILED_OP_CPU_S,
    EAGER_BWD_OP_CPU_S,
    EAGER_FWD_OP_CPU_S,
    ComputeModel,
)
from sim.model import ModelSpec

FP32 = 4
BF16 = 2
IDX = 8  # int64 token ids

KernelClass = Literal["gemm", "attention", "elementwise", "norm_fused", "tiny"]


@dataclass(frozen=True, eq=False)
class Tensor:
    """A tensor of a block, identified by object identity."""

    name: str
    nbytes: float


@dataclass(frozen=True, eq=False)
class Kernel:
    """One GPU kernel: what it reads and writes, and how it is priced."""

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
    attn_block: tuple[int, int] | None = None
    """(queries, keys) of one non-causal block (a step of torch's ring attention,
    :mod:`sim.frameworks.torchtitan_cp`); the kernel runs exactly that rectangle."""
    activation_elements: float = 0.0
    """Elements through an eager SiLU/GELU (see ComputeModel.activation_time)."""
    fp8: bool = False
    """A GEMM on FP8 operands (Transformer Engine, torchao float8): runs at the FP8 rate."""
    reduction: bool = False
    """A fused kernel (torch.compile) that contains a reduction (see :func:`is_reduction`)."""

    @property
    def nbytes(self) -> float:
        return sum(t.nbytes for t in self.reads) + sum(t.nbytes for t in self.writes)

    @property
    def fusible(self) -> bool:
        return self.klass in ("elementwise", "tiny", "norm_fused")


@dataclass(frozen=True)
class Style:
    """How a framework runs the model's math (see the module docstring)."""

    name: Literal["autocast", "bf16", "hf_bf16"]
    compile: bool = False
    float8: bool = False
    """torchao's Float8Linear (dynamic tensorwise scaling) on the transformer blocks' linears,
    as torchtitan's ``float8`` model converter applies it (all but the output layer)."""
    float8_weights: bool = False
    """The weights arrive in FP8 (FSDP2's float8 all-gather casts the shards before the
    gather): the linears cast no weights."""

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


class _Builder:
    """Collects forward kernels and, per op, the backward kernels that undo it."""

    def __init__(self, name: str, style: Style) -> None:
        self.block = Block(name)
        self.style = style
        self._bwd_ops: list[list[Kernel]] = []

    # tensors and kernels
    def t(self, name: str, numel: float, nbytes_per: float) -> Tensor:
        return Tensor(f"{self.block.name}.{name}", float(numel) * nbytes_per)

    def fwd(self, k: Kernel) -> Kernel:
        self.block.forward.append(k)
        self.block.flops_fwd += k.flops
        return k

    def bwd(self, *ks: Kernel) -> None:
        self._bwd_ops.append(list(ks))
        for k in ks:
            self.block.flops_bwd += k.flops

    def save(self, *ts: Tensor) -> None:
        for t in ts:
            if all(t is not s for s in self.block.saved):
                self.block.saved.append(t)

    def finish(self) -> Block:
        for ops in reversed(self._bwd_ops):
            self.block.backward.extend(ops)
        return self.block

    # ------------------------------------------------------------------ ops
    def cast(self, x: Tensor, numel: float, to_bytes: int, name: str) -> Tensor:
        y = self.t(name, numel, to_bytes)
        self.fwd(Kernel(f"{name}", "elementwise", (x,), (y,)))
        return y

    def grad_cast(self, g: Tensor, numel: float, to_bytes: int, name: str) -> tuple[Kernel, Tensor]:
        y = self.t(name, numel, to_bytes)
        return Kernel(name, "elementwise", (g,), (y,)), y

    def add_grads(self, a: Tensor, b: Tensor, numel: float, nbytes: int, name: str
                  ) -> tuple[Kernel, Tensor]:
        y = self.t(name, numel, nbytes)
        return Kernel(name, "elementwise", (a, b), (y,)), y

    def linear(self, x: Tensor, tokens: float, n_in: int, n_out: int, name: str,
               bias: bool = False, float8: bool = True) -> Tensor:
        """``y = x W^T (+ b)``; under autocast x and W are cast to bf16 first.

        Returns the bf16 output. The backward kernels it registers expect a bf16 output
        gradient and leave the input gradient in x's dtype. With the style's ``float8`` (and
        ``float8`` here: torchtitan leaves the output layer in bf16), see
        :meth:`float8_linear`.
        """
        st = self.style
        if st.float8 and float8 and not st.autocast:
            return self.float8_linear(x, tokens, n_in, n_out, name, bias)
        self.block.params += n_in * n_out + (n_out if bias else 0)
        x_fp32 = x.nbytes == tokens * n_in * FP32
        xb = self.cast(x, tokens * n_in, BF16, f"{name}.in_bf16") if st.autocast and x_fp32 else x
        if st.autocast:
            w32 = self.t(f"{name}.w", n_in * n_out, FP32)
            wb = self.t(f"{name}.w_bf16", n_in * n_out, BF16)
            self.fwd(Kernel(f"{name}.w_cast", "elementwise", (w32,), (wb,)))
            self.block.weight_casts.append(wb)
        else:
            wb = self.t(f"{name}.w", n_in * n_out, BF16)
        y = self.t(f"{name}.out", tokens * n_out, BF16)
        flops = 2.0 * tokens * n_in * n_out
        self.fwd(Kernel(f"{name}.fwd", "gemm", (xb, wb), (y,), flops,
                        gemm=(tokens, n_in, n_out, "fwd")))
        self.save(xb)
        gy = self.t(f"{name}.g_out", tokens * n_out, BF16)
        gxb = self.t(f"{name}.g_in", tokens * n_in, BF16)
        gwb = self.t(f"{name}.g_w", n_in * n_out, BF16)
        ks = [
            Kernel(f"{name}.dgrad", "gemm", (gy, wb), (gxb,), flops,
                   gemm=(tokens, n_in, n_out, "dgrad")),
            Kernel(f"{name}.wgrad", "gemm", (gy, xb), (gwb,), flops,
                   gemm=(tokens, n_in, n_out, "wgrad")),
        ]
        if st.autocast:
            # ToCopyBackward of the weight cast: the fp32 gradient AccumulateGrad keeps.
            k, gw = self.grad_cast(gwb, n_in * n_out, FP32, f"{name}.g_w_fp32")
            ks.append(k)
            self.block.weight_grads.append(gw)
        else:
            self.block.weight_grads.append(gwb)
        if bias:
            gb = self.t(f"{name}.g_b", n_out, FP32 if st.autocast else BF16)
            ks.append(Kernel(f"{name}.g_bias", "elementwise", (gy,), (gb,)))
        if st.autocast and x_fp32:
            k, _ = self.grad_cast(gxb, tokens * n_in, FP32, f"{name}.g_in_fp32")
            ks.append(k)
        self.bwd(*ks)
        return y

    def float8_linear(self, x: Tensor, tokens: float, n_in: int, n_out: int, name: str,
                      bias: bool = False) -> Tensor:
        """torchao's ``Float8Linear`` with dynamic tensorwise scaling
        (``torchao/float8/float8_linear.py``, ``matmul_with_hp_or_float8_args``): forward takes
        the amax of the bf16 input and weight (a reduction each), casts both to E4M3 and runs
        the GEMM on FP8 operands into bf16; autograd keeps the bf16 input (and the weight),
        not the FP8 copies, so backward casts again: the output gradient (amax, then one
        cast per GEMM layout), the weight for dgrad and the input for wgrad, each after its
        amax. Under ``compile`` the amax and cast kernels fuse with their neighbours.
        """
        self.block.params += n_in * n_out + (n_out if bias else 0)
        fp8 = 1.0
        w = self.t(f"{name}.w", n_in * n_out, BF16)
        x8 = self.t(f"{name}.in_fp8", tokens * n_in, fp8)
        w8 = self.t(f"{name}.w_fp8", n_in * n_out, fp8)
        y = self.t(f"{name}.out", tokens * n_out, BF16)
        flops = 2.0 * tokens * n_in * n_out
        self.fwd(Kernel(f"{name}.amax_in", "elementwise", (x,), ()))
        self.fwd(Kernel(f"{name}.cast_in", "elementwise", (x,), (x8,)))
        if not self.style.float8_weights:
            self.fwd(Kernel(f"{name}.amax_w", "elementwise", (w,), ()))
            self.fwd(Kernel(f"{name}.cast_w", "elementwise", (w,), (w8,)))
        self.fwd(Kernel(f"{name}.fwd", "gemm", (x8, w8), (y,), flops,
                        gemm=(tokens, n_in, n_out, "fwd"), fp8=True))
        self.save(x)
        gy = self.t(f"{name}.g_out", tokens * n_out, BF16)
        g8a = self.t(f"{name}.g_out_fp8", tokens * n_out, fp8)
        g8b = self.t(f"{name}.g_out_fp8_t", tokens * n_out, fp8)
        w8b = self.t(f"{name}.w_fp8_bwd", n_in * n_out, fp8)
        x8b = self.t(f"{name}.in_fp8_bwd", tokens * n_in, fp8)
        gx = self.t(f"{name}.g_in", tokens * n_in, BF16)
        gw = self.t(f"{name}.g_w", n_in * n_out, BF16)
        recast_w = [] if self.style.float8_weights else [
            Kernel(f"{name}.amax_w_bwd", "elementwise", (w,), ()),
            Kernel(f"{name}.cast_w_bwd", "elementwise", (w,), (w8b,))]
        ks = [Kernel(f"{name}.amax_g", "elementwise", (gy,), ()),
              Kernel(f"{name}.cast_g", "elementwise", (gy,), (g8a,)),
              Kernel(f"{name}.cast_g_t", "elementwise", (gy,), (g8b,)),
              *recast_w,
              Kernel(f"{name}.dgrad", "gemm", (g8a, w8b), (gx,), flops,
                     gemm=(tokens, n_in, n_out, "dgrad"), fp8=True),
              Kernel(f"{name}.amax_in_bwd", "elementwise", (x,), ()),
              Kernel(f"{name}.cast_in_bwd", "elementwise", (x,), (x8b,)),
              Kernel(f"{name}.wgrad", "gemm", (g8b, x8b), (gw,), flops,
                     gemm=(tokens, n_in, n_out, "wgrad"), fp8=True)]
        if bias:
            gb = self.t(f"{name}.g_b", n_out, BF16)
            ks.append(Kernel(f"{name}.g_bias", "elementwise", (gy,), (gb,)))
        self.bwd(*ks)
        self.block.weight_grads.append(gw)
        return y

    def rmsnorm(self, x: Tensor, tokens: float, h: int, name: str) -> Tensor:
        st = self.style
        if st.name == "hf_bf16":
            from sim.hf_ops import hf_rmsnorm_bf16
            return hf_rmsnorm_bf16(self, x, tokens, h, name)
        self.block.params += h
        if not st.autocast:
            # torch's fused RMSNorm kernel (F.rms_norm on CUDA): one read, one write, per-row rstd.
            y = self.t(f"{name}.out", tokens * h, BF16)
            rstd = self.t(f"{name}.rstd", tokens, FP32)
            self.fwd(Kernel(f"{name}.fused", "norm_fused", (x,), (y, rstd)))
            self.save(x, rstd)
            gy = self.t(f"{name}.g_out", tokens * h, BF16)
            gx = self.t(f"{name}.g_in", tokens * h, BF16)
            gw = self.t(f"{name}.g_w", h, BF16)
            self.bwd(Kernel(f"{name}.bwd_input", "norm_fused", (gy, x, rstd), (gx,)),
                     Kernel(f"{name}.bwd_weight", "norm_fused", (gy, x, rstd), (gw,)))
            self.block.weight_grads.append(gw)
            return y
        # Hugging Face LlamaRMSNorm in fp32: pow, mean, add eps, rsqrt, mul, mul by weight.
        n = tokens * h
        r, xn = self.rms_core_forward(x, tokens, h, name)
        y = self.t(f"{name}.out", n, FP32)
        self.fwd(Kernel(f"{name}.mul_w", "elementwise", (xn,), (y,)))
        self.save(x, r, xn)
        g = {k: self.t(f"{name}.g_{k}", n, FP32) for k in ("out", "xn", "wprod")}
        gw = self.t(f"{name}.g_w", h, FP32)
        core, _ = self.rms_core_backward(g["xn"], x, r, tokens, h, name, f"{name}.g_in")
        self.bwd(
            Kernel(f"{name}.g_mul_w", "elementwise", (g["out"],), (g["xn"],)),
            Kernel(f"{name}.g_w_prod", "elementwise", (g["out"], xn), (g["wprod"],)),
            Kernel(f"{name}.g_w_sum", "elementwise", (g["wprod"],), (gw,)),
            *core,
        )
        self.block.weight_grads.append(gw)
        return y

    def rms_core_forward(self, x32: Tensor, tokens: float, h: int, name: str
                         ) -> tuple[Tensor, Tensor]:
        """The fp32 heart of ``LlamaRMSNorm`` (pow, mean, add eps, rsqrt, mul) on an fp32
        input, as separate eager kernels; returns (rsqrt, normalised x). The autocast style
        runs it on the fp32 residual stream, the bf16 style (:mod:`sim.hf_ops`) after its
        upcast."""
        n = tokens * h
        p = self.t(f"{name}.pow", n, FP32)
        var = self.t(f"{name}.var", tokens, FP32)
        var_eps = self.t(f"{name}.var_eps", tokens, FP32)
        r = self.t(f"{name}.rsqrt", tokens, FP32)
        xn = self.t(f"{name}.xn", n, FP32)
        self.fwd(Kernel(f"{name}.pow", "elementwise", (x32,), (p,)))
        self.fwd(Kernel(f"{name}.mean", "elementwise", (p,), (var,)))
        self.fwd(Kernel(f"{name}.add_eps", "tiny", (var,), (var_eps,)))
        self.fwd(Kernel(f"{name}.rsqrt", "tiny", (var_eps,), (r,)))
        self.fwd(Kernel(f"{name}.mul", "elementwise", (x32, r), (xn,)))
        return r, xn

    def rms_core_backward(self, g_xn: Tensor, x32: Tensor, r: Tensor, tokens: float, h: int,
                          name: str, g_in_name: str) -> tuple[list[Kernel], Tensor]:
        """Backward kernels of :meth:`rms_core_forward` from the normalised x's fp32 gradient:
        both products' gradients, the rsqrt's through its row sum, the mean and the pow,
        summed into the fp32 input's gradient (named ``g_in_name``), returned with it. The
        caller issues them inside its own :meth:`bwd` group, which keeps the block's kernel
        order."""
        n = tokens * h
        g = {k: self.t(f"{name}.g_{k}", n, FP32) for k in ("xa", "xprod", "mean", "xb")}
        g_in = self.t(g_in_name, n, FP32)
        gr = self.t(f"{name}.g_r", tokens, FP32)
        return [
            Kernel(f"{name}.g_mul_a", "elementwise", (g_xn, r), (g["xa"],)),
            Kernel(f"{name}.g_mul_b", "elementwise", (g_xn, x32), (g["xprod"],)),
            Kernel(f"{name}.g_r_sum", "elementwise", (g["xprod"],), (gr,)),
            Kernel(f"{name}.g_rsqrt", "tiny", (gr,), ()),
            Kernel(f"{name}.g_mean", "elementwise", (), (g["mean"],)),
            Kernel(f"{name}.g_pow", "elementwise", (g["mean"], x32), (g["xb"],)),
            Kernel(f"{name}.g_sum", "elementwise", (g["xa"], g["xb"]), (g_in,)),
        ], g_in

    def layernorm(self, x: Tensor, tokens: float, h: int, name: str) -> Tensor:
        # GPT-style LayerNorm: one fused kernel each way (torch native_layer_norm).
        self.block.params += 2 * h
        ab = self.style.act_bytes
        y = self.t(f"{name}.out", tokens * h, ab)
        stats = self.t(f"{name}.stats", 2 * tokens, FP32)
        self.fwd(Kernel(f"{name}.fused", "norm_fused", (x,), (y, stats)))
        self.save(x, stats)
        gy = self.t(f"{name}.g_out", tokens * h, ab)
        gx = self.t(f"{name}.g_in", tokens * h, ab)
        gwb = self.t(f"{name}.g_wb", 2 * h, FP32)
        self.bwd(Kernel(f"{name}.bwd", "norm_fused", (gy, x, stats), (gx,)),
                 Kernel(f"{name}.bwd_w", "norm_fused", (gy, x), (gwb,)))
        self.block.weight_grads.append(gwb)
        return y

    def norm(self, m: ModelSpec, x: Tensor, tokens: float, name: str) -> Tensor:
        if m.norm == "layernorm":
            return self.layernorm(x, tokens, m.hidden, name)
        return self.rmsnorm(x, tokens, m.hidden, name)

    def rope(self, q: Tensor, tokens: float, width: int, name: str) -> Tensor:
        """Rotary embedding of q or k (bf16 in); fp32 out under autocast, bf16 otherwise."""
        n = tokens * width
        if self.style.name == "hf_bf16":
            from sim.hf_ops import hf_rope_bf16
            return hf_rope_bf16(self, q, tokens, width, name)
        if self.style.autocast:
            # HF rotate_half: neg of one half, cat, q*cos and rot*sin in fp32, add.
            neg = self.t(f"{name}.neg", n / 2, BF16)
            rot = self.t(f"{name}.rot", n, BF16)
            a = self.t(f"{name}.qcos", n, FP32)
            b = self.t(f"{name}.rsin", n, FP32)
            out = self.t(f"{name}.out", n, FP32)
            half = self.t(f"{name}.half", n / 2, BF16)
            self.fwd(Kernel(f"{name}.neg", "elementwise", (half,), (neg,)))
            self.fwd(Kernel(f"{name}.cat", "elementwise", (neg, half), (rot,)))
            self.fwd(Kernel(f"{name}.mul_cos", "elementwise", (q,), (a,)))
            self.fwd(Kernel(f"{name}.mul_sin", "elementwise", (rot,), (b,)))
            self.fwd(Kernel(f"{name}.add", "elementwise", (a, b), (out,)))
            g = {k: self.t(f"{name}.g_{k}", n, FP32) for k in ("out", "a", "b")}
            gb = {k: self.t(f"{name}.gb_{k}", n, BF16) for k in ("a", "b", "sa", "sb", "in")}
            gneg = self.t(f"{name}.g_neg", n / 2, BF16)
            self.bwd(
                Kernel(f"{name}.g_mul_cos", "elementwise", (g["out"],), (g["a"],)),
                Kernel(f"{name}.g_cast_a", "elementwise", (g["a"],), (gb["a"],)),
                Kernel(f"{name}.g_mul_sin", "elementwise", (g["out"],), (g["b"],)),
                Kernel(f"{name}.g_cast_b", "elementwise", (g["b"],), (gb["b"],)),
                Kernel(f"{name}.g_neg", "elementwise", (gneg,), (gneg,)),
                Kernel(f"{name}.g_slice_a", "elementwise", (gneg,), (gb["sa"],)),
                Kernel(f"{name}.g_slice_b", "elementwise", (gneg,), (gb["sb"],)),
                Kernel(f"{name}.g_sum_slices", "elementwise", (gb["sa"], gb["sb"]), (gb["in"],)),
                Kernel(f"{name}.g_sum", "elementwise", (gb["a"], gb["in"]), (gb["in"],)),
            )
            return out
        # torchtitan: x.float() -> view_as_complex -> * freqs_cis -> view_as_real -> type_as(x)
        f32 = self.t(f"{name}.f32", n, FP32)
        rot = self.t(f"{name}.rot", n, FP32)
        out = self.t(f"{name}.out", n, BF16)
        self.fwd(Kernel(f"{name}.to_fp32", "elementwise", (q,), (f32,)))
        self.fwd(Kernel(f"{name}.cmul", "elementwise", (f32,), (rot,)))
        self.fwd(Kernel(f"{name}.to_bf16", "elementwise", (rot,), (out,)))
        go = self.t(f"{name}.g_out", n, BF16)
        g32 = self.t(f"{name}.g_f32", n, FP32)
        grot = self.t(f"{name}.g_rot", n, FP32)
        gin = self.t(f"{name}.g_in", n, BF16)
        self.bwd(Kernel(f"{name}.g_to_fp32", "elementwise", (go,), (g32,)),
                 Kernel(f"{name}.g_cmul", "elementwise", (g32,), (grot,)),
                 Kernel(f"{name}.g_to_bf16", "elementwise", (grot,), (gin,)))
        return out

    def attention(self, m: ModelSpec, q: Tensor, k: Tensor, v: Tensor, batch: int, seq: int
                  ) -> Tensor:
        st = self.style
        tokens = batch * seq
        if st.autocast:
            # autocast casts fp32 q/k (after RoPE) to bf16 for SDPA; v is bf16 already.
            q = self.cast(q, tokens * m.q_dim, BF16, "sdpa.q_bf16")
            k = self.cast(k, tokens * m.kv_dim, BF16, "sdpa.k_bf16")
        o = self.t("sdpa.out", tokens * m.q_dim, BF16)
        lse = self.t("sdpa.lse", batch * m.heads * seq, FP32)
        fl = 2.0 * batch * seq * seq * m.q_dim   # causal half of 4*S^2*D*H per sequence
        self.fwd(Kernel("sdpa.fwd", "attention", (q, k, v), (o, lse), fl,
                        attn=(batch, m.heads, seq, m.head_dim, "fwd")))
        self.save(q, k, v, o, lse)
        go = self.t("sdpa.g_out", tokens * m.q_dim, BF16)
        gq = self.t("sdpa.g_q", tokens * m.q_dim, BF16)
        gk = self.t("sdpa.g_k", tokens * m.kv_dim, BF16)
        gv = self.t("sdpa.g_v", tokens * m.kv_dim, BF16)
        ks = [Kernel("sdpa.bwd", "attention", (go, q, k, v, o, lse), (gq, gk, gv), 2.5 * fl,
                     attn=(batch, m.heads, seq, m.head_dim, "bwd"))]
        if st.autocast:
            ks.append(self.grad_cast(gq, tokens * m.q_dim, FP32, "sdpa.g_q_fp32")[0])
            ks.append(self.grad_cast(gk, tokens * m.kv_dim, FP32, "sdpa.g_k_fp32")[0])
        self.bwd(*ks)
        return o

    def residual_add(self, x: Tensor, y: Tensor, tokens: float, h: int, name: str) -> Tensor:
        ab = self.style.act_bytes
        out = self.t(f"{name}.out", tokens * h, ab)
        self.fwd(Kernel(f"{name}", "elementwise", (x, y), (out,)))
        g = self.t(f"{name}.g_out", tokens * h, ab)
        if ab != BF16:
            # bf16 branch of an fp32 add: its gradient is cast back to bf16.
            self.bwd(self.grad_cast(g, tokens * h, BF16, f"{name}.g_branch_bf16")[0])
        return out

    def sum_grads(self, n: int, numel: float, nbytes: int, name: str) -> None:
        """Autograd summing the gradients of a tensor read by ``n`` ops (n-1 adds)."""
        ks = []
        for i in range(n - 1):
            a = self.t(f"{name}.g{i}a", numel, nbytes)
            b = self.t(f"{name}.g{i}b", numel, nbytes)
            ks.append(self.add_grads(a, b, numel, nbytes, f"{name}.g_sum{i}")[0])
        if ks:
            self.bwd(*ks)


# ---------------------------------------------------------------------- blocks
def qkv_projections(b: _Builder, m: ModelSpec, y: Tensor, tokens: float,
                    names: tuple[str, str, str] = ("q", "k", "v")
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """Query, key and value projections of the normalised input ``y`` over the widths in
    ``m`` (the whole model, or one tensor-parallel rank's heads), with RoPE on queries and
    keys. ``names``: HF q, k, v; torchtitan wq, wk, wv."""
    h = m.hidden
    q = b.linear(y, tokens, h, m.q_dim, names[0], bias=m.bias)
    k = b.linear(y, tokens, h, m.kv_dim, names[1], bias=m.bias)
    v = b.linear(y, tokens, h, m.kv_dim, names[2], bias=m.bias)
    if m.position == "rope":
        q = b.rope(q, tokens, m.q_dim, "rope_q")
        k = b.rope(k, tokens, m.kv_dim, "rope_k")
    return q, k, v


def attention_block(m: ModelSpec, style: Style, batch: int, seq: int, kv_cache: bool) -> Block:
    """Norm, q/k/v projections, rotary embedding, causal attention, output projection, residual."""
    b = _Builder("attn", style)
    tokens = batch * seq
    h = m.hidden
    x = b.t("in", tokens * h, style.act_bytes)
    b.block.inputs.append(x)
    # Residual stream gradient plus the branch gradient through the norm.
    b.sum_grads(2, tokens * h, style.act_bytes, "resid_in")
    y = b.norm(m, x, tokens, "norm")
    # Under autocast each projection casts y separately (3 reads of y, 3 fp32 input grads);
    # in bf16 they share y and their input gradients are summed.
    b.sum_grads(3, tokens * h, FP32 if style.autocast else BF16, "norm_out")
    q, k, v = qkv_projections(b, m, y, tokens)
    if kv_cache:
        # DynamicCache.update: torch.cat([empty, k]) and the same for v, kept until return.
        kc = Tensor("attn.cache_k", k.nbytes)   # same dtype as k after RoPE
        vc = b.t("cache_v", tokens * m.kv_dim, BF16)
        b.fwd(Kernel("cache_k", "elementwise", (k,), (kc,)))
        b.fwd(Kernel("cache_v", "elementwise", (v,), (vc,)))
        b.block.forward_scoped += [kc, vc]
    o = b.attention(m, q, k, v, batch, seq)
    out = b.linear(o, tokens, m.q_dim, h, "o", bias=m.bias)
    res = b.residual_add(x, out, tokens, h, "resid")
    b.block.outputs.append(res)
    return b.finish()


def mlp_projections(b: _Builder, m: ModelSpec, y: Tensor, tokens: float, f: int,
                    names: tuple[str, str, str] = ("gate", "up", "down")) -> Tensor:
    """The MLP between its normalised input ``y`` and its output projection's result:
    gate/up projections, SiLU and gate product (or the up projection and GELU), and the down
    projection, over an inner width ``f`` (the full ``ffn_hidden``, or one tensor-parallel
    rank's share). ``names``: the three projections' names (HF: gate, up, down; torchtitan:
    w1, w3, w2)."""
    h = m.hidden
    gate, up, down = names
    if m.mlp == "swiglu":
        g = b.linear(y, tokens, h, f, gate, bias=m.bias)
        u = b.linear(y, tokens, h, f, up, bias=m.bias)
        s = b.t("silu", tokens * f, BF16)
        prod = b.t("prod", tokens * f, BF16)
        b.fwd(Kernel("silu", "elementwise", (g,), (s,), activation_elements=tokens * f))
        b.fwd(Kernel("gate_mul", "elementwise", (s, u), (prod,)))
        b.save(g, s, u)
        gp = b.t("g_prod", tokens * f, BF16)
        gs = b.t("g_silu", tokens * f, BF16)
        gu = b.t("g_up", tokens * f, BF16)
        gg = b.t("g_gate", tokens * f, BF16)
        b.bwd(Kernel("g_gate_mul_s", "elementwise", (gp, u), (gs,)),
              Kernel("g_gate_mul_u", "elementwise", (gp, s), (gu,)),
              Kernel("g_silu", "elementwise", (gs, g), (gg,), activation_elements=tokens * f))
        act = prod
    else:
        u = b.linear(y, tokens, h, f, up, bias=m.bias)
        act = b.t("gelu", tokens * f, BF16)
        b.fwd(Kernel("gelu", "elementwise", (u,), (act,), activation_elements=tokens * f))
        b.save(u)
        ga = b.t("g_gelu", tokens * f, BF16)
        gu = b.t("g_up", tokens * f, BF16)
        b.bwd(Kernel("g_gelu", "elementwise", (ga, u), (gu,), activation_elements=tokens * f))
    return b.linear(act, tokens, f, h, down, bias=m.bias)


def mlp_block(m: ModelSpec, style: Style, batch: int, seq: int) -> Block:
    """Norm, gate/up projections, SiLU-gate (or GELU), down projection, residual."""
    b = _Builder("mlp", style)
    tokens = batch * seq
    h, f = m.hidden, m.ffn_hidden
    x = b.t("in", tokens * h, style.act_bytes)
    b.block.inputs.append(x)
    b.sum_grads(2, tokens * h, style.act_bytes, "resid_in")
    y = b.norm(m, x, tokens, "norm")
    if m.mlp == "swiglu":
        b.sum_grads(2, tokens * h, FP32 if style.autocast else BF16, "norm_out")
    out = mlp_projections(b, m, y, tokens, f)
    res = b.residual_add(x, out, tokens, h, "resid")
    b.block.outputs.append(res)
    return b.finish()


def embedding_block(m: ModelSpec, style: Style, batch: int, seq: int) -> Block:
    """Token (and learned position) embedding lookup; backward scatters into a dense grad."""
    b = _Builder("embed", style)
    tokens = batch * seq
    h = m.hidden
    wb = FP32 if style.autocast else BF16
    ids = b.t("ids", tokens, IDX)
    rows = b.t("rows", tokens * h, wb)
    out = b.t("out", tokens * h, style.act_bytes)
    b.fwd(Kernel("lookup", "elementwise", (ids, rows), (out,)))
    b.block.params += m.vocab * h
    gout = b.t("g_out", tokens * h, style.act_bytes)
    gtab = b.t("g_table", m.vocab * h, wb)
    # embedding_dense_backward: zero-filled [V, h] gradient, then index_add of the rows.
    b.bwd(Kernel("g_zero", "elementwise", (), (gtab,)),
          Kernel("g_index_add", "elementwise", (gout, ids), (rows,)))
    b.block.weight_grads.append(gtab)
    if m.position == "learned":
        b.block.params += m.max_positions * h
        pos = b.t("pos", seq * h, wb)
        out2 = b.t("out_pos", tokens * h, style.act_bytes)
        b.fwd(Kernel("add_pos", "elementwise", (out, pos), (out2,)))
        gpos = b.t("g_pos", m.max_positions * h, wb)
        b.bwd(Kernel("g_pos_sum", "elementwise", (gout,), (gpos,)))
        b.block.weight_grads.append(gpos)
        out = out2
    elif style.hf:
        # HF LlamaRotaryEmbedding, once per forward: a handful of [S, head_dim] kernels
        # (in bf16 also the casts of cos and sin to the hidden states' dtype).
        tab = b.t("rope_table", seq * m.head_dim, FP32)
        casts = ("cos_to_bf16", "sin_to_bf16") if not style.autocast else ()
        for name in ("pos_float", "inv_freq_mul", "cat", "cos", "sin", "scale_cos",
                     "scale_sin", *casts):
            b.fwd(Kernel(f"rope.{name}", "tiny", (tab,), (tab,)))
    b.block.outputs.append(out)
    return b.finish()


def head_block(m: ModelSpec, style: Style, batch: int, seq: int) -> Block:
    """Final norm, LM head over every position, cross-entropy in fp32."""
    b = _Builder("head", style)
    tokens = batch * seq
    h, vocab = m.hidden, m.vocab
    x = b.t("in", tokens * h, style.act_bytes)
    b.block.inputs.append(x)
    y = b.norm(m, x, tokens, "norm")
    logits = b.linear(y, tokens, h, vocab, "lm_head", float8=False)
    if m.tied_embeddings:
        # The shared matrix's parameters belong to the embedding block.
        b.block.params -= h * vocab
    # The bf16 logits stay referenced (model output / local) until the forward returns.
    b.block.forward_scoped.append(logits)
    n = tokens * vocab
    lf = b.t("logits_fp32", n, FP32)
    lsm = b.t("log_softmax", n, FP32)
    loss = b.t("loss", 1, FP32)
    b.fwd(Kernel("logits_float", "elementwise", (logits,), (lf,)))
    # A 128k-wide fp32 row does not fit in shared memory, so PyTorch's softmax kernel makes
    # three passes over it (max, sum of exponentials, output) and writes once.
    b.fwd(Kernel("log_softmax", "elementwise", (lf, lf, lf), (lsm,)))
    b.fwd(Kernel("nll_loss", "tiny", (lsm,), (loss,)))
    b.save(lsm)
    g_nll = b.t("g_nll", n, FP32)
    g_lsm = b.t("g_log_softmax", n, FP32)
    g_logits = b.t("lm_head.g_out", n, BF16)
    # log_softmax backward: sum of the gradient over the row, then grad - exp(out) * sum.
    b.bwd(Kernel("g_nll", "elementwise", (), (g_nll,)),
          Kernel("g_log_softmax", "elementwise", (g_nll, g_nll, lsm), (g_lsm,)),
          Kernel("g_logits_bf16", "elementwise", (g_lsm,), (g_logits,)))
    return b.finish()


# ---------------------------------------------------------------------- pricing
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
    """Of the saved bytes, those of the block's input (all a checkpointed layer keeps)."""
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


def _fuse(kernels: list[Kernel], keep: set[int], block: Block | None = None) -> list[Kernel]:
    """torch.compile: each run of memory-bound kernels between GEMM/attention kernels becomes
    the fused kernels inductor makes of it (:func:`sim.inductor.fuse_run`).

    A fused kernel reads the inputs produced outside it and writes the outputs that something
    outside it still needs (``keep`` holds ids of such tensors needed outside the run).
    ``block``: its weight gradients written by reductions are reductions over the tokens.
    """
    from sim.inductor import fuse_run

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
    ids = [id(t) for t in k.reads]
    read = sum(t.nbytes for t in k.reads)
    written = sum(t.nbytes for t in k.writes)
    return len(set(ids)) < len(ids) or written < 0.25 * read


def kernel_time(cm: ComputeModel, k: Kernel) -> float:
    """GPU time of one kernel."""
    if k.klass == "gemm":
        assert k.gemm is not None
        m_, kk, n, p = k.gemm
        return cm.gemm_time(m_, kk, n, p, fp8=k.fp8)  # type: ignore[arg-type]
    if k.klass == "attention":
        assert k.attn is not None
        bsz, heads, seq, hd, p = k.attn
        if k.attn_block is not None:
            q_len, kv_len = k.attn_block
            return cm.attention_time(bsz, heads, q_len, hd, p,  # type: ignore[arg-type]
                                     kv_seq=kv_len, causal=False)
        if k.attn_kv_seq and k.attn_kv_seq != seq:
            # Megatron splits each sequence in 2 x cp chunks so every rank gets an equal
            # share of the causal triangle: half of its queries x all keys.
            return 0.5 * cm.attention_time(bsz, heads, seq, hd, p,  # type: ignore[arg-type]
                                           kv_seq=k.attn_kv_seq, causal=False)
        return cm.attention_time(bsz, heads, seq, hd, p)  # type: ignore[arg-type]
    if k.klass == "tiny":
        return cm.kernel_min_s
    klass = "reduction" if k.klass == "elementwise" and is_reduction(k) else k.klass
    t = cm.membound_time(k.nbytes, klass)  # type: ignore[arg-type]
    if k.activation_elements:
        t = max(t, cm.kernel_min_s + cm.activation_time(k.activation_elements))
    return t


def _gpu_time(cm: ComputeModel, kernels: list[Kernel]) -> float:
    return sum(kernel_time(cm, k) for k in kernels)


def _cpu_time(kernels: list[Kernel], cpu_per_op: float, attn_cpu: float) -> float:
    return sum(attn_cpu if k.klass == "attention" else cpu_per_op for k in kernels)


def _stream_time(cm: ComputeModel, kernels: list[Kernel], cpu_per_op: float, attn_cpu: float
                 ) -> float:
    # The CPU issues kernels while the GPU runs them: a block takes the longer of the two
    # (bound by the GPU when kernels are long, by Python dispatch when they are short).
    return max(_gpu_time(cm, kernels), _cpu_time(kernels, cpu_per_op, attn_cpu))


def _transient_parts(kernels: list[Kernel], persistent: set[int],
                     releasable: dict[int, float]) -> tuple[float, ...]:
    """The tensors alive at the peak of bytes alive during a kernel sequence, over those held
    anyway, largest first, trimmed so they add up to the peak (released saved tensors make
    room for the first ones): the separate requests the caching allocator sees
    (:mod:`sim.allocator`); their sum is the transient peak.

    ``persistent``: tensors accounted elsewhere (saved, parameters, block inputs).
    ``releasable``: saved tensors that autograd frees after their last backward read; their
    release lowers the running total.
    """
    last_use: dict[int, int] = {}
    for i, k in enumerate(kernels):
        for t in k.reads + k.writes:
            last_use[id(t)] = i
    live: dict[int, float] = {}
    released = 0.0
    peak = 0.0
    at_peak: list[float] = []
    for i, k in enumerate(kernels):
        for t in k.writes:
            if id(t) not in persistent:
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


def price_block(block: Block, style: Style, cm: ComputeModel,
                cpu_per_op: tuple[float, float] | None = None) -> BlockCost:
    """Time and memory of a block under a compute model.

    ``cpu_per_op``: (forward, backward) CPU seconds to issue one kernel, when the framework's
    Python costs differ from plain PyTorch eager's.
    """
    fwd, bwd = block.forward, block.backward
    if style.compile:
        fwd = _fuse(fwd, _needed_outside(fwd, block), block)
        bwd = _fuse(bwd, _needed_outside(bwd, block), block)
        fwd_cpu = bwd_cpu = COMPILED_OP_CPU_S
    else:
        fwd_cpu, bwd_cpu = cpu_per_op or (EAGER_FWD_OP_CPU_S, EAGER_BWD_OP_CPU_S)
    fwd_s = _stream_time(cm, fwd, fwd_cpu, cm.attention_cpu_s("fwd"))
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
        forward_scoped_bytes=sum(t.nbytes for t in block.forward_scoped),
        weight_cast_bytes=sum(t.nbytes for t in block.weight_casts),
        fwd_transient_bytes=fwd_peak,
        fwd_transient_unsaved_bytes=unsaved_peak,
        bwd_transient_bytes=bwd_peak,
        weight_grad_bytes=sum(t.nbytes for t in block.weight_grads),
        params=block.params,
        early_stop_fwd_s=early,
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
    >>> from sim.compute import ComputeModel
    >>> from sim.model import ModelSpec
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


@lru_cache(maxsize=256)
def model_blocks(m: ModelSpec, style: Style, batch: int, seq: int, kv_cache: bool
                 ) -> tuple[Block, Block, Block, Block]:
    """(embedding, attention, MLP, head) blocks of one micro-batch."""
    return (embedding_block(m, style, batch, seq),
            attention_block(m, style, batch, seq, kv_cache),
            mlp_block(m, style, batch, seq),
            head_block(m, style, batch, seq))
