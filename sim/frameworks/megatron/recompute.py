"""Megatron-Core's selective recomputation by module (``--recompute-modules``).

With ``--recompute-granularity selective`` Megatron-Core recomputes the submodules
``TransformerConfig.recompute_modules`` names (default ``["core_attn"]``;
megatron/core/transformer/transformer_config.py). Two mechanisms, as the source has them:

* **output-discarding checkpoints** (``tensor_parallel.CheckpointWithoutOutput``,
  megatron/core/tensor_parallel/random.py): the function runs under ``no_grad`` (nothing
  inside it is saved), its inputs are saved, and once its consumer has run
  ``discard_output_and_register_recompute`` frees the output's storage, so whatever the
  consumer saved of it is gone too; a hook on the consumer's output gradient re-runs the
  function at the start of the consumer's backward:

  - ``layernorm`` (transformer_layer.py): the input and pre-MLP norms where they are their
    own modules. Transformer Engine's layer spec fuses the input norm into the QKV linear and
    a dense layer's pre-MLP norm into fc1 (``IdentityOp``, models/gpt/gpt_layer_specs.py), so
    only an MoE layer's pre-MLP norm and MLA's input norm are; the local spec keeps both.
    Freed: the norm's statistics and the norm output as its consumers saved it (under FP8
    ``set_for_recompute_input_layernorm`` / ``set_save_original_input`` make them save the
    16-bit input, which is the discarded one; they quantize it again in backward).
  - ``moe_act`` (moe/experts.py ``TEGroupedMLP``): the weighted activation between the grouped
    fc1 and fc2; freed: fc2's saved input (``set_save_original_input`` under FP8).
  - ``mla_up_proj`` (multi_latent_attention.py ``qkv_up_proj_and_rope_apply``): the latent
    norms fused into the up projections, the up projections (their inputs gathered again
    under sequence parallelism), the rotary embedding and the concatenations; freed: all
    they saved and the query, key and value core attention saved.

* **whole checkpoints** (``tensor_parallel.checkpoint`` / ``te_checkpoint``): the module's
  input is saved, nothing inside; its forward re-runs, collectives included, just before its
  backward and what it saves lives until its backward ends:

  - ``core_attn``: core attention (``CORE_FWD`` in :mod:`sim.frameworks.megatron.layer`,
    priced there as before);
  - ``mlp``: a dense layer's MLP (with Transformer Engine its fused pre-MLP norm);
  - ``moe``: the whole MoE layer (router, dispatch, experts, combine, shared experts);
  - ``shared_experts``: the shared experts' MLP.

With ``moe`` the layer's ``moe_act`` and ``shared_experts`` checkpoints would nest inside the
re-run; they are not counted again (the MoE layer's saved activations are dropped whole).

Each output-discarding checkpoint also pays its own host calls, the copy of its recomputed
outputs into the freed storages and both copies through its consumer's backward
(:mod:`sim.workload.checkpoint_without_output`, one rule for ``layernorm``, ``moe_act`` and
``mla_up_proj``). Not yet charged: a dense layer's own pre-MLP norm checkpoint (local spec
only) beyond its kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from sim.frameworks.common.base import JobContext
from sim.hardware.compute import EAGER_FWD_OP_CPU_S, ComputeModel
from sim.workload.checkpoint_without_output import (
    LAYERNORM_IO,
    LAYERNORM_MODULES,
    MOE_ACT_IO,
    MOE_ACT_RERUN,
    checkpoint_calls,
    restore_copy,
)
from sim.workload.kernels import Block, Kernel, Tensor
from sim.workload.layer_ops import kernel_time
from sim.workload.megatron_mla import (
    MLA_UP_CKPT_MODULES,
    mla_up_checkpoint_calls,
    mla_up_restore,
)

if TYPE_CHECKING:
    from sim.frameworks.megatron.shape import MegatronShape
    from sim.scenario import MegatronOptions

Module = Literal["core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                 "shared_experts"]
DEFAULT_MODULES: frozenset[str] = frozenset({"core_attn"})
"""``TransformerConfig.recompute_modules`` when unset."""
KEY = "framework.recompute_modules"

MLA_UP_KERNELS = frozenset({"q_latent_norm", "q_up", "q_proj", "kv_latent_norm", "kv_up",
                            "rope", "cat_query", "cat_key", "value_contiguous"})
"""Kernel prefixes of MLA's ``qkv_up_proj_and_rope_apply`` (:mod:`sim.workload.megatron_mla`)."""
MLA_UP_SAVED = frozenset({"q_latent_norm.stats", "kv_latent_norm.stats", "q_latent_norm.out",
                          "kv_latent_norm.out", "q_up.in_shard", "kv_up.in_shard",
                          "q_up.in_fp8_t", "kv_up.in_fp8_t", "q_proj.in_fp8_t", "query",
                          "key", "value", "q_up.out", "q_proj.out"})
"""What the up projections save inside the checkpoint and the outputs core attention saves
(with ``apply_rope_fusion`` the query is the q projection's output, rotated in place);
the checkpoint's inputs (the latents before their norms) stay."""
ATTN_NORM_OUT = frozenset({"qkv_in", "qkv_in_shard", "qkv.in_fp8_t", "q_down.in_fp8_t",
                           "kv_down.in_fp8_t", "q_proj.in_fp8_t"})
"""The input norm's output as the attention's first linears save it."""
FIRST_LINEARS = ("qkv", "q_down", "kv_down", "q_proj")


def recompute_modules(ac: str, opts: MegatronOptions) -> frozenset[str]:
    """The modules recomputed: ``recompute_modules`` (default ``core_attn``) under selective
    granularity, none otherwise (full recomputation is the layer builder's own)."""
    if ac != "selective":
        return frozenset()
    if opts.recompute_modules is None:
        return DEFAULT_MODULES
    return frozenset(opts.recompute_modules)


def check_recompute(ctx: JobContext, opts: MegatronOptions) -> None:
    """Refuse what Megatron-Core's ``TransformerConfig.__post_init__`` refuses."""
    mods = opts.recompute_modules
    if mods is None:
        return
    s, m = ctx.scenario, ctx.model
    ctx.require(s.training.activation_checkpointing == "selective", KEY,
                "recompute_modules needs training.activation_checkpointing: selective "
                "(Megatron-Core's recompute_granularity selective)")
    # "moe_act in recompute_modules is only supported with moe_grouped_gemm": the MoE
    # layers are modelled with TE's grouped GEMMs, so a model with experts has it.
    ctx.require("moe_act" not in mods or m.moe is not None, KEY,
                "moe_act needs the MoE grouped GEMM (a model with experts)")
    ctx.require("mla_up_proj" not in mods or m.mla is not None, KEY,
                "mla_up_proj is only supported with multi-latent attention")
    ctx.require("shared_experts" not in mods or m.moe is None or not m.moe.shared
                or not opts.moe_shared_expert_overlap, KEY,
                "shared_experts recompute cannot work with moe_shared_expert_overlap")
    ctx.require(not ({"moe_act", "layernorm"} & set(mods)) or s.training.precision != "fp8"
                or opts.fp8_recipe != "delayed", KEY,
                "delayed FP8 scaling does not support moe_act and layernorm recompute "
                "(Megatron-Core); use fp8_recipe tensorwise")


@dataclass(frozen=True)
class Recompute:
    """What the modules beyond ``core_attn`` drop and re-run, per layer on one rank."""

    modules: frozenset[str] = DEFAULT_MODULES
    attn_freed: float = 0.0
    """Bytes the attention half no longer holds (input norm, MLA up projection)."""
    attn_s: float = 0.0
    """GPU seconds re-run at the attention's backward."""
    attn_gather: float = 0.0
    """Bytes of the MLA latents gathered again (sequence parallelism)."""
    attn_cpu_fwd: float = 0.0
    """Host seconds of the ``mla_up_proj`` checkpoint's bookkeeping in forward."""
    attn_cpu_bwd: float = 0.0
    """Host seconds of its recompute in backward (the re-run's calls, the RNG states, the
    outputs restored: :func:`sim.workload.megatron_mla.mla_up_checkpoint_calls`)."""
    attn_transient: float = 0.0
    """Bytes live only through the attention's backward: the recomputed query, key and value
    beside the storages they were copied into
    (:func:`~sim.workload.megatron_mla.mla_up_restore`)."""
    norm_freed_dense: float = 0.0
    """A dense layer's pre-MLP norm (its own module: local spec only)."""
    norm_s_dense: float = 0.0
    mlp_freed: float = 0.0
    """``mlp``: what a dense MLP saves beyond its input."""
    norm_freed_moe: float = 0.0
    """An MoE layer's pre-MLP norm output and statistics as its consumers saved them."""
    norm_s_moe: float = 0.0
    norm_cpu_fwd: float = 0.0
    """Host seconds of the pre-MLP norm's checkpoint in forward
    (:func:`sim.workload.checkpoint_without_output.checkpoint_calls`)."""
    norm_cpu_bwd: float = 0.0
    """Host seconds of its recompute hook and backward (the norm module called again)."""
    norm_transient: float = 0.0
    """Bytes of the recomputed norm output, live beside the restored one through the MoE
    layer's backward."""
    act_freed: float = 0.0
    """``moe_act``: fc2's saved input on the pace-setting rank."""
    act_s: float = 0.0
    act_cpu_fwd: float = 0.0
    """Host seconds of the activation's checkpoint in forward."""
    act_cpu_bwd: float = 0.0
    """Host seconds of its recompute hook (the activation's Python again) and backward."""
    act_transient: float = 0.0
    """Bytes of the recomputed activation, live beside the restored one through fc2's
    backward."""
    shared_freed: float = 0.0
    """``shared_experts``: what the shared experts save beyond their input."""
    moe_freed: float = 0.0
    """``moe``: what the MoE layer saves beyond its input."""

    @property
    def dense_freed(self) -> float:
        """Bytes a dense layer holds less from forward to backward."""
        return self.attn_freed + self.norm_freed_dense + self.mlp_freed

    @property
    def moe_layer_freed(self) -> float:
        """Bytes an MoE layer holds less from forward to backward."""
        return (self.attn_freed + self.norm_freed_moe + self.act_freed + self.shared_freed
                + self.moe_freed)


def _saved(block: Block | None, names: frozenset[str] | None = None,
           exclude: frozenset[str] = frozenset()) -> float:
    """Bytes ``block`` saves, of the tensors named ``names`` (all if None) less ``exclude``
    (names without the block's prefix)."""
    if block is None:
        return 0.0
    total = 0.0
    for tn in block.saved:
        short = tn.name.split(".", 1)[1] if tn.name.startswith(block.name + ".") else tn.name
        if (names is None or short in names) and short not in exclude:
            total += tn.nbytes
    return float(total)


def _kernels(block: Block | None, pick: object) -> list[Kernel]:
    """Forward kernels of ``block`` that ``pick(kernel)`` selects."""
    if block is None:
        return []
    return [k for k in block.forward if pick(k)]  # type: ignore[operator]


def _input_casts(block: Block | None, linears: tuple[str, ...]) -> list[Kernel]:
    """FP8: the input quantization of ``linears``, run again in backward when they saved
    the 16-bit input (``save_original_input``)."""
    return _kernels(block, lambda k: k.name in {f"{n}.{p}" for n in linears
                                                for p in ("amax_in", "cast_in")})


def _mla_up(k: Kernel) -> bool:
    return k.name.split(".")[0] in MLA_UP_KERNELS and not k.name.endswith(("amax_w", "cast_w"))


def _moe_blocks(s: MegatronShape) -> tuple[Block, Block | None, list[Block]]:
    """(router, shared experts, every MoE block) of one layer, the experts the pace-setting
    rank's."""
    assert s.moe is not None
    ops = s.moe.pace.ops if s.moe.pace is not None else s.moe.ops
    return s.moe.ops.router, s.moe.ops.shared, [ops.experts, *(
        b for b in s.moe.ops.blocks if b.name != "moe_experts")]


def _outputs(block: Block | None, pick: object) -> list[Tensor]:
    """The tensors the forward kernels ``pick(kernel)`` selects write first (a norm's output,
    not its statistics; the activation's output)."""
    return [k.writes[0] for k in _kernels(block, pick) if k.writes]


def _checkpoint_cost(r: dict[str, float], key: str, io: tuple[int, int], rerun: int,
                     modules: int, te_contexts: bool, cpu_call: float,
                     restore: Kernel) -> None:
    """Add one ``CheckpointWithoutOutput``'s host seconds (``{key}_cpu_fwd``, ``_cpu_bwd``:
    plain calls at an eager op's cost, the re-run's module calls at ``cpu_call``) and the
    recomputed outputs' bytes (``{key}_transient``) to ``r``."""
    f, b = checkpoint_calls(*io, rerun, te_contexts)
    for name, v in ((f"{key}_cpu_fwd", f * EAGER_FWD_OP_CPU_S),
                    (f"{key}_cpu_bwd", b * EAGER_FWD_OP_CPU_S + modules * cpu_call),
                    (f"{key}_transient", float(sum(t.nbytes for t in restore.reads)))):
        r[name] = r.get(name, 0.0) + v


def _is_norm(k: Kernel) -> bool:
    return k.name.startswith("norm")


def recompute_plan(s: MegatronShape, cm: ComputeModel | None, cpu_call: float = 0.0
                   ) -> tuple[Recompute, dict[str, float]]:
    """The per-layer :class:`Recompute` of the job (GPU seconds only with ``cm``) and the
    hardware FLOPs re-run per layer: ``{"dense": ..., "moe": ...}``. ``cpu_call``: host
    seconds of a module call (the builder's ``cpu_call``), for the host time of the
    output-discarding checkpoints' re-runs (``mla_up_proj``, ``layernorm``, ``moe_act``)."""
    mods, b = s.recompute, s.blocks
    te = not s.legacy
    runs: dict[str, list[Kernel]] = {"attn": [], "dense": [], "moe_norm": [], "act": []}
    extra = {"dense": 0.0, "moe": 0.0}
    r: dict[str, float] = {}
    attn = b["attn_main"]
    attn_names: set[str] = set()
    if "layernorm" in mods and (not te or s.model.mla is not None):
        # The input norm is its own module (IdentityOp only when TE fuses it into QKV).
        r["attn_freed"] = _saved(b["attn_pre"], frozenset({"norm.stats"}))
        attn_names |= ATTN_NORM_OUT
        runs["attn"] += list(b["attn_pre"].forward)
        restore = restore_copy("input_norm.restore", _outputs(b["attn_pre"], _is_norm))
        runs["attn"].append(restore)
        # CheckpointWithoutOutput() with no argument: TE's recompute contexts always.
        _checkpoint_cost(r, "attn", LAYERNORM_IO, 0, LAYERNORM_MODULES, True, cpu_call,
                         restore)
        if s.lay.fp8:
            runs["attn"] += _input_casts(attn, FIRST_LINEARS)
    if "mla_up_proj" in mods and s.model.mla is not None:
        attn_names |= MLA_UP_SAVED
        runs["attn"] += _kernels(attn, _mla_up)
        restore = mla_up_restore(attn)
        runs["attn"].append(restore)
        r["attn_transient"] = r.get("attn_transient", 0.0) + \
            float(sum(t.nbytes for t in restore.reads))
        f, bw = mla_up_checkpoint_calls(s.lay.fp8 is not None, s.lay.rope_fusion)
        r["attn_cpu_fwd"] = r.get("attn_cpu_fwd", 0.0) + f * EAGER_FWD_OP_CPU_S
        r["attn_cpu_bwd"] = r.get("attn_cpu_bwd", 0.0) + bw * EAGER_FWD_OP_CPU_S + \
            MLA_UP_CKPT_MODULES * cpu_call
        if s.sp:
            mla = s.model.mla
            r["attn_gather"] = float(s.act * s.tokens * ((mla.q_lora_rank or s.h)
                                                         + mla.kv_lora_rank))
    if attn_names:
        r["attn_freed"] = r.get("attn_freed", 0.0) + _saved(attn, frozenset(attn_names))
    if "layernorm" in mods and not te:
        r["norm_freed_dense"] = _saved(b["mlp_pre"], frozenset({"norm.stats"})) + \
            _saved(b["mlp_main"], frozenset({"fc1_in", "fc1_in_shard"}))
        runs["dense"] += list(b["mlp_pre"].forward)
    if "mlp" in mods:
        # TE: the checkpointed MLP is fused norm + fc1 ... fc2 on the layer's hidden states;
        # local: the norm output is the checkpoint's input, saved by it.
        r["mlp_freed"] = (_saved(b["mlp_pre"], frozenset({"norm.stats"}))
                          + _saved(b["mlp_main"])) if te else \
            _saved(b["mlp_main"], exclude=frozenset({"fc1_in", "fc1_in_shard"}))
        extra["dense"] += b["mlp_main"].flops_fwd
    if s.moe is not None:
        router, shared, blocks = _moe_blocks(s)
        whole = "moe" in mods
        if "layernorm" in mods:
            # The router's gate and (unless the layer is checkpointed whole, when the
            # checkpoint's own input is this output) the shared experts' fc1 saved it; under
            # FP8 fc1 saves the 16-bit input instead of its FP8 copy
            # (MoELayer.set_for_recompute_pre_mlp_layernorm), or the shared experts' own
            # checkpoint does (shared_experts: its freed bytes count the FP8 copy).
            own = "shared_experts" in mods and shared is not None
            names = frozenset({"in"} if own else {"in", "fc1.in_fp8_t"})
            r["norm_freed_moe"] = _saved(b["mlp_pre"], frozenset({"norm.stats"})) + \
                _saved(router, frozenset({"in"})) + (0.0 if whole else _saved(shared, names))
            runs["moe_norm"] += list(b["mlp_pre"].forward)
            if s.lay.fp8 and not whole and not own:
                runs["moe_norm"] += _input_casts(shared, ("fc1",))
            restore = restore_copy("pre_mlp_norm.restore", _outputs(b["mlp_pre"], _is_norm))
            runs["moe_norm"].append(restore)
            _checkpoint_cost(r, "norm", LAYERNORM_IO, 0, LAYERNORM_MODULES, True, cpu_call,
                             restore)
        if whole:
            r["moe_freed"] = sum(_saved(x) for x in blocks) - _saved(router, frozenset({"in"}))
            extra["moe"] += s.moe.flops_fwd
        else:
            if "moe_act" in mods:
                experts = blocks[0]
                # GPT-OSS's clamp and cat run inside the checkpointed function too
                # (sim.workload.gpt_oss_ops): their output is not kept either.
                r["act_freed"] = _saved(experts, frozenset({"act", "fc2.in_fp8_t",
                                                            "glu_clamped"}))
                runs["act"] += _kernels(experts, lambda k: k.name == "weighted_act"
                                        or k.name.startswith("weighted_act."))
                if s.lay.fp8:
                    runs["act"] += _input_casts(experts, ("fc2",))
                restore = restore_copy("moe_act.restore", _outputs(
                    experts, lambda k: k.name == "weighted_act"))
                runs["act"].append(restore)
                clamp = s.model.activation_clamp is not None
                _checkpoint_cost(r, "act", MOE_ACT_IO,
                                 MOE_ACT_RERUN["clamped_geglu" if clamp else "swiglu"], 0,
                                 True, cpu_call, restore)
            if "shared_experts" in mods and shared is not None:
                r["shared_freed"] = _saved(shared, exclude=frozenset({"in"}))
                extra["moe"] += shared.flops_fwd
    gemm = sum(k.flops for k in runs["attn"])
    extra["dense"] += gemm + sum(k.flops for k in runs["dense"])
    extra["moe"] += gemm + sum(k.flops for k in runs["moe_norm"] + runs["act"])
    if cm is not None:
        secs = {key: sum(kernel_time(cm, k) for k in ks) for key, ks in runs.items()}
        r.update(attn_s=secs["attn"], norm_s_dense=secs["dense"], norm_s_moe=secs["moe_norm"],
                 act_s=secs["act"])
    return Recompute(modules=mods, **r), extra
