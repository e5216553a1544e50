"""What every framework schedule builder shares: the job context.

A builder is a function ``(JobContext) -> Program``, named by the framework's entry in
:mod:`sim.frameworks.registry`.
It reads the scenario's options, prices the model's blocks with :mod:`sim.workload.layer_ops`, and
lays
out ops on streams with the framework's real order, prefetching and bucketing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

from sim import catalog
from sim.catalog import GpuSpec
from sim.hardware import attention_cost
from sim.hardware.compute import ComputeModel
from sim.program.ir import Program
from sim.scenario import Scenario, ScenarioError
from sim.workload.layer_ops import BlockCost, Style, model_blocks, price_block
from sim.workload.model import ModelSpec
from sim.workload.moe import BEYOND_DENSE, ISSUE_OF


@dataclass(frozen=True)
class JobContext:
    """Everything a schedule builder needs, derived once from the scenario."""

    scenario: Scenario
    model: ModelSpec
    gpu: GpuSpec
    compute: ComputeModel
    origin: str = "<scenario>"
    cast_micro_batches: int | None = None
    """Micro-batches a step's once-a-step weight casts are shared over, where not this job's
    own: the shorter job a spliced run simulates (:mod:`sim.engine.splice`) stands for the
    long one, whose every op it must repeat; None: :attr:`micro_batches`."""

    @classmethod
    def from_scenario(cls, s: Scenario, origin: str = "<scenario>") -> JobContext:
        model = ModelSpec.from_ref(s.model, s.training.seq_len)
        _require_dense(model, s.framework.name, origin)
        _check_experts(s, model, origin)
        _check_latent_attention(s, model, origin)
        if s.training.deterministic and s.framework.name != "megatron":
            raise ScenarioError(f"{origin}: training.deterministic: modelled for framework "
                                "megatron (Megatron-LM's --deterministic-mode) only")
        gpu = catalog.gpu(s.cluster.gpu, s.cluster.gpu_power_w, s.gpus)
        try:
            dims = ((model.mla.qk_head_dim, model.mla.v_head_dim) if model.mla is not None
                    else (model.head_dim, model.head_dim))
            backend = attention_cost.resolve(s, gpu, head_dims=dims, sinks=model.attention_sinks)
        except ValueError as e:
            raise ScenarioError(f"{origin}: {e}") from None
        compute = ComputeModel(gpu, s.training.precision, backend,
                               deterministic=s.training.deterministic,
                               cudnn_release=attention_cost.release_or_newest(
                                   s.training.cudnn_version))
        return cls(s, model, gpu, compute, origin)

    # ------------------------------------------------------------------ layout
    @property
    def n_ranks(self) -> int:
        return self.scenario.gpus

    @property
    def dp(self) -> int:
        return self.scenario.dp

    @property
    def micro_batch(self) -> int:
        return self.scenario.training.micro_batch_size

    @property
    def seq(self) -> int:
        return self.scenario.training.seq_len

    @cached_property
    def global_batch(self) -> int:
        t = self.scenario.training
        return t.global_batch_size or t.micro_batch_size * self.dp

    @cached_property
    def micro_batches(self) -> int:
        """Gradient-accumulation steps: micro-batches each replica runs per optimizer step."""
        per_step = self.micro_batch * self.dp
        if self.global_batch % per_step:
            self.fail("training.global_batch_size",
                      f"{self.global_batch} is not a multiple of micro_batch_size x dp = "
                      f"{self.micro_batch} x {self.dp}")
        return self.global_batch // per_step

    @property
    def tokens_per_step(self) -> float:
        return float(self.global_batch * self.seq)

    @property
    def recompute(self) -> bool:
        return self.scenario.training.activation_checkpointing == "full"

    def fail(self, key: str, message: str) -> None:
        raise ScenarioError(f"{self.origin}: {key}: {message}")

    def require(self, ok: bool, key: str, message: str) -> None:
        if not ok:
            self.fail(key, message)

    def require_data_parallel_only(self, framework: str) -> None:
        """Refuse what a pure data-parallel schedule of this version does not model: tensor,
        pipeline or context parallelism, precisions other than 16-bit mixed precision, and
        selective recomputation."""
        s = self.scenario
        p = s.parallelism
        self.require(p.tp == 1 and p.pp == 1 and p.cp == 1, "parallelism",
                     f"{framework} is modelled as pure data parallelism here: "
                     "tp, pp and cp must be 1")
        self.require(s.training.precision in ("bf16", "fp16"), "training.precision",
                     f"{framework} is modelled with 16-bit mixed precision (bf16 or fp16); "
                     f"{s.training.precision} is not yet")
        self.require(s.training.activation_checkpointing != "selective",
                     "training.activation_checkpointing",
                     f"{framework} is modelled with none or full (per-block) checkpointing")

    # ------------------------------------------------------------------ pricing
    def block_costs(self, style: Style, kv_cache: bool) -> dict[str, BlockCost]:
        """Price of each block (embed, attn, mlp, head) for one micro-batch."""
        blocks = model_blocks(self.model, style, self.micro_batch, self.seq, kv_cache)
        return {b.name: price_block(b, style, self.compute) for b in blocks}

    def model_flops_per_step(self) -> float:
        return self.model.model_flops_per_token(self.seq) * self.tokens_per_step

    def layer_recompute_flops(self, costs: dict[str, BlockCost]) -> float:
        """Extra hardware FLOPs per step when every layer's forward is recomputed."""
        if not self.recompute:
            return 0.0
        per_mb = self.model.layers * (costs["attn"].flops_fwd + costs["mlp"].flops_fwd)
        return per_mb * self.micro_batches * self.dp


def _require_dense(model: ModelSpec, framework: str, origin: str) -> None:
    """Refuse a model with a feature its builder does not price yet (experts, MLA, MTP, ...):
    every builder gets its context here, so none returns a number for a block it does not
    model. What each builder models is its registry entry's ``model_features`` (the one home
    the planner reads too). Mixture-of-experts training is issue 14's work in progress."""
    # The registry imports every builder, and they import this module: ask it at call time.
    from sim.frameworks import registry

    try:
        entry = registry.framework(framework)
    except KeyError:
        return   # no builder of that name: build_program says so
    key = entry.builds(model)
    if key is not None:
        # Multi-token prediction is a training objective some model code lacks (torchtitan's
        # and NeMo AutoModel's DeepSeek-V3 have no MTP module): name the way to run without.
        hint = ("; with model.mtp_layers: 0 it trains without (--set model.mtp_layers=0)"
                if key == "mtp_layers" else "")
        raise ScenarioError(f"{origin}: model.{key}: {framework} does not model "
                            f"{BEYOND_DENSE[key]} yet{ISSUE_OF.get(key, '')}{hint}")


def _check_experts(s: Scenario, model: ModelSpec, origin: str) -> None:
    """Expert parallelism needs routed experts to share, as many experts as a multiple of
    ``ep`` (Megatron-LM ``validate_args``: ``num_experts % expert_model_parallel_size == 0``)
    and an expert width that splits over expert-TP."""
    p = s.parallelism
    if p.ep == 1 and p.etp is None:
        return
    if model.moe is None:
        raise ScenarioError(f"{origin}: parallelism.ep: model {model.name!r} has no experts to "
                            "split (ep and etp need a mixture-of-experts model)")
    if model.moe.experts % p.ep:
        raise ScenarioError(f"{origin}: parallelism.ep: {model.moe.experts} experts do not "
                            f"split over ep={p.ep}")
    if model.moe.ffn_hidden % p.expert_tp:
        raise ScenarioError(f"{origin}: parallelism.etp: expert width {model.moe.ffn_hidden} "
                            f"does not split over etp={p.expert_tp}")


def _check_latent_attention(s: Scenario, model: ModelSpec, origin: str) -> None:
    """Multi-head Latent Attention is modelled without context parallelism, with sequence
    parallelism when tp > 1 (where the latents, not the hidden state, are gathered), and
    without Transformer Engine's userbuffer overlap of its GEMMs (which name the fused QKV
    GEMM)."""
    p = s.parallelism
    if model.mla is None:
        return
    if p.cp > 1:
        raise ScenarioError(f"{origin}: parallelism.cp: multi-head latent attention is "
                            "modelled without context parallelism yet (issue 14)")
    if p.tp > 1 and not p.sequence_parallel:
        raise ScenarioError(f"{origin}: parallelism.sequence_parallel: multi-head latent "
                            "attention with tp > 1 is modelled with sequence parallelism")
    if getattr(s.framework, "tp_comm_overlap", False):
        raise ScenarioError(f"{origin}: framework.tp_comm_overlap: multi-head latent "
                            "attention is modelled without userbuffer overlap yet (issue 14)")


Builder = Callable[[JobContext], Program]
"""A schedule builder: one training step's program for a scenario (a registry entry's
``build``)."""
