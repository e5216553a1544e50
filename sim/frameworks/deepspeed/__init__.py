"""Microsoft DeepSpeed ZeRO stages 0-3, ZeRO++ and ZeRO-Offload/Infinity (pure data parallelism).

Every behaviour below is read from DeepSpeed's sources at commit 38327e07 (``deepspeed/runtime/
engine.py``, ``bf16_optimizer.py``, ``fp16/fused_optimizer.py``, ``zero/stage_1_and_2.py``,
``zero/stage3.py``, ``zero/partitioned_param_coordinator.py``, ``zero/partition_parameters.py``,
``zero/parameter_offload.py``, ``comm/coalesced_collectives.py``, ``zero/config.py``,
``zero/offload_config.py``, ``ops/adam/cpu_adam.py``, ``runtime/utils.py``). The model is a
Hugging Face Llama/GPT module tree (its submodules are what ZeRO-3 hooks) run eagerly in
16-bit: DeepSpeed casts the module to bf16/fp16, no autocast. Its kernels are priced with
:mod:`sim.workload.layer_ops` style ``hf_bf16``: Hugging Face's own eager RMSNorm through fp32
and ``rotate_half`` RoPE in 16-bit (:mod:`sim.workload.hf_ops`), the style FSDP2 runs Hugging
Face's code with and that the lent H200's FSDP2 steps validate; no KV cache is built.
DeepSpeed-MoE models keep style ``bf16`` (fused RMSNorm, complex RoPE standing in for
Hugging Face's), in which their MoE blocks (:mod:`sim.frameworks.deepspeed.moe_blocks`) are
written.

Communication dtype is the model dtype (``engine.communication_data_type``), and with ZeRO the
gradient accumulation dtype is the model dtype too (``engine.get_data_types``); all collectives
of gradients move 2 bytes per element. Param groups: one (the client passes
``model.parameters()``), so "one collective per param group" is one collective.

Stage 0 (no ZeRO; ``engine.allreduce_gradients`` -> ``buffered_allreduce_fallback``)
    bf16 runs ``BF16_Optimizer``: fp32 gradient accumulation buffers of the whole model (4 B),
    16-bit ``.grad`` cleared at the start of each backward, added into the fp32 buffer after it
    (``update_hp_grads``); at the accumulation boundary the flat fp32 buffer is cast to bf16,
    all-reduced in one call on the compute stream, scaled and copied back; the fp32 master and
    Adam states are partitioned over the ranks, the step updates the local partition, copies
    it into the 16-bit weights and all-gathers them (``update_lp_params``). fp16 runs
    ``FP16_Optimizer``: fp16 ``.grad`` accumulate in place, bucketed all-reduce (5e8 elements,
    ``MEMORY_OPT_ALLREDUCE_SIZE``) at the boundary, full fp32 master and Adam on every rank,
    a host-synchronising overflow check and norm per tensor.
Stages 1 and 2 (``DeepSpeedZeroOptimizer``)
    Gradients are **all-reduced** bucket by bucket (``average_tensor`` -> ``allreduce_and_scatter``
    -> ``allreduce_bucket``: ``use_multi_rank_bucket_allreduce``), each rank keeping its slice;
    never a reduce-scatter. A bucket holds ``reduce_bucket_size`` elements copied by the
    AccumulateGrad hooks into a contiguous ``ipg_buffer`` (two with ``overlap_comm``); it is
    reduced when the next gradient does not fit. Stage 2 hooks reduce every micro-step; stage 1
    has hooks only with ``overlap_comm`` and then reduces only at the boundary, otherwise
    ``reduce_gradients`` walks the parameters after the last backward. With ``overlap_comm``
    the reduction stream waits for the compute stream and the compute stream for the
    reduction stream at each launch, so one bucket reduces beside compute; the epilogue
    synchronises the device. After the step one ``all_gather_into_tensor`` of the 16-bit flat
    buffer (``all_gather_dp_groups``), on the compute stream, before the next forward.
Stage 3 (``DeepSpeedZeroOptimizer_Stage3`` + ``PartitionedParameterCoordinator``)
    Hooks on every submodule fetch the parameters a module owns directly; the coordinator's
    decisions are replayed here exactly on the module trace (recorded in iteration 1, so this
    is the steady state): a module's missing parameters are all-gathered in one coalesced call,
    then up to ``stage3_prefetch_bucket_size`` more elements of upcoming parameters (bounded by
    ``stage3_max_live_parameters`` gathered at once), at every module's fetch; the host waits
    for the all-gather of the third-latest waited parameter (``__max_ongoing_fetch_events=2``);
    parameters are released after use unless persistent (``<= stage3_param_persistence_
    threshold`` elements: gathered once after every step), reused within
    ``stage3_max_reuse_distance`` (default 1e9 elements), or their reuse was already
    scanned by the prefetcher. Backward gathers again with prefetch. Gradients go through one
    ``reduce_bucket_size`` bucket on ``reduce_and_partition_stream`` with one coalesced
    reduce-scatter per bucket (``reduce_scatter_coalesced``: interleaving ``torch.cat`` copy,
    pre-divide, reduce-scatter), at most two reductions outstanding before the host waits
    (``max_param_reduce_events``), accumulated into a persistent gradient-partition buffer.
    The step loops over sub-groups (``sub_group_size``, default 1e9 elements).
ZeRO++ (stage 3)
    qwZ: int8 block-quantised all-gathers (``CUDAQuantizer``, groups of at most 8000 elements,
    one fp32 scale each, all-gathered separately), quantise before and dequantise after.
    hpZ: a secondary copy of each parameter sharded over ``hpz_partition_size`` ranks (one
    node by default) is made at its first release in a step (with a device synchronisation,
    ``_partition_param_sec``) and later gathers of the step use that node-local group.
    qgZ (more than one node): per tensor, int4 swizzled quantisation, all-to-all inside the
    node, dequantise-reduce-requantise, all-to-all across nodes, dequantise and sum
    (``all_to_all_quant_reduce``); 1-D tensors and sizes not divisible by 2 x world fall back
    to a reduce-scatter.
Offload
    ``offload_optimizer`` (stages 1-3): fp32 master and Adam states in host memory, the step
    on the CPU (``DeepSpeedCPUAdam``, :func:`sim.hardware.host.cpu_adam_s`; synchronous inside
    ``step()``), gradients copied to the host and parameters back as the code does. Stages
    1-2 (``copy_grads_in_partition``): the fp32 gradient partition to the host (4 B per
    element; under accumulation the 16-bit gradients make a round trip every micro-step),
    the updated fp32 partition back (4 B) and cast on the GPU, then the usual all-gather.
    Stage 3 (``partition_grads``): the 16-bit gradient partition to host memory and back to
    the GPU (2 + 2 B), at the boundary fp32 to the optimizer (4 B, blocking); parameters come
    back as 16-bit (``copy_`` converts on the CPU: 2 B). ``nvme`` on stage 3 swaps the fp32
    parameters and Adam states (and the fp32 gradients) with the node's NVMe around each
    sub-group's step; stages 1-2 treat ``nvme`` as ``cpu`` (``stage_1_and_2.py`` sets
    ``cpu_offload`` for any device other than none). ``offload_param`` (stage 3): 16-bit
    partitions in host memory, copied to the GPU (blocking ``.to``) before every gather;
    partitions beyond ``max_in_cpu`` (1e9 elements) per rank are read from NVMe first.

Host time (:mod:`.host_costs`) and the caching allocator's flushes under memory pressure
(:mod:`.stage3_coordinator`) are described where they are modelled.

Modules: :mod:`.options` (the options resolved to DeepSpeed's settings), :mod:`.constants`,
:mod:`.host_costs`, :mod:`.emitter` (ops of the one rank class), :mod:`.zero012` (stages
0-2), ZeRO-3 in :mod:`.stage3` (the builder) over :mod:`.stage3_trace` (module tree and hook
order), :mod:`.stage3_state`, :mod:`.stage3_coordinator` (fetch, prefetch, release, gathers),
:mod:`.stage3_grads` (buckets, reduce-scatter, qgZ, gradient partitions) and
:mod:`.stage3_step` (the optimizer step, offloaded or not); :mod:`.build` (the registered
entry point) and Megatron-DeepSpeed 3D in :mod:`.pipe`, :mod:`.pipe_schedule`,
:mod:`.pipe_step`.
"""
