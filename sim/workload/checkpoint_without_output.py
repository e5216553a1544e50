"""What Megatron-Core's output-discarding checkpoint costs beyond the kernels it re-runs.

``tensor_parallel.CheckpointWithoutOutput`` (megatron/core/tensor_parallel/random.py
L483-615 at core_v0.14.0; the class is the same at the 25.11 container's 0d8e0714 and the
26.02 container's b0cc2706, which change only the RNG tracker's names) runs a function under
``no_grad``, saves its inputs, frees its outputs' storages once their consumer has run
(``discard_output_and_register_recompute``) and re-runs the function in a hook on the
consumer's output gradient. Megatron-Core wraps four functions in it: MLA's
``qkv_up_proj_and_rope_apply`` (``mla_up_proj``), the input and pre-MLP layer norms
(``layernorm``, transformer_layer.py) and the MoE experts' activation (``moe_act``,
moe/experts.py ``TEGroupedMLP``). Each pays, beyond re-running the function's kernels, the
same three things, counted here once for all of them (:func:`checkpoint_calls`,
:func:`restore_copy`) and priced as the layer's other Python-level calls are (a plain torch
call at :data:`sim.hardware.compute.EAGER_FWD_OP_CPU_S`, a module call at the framework's
per-call cost):

* host calls in forward (``checkpoint``, ``CheckpointWithoutOutputFunction.forward``,
  ``discard_output_and_register_recompute``): the checkpoint object, ``_get_all_rng_states``
  (the CPU and CUDA generator states and the RNG tracker's: 3), ``apply``, ``no_grad``,
  ``save_for_backward``, ``register_hook`` (:data:`FWD_FIXED` = 8), one ``detach`` per tensor
  input (``detach_variable``) and one ``untyped_storage().resize_(0)`` per output;
* host calls in backward (``_recompute`` and the Function's backward):
  ``_is_checkpoint_valid``, ``_fork_rng`` (the three states read and set back: 6),
  ``_set_all_rng_states`` (3), ``enable_grad``, then ``saved_tensors`` and the nested
  ``torch.autograd.backward`` (:data:`BWD_FIXED` = 13), the function's own calls again, per
  output the storage's ``size``, ``resize_`` and ``copy_`` (3), and one ``.grad`` per tensor
  input;
* under Transformer Engine's recompute contexts (``self.fp8``): forward
  ``is_fp8_enabled``, ``get_fp8_recipe``, ``activation_recompute_forward`` (3), backward
  ``activation_recompute_forward`` and ``fp8_autocast`` (2). ``CheckpointWithoutOutput(fp8=
  False)`` sets ``self.fp8 = fp8 is not None``, so the layer norms' and the activation's
  checkpoints (built with no argument) always take this branch; MLA's passes ``config.fp8``
  (``None`` in 16-bit training) and takes it only under FP8;
* a device copy of each recomputed output into the storage the forward freed
  (``output.untyped_storage().copy_(recomputation_output.untyped_storage())``), and the
  recomputed tensors stay referenced (``ctx.outputs``) until the checkpoint's own backward,
  after its consumer's: both copies are live through the consumer's backward.
"""

from __future__ import annotations

from collections.abc import Sequence

from sim.workload.kernels import Kernel, Tensor

FWD_FIXED = 8
"""Forward host calls of any checkpoint, before its inputs and outputs (see the module)."""
BWD_FIXED = 13
"""Backward host calls of any checkpoint, before its re-run, outputs and inputs."""
RESTORE_CALLS = 3
"""Per output: the recomputed storage's ``size``, ``resize_`` and ``copy_``."""
TE_CONTEXT_CALLS = (3, 2)
"""Transformer Engine's recompute contexts (forward, backward) when ``self.fp8``."""

# The functions the checkpoints wrap, their tensor inputs and outputs and their own calls
# (Megatron-Core 0d8e0714 / b0cc2706):
LAYERNORM_IO = (1, 1)
"""``self.pre_mlp_layernorm(hidden_states)`` / ``self.input_layernorm(...)``: one input, one
output; its re-run is one module call (Transformer Engine's RMSNorm / LayerNorm) and no plain
torch call."""
LAYERNORM_MODULES = 1
MOE_ACT_IO = (2, 1)
"""``bias_act_func(intermediate_parallel, bias_parallel, permuted_probs)``: the fc1 output and
the probs are tensors, fc1's bias ``None`` (fc1 adds it in its GEMM, ``skip_bias_add=False``);
one output."""
MOE_ACT_RERUN = {"swiglu": 2, "clamped_geglu": 7}
"""Plain calls of ``bias_act_func``'s re-run (``fusions/fused_bias_swiglu.py``,
``fused_bias_geglu.py``): ``weighted_bias_swiglu_impl``'s ``view`` and ``apply`` (2-D
input: no second view); GPT-OSS's ``weighted_bias_quick_geglu_impl`` with a clamp value:
``chunk``, two ``clamp``, ``cat``, ``view``, ``torch.tensor(linear_offset, device=...)`` and
``apply`` (7)."""


def checkpoint_calls(inputs: int, outputs: int, rerun: int, te_contexts: bool
                     ) -> tuple[int, int]:
    """(forward, backward) plain torch calls of one ``CheckpointWithoutOutput`` on the host.

    Parameters
    ----------
    inputs, outputs
        Tensor inputs and outputs of the checkpointed function.
    rerun
        The function's own plain calls, made again in backward (its module calls are priced
        apart, at the module-call cost).
    te_contexts
        Whether the checkpoint enters Transformer Engine's recompute contexts (``self.fp8``).

    Examples
    --------
    MLA's ``mla_up_proj`` (four inputs, the query, key and value; twelve calls in the re-run
    with fused rotary embedding; 16-bit: no TE contexts), the pre-MLP norm, GPT-OSS's
    activation:

    >>> checkpoint_calls(4, 3, 12, te_contexts=False)
    (15, 38)
    >>> checkpoint_calls(*LAYERNORM_IO, 0, te_contexts=True)
    (13, 19)
    >>> checkpoint_calls(*MOE_ACT_IO, MOE_ACT_RERUN["clamped_geglu"], te_contexts=True)
    (14, 27)
    """
    f = FWD_FIXED + inputs + outputs
    b = BWD_FIXED + rerun + RESTORE_CALLS * outputs + inputs
    if te_contexts:
        f, b = f + TE_CONTEXT_CALLS[0], b + TE_CONTEXT_CALLS[1]
    return f, b


def restore_copy(name: str, outputs: Sequence[Tensor]) -> Kernel:
    """The device copy of each recomputed output into the storage its forward freed: reads
    the recomputed tensors, writes the restored ones (``outputs``). The recomputed tensors'
    bytes (``sum(t.nbytes for t in kernel.reads)``) are what both copies hold beyond one.

    Examples
    --------
    >>> k = restore_copy("pre_mlp_norm.restore", [Tensor("norm.out", 64.0)])
    >>> k.klass, [t.name for t in k.reads], k.nbytes
    ('elementwise', ['norm.out.recomputed'], 128.0)
    """
    outs = tuple(outputs)
    fresh = tuple(Tensor(f"{t.name}.recomputed", t.nbytes) for t in outs)
    return Kernel(name, "elementwise", fresh, outs)
