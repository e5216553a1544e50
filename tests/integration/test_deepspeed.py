"""DeepSpeed ZeRO stages 0-3, ZeRO++ and offload against closed forms, DeepSpeed's own memory
estimators (``estimate_zero2_model_states_mem_needs``, ``estimate_zero3_...``) and the byte
sizes of what the code communicates and copies."""

from __future__ import annotations

import math

import pytest
from conftest import SMALL_MODEL, make_scenario
from helpers import program

from sim.api import fabric_spec, simulate
from sim.fabric.collectives.chain import ring_bytes_per_rank
from sim.fabric.topology import build_fabric
from sim.hardware.host import HostSpec, cpu_adam_s
from sim.program.ir import Op, Program
from sim.scenario import ModelDims, ScenarioError
from sim.workload.model import ModelSpec

SMALL = SMALL_MODEL
# Layers so wide that no parameter is kept from its forward to its backward use under
# DeepSpeed's default stage3_max_reuse_distance (1e9 elements) except the LM head, used last
# in forward and first in backward. Only programs are built (or simulated: few ops).
HUGE = {"layers": 2, "hidden": 16384, "heads": 128, "ffn_hidden": 65536, "vocab": 32000,
        "mlp": "swiglu"}
PERSISTENCE = 100_000          # stage3_param_persistence_threshold default (zero/config.py)
BF16 = 2


def scenario(framework: dict, nodes: int = 1, gpus: int = 8, model: dict | str = SMALL,
             cluster: dict | None = None, nccl: dict | None = None, **training):
    return make_scenario(model=model, cluster__nodes=nodes, cluster__gpus_per_node=gpus,
                         cluster__nics_per_node=8 if nodes > 1 else 0,
                         **{f"cluster.{k}": v for k, v in (cluster or {}).items()},
                         framework={"name": "deepspeed", **framework}, nccl=nccl or None,
                         **{f"training.{k}": v for k, v in training.items()})


def colls(p: Program, kind: str) -> list[Op]:
    return [op for op in p.ops if op.collective == kind]


def aligned(numel: int, world: int) -> int:
    """A ZeRO-3 partition is numel padded to a multiple of the world, split evenly."""
    return -(-numel // world) * world


def spec(model: dict | str) -> ModelSpec:
    return ModelSpec.from_ref(ModelDims(**model) if isinstance(model, dict) else model)


def tensors(model: dict | str) -> list[int]:
    return [numel for _, numel, _, _ in spec(model).parameter_tensors()]


def egress(op: Op, gpn: int) -> float:
    """Bytes a collective sends out of nodes (all groups): a ring all-gather/reduce-scatter
    of P ranks over n nodes pushes (P-1)/P of the buffer through each node's outgoing ring
    edge; an all-to-all sends each peer 1/P of the buffer; a node-local group sends nothing
    out."""
    total = 0.0
    for g in op.all_groups:
        nodes = {r // gpn for r in g}
        if len(nodes) == 1:
            continue
        p = len(g)
        if op.collective == "all_to_all":
            total += sum(op.nbytes * sum(q // gpn != r // gpn for q in g) / p for r in g)
        else:
            total += (2 if op.collective == "all_reduce" else 1) * len(nodes) * (p - 1) / p \
                * op.nbytes
    return total


def states_at_step(r) -> float:
    """Model-state bytes (parameters, gradients, optimizer) held while the optimizer runs."""
    t0 = min(x.start for x in r.recorder.ops if x.op.phase == "optimizer")
    t1 = max(x.end for x in r.recorder.ops if x.op.phase == "optimizer")
    series = r.recorder.memory[0].series
    before = [v for t, v in series if t <= t0][-1:]
    during = [v for t, v in series if t0 <= t < t1]
    return max(v["parameters"] + v["gradients"] + v["optimizer"] for v in before + during)


# --------------------------------------------------------------------------- stage 3 traffic
def test_stage3_traffic_is_one_and_a_half_ddp_allreduces() -> None:
    # ZeRO-3 must gather every parameter for its forward and again for its backward, and
    # reduce-scatter every gradient: 3 x the model's 16-bit bytes on the ring, against DDP's
    # all-reduce (2 x). Exceptions, derived from what the schedule must issue: persistent
    # parameters (<= 1e5 elements: the norms) are gathered once after the step, not per
    # module; the LM head is used last in forward and first in backward, nothing between,
    # so it is not released (reuse distance 0 < 1e9) and not gathered again. Every other
    # parameter has at least the LM head twice (2 x 524M elements > 1e9) before its reuse.
    w = 8
    p = program(scenario({"zero_stage": 3}, model=HUGE))
    sizes = tensors(HUGE)
    m = spec(HUGE)
    lm = aligned(m.vocab * m.hidden, w)
    big = sum(aligned(n, w) for n in sizes if n > PERSISTENCE)
    small = sum(aligned(n, w) for n in sizes if n <= PERSISTENCE)
    ag = [op for op in colls(p, "all_gather") if "persistent" not in op.name]
    persistent = [op for op in colls(p, "all_gather") if "persistent" in op.name]
    rs = colls(p, "reduce_scatter")
    assert sum(op.nbytes for op in ag) == BF16 * (2 * big - lm)
    assert sum(op.nbytes for op in persistent) == BF16 * small
    assert len(persistent) == sum(n <= PERSISTENCE for n in sizes) == 2 * m.layers + 1
    assert sum(op.nbytes for op in rs) == BF16 * (big + small)
    psi = m.total_params
    ddp = ring_bytes_per_rank("all_reduce", BF16 * psi, w)
    zero3 = sum(ring_bytes_per_rank(op.collective, op.nbytes, w) for op in ag + persistent + rs)
    # (gathers 2 x big - lm + small, reduce-scatter big + small) over 2 x psi, in bytes
    assert zero3 / ddp == pytest.approx((3 * big + 2 * small - lm) / (2 * psi), rel=1e-9)
    assert zero3 / ddp == pytest.approx(1.5, abs=0.06)     # the LM head is 5% of the model


def test_stage3_fetches_each_submodule_on_its_own() -> None:
    # Without prefetch every module's forward pre-hook gathers the parameters it owns
    # directly: one all-gather per nn.Linear (q, k, v, o, gate, up, down), the embedding and
    # the LM head; the norms are persistent. A model under 1e9 elements keeps everything
    # from forward to backward (max_reuse_distance), so backward gathers nothing.
    w = 8
    p = program(scenario({"zero_stage": 3, "stage3_prefetch_bucket_size": 0}))
    m = spec(SMALL)
    ag = [op for op in colls(p, "all_gather") if "persistent" not in op.name]
    assert all("(fwd)" in op.name for op in ag)
    want = sorted(BF16 * aligned(n, w) for n in tensors(SMALL) if n > PERSISTENCE)
    assert sorted(op.nbytes for op in ag) == want
    assert len(ag) == 7 * m.layers + 2
    assert all("," not in op.name for op in ag)          # one module's parameter each


def test_persistence_threshold_moves_norms_out_of_module_gathers() -> None:
    w = 8
    m = spec(SMALL)
    norms = [n for n in tensors(SMALL) if n <= PERSISTENCE]
    assert len(norms) == 2 * m.layers + 1

    def gathered(threshold: int) -> tuple[float, int, int]:
        p = program(scenario({"zero_stage": 3, "stage3_prefetch_bucket_size": 0,
                              "stage3_param_persistence_threshold": threshold}))
        ag = colls(p, "all_gather")
        per_module = [op for op in ag if "persistent" not in op.name]
        return (sum(op.nbytes for op in per_module), len(per_module),
                sum("persistent" in op.name for op in ag))

    default = gathered(PERSISTENCE)
    none = gathered(0)
    assert default[2] == len(norms) and none[2] == 0
    assert none[1] - default[1] == len(norms)            # one gather per norm module
    assert none[0] - default[0] == BF16 * sum(aligned(n, w) for n in norms)


def test_a_bigger_prefetch_bucket_is_never_slower_when_gathers_are_exposed() -> None:
    # One 100 Gb/s NIC per node: the gathers are what the step waits for, so fetching
    # upcoming parameters earlier can only help, up to the default bucket. (A bucket large
    # enough to coalesce the first module's gather with far-away ones makes the first module
    # wait for the whole coalesced call; DeepSpeed behaves so too.)
    times = []
    for bucket in (0, 1_000_000, 5_000_000, 20_000_000, 50_000_000):
        s = scenario({"zero_stage": 3, "stage3_prefetch_bucket_size": bucket}, nodes=2,
                     model="llama3.2-1b", cluster={"nics_per_node": 1, "nic_gbps": 100},
                     global_batch_size=16)
        times.append(simulate(s).summary["step_time_s"])
    assert all(b <= a * (1 + 1e-9) for a, b in zip(times, times[1:], strict=False))
    assert times[-1] < 0.9 * times[0]


def test_stage3_host_waits_for_the_third_latest_reduction() -> None:
    # __reduce_and_partition_ipg_grads: with more than max_param_reduce_events = 2 recorded,
    # the host synchronises on the oldest before launching the next bucket.
    p = program(scenario({"zero_stage": 3, "reduce_bucket_size": 2_000_000}))
    rs = colls(p, "reduce_scatter")
    assert len(rs) > 5
    syncs = [op for op in p.ops if op.name.startswith("reduce event sync")]
    assert len(syncs) == len(rs) - 3
    for k, sync in enumerate(syncs):
        # the sync before bucket k+3 waits for the last op of bucket k
        (dep,) = sync.deps
        assert dep.stream == "rs" and f"(bucket {k})" in dep.name
        assert sync.host_sync
    # all gathers wait for compute only through the allgather stream; the gathers themselves
    # run on NCCL's stream
    assert {op.stream for op in colls(p, "all_gather")} == {"nccl-ag"}


def test_gathers_far_ahead_of_compute_stop_at_the_gpus_memory() -> None:
    # Llama 3 70B on 32 GPUs, compute-bound: the host issues gathers far ahead of the GPU;
    # PyTorch's caching allocator synchronises when the device is full instead of failing.
    # DeepSpeed trains this layout, so it must not come out of memory.
    s = scenario({"zero_stage": 3}, nodes=4, model="llama3-70b", seq_len=4096,
                 global_batch_size=32, activation_checkpointing="full")
    r = simulate(s)
    assert r.program.meta["allocator_syncs"] > 0
    assert not r.summary["oom"]
    # the resident states alone: 16 bytes per parameter over 32 ranks
    states = 16 * spec("llama3-70b").total_params / 32 / 2**30
    assert states < r.summary["peak_memory_gib"] <= r.summary["gpu_memory_gib"]


# --------------------------------------------------------------------------- stages 0-2
def test_stages_1_and_2_all_reduce_buckets_then_all_gather_once() -> None:
    # stage_1_and_2.average_tensor all-reduces each bucket (use_multi_rank_bucket_allreduce);
    # stage 2 every micro-step, stage 1 at the accumulation boundary only; then one
    # all_gather_into_tensor of the 16-bit flat buffer (padded to 2 x world elements).
    w = 8
    psi = spec(SMALL).total_params
    padded = aligned(psi, 2 * w)
    for stage, reductions in ((1, 1), (2, 2)):
        p = program(scenario({"zero_stage": stage}, global_batch_size=16))
        assert p.micro_batches == 2
        assert not colls(p, "reduce_scatter")
        grads = [op for op in colls(p, "all_reduce") if op.nbytes > 8]
        assert sum(op.nbytes for op in grads) == reductions * BF16 * psi
        (ag,) = colls(p, "all_gather")
        assert ag.nbytes == BF16 * padded and ag.stream == "compute"
    # In ring bytes one boundary moves 1.5 x DDP's all-reduce of the 16-bit gradients.
    p = program(scenario({"zero_stage": 2}))
    wire = sum(ring_bytes_per_rank(op.collective, op.nbytes, w) for op in p.ops
               if op.collective and op.nbytes > 8)
    assert wire / ring_bytes_per_rank("all_reduce", BF16 * psi, w) == pytest.approx(1.5,
                                                                                    rel=1e-4)


def test_overlap_comm_keeps_one_bucket_beside_compute() -> None:
    # average_tensor: the reduction stream waits for the compute stream and the compute
    # stream for the reduction stream, so launching bucket k makes compute wait for bucket
    # k-1; two ipg buffers alternate.
    bucket = 3_000_000
    r = simulate(scenario({"zero_stage": 2, "overlap_comm": True,
                           "reduce_bucket_size": bucket}, nodes=2))
    recs = sorted(r.recorder.ops, key=lambda x: x.op.index)
    launches = [x for x in recs if x.op.name.startswith("pre-divide + flatten bucket")]
    ends = {int(x.op.name.split("bucket ")[1].split(")")[0]): x.end for x in recs
            if x.op.name.startswith("copy back my slice")}
    assert len(launches) >= 4 and {x.op.stream for x in launches} == {"reduce"}
    checked = 0
    for x in launches:
        k = int(x.op.name.split("bucket ")[1].split()[0])
        after = [y for y in recs if y.op.index > x.op.index and y.op.stream == "compute"]
        if k == 0 or not after:
            continue
        assert after[0].start >= ends[k - 1] - 1e-12
        checked += 1
    assert checked >= 2
    allocs = [op for op in r.program.ops if op.name.startswith("allocate ipg buffers")]
    assert allocs[0].alloc == (("buffers", 2 * BF16 * bucket),)
    # without overlap_comm everything runs on the compute stream
    p = program(scenario({"zero_stage": 2, "reduce_bucket_size": bucket}))
    assert "reduce" not in {op.stream for op in p.ops}


def test_stage1_holds_full_gradients_until_the_boundary() -> None:
    # Stage 1 reduces only at the accumulation boundary: the 16-bit .grad of the whole model
    # accumulates across micro-steps; stage 2 reduces each micro-step into its partition.
    psi = spec(SMALL).total_params

    def peak_grads(stage: int) -> float:
        r = simulate(scenario({"zero_stage": stage}, global_batch_size=32))
        return max(v["gradients"] for _, v in r.recorder.memory[0].series)

    one, two = peak_grads(1), peak_grads(2)
    assert one >= BF16 * psi
    assert two < 0.6 * BF16 * psi


def test_stage0_uses_deepspeeds_own_allreduce_and_mixed_precision_optimizers() -> None:
    w = 8
    m = spec(SMALL)
    psi = m.total_params
    # bf16: BF16_Optimizer all-reduces its flat fp32 gradients cast to bf16 in one call,
    # holds fp32 master + Adam for its partition and all-gathers the updated weights.
    p = program(scenario({"zero_stage": 0}, global_batch_size=16))
    (ar,) = [op for op in colls(p, "all_reduce")]
    assert ar.nbytes == BF16 * aligned(psi, 2 * w) and ar.micro_batch == 1
    assert len(colls(p, "all_gather")) == 1
    cls = p.classes[0]
    assert cls.initial_memory["optimizer"] == 12 * aligned(psi, 2 * w) // w
    assert cls.initial_memory["gradients"] == 4 * aligned(psi, 2 * w) + BF16 * psi
    # fp16: FP16_Optimizer: fp16 .grad all-reduced in buckets closed past 5e8 elements,
    # full fp32 master and Adam, nothing gathered.
    p = program(scenario({"zero_stage": 0}, precision="fp16"))
    assert sum(op.nbytes for op in colls(p, "all_reduce")) == BF16 * psi
    assert not colls(p, "all_gather")
    assert p.classes[0].initial_memory["optimizer"] == 12 * psi
    assert all(op.stream == "compute" for op in p.ops if op.collective)


# --------------------------------------------------------------------------- memory
def test_memory_matches_deepspeeds_estimators() -> None:
    w = 8
    psi = spec(SMALL).total_params
    padded = aligned(psi, 2 * w)
    # estimate_zero2_model_states_mem_needs: 2 x params + 18 x params / gpus, where 18 = 2
    # (16-bit grads) + 4 (fp32 grads) + 4 (fp32 params) + 8 (Adam); with cpu_offload 2 x
    # params. The simulated states peak in the step, on the padded flat buffer.
    r = simulate(scenario({"zero_stage": 2}))
    assert states_at_step(r) == pytest.approx(2 * psi + 18 * psi / w, rel=2e-6)
    assert states_at_step(r) == 2 * padded + 18 * padded // w
    r = simulate(scenario({"zero_stage": 2, "offload_optimizer": "cpu"}))
    assert r.recorder.memory[0].peak_breakdown["optimizer"] == 0
    assert states_at_step(r) == pytest.approx(2 * psi, rel=2e-6)
    # estimate_zero3_model_states_mem_needs: 4 x largest layer + 18 x params / gpus. Its
    # 18 lists the same four terms as stage 2's and leaves out the 16-bit parameter
    # partition stage 3 also keeps (lp_param_buffer, 2 bytes), held during the step while the
    # gathered layers are not.
    part = sum(aligned(n, w) for n in tensors(SMALL)) // w
    r = simulate(scenario({"zero_stage": 3}))
    assert states_at_step(r) == pytest.approx((18 + 2) * part, rel=1e-9)
    assert states_at_step(r) == pytest.approx((18 + 2) * psi / w, rel=1e-3)
    # with cpu_offload: 2 x params / gpus beside the gathered layers (the 16-bit partition),
    # and the persistent norms gathered again as the step ends
    norms = sum(aligned(n, w) for n in tensors(SMALL) if n <= PERSISTENCE)
    r = simulate(scenario({"zero_stage": 3, "offload_optimizer": "cpu"}))
    assert states_at_step(r) == 2 * part + BF16 * norms


@pytest.mark.parametrize("framework", [
    {"zero_stage": 0}, {"zero_stage": 1}, {"zero_stage": 2, "overlap_comm": True},
    {"zero_stage": 3}, {"zero_stage": 3, "zeropp": {"qwz": True, "hpz": True, "qgz": True}},
    {"zero_stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}])
def test_memory_returns_to_its_start_after_a_step(framework: dict) -> None:
    r = simulate(scenario(framework, nodes=2, global_batch_size=32,
                          activation_checkpointing="full"))
    cls = r.program.classes[0]
    assert r.recorder.memory[0].total == pytest.approx(sum(cls.initial_memory.values()),
                                                       rel=1e-9, abs=1.0)
    assert min(min(v.values()) for _, v in r.recorder.memory[0].series) > -1.0


# --------------------------------------------------------------------------- ZeRO++
def test_qwz_halves_the_gathered_bytes() -> None:
    # int8 data instead of bf16, plus one fp32 scale per quantisation group of at most 8000
    # elements (CUDAQuantizer.target_group_size), gathered separately; quantise before and
    # dequantise after each gather.
    base = program(scenario({"zero_stage": 3}, nodes=2))
    qwz = program(scenario({"zero_stage": 3, "zeropp": {"qwz": True}}, nodes=2))

    def gathered(p: Program, scales: bool) -> float:
        return sum(op.nbytes for op in colls(p, "all_gather") if "persistent" not in op.name
                   and ("scales" in op.name) == scales)

    data, scales = gathered(qwz, False), gathered(qwz, True)
    assert data == gathered(base, False) / 2
    assert 4 / 8000 <= scales / data <= 4 / 1000
    names = [op.name for op in qwz.ops]
    n_gathers = sum(1 for op in colls(qwz, "all_gather") if "scales" in op.name)
    assert sum(n.startswith("qwZ quantize") for n in names) == n_gathers
    assert sum(n.startswith("qwZ dequantize") for n in names) == n_gathers


def test_hpz_keeps_backward_gathers_inside_the_node() -> None:
    # hpZ: at its first release in a step each parameter keeps a secondary copy sharded over
    # the node; the gathers that follow (backward) use the node-local group. So each
    # parameter crosses the network once per step, for its first forward use.
    w, gpn = 16, 8
    base = program(scenario({"zero_stage": 3}, nodes=2, model=HUGE))
    hpz = program(scenario({"zero_stage": 3, "zeropp": {"hpz": True}}, nodes=2, model=HUGE))
    sizes = [n for n in tensors(HUGE) if n > PERSISTENCE]
    m = spec(HUGE)
    lm = aligned(m.vocab * m.hidden, w)

    def split(p: Program) -> tuple[float, float]:
        ag = [op for op in colls(p, "all_gather") if "persistent" not in op.name]
        local = sum(op.nbytes for op in ag if len({r // gpn for r in op.group}) == 1)
        return sum(op.nbytes for op in ag) - local, local

    assert split(base) == (BF16 * (2 * sum(aligned(n, w) for n in sizes) - lm), 0)
    cross, local = split(hpz)
    assert cross == BF16 * sum(aligned(n, w) for n in sizes)
    assert local == BF16 * (sum(aligned(n, w) for n in sizes) - lm)
    # the secondary partitions: 2 bytes x params / hpz per GPU at most
    secondary = sum(b for op in hpz.ops if op.name.startswith("hpZ secondary copy")
                    for _, b in op.alloc)
    assert 0 < secondary <= BF16 * m.total_params / gpn
    # _partition_param_sec synchronises the device after each copy
    assert all(op.host_sync for op in hpz.ops if op.name.startswith("hpZ secondary copy"))


def test_qgz_reduces_gradients_with_a_two_hop_int4_all_to_all() -> None:
    w, gpn, nodes = 16, 8, 2
    p = program(scenario({"zero_stage": 3, "zeropp": {"qgz": True}}, nodes=nodes))
    m = spec(SMALL)
    matrices = [n for n in tensors(SMALL) if n > PERSISTENCE]
    a2a = [op for op in colls(p, "all_to_all") if "scales" not in op.name]
    intra = [op for op in a2a if "intra-node" in op.name]
    inter = [op for op in a2a if "inter-node" in op.name]
    # one int4 all-to-all inside each node of the whole gradient, one across nodes of the
    # node-reduced 1/gpn share
    assert sorted(op.nbytes for op in intra) == sorted(n / 2 for n in matrices)
    assert sorted(op.nbytes for op in inter) == sorted(n / 2 / gpn for n in matrices)
    assert all(len(op.groups) == nodes and len(op.group) == gpn for op in intra)
    assert all(len(op.groups) == gpn and {r // gpn for r in op.group} == {0, 1}
               for op in inter)
    # 1-D tensors (the norms) fall back to a reduce-scatter each
    rs = colls(p, "reduce_scatter")
    assert len(rs) == 2 * m.layers + 1 and all(op.nbytes == BF16 * aligned(m.hidden, w)
                                               for op in rs)
    # on one node qgZ is off (num_nodes > 1 in __avg_scatter_grads)
    one = program(scenario({"zero_stage": 3, "zeropp": {"qgz": True}}))
    assert not colls(one, "all_to_all") and colls(one, "reduce_scatter")


def test_zeropp_cuts_cross_node_traffic_as_the_paper_says() -> None:
    # Wang et al. (ZeRO++, 2023) count per step, in model sizes M of 16-bit bytes:
    # ZeRO-3 forward gather M, backward gather M, reduce-scatter M; ZeRO++ 0.5M (int8),
    # 0 (hpZ), 0.25M (int4). Here from byte sizes: what leaves the nodes, per collective.
    w, gpn, nodes = 16, 8, 2
    base = simulate(scenario({"zero_stage": 3}, nodes=nodes, model=HUGE,
                             nccl={"algo": "ring"}, seq_len=256))
    zpp = simulate(scenario({"zero_stage": 3, "zeropp": {"qwz": True, "hpz": True,
                                                          "qgz": True}},
                            nodes=nodes, model=HUGE, nccl={"algo": "ring"}, seq_len=256))
    m = spec(HUGE)
    sizes = tensors(HUGE)
    big = sum(aligned(n, w) for n in sizes if n > PERSISTENCE)
    lm = aligned(m.vocab * m.hidden, w)
    ring = nodes * (w - 1) / w        # a ring's node-crossing edges, (P-1)/P of the buffer

    def out(r, kind: str) -> float:
        return sum(egress(op, gpn) for op in r.program.ops
                   if op.collective == kind and "persistent" not in op.name)

    # ZeRO-3: first gathers 2 bytes x every parameter, again for backward (but the LM head),
    # the reduce-scatter of every gradient.
    assert out(base, "all_gather") == pytest.approx(ring * BF16 * (2 * big - lm), rel=1e-9)
    assert out(base, "reduce_scatter") == pytest.approx(ring * BF16 * sum(
        aligned(n, w) for n in sizes), rel=1e-9)
    # ZeRO++ gathers: int8 (half of bf16, plus < 0.1% of scales) once; backward in the node.
    ag = out(zpp, "all_gather")
    assert ring * big <= ag <= ring * big * 1.001
    # qgZ: each node sends out only the node-reduced int4 share of each gradient:
    # gpn GPUs x n / (2 gpn) bytes x (nodes-1)/nodes of it to the other nodes.
    qgz = out(zpp, "all_to_all") + out(zpp, "reduce_scatter")
    int4 = (nodes - 1) * sum(n for n in sizes if n > PERSISTENCE) / 2
    assert int4 <= qgz <= int4 * 1.01
    ratio_rs = qgz / out(base, "reduce_scatter")
    # (N-1)/N x 1/4 x W/(W-1): the paper's 0.25 as the node count grows
    assert ratio_rs == pytest.approx((nodes - 1) / nodes / 4 * w / (w - 1), rel=0.01)
    # measured on the fabric: network bytes fall by the same factor as the egress
    net = zpp.summary["bytes"]["network"] / base.summary["bytes"]["network"]
    total = sum(egress(op, gpn) for op in zpp.program.ops if op.collective) / sum(
        egress(op, gpn) for op in base.program.ops if op.collective)
    assert net == pytest.approx(total, rel=0.01)
    assert total < 0.25


# --------------------------------------------------------------------------- offload
def test_optimizer_offload_moves_states_to_the_host_and_pays_pcie() -> None:
    w = 8
    s0 = scenario({"zero_stage": 2})
    fab = build_fabric(fabric_spec(s0))
    hops = len(fab.route_to_host(0))
    assert hops == len(fab.route_from_host(0))
    psi = spec(SMALL).total_params
    part = aligned(psi, 2 * w) // w
    plain = simulate(s0)
    off = simulate(scenario({"zero_stage": 2, "offload_optimizer": "cpu"}))
    # fp32 master + Adam (12 bytes per partition element) leave the GPU
    # (and the 16-bit + fp32 gradient partitions: 2 + 4 bytes); the estimator's 18 bytes
    gone = states_at_step(plain) - states_at_step(off)
    assert gone == 18 * part
    assert plain.summary["bytes"]["pcie"] == 0
    # ZeRO-2 copies each fp32 gradient partition to the host (4 B per element,
    # async_inplace_copy_grad_to_fp32_buffer_from_gpu) and the fp32 partition back
    # (fp32_partition.to(device), 4 B).
    per_rank = 4 * psi / w + 4 * part
    assert off.summary["bytes"]["pcie"] == pytest.approx(hops * w * per_rank, rel=1e-6)
    # the CPU step: DeepSpeedCPUAdam on the partition, on the host
    host = HostSpec.from_scenario(s0)
    (adam,) = [x for x in off.recorder.ops if x.op.name.startswith("DeepSpeedCPUAdam")]
    assert adam.op.stream == "cpu"
    assert adam.end - adam.start == pytest.approx(cpu_adam_s(host, part, "deepspeed"))
    # ZeRO-3: the gradient partition goes to host memory (16-bit, first micro-step), back
    # to the GPU, then fp32 to the optimizer; 16-bit parameters return (converted on the CPU)
    z3 = simulate(scenario({"zero_stage": 3, "offload_optimizer": "cpu"}))
    p3 = sum(aligned(n, w) for n in tensors(SMALL)) // w
    assert z3.summary["bytes"]["pcie"] == pytest.approx(hops * w * (2 + 2 + 4 + 2) * p3,
                                                        rel=1e-6)
    assert z3.recorder.memory[0].peak_breakdown["optimizer"] == 0


def test_param_offload_copies_partitions_in_before_every_gather() -> None:
    w = 8
    s = scenario({"zero_stage": 3, "offload_param": "cpu", "offload_optimizer": "cpu"})
    fab = build_fabric(fabric_spec(s))
    hops = len(fab.route_to_host(0))
    r = simulate(s)
    gathered = sum(op.nbytes for op in colls(r.program, "all_gather")
                   if "persistent" not in op.name)
    h2d = [op for op in r.program.ops if op.host_transfer == "h2d"
           and op.name.startswith("partition to GPU")]
    # each gather's 16-bit input partition (1/w of what it gathers) comes from host memory,
    # with a blocking copy
    assert sum(op.nbytes for op in h2d) == pytest.approx(gathered / w)
    assert all(op.host_sync for op in h2d)
    p3 = sum(aligned(n, w) for n in tensors(SMALL)) // w
    grads = (2 + 2 + 4) * p3        # gradient partition out, back, fp32 out
    assert r.summary["bytes"]["pcie"] == pytest.approx(hops * w * (grads + gathered / w),
                                                       rel=1e-6)
    # the 16-bit partitions are off the GPU too: only the persistent norms stay
    assert r.program.classes[0].initial_memory["parameters"] < 0.01 * BF16 * p3


def test_nvme_offload_swaps_optimizer_states_around_the_cpu_step() -> None:
    w = 8
    r = simulate(scenario({"zero_stage": 3, "offload_optimizer": "nvme"}))
    p3 = sum(aligned(n, w) for n in tensors(SMALL)) // w
    reads = sum(op.nbytes for op in r.program.ops if op.host_transfer == "nvme_read")
    writes = sum(op.nbytes for op in r.program.ops if op.host_transfer == "nvme_write")
    # swap_in_optimizer_state: fp32 params, exp_avg, exp_avg_sq + swapped gradients;
    # swap_out: the three states; gradients written in backward (swap_out_gradients)
    assert reads == 16 * p3
    assert writes == 12 * p3 + 4 * p3
    sync = [op for op in r.program.ops if op.host_transfer in ("nvme_read", "nvme_write")
            and op.phase == "optimizer"]
    assert all(op.host_sync for op in sync)


# --------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("framework,extra,key", [
    ({"zero_stage": 2, "offload_param": "cpu"}, {}, "framework.offload_param"),
    ({"zero_stage": 2, "zeropp": {"qwz": True}}, {}, "framework.zeropp"),
    ({"zero_stage": 0, "offload_optimizer": "cpu"}, {}, "framework.offload_optimizer"),
    ({"zero_stage": 3, "zeropp": {"hpz": True, "hpz_partition_size": 3}}, {},
     "framework.zeropp.hpz_partition_size"),
    # With tp or pp > 1 the step is DeepSpeed's PipelineEngine, which refuses ZeRO-2/3.
    ({"zero_stage": 3}, {"parallelism": {"tp": 2}}, "framework.zero_stage"),
    ({"zero_stage": 1}, {"parallelism": {"tp": 2, "cp": 2}}, "parallelism"),
])
def test_bad_input_is_refused_naming_the_key(framework: dict, extra: dict, key: str) -> None:
    d = {"name": "t", "model": SMALL,
         "cluster": {"gpu": "h100-sxm", "gpus_per_node": 8, "nics_per_node": 0},
         "framework": {"name": "deepspeed", **framework}, "training": {"seq_len": 512}}
    with pytest.raises(ScenarioError) as err:
        program(make_scenario(d, **extra))
    msg = str(err.value)
    assert key in msg and "\n" not in msg


def test_single_gpu_runs_without_collectives() -> None:
    for stage in (0, 1, 2, 3):
        r = simulate(scenario({"zero_stage": stage}, gpus=1))
        assert not [op for op in r.program.ops if op.kind == "collective"]
        assert r.summary["step_time_s"] > 0 and not math.isnan(r.summary["mfu"])


def test_reuse_distance_keeps_parameters_gathered_between_uses() -> None:
    # stage3_max_reuse_distance: a parameter used again within that many elements of upcoming
    # modules is not released. HUGE's blocks (~3.2e9 elements each) are farther apart than
    # the default 1e9, so backward re-gathers them; a distance above the whole model keeps
    # every parameter gathered from its forward to its backward use: fewer bytes gathered.
    def gathered(distance: int) -> float:
        p = program(scenario({"zero_stage": 3, "stage3_max_reuse_distance": distance},
                             model=HUGE))
        return sum(op.nbytes for op in colls(p, "all_gather"))

    assert gathered(10**11) < gathered(10**9)


def test_sub_group_size_splits_the_optimizer_step() -> None:
    # _create_fp16_sub_groups: the partition is stepped in sub-groups; a smaller sub_group_size
    # gives more optimizer ops, the same total elements.
    def steps(size: int) -> int:
        p = program(scenario({"zero_stage": 3, "sub_group_size": size}))
        return sum(1 for op in p.ops if op.phase == "optimizer" and op.kind == "compute")

    assert steps(1_000_000) > steps(1_000_000_000)
