"""The builder that writes a block's kernels as PyTorch issues them, op by op.

:class:`_Builder` collects forward kernels and, per op, the backward kernels autograd runs for
it (in reverse op order), with the tensors autograd saves. Its ops (casts, linear, float8
linear, norms, rotary embedding, attention, residual add, gradient sums) follow the execution
:class:`~sim.workload.kernels.Style` described in :mod:`sim.workload.layer_ops`; Hugging Face's bf16
RMSNorm and
rotary embedding are in :mod:`sim.workload.hf_ops`, the rules its linears and fused norms share with
Megatron's in :mod:`sim.workload.layer_rules`.
"""

from __future__ import annotations

from dataclasses import replace

from sim.workload.kernels import BF16, FP32, Block, Kernel, Style, Tensor
from sim.workload.layer_rules import (
    FP8,
    bias_grad,
    cast_kernel,
    fused_norm_forward,
    linear16_gemms,
    linear_gemm,
    linear_params,
    rope_loops,
    scaled_cast,
    weight_mul_grad,
)
from sim.workload.model import ModelSpec


class _Builder:
    """Collects forward kernels and, per op, the backward kernels that undo it.

    Gradients are linked by identity, as autograd passes them: each op records the gradient
    tensor its backward reads for its output (:meth:`reads_grad`) and the ones it writes for
    its inputs (:meth:`writes_grad`); :meth:`finish` makes a tensor's one gradient the same
    object on both sides, or feeds its several gradients into the adds :meth:`sum_grads`
    placed for it. What reads what is then what torch.compile's fusion sees
    (:mod:`sim.workload.inductor`).
    """

    def __init__(self, name: str, style: Style) -> None:
        self.block = Block(name)
        self.style = style
        self._bwd_ops: list[list[Kernel]] = []
        self._input_casts: dict[int, Tensor] = {}
        self._grad_read: dict[int, Tensor] = {}
        self._grad_parts: dict[int, list[Tensor]] = {}
        self._grad_sums: dict[int, list[Kernel]] = {}

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

    def reads_grad(self, y: Tensor, g: Tensor) -> None:
        """The backward of ``y``'s producer reads ``g`` as ``y``'s gradient."""
        self._grad_read[id(y)] = g

    def writes_grad(self, x: Tensor, g: Tensor) -> None:
        """The backward of one of ``x``'s consumers writes ``g``, its part of ``x``'s
        gradient."""
        self._grad_parts.setdefault(id(x), []).append(g)

    def finish(self) -> Block:
        same = self._link_grads()
        for ops in reversed(self._bwd_ops):
            for k in ops:
                if any(id(t) in same for t in k.reads + k.writes):
                    k = replace(k, reads=tuple(same.get(id(t), t) for t in k.reads),
                                writes=tuple(same.get(id(t), t) for t in k.writes))
                self.block.backward.append(k)
        return self.block

    def _link_grads(self) -> dict[int, Tensor]:
        """Rewire the gradient sums placed for a tensor to add up its parts into the gradient
        its producer reads, and return the substitutions that make a tensor's one part and
        the gradient its producer reads the same object. A tensor whose parts do not match
        the sum placed for it keeps the sum's own tensors."""
        same: dict[int, Tensor] = {}
        for tid, group in self._grad_sums.items():
            parts = self._grad_parts.get(tid, [])
            if len(parts) != len(group) + 1:
                continue
            out = self._grad_read.get(tid)
            acc = parts[0]
            for i, k in enumerate(group):
                last = i == len(group) - 1
                dst = out if (last and out is not None) else k.writes[0]
                group[i] = replace(k, reads=(acc, parts[i + 1]), writes=(dst,))
                acc = dst
        for tid, g in self._grad_read.items():
            parts = self._grad_parts.get(tid, [])
            if tid not in self._grad_sums and len(parts) == 1 and parts[0] is not g:
                same[id(g)] = parts[0]
        for key, t in same.items():      # follow chains: a part may itself be substituted
            seen = {key}
            while id(t) in same and id(t) not in seen:
                seen.add(id(t))
                t = same[id(t)]
            same[key] = t
        return same

    # ------------------------------------------------------------------ ops
    def cast(self, x: Tensor, numel: float, to_bytes: int, name: str) -> Tensor:
        y = self.t(name, numel, to_bytes)
        self.fwd(cast_kernel(name, x, y, numel))
        return y

    def grad_cast(self, g: Tensor, numel: float, to_bytes: int, name: str) -> tuple[Kernel, Tensor]:
        y = self.t(name, numel, to_bytes)
        return cast_kernel(name, g, y, numel), y

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
            if st.float8_recipe == "mxfp8":
                from sim.workload.float8_mx import mx_linear
                return mx_linear(self, x, tokens, n_in, n_out, name, bias)
            if st.float8_recipe != "tensorwise":
                from sim.workload.float8_rowwise import rowwise_linear
                return rowwise_linear(self, x, tokens, n_in, n_out, name, bias,
                                      gw_hp=st.float8_recipe == "rowwise_with_gw_hp")
            return self.float8_linear(x, tokens, n_in, n_out, name, bias)
        self.block.params += linear_params(n_in, n_out, bias)
        x_fp32 = x.nbytes == tokens * n_in * FP32
        xb = x
        if st.autocast and x_fp32:
            # Eager autocast casts x once per linear; a compiled graph's common-subexpression
            # elimination leaves one cast of x, saved once for every linear that reads it.
            shared = self._input_casts.get(id(x)) if st.compile else None
            xb = shared or self.cast(x, tokens * n_in, BF16, f"{name}.in_bf16")
            self._input_casts[id(x)] = xb
        if st.autocast:
            w32 = self.t(f"{name}.w", n_in * n_out, FP32)
            wb = self.t(f"{name}.w_bf16", n_in * n_out, BF16)
            self.fwd(Kernel(f"{name}.w_cast", "elementwise", (w32,), (wb,)))
            self.block.weight_casts.append(wb)
        else:
            wb = self.t(f"{name}.w", n_in * n_out, BF16)
        y = self.t(f"{name}.out", tokens * n_out, BF16)
        gy = self.t(f"{name}.g_out", tokens * n_out, BF16)
        gxb = self.t(f"{name}.g_in", tokens * n_in, BF16)
        gwb = self.t(f"{name}.g_w", n_in * n_out, BF16)
        ks = linear16_gemms(self, name, xb, wb, y, gy, gxb, gwb, tokens, n_in, n_out)
        if st.autocast:
            # ToCopyBackward of the weight cast: the fp32 gradient AccumulateGrad keeps.
            k, gw = self.grad_cast(gwb, n_in * n_out, FP32, f"{name}.g_w_fp32")
            ks.append(k)
            self.block.weight_grads.append(gw)
        else:
            self.block.weight_grads.append(gwb)
        if bias:
            gb = self.t(f"{name}.g_b", n_out, FP32 if st.autocast else BF16)
            ks.append(bias_grad(name, gy, gb))
        gx = gxb
        if st.autocast and x_fp32:
            k, gx = self.grad_cast(gxb, tokens * n_in, FP32, f"{name}.g_in_fp32")
            ks.append(k)
        self.bwd(*ks)
        self.reads_grad(y, gy)
        self.writes_grad(x, gx)
        return y

    def float8_forward(self, x: Tensor, tokens: float, n_in: int, n_out: int, name: str,
                       bias: bool) -> tuple[Tensor, Tensor]:
        """A torchao ``Float8Linear``'s forward, every recipe alike: amax and cast of the bf16
        input and (unless FSDP2 all-gathers float8 weights) of the weight, the GEMM on FP8
        operands into bf16; autograd keeps the bf16 input. Returns (weight, output)."""
        self.block.params += linear_params(n_in, n_out, bias)
        w = self.t(f"{name}.w", n_in * n_out, BF16)
        x8 = self.t(f"{name}.in_fp8", tokens * n_in, FP8)
        w8 = self.t(f"{name}.w_fp8", n_in * n_out, FP8)
        y = self.t(f"{name}.out", tokens * n_out, BF16)
        cast_w = not self.style.float8_weights
        for k in scaled_cast(name, "in", x, (x8,), amax=True) + (
                scaled_cast(name, "w", w, (w8,), amax=True) if cast_w else []):
            self.fwd(k)
        self.fwd(linear_gemm(name, "fwd", (x8, w8), y, tokens, n_in, n_out, fp8=True))
        self.save(x)
        return w, y

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
        w, y = self.float8_forward(x, tokens, n_in, n_out, name, bias)
        cast_w = not self.style.float8_weights
        gy = self.t(f"{name}.g_out", tokens * n_out, BF16)
        g8a = self.t(f"{name}.g_out_fp8", tokens * n_out, FP8)
        g8b = self.t(f"{name}.g_out_fp8_t", tokens * n_out, FP8)
        w8b = self.t(f"{name}.w_fp8_bwd", n_in * n_out, FP8)
        x8b = self.t(f"{name}.in_fp8_bwd", tokens * n_in, FP8)
        gx = self.t(f"{name}.g_in", tokens * n_in, BF16)
        gw = self.t(f"{name}.g_w", n_in * n_out, BF16)
        # One amax of the gradient, then a cast per GEMM layout (two kernels, where
        # Transformer Engine writes both layouts in one).
        ks = [*scaled_cast(name, "g", gy, (g8a,), amax=True),
              Kernel(f"{name}.cast_g_t", "elementwise", (gy,), (g8b,)),
              *(scaled_cast(name, "w_bwd", w, (w8b,), amax=True) if cast_w else []),
              linear_gemm(name, "dgrad", (g8a, w8b), gx, tokens, n_in, n_out, fp8=True),
              *scaled_cast(name, "in_bwd", x, (x8b,), amax=True),
              linear_gemm(name, "wgrad", (g8b, x8b), gw, tokens, n_in, n_out, fp8=True)]
        self.low_precision_backward(ks, name, gy, gw, n_out, bias)
        return y

    def low_precision_backward(self, ks: list[Kernel], name: str, gy: Tensor, gw: Tensor,
                               n_out: int, bias: bool) -> None:
        """Register a torchao low-precision linear's backward kernels ``ks`` (float8 or MX),
        the bias gradient after them (bf16, from the bf16 output gradient ``gy``), and its
        bf16 weight gradient ``gw``."""
        if bias:
            gb = self.t(f"{name}.g_b", n_out, BF16)
            ks.append(bias_grad(name, gy, gb))
        self.bwd(*ks)
        self.block.weight_grads.append(gw)

    def rmsnorm(self, x: Tensor, tokens: float, h: int, name: str) -> Tensor:
        st = self.style
        if st.name == "hf_bf16" or (st.name == "bf16" and not st.fused_rmsnorm):
            from sim.workload.hf_ops import hf_rmsnorm_bf16
            return hf_rmsnorm_bf16(self, x, tokens, h, name)
        self.block.params += h
        if not st.autocast:
            # torch's fused RMSNorm kernel (F.rms_norm on CUDA): one read, one write, per-row rstd.
            y = self.t(f"{name}.out", tokens * h, BF16)
            rstd = self.t(f"{name}.rstd", tokens, FP32)
            fused_norm_forward(self, x, y, rstd, name)
            gy = self.t(f"{name}.g_out", tokens * h, BF16)
            gx = self.t(f"{name}.g_in", tokens * h, BF16)
            gw = self.t(f"{name}.g_w", h, BF16)
            # Backward stays here, not shared with Megatron's fused norm (megatron_ops._norm):
            # torch's rms_norm backward writes a bf16 weight gradient of h elements from one
            # rstd per row, Megatron's apex/TE kernel an fp32 one from two statistics per row.
            self.bwd(Kernel(f"{name}.bwd_input", "norm_fused", (gy, x, rstd), (gx,)),
                     Kernel(f"{name}.bwd_weight", "norm_fused", (gy, x, rstd), (gw,)))
            self.block.weight_grads.append(gw)
            self.reads_grad(y, gy)
            self.writes_grad(x, gx)
            return y
        # Hugging Face LlamaRMSNorm in fp32: pow, mean, add eps, rsqrt, mul, mul by weight.
        n = tokens * h
        r, xn = self.rms_core_forward(x, tokens, h, name)
        y = self.t(f"{name}.out", n, FP32)
        # The weight ([h]) broadcast over the tokens: the non-vectorised loop.
        self.fwd(Kernel(f"{name}.mul_w", "elementwise", (xn,), (y,), legacy_elements=n,
                        legacy_operands=3))
        self.save(x, r, xn)
        g = {k: self.t(f"{name}.g_{k}", n, FP32) for k in ("out", "xn", "wprod")}
        gw = self.t(f"{name}.g_w", h, FP32)
        core, g_in = self.rms_core_backward(g["xn"], x, r, tokens, h, name, f"{name}.g_in")
        self.bwd(
            # xn's gradient counts no read of the weight (h elements), unlike hf_ops's bf16
            # norm; the weight's gradient is the shared rule.
            Kernel(f"{name}.g_mul_w", "elementwise", (g["out"],), (g["xn"],),
                   legacy_elements=n, legacy_operands=3),
            *weight_mul_grad(name, g["out"], xn, g["wprod"], gw),
            *core,
        )
        self.block.weight_grads.append(gw)
        self.reads_grad(y, g["out"])
        self.writes_grad(x, g_in)
        return y

    def rms_core_forward(self, x32: Tensor, tokens: float, h: int, name: str
                         ) -> tuple[Tensor, Tensor]:
        """The fp32 heart of ``LlamaRMSNorm`` (pow, mean, add eps, rsqrt, mul) on an fp32
        input, as separate eager kernels; returns (rsqrt, normalised x). The autocast style
        runs it on the fp32 residual stream, the bf16 style (:mod:`sim.workload.hf_ops`) after its
        upcast."""
        n = tokens * h
        p = self.t(f"{name}.pow", n, FP32)
        var = self.t(f"{name}.var", tokens, FP32)
        var_eps = self.t(f"{name}.var_eps", tokens, FP32)
        r = self.t(f"{name}.rsqrt", tokens, FP32)
        xn = self.t(f"{name}.xn", n, FP32)
        self.fwd(Kernel(f"{name}.pow", "elementwise", (x32,), (p,)))
        self.fwd(Kernel(f"{name}.mean", "elementwise", (p,), (var,), row_elements=h))
        self.fwd(Kernel(f"{name}.add_eps", "tiny", (var,), (var_eps,)))
        self.fwd(Kernel(f"{name}.rsqrt", "tiny", (var_eps,), (r,)))
        # x times its row's rsqrt ([tokens, 1], broadcast): the non-vectorised loop.
        self.fwd(Kernel(f"{name}.mul", "elementwise", (x32, r), (xn,), legacy_elements=n,
                        legacy_operands=3))
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
            Kernel(f"{name}.g_mul_a", "elementwise", (g_xn, r), (g["xa"],),
                   legacy_elements=n, legacy_operands=3),
            Kernel(f"{name}.g_mul_b", "elementwise", (g_xn, x32), (g["xprod"],)),
            Kernel(f"{name}.g_r_sum", "elementwise", (g["xprod"],), (gr,), row_elements=h),
            Kernel(f"{name}.g_rsqrt", "tiny", (gr,), ()),
            # MeanBackward: the row gradient expanded over h and divided by it, a unary op
            # on a broadcast view (the non-vectorised loop).
            Kernel(f"{name}.g_mean", "elementwise", (), (g["mean"],), legacy_elements=n),
            Kernel(f"{name}.g_pow", "elementwise", (g["mean"], x32), (g["xb"],)),
            Kernel(f"{name}.g_sum", "elementwise", (g["xa"], g["xb"]), (g_in,)),
        ], g_in

    def layernorm(self, x: Tensor, tokens: float, h: int, name: str) -> Tensor:
        # GPT-style LayerNorm: one fused kernel each way (torch native_layer_norm).
        self.block.params += 2 * h
        ab = self.style.act_bytes
        y = self.t(f"{name}.out", tokens * h, ab)
        stats = self.t(f"{name}.stats", 2 * tokens, FP32)
        fused_norm_forward(self, x, y, stats, name)
        gy = self.t(f"{name}.g_out", tokens * h, ab)
        gx = self.t(f"{name}.g_in", tokens * h, ab)
        gwb = self.t(f"{name}.g_wb", 2 * h, FP32)
        # Not Megatron's kernel pair (megatron_ops._norm): here the weight kernel reads no row
        # statistics, although PyTorch's GammaBetaBackward reads mean and rstd too
        # (aten/src/ATen/native/cuda/layer_norm_kernel.cu); adding them would move numbers,
        # so the difference is kept until a behaviour-changing issue takes it.
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
            from sim.workload.hf_ops import hf_rope_bf16
            return hf_rope_bf16(self, q, tokens, width, name)
        if self.style.autocast:
            # HF rotate_half: neg of one half, cat, q*cos and rot*sin in fp32, add.
            neg = self.t(f"{name}.neg", n / 2, BF16)
            rot = self.t(f"{name}.rot", n, BF16)
            a = self.t(f"{name}.qcos", n, FP32)
            b = self.t(f"{name}.rsin", n, FP32)
            out = self.t(f"{name}.out", n, FP32)
            half = self.t(f"{name}.half", n / 2, BF16)
            # q is a transposed view of the projection and cos/sin broadcast over batch and
            # heads, so every op here but none of the vectorised ones runs the non-vectorised
            # loop; the products of bf16 q and fp32 cos/sin also cast (rope_loops).
            loops = rope_loops(n)
            self.fwd(Kernel(f"{name}.neg", "elementwise", (half,), (neg,), **loops["neg"]))
            self.fwd(Kernel(f"{name}.cat", "elementwise", (neg, half), (rot,), **loops["cat"]))
            self.fwd(Kernel(f"{name}.mul_cos", "elementwise", (q,), (a,), **loops["mul_cast"]))
            self.fwd(Kernel(f"{name}.mul_sin", "elementwise", (rot,), (b,),
                            **loops["mul_cast"]))
            self.fwd(Kernel(f"{name}.add", "elementwise", (a, b), (out,), **loops["mul"]))
            g = {k: self.t(f"{name}.g_{k}", n, FP32) for k in ("out", "a", "b")}
            gb = {k: self.t(f"{name}.gb_{k}", n, BF16) for k in ("a", "b", "sa", "sb", "in")}
            gneg = self.t(f"{name}.g_neg", n / 2, BF16)
            # CatBackward's narrow view of the rotated half's gradient (no copy); NegBackward
            # writes a new tensor from it.
            gview = self.t(f"{name}.g_x2", n / 2, BF16)
            self.bwd(
                Kernel(f"{name}.g_mul_cos", "elementwise", (g["out"],), (g["a"],),
                       **loops["mul"]),
                Kernel(f"{name}.g_cast_a", "elementwise", (g["a"],), (gb["a"],)),
                Kernel(f"{name}.g_mul_sin", "elementwise", (g["out"],), (g["b"],),
                       **loops["mul"]),
                Kernel(f"{name}.g_cast_b", "elementwise", (g["b"],), (gb["b"],)),
                Kernel(f"{name}.g_neg", "elementwise", (gview,), (gneg,), **loops["neg"]),
                Kernel(f"{name}.g_slice_a", "elementwise", (gneg,), (gb["sa"],),
                       **loops["neg"]),
                Kernel(f"{name}.g_slice_b", "elementwise", (gneg,), (gb["sb"],),
                       **loops["neg"]),
                Kernel(f"{name}.g_sum_slices", "elementwise", (gb["sa"], gb["sb"]), (gb["in"],)),
                Kernel(f"{name}.g_sum", "elementwise", (gb["a"], gb["in"]), (gb["in"],),
                       **loops["mul"]),
            )
            self.reads_grad(out, g["out"])
            self.writes_grad(q, gb["in"])
            return out
        # torchtitan: x.float() -> view_as_complex -> * freqs_cis -> view_as_real -> type_as(x)
        f32 = self.t(f"{name}.f32", n, FP32)
        rot = self.t(f"{name}.rot", n, FP32)
        out = self.t(f"{name}.out", n, BF16)
        # xq.float() widens (the casting loop); the complex product with freqs_cis, which
        # broadcasts over batch and heads, runs the non-vectorised loop over n/2 complex
        # elements; type_as narrows (vectorised).
        self.fwd(cast_kernel(f"{name}.to_fp32", q, f32, n))
        self.fwd(Kernel(f"{name}.cmul", "elementwise", (f32,), (rot,), legacy_elements=n / 2,
                        legacy_operands=3))
        self.fwd(Kernel(f"{name}.to_bf16", "elementwise", (rot,), (out,)))
        go = self.t(f"{name}.g_out", n, BF16)
        g32 = self.t(f"{name}.g_f32", n, FP32)
        grot = self.t(f"{name}.g_rot", n, FP32)
        gin = self.t(f"{name}.g_in", n, BF16)
        self.bwd(cast_kernel(f"{name}.g_to_fp32", go, g32, n),
                 Kernel(f"{name}.g_cmul", "elementwise", (g32,), (grot,),
                        legacy_elements=n / 2, legacy_operands=3),
                 Kernel(f"{name}.g_to_bf16", "elementwise", (grot,), (gin,)))
        self.reads_grad(out, go)
        self.writes_grad(q, gin)
        return out

    def attention(self, m: ModelSpec, q: Tensor, k: Tensor, v: Tensor, batch: int, seq: int
                  ) -> Tensor:
        st = self.style
        tokens = batch * seq
        q_arg, k_arg = q, k
        if st.autocast:
            # autocast casts fp32 q/k (after RoPE) to bf16 for SDPA; v is bf16 already.
            q = self.cast(q, tokens * m.q_dim, BF16, "sdpa.q_bf16")
            k = self.cast(k, tokens * m.kv_dim, BF16, "sdpa.k_bf16")
        o = self.t("sdpa.out", tokens * m.q_dim, BF16)
        lse = self.t("sdpa.lse", batch * m.heads * seq, FP32)
        fl = 2.0 * batch * seq * seq * m.q_dim   # causal half of 4*S^2*D*H per sequence
        masked = st.sdpa_mask
        k_in, v_in = k, v
        if masked and m.kv_dim < m.q_dim:
            # repeat_kv: grouped keys and values expanded to every query head. The compiled
            # graph saves the grouped ones and repeats them again for the backward (inductor's
            # partitioner recomputes a copy rather than save the bigger output).
            k_in = self.t("sdpa.k_rep", tokens * m.q_dim, BF16)
            v_in = self.t("sdpa.v_rep", tokens * m.q_dim, BF16)
            self.fwd(Kernel("sdpa.repeat_k", "elementwise", (k,), (k_in,)))
            self.fwd(Kernel("sdpa.repeat_v", "elementwise", (v,), (v_in,)))
        self.fwd(Kernel("sdpa.fwd", "attention", (q, k_in, v_in), (o, lse), fl,
                        attn=(batch, m.heads, seq, m.head_dim, "fwd"), attn_masked=masked))
        self.save(q, k, v, o, lse)
        go = self.t("sdpa.g_out", tokens * m.q_dim, BF16)
        gq = self.t("sdpa.g_q", tokens * m.q_dim, BF16)
        gk = self.t("sdpa.g_k", tokens * m.kv_dim, BF16)
        gv = self.t("sdpa.g_v", tokens * m.kv_dim, BF16)
        ks: list[Kernel] = []
        gk_in, gv_in = gk, gv
        if k_in is not k:
            k_b = self.t("sdpa.k_rep_bwd", tokens * m.q_dim, BF16)
            v_b = self.t("sdpa.v_rep_bwd", tokens * m.q_dim, BF16)
            gk_in = self.t("sdpa.g_k_rep", tokens * m.q_dim, BF16)
            gv_in = self.t("sdpa.g_v_rep", tokens * m.q_dim, BF16)
            ks += [Kernel("sdpa.repeat_k_bwd", "elementwise", (k,), (k_b,)),
                   Kernel("sdpa.repeat_v_bwd", "elementwise", (v,), (v_b,))]
            k_in, v_in = k_b, v_b
        ks.append(Kernel("sdpa.bwd", "attention", (go, q, k_in, v_in, o, lse),
                         (gq, gk_in, gv_in), 2.5 * fl,
                         attn=(batch, m.heads, seq, m.head_dim, "bwd"), attn_masked=masked))
        if gk_in is not gk:
            # The repeated heads' gradients summed back over each group.
            ks += [Kernel("sdpa.g_k_sum", "elementwise", (gk_in,), (gk,)),
                   Kernel("sdpa.g_v_sum", "elementwise", (gv_in,), (gv,))]
        gq_in, gk_out = gq, gk
        if st.autocast:
            kq, gq_in = self.grad_cast(gq, tokens * m.q_dim, FP32, "sdpa.g_q_fp32")
            kk, gk_out = self.grad_cast(gk, tokens * m.kv_dim, FP32, "sdpa.g_k_fp32")
            ks += [kq, kk]
        self.bwd(*ks)
        self.reads_grad(o, go)
        self.writes_grad(q_arg, gq_in)
        self.writes_grad(k_arg, gk_out)
        self.writes_grad(v, gv)
        return o

    def residual_add(self, x: Tensor, y: Tensor, tokens: float, h: int, name: str) -> Tensor:
        ab = self.style.act_bytes
        out = self.t(f"{name}.out", tokens * h, ab)
        # An fp32 stream plus a bf16 branch: the casting loop.
        mixed = tokens * h if x.nbytes != y.nbytes else 0.0
        self.fwd(Kernel(f"{name}", "elementwise", (x, y), (out,), cast_elements=mixed))
        g = self.t(f"{name}.g_out", tokens * h, ab)
        g_branch = g
        if ab != BF16:
            # bf16 branch of an fp32 add: its gradient is cast back to bf16.
            k, g_branch = self.grad_cast(g, tokens * h, BF16, f"{name}.g_branch_bf16")
            self.bwd(k)
        # The add passes its output's gradient on to the stream unchanged.
        self.reads_grad(out, g)
        self.writes_grad(x, g)
        self.writes_grad(y, g_branch)
        return out

    def sum_grads(self, n: int, numel: float, nbytes: int, name: str,
                  of: Tensor | None = None) -> None:
        """Autograd summing the gradients of a tensor read by ``n`` ops (n-1 adds). ``of``:
        that tensor, whose gradient parts :meth:`finish` feeds into the adds."""
        ks: list[Kernel] = []
        for i in range(n - 1):
            a = self.t(f"{name}.g{i}a", numel, nbytes)
            b = self.t(f"{name}.g{i}b", numel, nbytes)
            ks.append(self.add_grads(a, b, numel, nbytes, f"{name}.g_sum{i}")[0])
        if ks:
            self.bwd(*ks)
            if of is not None:
                self._grad_sums[id(of)] = self._bwd_ops[-1]
