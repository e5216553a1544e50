"""The ``framework:`` options of ``megatron`` (Megatron-LM / Megatron-Core). Imports only the
config layer's base: the scenario schema (:mod:`sim.config.scenario`) reads it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from sim.config import bounds as B
from sim.config.base import Fp8Recipe, StrictModel


class MegatronOptions(StrictModel):
    """NVIDIA Megatron-LM: tensor, pipeline, context and data parallelism."""

    name: Literal["megatron"]
    implementation: Literal["transformer_engine", "local"] = "transformer_engine"
    """Megatron's --transformer-impl: Transformer Engine's fused modules (Megatron-Core's
    default), or the local apex/PyTorch layers (older Megatron and Megatron-DeepSpeed, whose
    timers also synchronise the device around every micro-batch)."""
    distributed_optimizer: bool = False
    """Shard fp32 master weights and Adam states over data-parallel ranks (reduce-scatter
    gradients, all-gather parameters)."""
    overlap_grad_reduce: bool = False
    """Reduce gradients bucket by bucket during the last micro-batch's backward."""
    overlap_param_gather: bool = False
    """With the distributed optimizer: all-gather parameters bucket by bucket in forward."""
    align_param_gather: bool | None = None
    """Interleaved schedule: every stage dispatches its first two chunks' gathers at step start
    and chunk c's at one point; default Megatron-LM's: on with vp > 1 (no effect without)."""
    overlap_param_gather_with_optimizer_step: bool = False
    """Interleaved, distributed optimizer: chunk 0's gathers start after its own optimizer step."""
    gradient_accumulation_fusion: bool = True
    """Megatron's default: each weight-gradient GEMM accumulates into the fp32 main_grad; off
    (NeMo's Megatron-FSDP recipes turn it off), a 16-bit gradient plus one add a linear."""
    use_megatron_fsdp: bool = False
    """Megatron-FSDP (``--use-megatron-fsdp``; NeMo's ``use_mcore_fsdp``), sharding strategy
    ``optim_grads_params``: parameters, gradients and optimizer state sharded over dp x cp;
    each transformer layer (and the embedding and output layer) all-gathered before its
    forward and again before its backward, its gradients reduce-scattered after its backward,
    every micro-batch (sim/frameworks/megatron/fsdp.py). Needs pp 1, the distributed optimizer
    and both overlaps; no CUDA graphs, no experts."""
    cpu_offloading_num_layers: int = Field(default=0, ge=0, le=B.MAX_LAYERS)
    """Megatron-Core's layer-level activation CPU offloading (``cpu_offloading``, activations
    only): the first n layers' saved activations go to host memory after their forward and
    come back one layer ahead of their backward (sim/frameworks/megatron/layer_offload.py);
    pp 1, no recomputation, dense layers; 0: off."""
    num_distributed_optimizer_instances: int = Field(default=1, gt=0, le=B.MAX_GPUS)
    """Distributed optimizer sharded within dp*cp/k ranks, gradient shards all-reduced across k."""
    overlap_p2p_comm: bool | None = None
    """Interleaved schedule: post pipeline sends/receives and wait later; default
    Megatron-LM's: on with vp > 1 (non-interleaved 1F1B cannot)."""
    batch_p2p_comm: bool | None = None
    """Blocking pipeline calls as one batch_isend_irecv plus torch.cuda.synchronize; default
    not overlap_p2p_comm (Megatron-LM). Neither is read under dualpipe / dualpipev, which
    post their own."""
    tp_comm_overlap: bool = False
    """Overlap tensor-parallel communication with the GEMMs around it (TE userbuffers)."""
    flash_attention: bool = True
    """Fused flash attention; false: baddbmm, fused softmax, dropout, bmm."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Hidden and attention dropout (Megatron-LM's and Megatron-DeepSpeed's default is 0.1,
    NeMo and Megatron-Bridge recipes set 0): a 1-byte mask at each bias-dropout-add, and the
    fused attention kernel's own draw
    (:func:`sim.hardware.attention_cost.attention_dropout_factor`)."""
    grad_reduce_in_fp32: bool | None = None
    """fp32 gradient buffers and all-reduce; default: true for bf16, false for fp16."""
    bucket_size: int | None = Field(default=None, gt=0, le=B.MAX_ELEMENTS)
    """Gradient bucket in parameters; default max(40M, 1M x dp) with overlap, else one."""
    pipeline_schedule: Literal["1f1b", "gpipe", "dualpipe", "dualpipev"] = "1f1b"
    """Pipeline schedule; with parallelism.vp > 1, 1F1B is interleaved. ``dualpipe``:
    DeepSeek's DualPipe (deepseek-ai/DualPipe), both directions on the pp ranks (vp: 1);
    ``dualpipev``: its DualPipeV on a V of 2 x pp virtual stages (vp: 2)."""
    fp8_recipe: Fp8Recipe = "delayed"
    """With training.precision fp8: Transformer Engine's scaling (--fp8-recipe): delayed
    (amax history), tensorwise (current scaling, NeMo's FP8-CS), mxfp8 (a scale per 32
    elements; Blackwell only, NeMo's MXFP8) or blockwise (1x128 / 128x128 blocks, DeepSeek-V3's
    recipe; Hopper or later)."""
    account_for_embedding_in_pipeline_split: bool = False
    """The embedding counts as one layer when layers are split over pipeline chunks."""
    account_for_loss_in_pipeline_split: bool = False
    """The loss and output layer count as one layer when layers are split over chunks."""
    decoder_first_pipeline_num_layers: int | None = Field(default=None, gt=0, le=B.MAX_LAYERS)
    """Transformer layers of the first pipeline stage (``--decoder-first-pipeline-num-
    layers``); the stages without a given count share the rest evenly."""
    decoder_last_pipeline_num_layers: int | None = Field(default=None, gt=0, le=B.MAX_LAYERS)
    """Transformer layers of the last pipeline stage (``--decoder-last-pipeline-num-
    layers``): NeMo's DeepSeek-V3 layout gives it 1 beside the MTP module and the loss."""
    pipeline_model_parallel_layout: str | list[list[str]] | None = None
    """``--pipeline-model-parallel-layout``: the layers of every virtual stage, pp x vp entries
    in ``vpp_rank * pp + pp_rank`` order, as a string (``E`` embedding, ``t`` transformer
    layer, ``m`` MTP module, ``L`` loss, ``|`` between stages, ``(...)*n`` repeats: Megatron-
    Bridge's DeepSeek-V3 on pp 8 x vp 4 is ``"Et|(tt|)*30mL"``) or as lists of those names;
    not with the first/last or embedding/loss split options
    (:mod:`sim.frameworks.megatron.layout`)."""
    cross_entropy_loss_fusion: bool = False
    """``--cross-entropy-loss-fusion``: the fused vocab-parallel cross-entropy (Megatron-Core's
    TransformerConfig default off; Megatron-Bridge's GPTModelProvider turns it on), saving no
    fp32 logits with ``cross_entropy_fusion_impl: te`` (:mod:`sim.workload.megatron_loss`)."""
    cross_entropy_fusion_impl: Literal["native", "te"] = "native"
    """``--cross-entropy-fusion-impl``: Megatron-Core's ``torch.compile``-fused loss (still an
    fp32 softmax saved) or Transformer Engine's Triton ``parallel_cross_entropy`` (the bf16
    gradient written into the logits in forward); only with ``cross_entropy_loss_fusion``."""
    apply_rope_fusion: bool = False
    """``--apply-rope-fusion`` (Megatron-Core's TransformerConfig default off; Megatron-Bridge's
    performance scripts turn it on for every model): with multi-head latent attention, the
    rotary embedding and the query / key / value assembly as two fused Triton kernels
    (:mod:`sim.workload.megatron_mla`); a standard attention's rotary embedding is one kernel
    either way."""
    moe_router_fusion: bool = False
    """Mixture-of-experts layers: top-k routing and the aux-loss scores as fused Transformer
    Engine kernels (``--moe-router-fusion``; Megatron-Core's TransformerConfig default off)."""
    moe_permute_fusion: bool = True
    """``--moe-permute-fusion``: the token permutations as Transformer Engine's fused kernels
    (``moe_permute_with_probs``, ``moe_unpermute``, ``moe_sort_chunks_by_index``). On by
    default, as every Megatron-Bridge model provider and performance recipe sets it
    (Megatron-Core's own TransformerConfig default is off); off, PyTorch's ops as
    ``moe_utils.permute`` / ``unpermute`` / ``sort_chunks_by_idxs`` issue them: a stable
    argsort of the routing map, ``index_select`` and ``scatter_add_`` (atomics, element by
    element), ``torch.split`` and ``torch.cat`` over every (source rank, local expert) chunk
    (:mod:`sim.workload.moe_torch_permute`)."""
    moe_router_dtype: Literal["fp32"] | None = "fp32"
    """``--moe-router-dtype``: the dtype of the gate GEMM's output and of every routing
    tensor after it (logits, scores, probs, the permuted probs and their all-to-all). ``fp32``
    (this simulator's default, as DeepSeek's and GLM's Megatron-Bridge providers set it);
    null is Megatron-Core's own default (``TransformerConfig.moe_router_dtype = None``: the
    input's dtype, bf16), which Megatron-Bridge's Qwen3-MoE and GPT-OSS providers leave
    (:func:`sim.workload.moe_router_ops.router_dtype_bytes`)."""
    # Loss coefficients are 1e-4 to 1e-2 in published recipes (Mixtral 0.01, Megatron-Core's
    # z-loss 1e-3); the bound only refuses absurd input.
    moe_aux_loss_coeff: float = Field(default=0.0, ge=0.0, le=1e6)
    """``--moe-aux-loss-coeff``: above 0 the router computes the load-balancing loss
    (Megatron-Core's default 0; NeMo's Mixtral config 0.01)."""
    moe_z_loss_coeff: float | None = Field(default=None, ge=0.0, le=1e6)
    """``--moe-z-loss-coeff``: set, the router adds the z-loss over its logits."""
    moe_token_dispatcher_type: Literal["alltoall", "allgather", "flex"] = "alltoall"
    """``--moe-token-dispatcher-type``: all-to-all over EP, all-gather / reduce-scatter of
    every token over expert-TP x EP (Megatron-Core's own default is allgather), or ``flex``:
    DeepEP's fused dispatch and combine over expert-TP x EP (``--moe-flex-dispatcher-backend
    deepep``; :mod:`sim.frameworks.megatron.moe_flex`)."""
    moe_flex_dispatcher_backend: Literal["deepep", "hybridep"] = "deepep"
    """``--moe-flex-dispatcher-backend`` with ``moe_token_dispatcher_type: flex``: DeepEP's
    normal kernels, or NVIDIA's Hybrid-EP (DeepEP's ``hybrid-ep`` branch: a token crosses
    the network once per destination NVLink domain, NVLink domains up to a GB200 NVL72
    rack, TMA copies with few SMs, 16-bit dispatch;
    :mod:`sim.frameworks.megatron.moe_hybridep`)."""
    moe_flex_dispatcher_num_sms: int | None = Field(default=None, gt=0, le=B.MAX_GPU_SMS)
    """``--moe-flex-dispatcher-num-sms``: SMs DeepEP's kernels hold (even; default 20, as
    Megatron-Core's DeepEP manager sets)."""
    moe_router_num_groups: int | None = Field(default=None, gt=0, le=B.MAX_EXPERTS)
    """``--moe-router-num-groups``: group-limited routing's expert groups (DeepSeek-V3: 8, one
    per node of its EP 64); with ``moe_router_group_topk`` it caps the nodes a token reaches,
    which only the flex dispatcher's bytes feel."""
    moe_router_group_topk: int | None = Field(default=None, gt=0, le=B.MAX_EXPERTS)
    """``--moe-router-group-topk``: groups each token may pick (DeepSeek-V3: 4)."""
    moe_deepep_fp8_dispatch: bool = False
    """Flex dispatcher with ``training.precision: fp8``: dispatch tokens (and the output
    gradient) in FP8 with one fp32 scale per 128 elements, combine in bf16, as DeepSeek-V3's
    recipe runs DeepEP (not a Megatron-Core flag: its DeepEP path sends 16-bit tokens)."""
    moe_pad_expert_input_to_capacity: bool = False
    """``--moe-pad-expert-input-to-capacity``: with model.capacity_factor, every expert's
    input padded to its capacity (sizes fixed by capacity, not by routing)."""
    moe_router_padding_for_quantization: bool = False
    """``--moe-router-padding-for-quantization`` (``--moe-router-padding-for-fp8`` before
    core_r0.16): the router pads the routing map so that every expert's rows are a multiple
    of the FP8 alignment (``pad_routing_map``), so the experts run no padding copies
    (``skip_routed_expert_padding``); under the balanced routing modelled here the counts are
    aligned already, so no rows are added."""
    moe_expert_rank_capacity_factor: float | None = Field(default=None, gt=0, le=64)
    """``--moe-expert-rank-capacity-factor`` (Megatron-Core's ``token_dispatcher.py``
    ``_HybridEPManager``, 2026): with the HybridEP backend, a fixed budget of ``tokens x
    top_k x factor`` received rows a rank (rounded up to the quantization alignment): the
    dispatch no longer waits on the host for the token counts (static shapes, so a whole
    iteration can be one CUDA graph), the expert buffers are budget-sized, and tokens above
    the budget are dropped. None: dropless with a host synchronisation each dispatch."""
    fp8_output_proj: bool = False
    """``--fp8-output-proj``: the LM head's output projection under the MXFP8 recipe
    (Megatron-Core ``TELMHeadColumnParallelLinear``; needs ``fp8_recipe: mxfp8`` and FP8
    training, as Megatron-Core asserts); otherwise it stays 16-bit."""
    fp8_dot_product_attention: bool = False
    """``--fp8-dot-product-attention`` (Transformer Engine's ``fp8_dpa``): the fused attention
    in FP8 (per-tensor scales; MXFP8 under the mxfp8 recipe), its inputs quantized first, at
    the gain cuDNN's own benchmark measured over BF16 (:mod:`sim.hardware.fp8_attention`).
    Needs FP8 training and a recipe Transformer Engine runs FP8 attention under (not
    blockwise)."""
    use_transformer_engine_op_fuser: bool = False
    """``--use-transformer-engine-op-fuser``: the routed experts as Transformer Engine
    operations (``te.ops`` GroupedLinear -> ScaledSwiGLU -> GroupedLinear) on the
    GroupedTensor path: each grouped GEMM one kernel over all local experts, each
    quantization one launch, expert segments padded to 256 rows
    (:attr:`sim.workload.moe_ops.MoELayout.te_ops`)."""
    cutedsl_fused_grouped_mlp: bool = False
    """Megatron-Bridge's ``cutedsl_fused_grouped_mlp`` (26.06): the operation fuser with
    ``NVTE_CUTEDSL_FUSED_GROUPED_MLP=1``, so that on Blackwell in MXFP8 the experts' SwiGLU
    and its quantizations run in the grouped GEMMs' epilogues (cuDNN's CuTe-DSL kernels,
    :attr:`sim.workload.moe_ops.MoELayout.fused_glu`)."""
    moe_paged_stash: bool = False
    """``--moe-paged-stash`` (Megatron-Core ``moe/paged_stash.py``, needs
    ``moe_expert_rank_capacity_factor``): the routed experts' saved activations are copied
    after the forward into a preallocated paged pool holding only the rows received, and
    back before the backward, instead of being held at the budget's size."""
    moe_paged_stash_buffer_size_factor_cuda: float = Field(default=1.10, gt=0, le=64)
    """``--moe-paged-stash-buffer-size-factor-cuda``: the pool's size over the average
    received rows (Megatron-Core's default 1.10; Megatron-Bridge's 26.06 scripts 1.2)."""
    moe_shared_expert_overlap: bool = False
    """``--moe-shared-expert-overlap``: shared experts on a side stream beside the dispatch and
    combine all-to-alls (alltoall dispatcher)."""
    recompute_modules: list[Literal["core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp",
                                    "moe", "shared_experts"]] | None = None
    """``--recompute-modules`` under ``training.activation_checkpointing: selective``
    (Megatron-Core's ``recompute_granularity selective``): the submodules recomputed in
    backward, default ``["core_attn"]``; ``moe_act``, ``layernorm`` and ``mla_up_proj`` discard
    their outputs after forward, ``core_attn``, ``mlp``, ``moe`` and ``shared_experts`` are
    checkpointed whole (:mod:`sim.frameworks.megatron.recompute`)."""
    fine_grained_activation_offloading: bool = False
    """``--fine-grained-activation-offloading``: the saved activations of the modules in
    ``offload_modules`` go to pinned host memory after their forward and come back one group
    ahead in backward, on their own copy streams
    (:mod:`sim.frameworks.megatron.activation_offload`)."""
    offload_modules: list[Literal["attn_norm", "qkv_linear", "core_attn", "attn_proj",
                                  "mlp_norm", "expert_fc1", "moe_act"]] | None = None
    """``--offload-modules``: whose saved inputs leave (``qkv_linear`` with its fused input
    norm, ``core_attn``, ``attn_proj`` (with ``core_attn``), an MoE layer's ``mlp_norm``, the
    grouped ``expert_fc1``, ``moe_act``; ``attn_norm`` is an IdentityOp under Transformer
    Engine); ``fused_group_mlp`` is not modelled."""
    min_offloaded_tensor_size: int = Field(default=1048576, ge=0, le=B.MAX_ELEMENTS)
    """``--min-offloaded-tensor-size``: tensors of fewer elements stay on the GPU."""
    activation_offload_fraction: float = Field(default=1.0, ge=0.0, le=1.0)
    """``--activation-offload-fraction``: of each chunk's eligible groups (forward order),
    the first this share are offloaded, the later ones stay."""
    delta_offload_bytes_across_pp_ranks: int = Field(default=0, ge=0, le=B.MAX_ELEMENTS)
    """``--delta-offload-bytes-across-pp-ranks``: pipeline rank r keeps r x this many bytes
    of groups on the GPU (the first backward chunks' first)."""
    moe_a2a_overlap: bool = False
    """``--overlap-moe-expert-parallel-comm`` (Megatron-Bridge ``moe_a2a_overlap``): the
    combined 1F1B schedule, in which one micro-batch's forward and another's backward run
    layer by layer together, each one's expert all-to-alls on a communication stream beside
    the other's compute (:mod:`sim.frameworks.megatron.a2a_overlap`)."""
    delay_wgrad_compute: bool = False
    """``--delay-wgrad-compute`` (Megatron-Bridge sets it with ``moe_a2a_overlap``): in the
    combined 1F1B schedule the Transformer Engine linears' weight-gradient GEMMs leave the
    backward and run later on the compute stream (the experts' before the dispatch's
    backward all-to-all, the attention's and shared experts' after the layer), so the
    backward all-to-alls no longer wait for them; needs ``moe_a2a_overlap``
    (:mod:`sim.frameworks.megatron.delay_wgrad`)."""
    cuda_device_max_connections: int = Field(default=8, ge=1, le=32)
    """The ``CUDA_DEVICE_MAX_CONNECTIONS`` environment variable: hardware work queues the
    streams share (CUDA's default 8; Megatron-Core's tensor-parallel overlap asks for 1, its
    combined 1F1B for more: the model zoo's ``A2A_OVERLAP=1`` sets 32, Megatron-Bridge's
    ``perf_plugins.py`` @ da98070 (``_set_num_cuda_device_max_connections``) 1 on Hopper with
    tp or cp > 1 and no ``moe_a2a_overlap`` ("to enforce kernel queuing order from host to
    execution order on GPU"), otherwise 8, or 32 with DeepEP/HybridEP). Only 1 changes
    the simulation, and only under ``moe_a2a_overlap``: the combined schedule's two streams
    then launch in issue order through one queue
    (:func:`sim.frameworks.megatron.a2a_overlap.single_queue_emit`)."""
    scatter_gather_tensors_in_pipeline: bool | None = None
    """Without sequence parallelism, each tensor-parallel rank sends 1/tp of the activation
    to the next stage, which all-gathers it; default: on for ``local`` (older Megatron,
    Megatron-DeepSpeed), off for ``transformer_engine`` (Megatron-Core dropped it)."""
    # Optimizer precision, FP8 primary weights and CPU offload
    # (:mod:`sim.frameworks.megatron.optimizer_precision`; Megatron-Core OptimizerConfig).
    use_precision_aware_optimizer: bool = False
    """``--use-precision-aware-optimizer``: Transformer Engine's FusedAdam keeps the moments in
    ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` and (unless an FP8 recipe other than delayed runs
    with fp32 main params) the master weights itself, reading the gradient buffer in place."""
    exp_avg_dtype: Literal["fp32", "fp16", "bf16", "fp8"] = "fp32"
    """``--exp-avg-dtype``: Adam's first moment in memory (precision-aware optimizer only)."""
    exp_avg_sq_dtype: Literal["fp32", "fp16", "bf16", "fp8"] = "fp32"
    """``--exp-avg-sq-dtype``: Adam's second moment in memory (precision-aware only)."""
    main_params_dtype: Literal["fp32", "fp16"] = "fp32"
    """``--main-params-dtype``: the master weights (precision-aware only)."""
    main_grads_dtype: Literal["fp32", "bf16"] | None = None
    """``--main-grads-dtype``: the gradient buffers' dtype under the precision-aware optimizer;
    bf16 is ``grad_reduce_in_fp32: false`` (Megatron-LM sets accumulate_allreduce_grads_in_fp32
    from it); unset: ``grad_reduce_in_fp32`` decides."""
    store_param_remainders: bool = True
    """``store_param_remainders`` (OptimizerConfig default on): with fp32 master weights held by
    TE over bf16 parameters, store only the 16 bits the bf16 parameter lacks (2 bytes)."""
    fp8_param_gather: bool = False
    """``--fp8-param-gather`` (FP8 primary weights; Megatron-Bridge's FP8 current-scaling
    precision recipe sets it): linear weights are TE FP8 tensors (1 byte, no 16-bit copy),
    gathered in FP8 by the distributed optimizer. Needs training.precision fp8 and the
    distributed optimizer."""
    optimizer_cpu_offload: bool = False
    """``--optimizer-cpu-offload``: Megatron-Core's HybridDeviceOptimizer steps
    ``optimizer_offload_fraction`` of each rank's shard with torch's fused AdamW on the CPU
    (fp32 states in pinned host memory, gradients copied down and parameters up each step).
    Needs ``use_precision_aware_optimizer`` (Megatron-LM validate_args)."""
    optimizer_offload_fraction: float = Field(default=1.0, ge=0.0, le=1.0)
    """``--optimizer-offload-fraction`` (Megatron-LM's argument default 1.0): the share of the
    shard's elements, in parameter order, stepped on the CPU."""
    overlap_cpu_optimizer_d2h_h2d: bool = False
    """``--overlap-cpu-optimizer-d2h-h2d``: one CPU optimizer per parameter, the gradient and
    parameter copies on their own streams, so copies and CPU steps pipeline."""
    offload_optimizer_states: bool = False
    """``--offload-optimizer-states`` (Megatron-Core's dev branch, core_dev_r0.16.0
    ``OptimizerConfig``): the distributed optimizer's moments and fp32 master weights go to
    host memory at each step's start and come back beside the gradient reduction; the step
    stays on the GPU (:mod:`sim.frameworks.megatron.optimizer_state_offload`). Needs the
    distributed optimizer."""
    cuda_graph_impl: Literal["none", "local", "transformer_engine", "full_iteration"] = "none"
    """``--cuda-graph-impl`` (``--enable-cuda-graph`` was ``local``, ``--external-cuda-graph``
    ``transformer_engine``, as Megatron-Bridge's 25.09 ``cuda_graphs: true`` set the former):
    Megatron-Core's own ``CudaGraphManager`` or Transformer Engine's ``make_graphed_callables``
    capture parts of each layer, replayed with one host call instead of one a kernel;
    ``full_iteration`` (Megatron-Core 2026's name for ``local`` with scope
    ``full_iteration``, its scope left empty) the whole forward-backward
    (:mod:`sim.frameworks.megatron.cuda_graphs`)."""
    cuda_graph_scope: list[Literal["full", "full_iteration", "attn", "mlp", "moe", "moe_router",
                                   "moe_preprocess"]] | None = None
    """``--cuda-graph-scope``: what is captured; unset, ``[]`` or ``[full]``: the whole
    layer; ``attn``, ``mlp`` (dense layers), ``moe`` (drop-and-pad only), ``moe_router``
    (+ ``moe_preprocess``); ``full_iteration`` (``local`` only) the whole forward-backward.
    Combinations Megatron-Core refuses are refused."""
