"""PyTorch FSDP2 (``fully_shard``) as torchtitan applies it to a Llama model, with HSDP, CPU
offload, and torchtitan's tensor, pipeline and context parallelism around it.

Units (torchtitan ``apply_fsdp``, ``torchtitan/models/llama3/infra/parallelize.py``; now
``torchtitan/distributed/fsdp.py``, ``apply_fsdp_to_decoder``): the token embedding, each
transformer block, and the final norm with the output projection; the root wraps them and owns
no parameters of its own here. Resharding after forward follows torchtitan's
``fsdp_reshard_after_forward`` policy (``get_fsdp_reshard_after_forward_policy``): with
``reshard_after_forward`` left unset it is ``"default"``: the embedding and the blocks reshard
without pipeline parallelism and do not with it ("to avoid per-microbatch all-gathers"); set
explicitly, it applies to them either way. Norm + output are never resharded after forward
(backward needs them right away); torchtitan's ``"always"``, which reshards them too, is not
offered by the boolean.

What each step does (``torch/distributed/fsdp/_fully_shard/``):

* Parameters live sharded in fp32 (1/n per rank, n = the FSDP world size) with fp32 gradients
  and AdamW states of the shard. Mixed precision: gathered parameters in bf16 (``param_dtype``),
  gradients reduced in fp32 (``reduce_dtype``) by default; compute in bf16
  (:mod:`sim.workload.layer_ops` style ``bf16``).
* Forward: each unit all-gathers its parameters on the all-gather stream (the copy-in cast to
  bf16 is folded into it), then the compute stream copies them out of the flat buffer and runs
  the unit. Prefetch is implicit: the CPU runs ahead, so unit u+1's all-gather is issued while
  unit u computes; it may start once the all-gather of unit u-1 has been copied out (the
  two-deep ``AllGatherState``, ``FSDPParamGroup.wait_for_unshard``). With
  ``reshard_after_forward`` a unit frees its gathered parameters after its forward.
* Backward: unit u's backward waits for its all-gather (issued again if resharded); when it
  starts, the all-gather of the unit before it is prefetched (``_backward_prefetch``, one unit
  ahead). After the unit's backward (``post_backward``) its gradients are copied into a
  reduce_dtype buffer on the compute stream (``foreach_reduce_scatter_copy_in``) and
  reduce-scattered on the reduce-scatter stream; that copy-in waits until the previous
  reduce-scatter has finished (one ``ReduceScatterState``). The optimizer waits for every
  reduce, then AdamW steps the local shard. Gradient accumulation (torchtitan's train loop)
  reduce-scatters every micro-batch.
* HSDP (``hsdp_shard_size`` = s): a 2-D mesh (dp/s replicas x s shards, consecutive ranks
  shard together). All-gathers and reduce-scatters stay inside the shard group; right after
  each reduce-scatter ``foreach_reduce`` all-reduces the reduced shard across the replicas on
  its own ``all_reduce_stream`` (which waits for the reduce-scatter stream; "run the HSDP
  all-reduces concurrently with all-gather/reduce-scatter since collectives use different
  network resources", ``FSDPCommContext.lazy_init``). The next micro-batch's post-backward of
  the same unit, and the optimizer, wait for that all-reduce (``_wait_for_post_backward``).
  States shard by s (x cp), not by dp.
* CPU offload (``CPUOffloadPolicy``): sharded fp32 parameters, gradients and optimizer
  states stay in pinned host memory. Each all-gather's input is first copied to the GPU
  (``FSDPParam.all_gather_inputs``: ``.to(device, non_blocking=True)``, then cast to
  param_dtype) on the all-gather copy-in stream; after each reduce the fp32 reduced shard is
  copied to the host on the post-reduce stream (``foreach_reduce``: non-blocking into pinned
  memory for the first gradient, blocking and added on the CPU when accumulating). The
  backward ends by waiting for those copies (``finalize_backward``) and ``torch.optim.AdamW``
  steps the CPU tensors (:func:`sim.hardware.host.cpu_adam_s`, one thread per rank under torchrun).
* Pipeline parallelism (``torch/distributed/pipelining``): each stage's model chunks are
  separate FSDP roots. ``_PipelineStageBase.backward_maybe_with_nosync`` runs every backward
  with ``set_requires_gradient_sync(False)`` and ``set_reshard_after_backward(False)``:
  gradients accumulate unsharded (cast to reduce_dtype on the first micro-batch,
  ``FSDPParam.to_accumulated_grad_if_needed``, then added, ``accumulate_unsharded_grad_if_needed``)
  and parameters stay gathered; after the chunk's last backward (``_add_reduce_grad`` /
  ``perform_reduce_grad`` -> ``_post_backward``) ``post_backward`` runs for every unit in
  module order: one reduce-scatter per unit per schedule step. Schedules come from
  :func:`sim.frameworks.megatron.build.schedule` (the same orders as torch's ``Schedule1F1B``,
  ``ScheduleGPipe`` and ``ScheduleInterleaved1F1B``, whose warm-up is
  ``(vp - 1) * pp + 2 * (pp - 1 - rank)``); Schedule1F1B batches each forward's send with the
  next backward's receive and waits for both, and each backward's send with the next
  forward's receive.
* Tensor and context parallelism: :mod:`.tp` and :mod:`.cp`. The FSDP unit of
  a tensor-parallel rank holds its 1/tp of the block (DTensor local shards), sharded again over
  the FSDP mesh (dp_shard x cp). The sequence-parallel norms' weights are replicated and their
  gradients come out Partial: post_backward all-reduces each over the tensor-parallel group
  before the copy-in (``FSDPParam._get_grad_inner_tensor`` redistributes to Replicate).

Modules: :mod:`.build` (the registered entry point: the job's shapes, rank classes, stages),
:mod:`.checks` (what is modelled), :mod:`.units` (units and the state the stages share),
:mod:`.stage` (one stage's state), :mod:`.unshard` (all-gather, copy-in, copy-out),
:mod:`.reduce` (post_backward: reduce-scatter, HSDP all-reduce), :mod:`.offload` (CPU
offload), :mod:`.pipeline` (pipelining: accumulation, sends, REDUCE_GRAD), :mod:`.passes`
(forward and backward of a chunk), :mod:`.step` (a stage's step and optimizer); torchtitan's
parallel blocks in :mod:`.mesh` (device mesh, stage split), :mod:`.tp` (tensor-parallel
segments), :mod:`.tp_pass` (their ops and collectives), :mod:`.cp` (ring attention) and
:mod:`.float8` (torchao's float8 tensor-parallel styles); mixture-of-experts layers with
expert parallelism in :mod:`.moe` (the experts' own FSDP units over the ``efsdp`` mesh, the
token all-to-alls, or DeepEP's dispatch with ``expert_parallel_comm_backend: deepep``) and
:mod:`.moe_blocks` (torchtitan's score and unsort kernels); NeMo AutoModel's own models
(``model_code: automodel``: Transformer Engine layers, DeepEP, a bf16 model) in
:mod:`.automodel`. With ``local_batch_size`` under pipelining, one schedule per
gradient-accumulation step (:func:`.pipeline.step_order`).
"""
