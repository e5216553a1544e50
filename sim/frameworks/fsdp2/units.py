"""FSDP2's ``fully_shard`` units and what every pipeline stage of one step shares.

Units (torchtitan ``apply_fsdp``, ``torchtitan/models/llama3/infra/parallelize.py``; now
``torchtitan/distributed/fsdp.py``, ``apply_fsdp_to_decoder``): the token embedding, each
transformer block, and the final norm with the output projection; the root wraps them and owns
no parameters of its own here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from sim.frameworks.common.accounting import WINDOWED_ATTN
from sim.frameworks.common.base import JobContext
from sim.frameworks.fsdp2.mesh import Mesh
from sim.frameworks.fsdp2.moe import TitanMoE
from sim.frameworks.fsdp2.tp import TitanBlocks
from sim.hardware.host import HostSpec
from sim.program.ir import NcclType, Op
from sim.scenario import Fsdp2Options
from sim.workload.layer_ops import BF16, FP32, BlockCost, SacCost, Style

AG, RS = "all-gather", "reduce-scatter"


@dataclass
class Unit:
    """One ``fully_shard`` unit of one pipeline model chunk."""

    name: str
    numel: int
    """Parameters on this tensor-parallel rank, unsharded."""
    keys: list[tuple[str, int]]
    """(block, layer) it covers, in forward order."""
    reshard_after_forward: bool
    grad_bytes: float
    """bf16 gradients its backward produces (autograd's unsharded .grad)."""
    partial_grads: int = 0
    """Tensor parallelism: replicated (SequenceParallel norm) weights whose gradients come out
    Partial and are all-reduced over the tensor-parallel group before the reduce
    (``FSDPParam._get_grad_inner_tensor`` redistributes them to the parameter's Replicate)."""
    partial_extra: tuple[int, ...] = ()
    """Further replicated weights with Partial gradients, by size (Qwen3's per-head q_norm
    and k_norm under tensor parallelism: head_dim each)."""
    experts: Unit | None = None
    """An MoE block under expert parallelism: its routed experts' own ``fully_shard`` unit,
    nested in this one (:mod:`.moe`)."""
    expert: bool = False
    """This unit is routed experts, sharded over the ``efsdp`` mesh."""
    resident: int = 0
    """Routed-expert parameters of this block kept outside FSDP (NeMo AutoModel with
    ``efsdp`` 1: ``ignored_params``): always in place, never gathered nor reduced; their bf16
    gradients accumulate in ``.grad``."""


def reshard_blocks(opts: Fsdp2Options, pp: int) -> bool:
    """Whether the embedding and blocks reshard after forward: the scenario's boolean when
    given, else the model code's default: torchtitan's "default" policy (not with pipeline
    parallelism), NeMo AutoModel's never (``parallelize_model(reshard_after_forward=False)``,
    ``components/moe/parallelizer.py`` at 8d9bfb90e; its configs set it where they want it)."""
    if "reshard_after_forward" in opts.model_fields_set:
        return opts.reshard_after_forward
    return pp == 1 and opts.model_code != "automodel"


def moe_unit(layer: int, moe: TitanMoE, numel: dict[str, int], ugrad: dict[str, float],
             raf: bool, qk: tuple[int, ...] = ()) -> Unit:
    """An MoE layer's unit: the attention block and the MoE module's dense parameters, with
    the routed experts inside it, or, under expert parallelism, in their own nested unit
    (torchtitan ``apply_fsdp``: ``fully_shard(transformer_block.moe.experts, mesh=edp_mesh)``
    before ``fully_shard(transformer_block)``)."""
    keys = [("attn", layer), ("moe", layer)]
    dense, experts = moe.dense_numel, moe.expert_numel
    partial = 2 if moe.tp > 1 else 0          # the two SequenceParallel norms
    if not moe.split_experts:
        n = numel["attn"] + dense + experts
        return Unit(f"L{layer}", n, keys, raf, ugrad["attn"] + BF16 * (dense + experts),
                    partial_grads=partial, partial_extra=qk)
    if moe.resident_experts:
        return Unit(f"L{layer}", numel["attn"] + dense, keys, raf, ugrad["attn"] + BF16 * dense,
                    partial_grads=partial, partial_extra=qk, resident=experts)
    inner = Unit(f"E{layer}", experts, [("experts", layer)], raf, BF16 * experts, expert=True)
    return Unit(f"L{layer}", numel["attn"] + dense, keys, raf, ugrad["attn"] + BF16 * dense,
                partial_grads=partial, partial_extra=qk, experts=inner)


def chunk_units(chunk_layers: list[list[int]], numel: dict[str, int], ugrad: dict[str, float],
                layer_raf: bool, tp: int, moe: TitanMoE | None = None,
                qk: tuple[int, ...] = ()) -> list[list[Unit]]:
    """The units of every pipeline model chunk, in forward order: the embedding on the first,
    one per layer, norm + output on the last (all on one chunk without pipelining)."""
    n_virtual = len(chunk_layers)

    def units_of(v: int) -> list[Unit]:
        out: list[Unit] = []
        if v == 0:
            out.append(Unit("embed", numel["embed"], [("embed", -1)], layer_raf,
                            ugrad["embed"]))
        for layer in chunk_layers[v]:
            if moe is not None and moe.is_moe(layer):
                out.append(moe_unit(layer, moe, numel, ugrad, layer_raf, qk))
                continue
            out.append(Unit(f"L{layer}", numel["attn"] + numel["mlp"],
                            [("attn", layer), ("mlp", layer)], layer_raf,
                            ugrad["attn"] + ugrad["mlp"], partial_grads=2 if tp > 1 else 0,
                            partial_extra=qk))
        if v == n_virtual - 1:
            # torchtitan does not reshard norm + output after forward: backward needs them
            # right away.
            out.append(Unit("head", numel["head"], [("head", -1)], False,
                            ugrad["head"], partial_grads=1 if tp > 1 else 0))
        return out

    return [units_of(v) for v in range(n_virtual)]


BlockOps = Callable[[tuple[str, int]], list[Op]]
"""The ops of one (block, layer) of one micro-batch, forward or backward."""


@dataclass
class Job:
    """What every pipeline stage of the step shares."""

    ctx: JobContext
    opts: Fsdp2Options
    mesh: Mesh
    style: Style
    n_mb: int
    n_shard: int
    """FSDP world size: dp_shard x cp."""
    pbytes: int
    rbytes: int
    costs: dict[str, BlockCost]
    titan: TitanBlocks | None
    chunk_units: list[list[Unit]]
    ugrad: dict[str, float]
    model_flops: dict[str, tuple[float, float]]
    p2p_bytes: float
    stage_params: list[int]
    host: HostSpec | None
    sac: dict[str, SacCost] | None = None
    """torchtitan's op-level selective checkpointing of each layer (``selective``)."""
    moe: TitanMoE | None = None
    """The MoE layers (:mod:`.moe`); None for a dense model."""
    sends: dict[tuple[str, int, int], Op] = field(default_factory=dict)
    first_compute: dict[tuple[str, int, int], Op] = field(default_factory=dict)
    """The first compute-stream op of each (F|B, virtual stage, micro-batch)."""

    @property
    def pp(self) -> int:
        return self.mesh.pp

    @property
    def round_mb(self) -> int:
        """Micro-batches of one pipeline schedule step: ``local_batch_size /
        micro_batch_size`` under pipeline parallelism when set, else the whole step's."""
        lbs = self.opts.local_batch_size
        if self.pp == 1 or lbs is None:
            return self.n_mb
        return lbs // self.ctx.micro_batch

    @property
    def sync_last_micro_batch_only(self) -> bool:
        """Gradients reduced at the step's last micro-batch only: NeMo AutoModel's train loop
        (``get_sync_ctx`` turns FSDP2's gradient sync off for the others); torchtitan's
        reduces every micro-batch."""
        return self.opts.model_code == "automodel"

    @property
    def state_bytes(self) -> int:
        """Bytes of each sharded parameter, its gradient and each Adam moment: fp32, or the
        bf16 model NeMo AutoModel builds (``model_code: automodel``, :mod:`.automodel`)."""
        return BF16 if self.opts.model_code == "automodel" else FP32

    def attn_key(self, layer: int) -> str:
        """The priced block of layer ``layer``'s attention: ``attn_window`` on a sliding
        layer where the window's own block is priced (NeMo AutoModel's GPT-OSS,
        :mod:`.automodel`), ``attn`` otherwise."""
        return WINDOWED_ATTN if WINDOWED_ATTN in self.costs \
            and self.ctx.model.windowed(layer) else "attn"

    def attn_cost(self, layer: int) -> BlockCost:
        """:meth:`attn_key`'s priced block."""
        return self.costs[self.attn_key(layer)]

    def shard_size(self, u: Unit) -> int:
        """The FSDP world size of a unit: ``efsdp`` for routed experts, else dp_shard x cp."""
        return self.mesh.efsdp if u.expert else self.n_shard

    def local_params(self, st: int) -> float:
        """Parameters of stage ``st``'s sharded state on one rank: each unit's over its FSDP
        size (the routed experts' already split over ``ep``)."""
        units = [u for v in range(st, self.n_virtual, self.pp) for u in self.chunk_units[v]]
        experts = sum(u.experts.numel for u in units if u.experts is not None)
        dense = self.stage_params[st] / self.n_shard + sum(u.resident for u in units)
        return dense + experts / self.mesh.efsdp if experts else dense

    def param_bytes(self, u: Unit) -> float:
        """Bytes of a unit's unsharded parameters as gathered: with FSDP2's float8 all-gather
        (torchao ``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather``) a transformer
        block's shards are cast to E4M3 before the gather, 1 byte per parameter (its norm
        weights, a few thousandths of it, counted alike); embedding and output stay 16-bit."""
        if self.style.float8_weights and u.name.startswith("L"):
            return float(u.numel)
        return float(self.pbytes * u.numel)

    @property
    def reduce_dtype(self) -> NcclType:
        """NCCL type of the gradient reduce-scatter and HSDP all-reduce: ``reduce_dtype``
        (as :attr:`rbytes`)."""
        return "bf16" if self.opts.reduce_dtype == "bf16" else "f32"

    def gather_dtype(self, u: Unit) -> NcclType:
        """NCCL type of a unit's all-gather, as :meth:`param_bytes` counts it: float8
        blocks go as uint8 (:func:`sim.frameworks.common.nccl_dtype.element_type`), the rest in
        ``param_dtype``."""
        if self.style.float8_weights and u.name.startswith("L"):
            return "u8"
        return "bf16" if self.opts.param_dtype == "bf16" else "f32"

    @property
    def vp(self) -> int:
        return self.ctx.scenario.parallelism.vp

    @property
    def n_virtual(self) -> int:
        return self.pp * self.vp

    @property
    def schedule(self) -> str:
        if self.pp == 1:
            return "none"
        return "interleaved 1f1b" if self.vp > 1 else self.opts.pipeline_schedule
