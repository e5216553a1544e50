"""Golden outputs: every shipped scenario, small synthetic scenarios that together exercise
every framework option, NCCL algorithm, zone/region and routing setting, and every output
command (``run --json``, ``compare``, ``collective``, ``sweep``, ``plan``), compared with the
results committed in ``tests/integration/golden/`` to the last bit.

A refactoring leaves every golden unchanged. A change of behaviour regenerates them
(``make golden``, i.e. ``python tools/update_golden.py``) in the same commit, whose message
says which cases moved and by how much (the tool prints it). See docs/golden.md.

Each case is one ``fabricsim`` command line, run in-process through the CLI from
``tests/integration/golden/scenarios`` (where the synthetic cases' base scenarios are); its JSON
output,
less the wall-clock fields (:data:`EXCLUDED_KEYS`), is the golden. Values compare exactly:
floats as Python reads back the repr that ``json`` wrote, ints and bools by type too (``1`` is
not ``1.0``), NaN equal to NaN; key order is ignored.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

GOLDEN = Path(__file__).resolve().parent / "golden"
SCENARIOS = GOLDEN / "scenarios"
"""The synthetic cases' base scenarios. Commands run from this folder and name them by file
name, so no output holds a path that would change if the folder moved."""
TINY = "tiny.yaml"
TINY_B = "tiny-fsdp2.yaml"

EXCLUDED_KEYS = frozenset({"wall_s", "sim.wall_s"})
"""Keys dropped at any depth before storing or comparing: wall-clock seconds (the summary's
``sim.wall_s``, a sweep row's ``wall_s`` and flattened ``sim.wall_s``, the plan's ``wall_s``).
Everything else the commands print is deterministic and compared."""

SLOW_SHIPPED = {
    # Measured on the 2-core machine (simulation alone): these run under `-m benchmark`
    # (make bench) and `make golden`, not in `make test`.
    # tests/integration/test_scenarios.py's SLOW.
    "bloom-176b-deepspeed-3d-384xa100": "128,378 ops, ~15 s",
    "llama3-405b-megatron-tp8pp8-256xh100": "97,520 ops, ~14 s",
    "llama3-70b-megatron-tp16pp4-64xh100": "83,140 ops, ~14 s",
    "llama3.1-405b-megatron-16384xh100-run": "104,096 ops on 16,384 GPUs, ~20-30 s",
    "deepseek-v3-megatron-tp2pp16ep64-1024xh100": "250,922 ops, 64-GPU all-to-alls, ~36 s CPU",
    "deepseek-v3-megatron-pp16ep64-2048xh800": "2,048 GPUs, 2 x 60 micro-batches, ~35-45 s",
    # ~12-22 s; tests/integration/test_megatron_gpt_oss.py runs it in make test already.
    "gpt-oss-120b-megatron-tp2pp4ep16-64xh100": "64 GPUs, EP16 all-to-alls across 2 nodes",
}


@dataclass(frozen=True)
class Case:
    """One ``fabricsim`` command line and the file holding its golden output."""

    name: str                    # golden file, relative to tests/integration/golden, without .json
    args: tuple[str, ...]        # arguments after ``fabricsim``
    slow: bool = False

    @property
    def path(self) -> Path:
        return GOLDEN / f"{self.name}.json"


def _sets(*assignments: str) -> tuple[str, ...]:
    return tuple(x for a in assignments for x in ("--set", a))


def _run(name: str, *assignments: str, base: str = TINY, steps: int = 1) -> Case:
    extra = ("--steps", str(steps)) if steps != 1 else ()
    return Case(f"run/{name}", ("run", base, "--json", *extra, *_sets(*assignments)))


# --------------------------------------------------------------------------- the cases
MEGATRON = "framework.name=megatron"
DEEPSPEED = "framework.name=deepspeed"
FSDP2 = "framework.name=fsdp2"
FAIRSCALE = "framework.name=fairscale"
MEG_OPT = ("framework.distributed_optimizer=true", "framework.overlap_grad_reduce=true",
           "framework.overlap_param_gather=true")

SYNTHETIC: tuple[Case, ...] = (
    # DDP (the base scenario's framework), one GPU, and its options
    _run("ddp"),
    _run("ddp-1gpu", "cluster.nodes=1", "cluster.gpus_per_node=1",
         "training.global_batch_size=2"),
    _run("ddp-bucket-view-compile-full-reentrant", "framework.bucket_mb=4",
         "framework.gradient_as_bucket_view=true", "framework.compile=true",
         "training.activation_checkpointing=full", "framework.checkpoint_use_reentrant=true"),
    _run("ddp-gelu-fp16-foreach", "model.mlp=gelu", "training.precision=fp16",
         "training.optimizer=adamw_foreach"),
    _run("ddp-tied-llama3.2-1b", "model=llama3.2-1b", "training.seq_len=512"),
    _run("ddp-two-steps", steps=2),
    # Megatron-LM: tp / pp / vp / cp / sp, tp_comm_overlap, fp8, the local implementation
    _run("megatron-tp2-pp2-vp2-sp", MEGATRON, *MEG_OPT, "parallelism.tp=2", "parallelism.pp=2",
         "parallelism.vp=2", "parallelism.sequence_parallel=true",
         "training.activation_checkpointing=selective"),
    _run("megatron-tp4-cp2-sp-tp-comm-overlap", MEGATRON, *MEG_OPT, "parallelism.tp=4",
         "parallelism.cp=2", "parallelism.sequence_parallel=true",
         "framework.tp_comm_overlap=true"),
    _run("megatron-tp2-pp2-vp2-sp-tp-comm-overlap", MEGATRON, *MEG_OPT, "parallelism.tp=2",
         "parallelism.pp=2", "parallelism.vp=2", "parallelism.sequence_parallel=true",
         "framework.tp_comm_overlap=true", "training.global_batch_size=32"),
    _run("megatron-tp2-pp2-tied", MEGATRON, "parallelism.tp=2", "parallelism.pp=2",
         "model.tied_embeddings=true",
         "framework.account_for_embedding_in_pipeline_split=true",
         "framework.account_for_loss_in_pipeline_split=true"),
    _run("megatron-fp8-delayed", MEGATRON, *MEG_OPT, "parallelism.tp=2",
         "parallelism.sequence_parallel=true", "training.precision=fp8"),
    _run("megatron-fp8-tensorwise", MEGATRON, "parallelism.tp=2", "training.precision=fp8",
         "framework.fp8_recipe=tensorwise"),
    _run("megatron-fp8-blockwise", MEGATRON, *MEG_OPT, "parallelism.tp=2",
         "parallelism.sequence_parallel=true", "training.precision=fp8",
         "framework.fp8_recipe=blockwise", "framework.fp8_param_gather=true"),
    _run("megatron-fp8-mxfp8-b200", MEGATRON, *MEG_OPT, "cluster.topology=dgx-b200",
         "cluster.gpu=b200", "parallelism.tp=2", "training.precision=fp8",
         "framework.fp8_recipe=mxfp8", "framework.fp8_param_gather=true"),
    _run("megatron-local-gpipe-full", MEGATRON, "framework.implementation=local",
         "parallelism.tp=2", "parallelism.pp=2", "framework.pipeline_schedule=gpipe",
         "framework.flash_attention=false", "framework.dropout=0.1",
         "training.activation_checkpointing=full", "training.precision=fp16"),
    _run("megatron-dist-opt-instances-vp-aligned", MEGATRON, *MEG_OPT, "parallelism.pp=2",
         "parallelism.vp=2", "framework.num_distributed_optimizer_instances=2",
         "framework.overlap_param_gather_with_optimizer_step=true",
         "framework.bucket_size=1000000"),
    _run("megatron-tp2-pp2-unbatched-p2p-scatter-gather", MEGATRON, "parallelism.tp=2",
         "parallelism.pp=2", "framework.batch_p2p_comm=false",
         "framework.grad_reduce_in_fp32=false",
         "framework.scatter_gather_tensors_in_pipeline=true"),
    _run("megatron-gelu-tp2", MEGATRON, "model.mlp=gelu", "parallelism.tp=2"),
    # DeepSpeed: ZeRO stages, offload, ZeRO++, the Megatron-DeepSpeed 3D pipeline
    _run("deepspeed-zero0", DEEPSPEED, "framework.zero_stage=0"),
    _run("deepspeed-zero1", DEEPSPEED, "framework.zero_stage=1"),
    _run("deepspeed-zero2-overlap", DEEPSPEED, "framework.zero_stage=2",
         "framework.overlap_comm=true", "framework.reduce_bucket_size=5000000"),
    _run("deepspeed-zero3", DEEPSPEED, "training.activation_checkpointing=full"),
    _run("deepspeed-zero3-small-buckets", DEEPSPEED, "framework.stage3_prefetch_bucket_size=0",
         "framework.stage3_param_persistence_threshold=0",
         "framework.stage3_max_live_parameters=10000000", "framework.sub_group_size=5000000"),
    _run("deepspeed-zeropp", DEEPSPEED, "framework.zeropp.qwz=true", "framework.zeropp.hpz=true",
         "framework.zeropp.qgz=true"),
    _run("deepspeed-zero3-offload-cpu", DEEPSPEED, "framework.offload_optimizer=cpu",
         "framework.offload_param=cpu"),
    _run("deepspeed-zero3-offload-nvme", DEEPSPEED, "framework.offload_optimizer=nvme",
         "framework.offload_param=nvme"),
    _run("deepspeed-zero3-offload-nvme-host-limits", DEEPSPEED, "framework.offload_optimizer=nvme",
         "framework.offload_param=nvme", "cluster.nvme_read_gbytes_per_s=6",
         "cluster.nvme_write_gbytes_per_s=3", "cluster.cpu_cores=32",
         "cluster.host_memory_gbytes_per_s=80"),
    _run("deepspeed-zero2-offload-cpu", DEEPSPEED, "framework.zero_stage=2",
         "framework.offload_optimizer=cpu"),
    _run("deepspeed-3d-tp2-pp2", DEEPSPEED, "framework.zero_stage=1", "parallelism.tp=2",
         "parallelism.pp=2", "training.activation_checkpointing=full",
         "framework.pipeline.partition_activations=true", "model.tied_embeddings=true",
         "framework.pipeline.partition_method=type:transformer|embedding"),
    _run("deepspeed-3d-blocking-no-partitioned", DEEPSPEED, "framework.zero_stage=0",
         "parallelism.tp=2", "parallelism.pp=2", "framework.pipeline.pipe_partitioned=false",
         "framework.pipeline.grad_partitioned=false",
         "framework.pipeline.cuda_launch_blocking=true", "framework.pipeline.dropout=0.1"),
    # FSDP2 (torchtitan and Hugging Face model code)
    _run("fsdp2", FSDP2),
    _run("fsdp2-tp2-sp", FSDP2, "parallelism.tp=2", "parallelism.sequence_parallel=true"),
    _run("fsdp2-cp2-alltoall", FSDP2, "parallelism.cp=2",
         "framework.cp_rotate_method=alltoall"),
    _run("fsdp2-cp2-allgather-tied", FSDP2, "parallelism.cp=2", "model.tied_embeddings=true"),
    _run("fsdp2-float8-tp2", FSDP2, "training.precision=fp8", "framework.float8_all_gather=true",
         "parallelism.tp=2"),
    _run("fsdp2-mxfp8-b200-compile", FSDP2, "cluster.topology=dgx-b200", "cluster.gpu=b200",
         "training.precision=fp8", "framework.float8_recipe=mxfp8", "framework.compile=true"),
    _run("fsdp2-compile-eager-loss", FSDP2, "framework.compile=true",
         "framework.compile_loss=false", "training.activation_checkpointing=selective"),
    _run("fsdp2-compile", FSDP2, "framework.compile=true"),
    _run("fsdp2-hf-full-reentrant", FSDP2, "framework.model_code=huggingface",
         "training.activation_checkpointing=full", "framework.checkpoint_use_reentrant=true",
         "training.attention_backend=sdpa"),
    _run("fsdp2-hf-tied-llama3.2-1b-torch2.5", FSDP2, "framework.model_code=huggingface",
         "model=llama3.2-1b", "training.seq_len=512", 'training.torch_version="2.5"'),
    _run("fsdp2-hsdp-fp32-no-reshard", FSDP2, "framework.hsdp_shard_size=4",
         "framework.param_dtype=fp32", "framework.reduce_dtype=bf16",
         "framework.reshard_after_forward=false"),
    _run("fsdp2-cpu-offload", FSDP2, "framework.cpu_offload=true"),
    _run("fsdp2-pp2-1f1b", FSDP2, "parallelism.pp=2"),
    _run("fsdp2-pp2-vp2-interleaved", FSDP2, "parallelism.pp=2", "parallelism.vp=2",
         "framework.pipeline_first_stage_less_layers=0",
         "framework.pipeline_last_stage_less_layers=0"),
    _run("fsdp2-pp2-gpipe", FSDP2, "parallelism.pp=2", "framework.pipeline_schedule=gpipe"),
    # FairScale
    _run("fairscale", FAIRSCALE),
    _run("fairscale-fp32-rs-no-reshard-tied", FAIRSCALE, "framework.fp32_reduce_scatter=true",
         "framework.reshard_after_forward=false", "model.tied_embeddings=true"),
    _run("fairscale-fp16-full", FAIRSCALE, "training.precision=fp16",
         "training.activation_checkpointing=full"),
    # NCCL algorithms and protocols (forced), CollNet over SHARP, tuning knobs
    _run("nccl-ring-simple", "nccl.algo=ring", "nccl.proto=simple"),
    _run("nccl-ring-ll", "nccl.algo=ring", "nccl.proto=ll"),
    _run("nccl-tree-ll128", "nccl.algo=tree", "nccl.proto=ll128"),
    _run("nccl-nvls-1node", "cluster.nodes=1", "nccl.algo=nvls", "training.global_batch_size=8"),
    _run("nccl-nvls-tree", "nccl.algo=nvls_tree"),
    _run("nccl-pat-1gpu-per-node", FSDP2, "cluster.nodes=8", "cluster.gpus_per_node=1",
         "cluster.nics_per_node=1", "nccl.algo=pat"),
    _run("nccl-collnet-direct-sharp", "cluster.sharp=true", "nccl.collnet_enable=true",
         "nccl.algo=collnet_direct"),
    _run("nccl-collnet-chain-sharp", "cluster.sharp=true", "nccl.collnet_enable=true",
         "nccl.algo=collnet_chain"),
    _run("nccl-collnet-auto-sharp", "cluster.sharp=true", "nccl.collnet_enable=true"),
    _run("nccl-collnet-fsdp2-sharp", FSDP2, "cluster.sharp=true", "nccl.collnet_enable=true",
         "nccl.algo=collnet_direct"),
    _run("nccl-buffsize-cross-nic-no-gdr", FSDP2, "nccl.buffsize=16777216", "nccl.cross_nic=1",
         "nccl.gdr=false"),
    # Zones, regions, routing, transports, fabric shape, GPUs, pricing
    _run("fabric-2az", FSDP2, "cluster.nodes=4", "cluster.azs=2", "cluster.az_link_gbps=400",
         "cluster.az_latency_ms=2.0", "training.global_batch_size=32",
         "pricing.instance=aws-p5.48xlarge"),
    _run("fabric-2region-2az", FSDP2, "cluster.nodes=4", "cluster.azs=2", "cluster.regions=2",
         "cluster.region_link_gbps=200", "cluster.region_latency_ms=20",
         "training.global_batch_size=32", "pricing.cloud=gcp",
         "pricing.gpu_hour_usd=2.5", "pricing.region_egress_usd_per_gb=0.05",
         "training.tokens_total=1.0e9"),
    _run("fabric-ecmp-roce-oversubscribed", FSDP2, "cluster.nodes=4", "cluster.routing=ecmp",
         "cluster.nic_transport=roce", "cluster.nodes_per_leaf=2", "cluster.oversubscription=2",
         "cluster.rail_optimized=false", "training.global_batch_size=32", "seed=7"),
    _run("fabric-adaptive-efa", FSDP2, "cluster.nodes=4", "cluster.routing=adaptive",
         "cluster.nic_transport=efa", "cluster.nodes_per_leaf=2",
         "training.global_batch_size=32"),
    _run("fabric-tcp-100g-amd", "cluster.nic_transport=tcp", "cluster.nic_gbps=100",
         "cluster.nics_per_node=1", "cluster.cpu_vendor=amd", "cluster.pcie_switches_per_node=2"),
    _run("fabric-links-latencies", FSDP2, "cluster.nvlink_gbytes_per_s=300",
         "cluster.pcie_gbytes_per_s=32", "cluster.nic_latency_us=5",
         "cluster.switch_latency_us=1"),
    _run("gpu-a100-cudnn", FSDP2, "cluster.topology=dgx-a100", "cluster.gpu=a100-80gb",
         "training.attention_backend=cudnn"),
    _run("gpu-h200-power-cap", "cluster.gpu=h200", "cluster.gpu_power_w=500"),
    _run("gpu-b200-expandable", FSDP2, "cluster.topology=dgx-b200", "cluster.gpu=b200",
         "allocator.expandable_segments=false"),
    _run("gpu-gb200-nvl72", MEGATRON, "cluster.topology=gb200-nvl72", "cluster.nodes=1",
         "cluster.gpus_per_node=8", "parallelism.tp=8", "training.global_batch_size=4"),
)

COLLECTIVES: tuple[Case, ...] = (
    Case("collective/all_reduce-dgx-h100-16", ("collective", "dgx-h100", "--op", "all_reduce",
                                               "--gpus", "16", "--sizes", "8:1G", "--json")),
    Case("collective/all_gather-ring-simple-aws-p5-16",
         ("collective", "aws-p5", "--op", "all_gather", "--gpus", "16", "--sizes", "1K:256M",
          "--algo", "ring", "--proto", "simple", "--json")),
    Case("collective/reduce_scatter-pat-8x1", ("collective", "dgx-h100", "--op",
                                               "reduce_scatter", "--gpus", "8", "--sizes",
                                               "64K:64M", "--algo", "pat", "--set",
                                               "cluster.gpus_per_node=1", "--json")),
    Case("collective/all_reduce-collnet-2az", ("collective", "dgx-h100", "--op", "all_reduce",
                                               "--gpus", "32", "--sizes", "1M:1G", "--algo",
                                               "collnet_direct", "--set",
                                               "nccl.collnet_enable=true", "--set",
                                               "cluster.azs=2", "--json")),
    Case("collective/all_to_all-ethernet-16", ("collective", "ethernet-100g", "--op",
                                               "all_to_all", "--gpus", "16", "--sizes",
                                               "1K:64M", "--json")),
    Case("collective/broadcast-dgx-h100-8", ("collective", "dgx-h100", "--op", "broadcast",
                                              "--gpus", "8", "--sizes", "8:16M", "--json")),
    Case("collective/all_gather-dgx-h100-8", ("collective", "dgx-h100", "--op", "all_gather",
                                              "--gpus", "8", "--sizes", "1K:1G", "--json")),
    Case("collective/sendrecv-16", ("collective", "dgx-h100", "--op", "sendrecv", "--gpus",
                                    "16", "--sizes", "8:16M", "--json")),
)

APPS: tuple[Case, ...] = (
    Case("compare/what-if-nic-gbps", ("compare", TINY, "--what-if", "cluster.nic_gbps=100,400",
                                      "--set", FSDP2, "--json")),
    Case("compare/files", ("compare", TINY, TINY_B, "--json")),
    Case("sweep/nvlink-x-mbs", ("sweep", TINY, "--grid", "cluster.nvlink_gbytes_per_s=300,450",
                                "--grid", "training.micro_batch_size=1,2", "--workers", "1",
                                "--no-cache", "--json")),
    Case("plan/ddp-8xh100-time", ("plan", "llama3.2-1b-ddp-8xh100", "--max-simulations", "4",
                                  "--workers", "1", "--no-cache", "--json")),
    Case("plan/tiny-cost-fsdp2-megatron", ("plan", TINY, "--objective", "cost", "--framework",
                                           "fsdp2", "--framework", "megatron",
                                           "--max-simulations", "3", "--top", "3", "--workers",
                                           "1", "--no-cache", "--json")),
)


def shipped_cases() -> list[Case]:
    from sim.config import resources

    return [Case(f"run/shipped/{n}", ("run", n, "--json"), slow=n in SLOW_SHIPPED)
            for n in resources.available("scenarios")]


def all_cases() -> list[Case]:
    """Every golden case, in a fixed order (names unique)."""
    cases = shipped_cases() + list(SYNTHETIC) + list(COLLECTIVES) + list(APPS)
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "duplicate golden case names"
    return cases


# --------------------------------------------------------------------------- produce
@contextmanager
def _in_scenarios() -> Iterator[None]:
    # The base scenarios by file name (labels in compare's output), whatever the caller's
    # folder; shipped scenarios and topologies resolve by name from anywhere.
    here = os.getcwd()
    os.chdir(SCENARIOS)
    try:
        yield
    finally:
        os.chdir(here)


def strip(obj: Any) -> Any:
    """``obj`` without the :data:`EXCLUDED_KEYS`, at any depth."""
    if isinstance(obj, dict):
        return {k: strip(v) for k, v in obj.items() if k not in EXCLUDED_KEYS}
    if isinstance(obj, list):
        return [strip(v) for v in obj]
    return obj


def produce(case: Case) -> Any:
    """Run the case's command in-process and return its JSON output, stripped."""
    from typer.testing import CliRunner

    from sim.cli.commands import app

    with _in_scenarios():
        result = CliRunner().invoke(app, list(case.args), catch_exceptions=False)
    if result.exit_code != 0:
        raise RuntimeError(f"fabricsim {' '.join(case.args)}: exit {result.exit_code}\n"
                           f"{result.output[-2000:]}")
    return strip(json.loads(result.stdout))


def dumps(case: Case, output: Any) -> str:
    """The golden file's text: the command and its output; floats as their repr (exact)."""
    return json.dumps({"command": ["fabricsim", *case.args], "output": output}, indent=1,
                      sort_keys=True) + "\n"


def load(case: Case) -> Any:
    return json.loads(case.path.read_text())["output"]


# --------------------------------------------------------------------------- compare
def same(a: Any, b: Any) -> bool:
    """Exactly equal scalars: same type (bool, int and float apart) and value; NaN == NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def differences(golden: Any, now: Any, path: str = "") -> Iterator[tuple[str, Any, Any]]:
    """``(path, golden, now)`` for every leaf that differs, in the golden's order; a key on
    one side only is reported with ``<absent>`` on the other."""
    if isinstance(golden, dict) and isinstance(now, dict):
        for k in list(golden) + [k for k in now if k not in golden]:
            sub = f"{path}.{k}" if path else str(k)
            if k not in now:
                yield sub, golden[k], "<absent>"
            elif k not in golden:
                yield sub, "<absent>", now[k]
            else:
                yield from differences(golden[k], now[k], sub)
    elif isinstance(golden, list) and isinstance(now, list):
        for i, (g, n) in enumerate(zip(golden, now, strict=False)):
            yield from differences(g, n, f"{path}[{i}]")
        if len(golden) != len(now):
            yield f"{path}.length", len(golden), len(now)
    elif not same(golden, now):
        yield path, golden, now


def relative(golden: Any, now: Any) -> str:
    numeric = (int, float)
    if (isinstance(golden, numeric) and isinstance(now, numeric) and not isinstance(golden, bool)
            and not isinstance(now, bool)):
        if golden == 0:
            return "(was 0)"
        return f"({(now - golden) / abs(golden):+.3e})"
    return ""


def diff_report(golden: Any, now: Any, limit: int = 12) -> str:
    """A readable account of the first ``limit`` differences: path, golden, now, relative
    change; empty when there is none."""
    diffs = list(differences(golden, now))
    if not diffs:
        return ""
    lines = [f"{len(diffs)} value(s) differ from the golden; the first {min(limit, len(diffs))}:"]
    for p, g, n in diffs[:limit]:
        lines.append(f"  {p}: golden {g!r} -> now {n!r} {relative(g, n)}".rstrip())
    return "\n".join(lines)


# --------------------------------------------------------------------------- the tests
UPDATE_HINT = ("the output changed. If the change is intended, run `make golden` (python "
               "tools/update_golden.py) and say in the commit message which cases moved and "
               "by how much (docs/golden.md).")


@pytest.mark.parametrize("case", [pytest.param(c, id=c.name, marks=[pytest.mark.benchmark]
                                               if c.slow else []) for c in all_cases()])
def test_golden(case: Case) -> None:
    assert case.path.is_file(), f"{case.path} is missing: run `make golden`"
    stored = json.loads(case.path.read_text())
    assert stored["command"] == ["fabricsim", *case.args], (
        f"{case.path}: the case's command changed since its golden was made: run make golden")
    report = diff_report(stored["output"], produce(case))
    if report:
        pytest.fail(f"fabricsim {' '.join(case.args)}: {UPDATE_HINT}\n{report}", pytrace=False)


def test_every_golden_file_is_a_case() -> None:
    # A stale file from a renamed or removed case would otherwise linger unchecked.
    known = {c.path for c in all_cases()}
    stray = sorted(str(p.relative_to(GOLDEN)) for p in GOLDEN.rglob("*.json")
                   if p not in known)
    assert not stray, f"golden files no case produces (delete them or run make golden): {stray}"


def test_the_comparison_catches_one_ulp() -> None:
    # The test can fail: a summary that moved by one unit in the last place of one float,
    # an int that became a float, a missing key and an extra list item are all caught.
    golden = {"step_time_s": 0.25, "gpus": 8, "bytes": {"nvlink": 1.5e9},
              "rows": [{"time_s": 1e-5}], "oom": False, "x": float("nan")}
    assert diff_report(golden, json.loads(json.dumps(golden))) == ""
    moved = json.loads(json.dumps(golden))
    moved["bytes"]["nvlink"] = math.nextafter(1.5e9, math.inf)
    report = diff_report(golden, moved)
    assert report.startswith("1 value(s) differ") and "bytes.nvlink" in report
    assert "1500000000.0 -> now 1500000000.0000002 (+1.589e-16)" in report
    retyped = dict(golden, gpus=8.0, oom=0)
    assert [d[0] for d in differences(golden, retyped)] == ["gpus", "oom"]
    fewer = dict(golden, rows=[{"time_s": 1e-5}, {"time_s": 2e-5}])
    del fewer["step_time_s"]
    assert [d[0] for d in differences(golden, fewer)] == ["step_time_s", "rows.length"]


def test_a_perturbed_golden_fails_the_case(tmp_path: Path) -> None:
    # End to end on the cheapest case: the committed golden matches, and the same golden with
    # step_time_s nudged by one ulp does not.
    case = next(c for c in SYNTHETIC if c.name == "run/ddp-1gpu")
    now = produce(case)
    golden = load(case)
    assert diff_report(golden, now) == ""
    golden["step_time_s"] = math.nextafter(golden["step_time_s"], 0.0)
    assert diff_report(golden, now).splitlines()[1].startswith("  step_time_s: golden ")


def test_strip_drops_only_wall_clock() -> None:
    out = strip({"sim": {"wall_s": 1.0, "events": 3}, "rows": [{"sim.wall_s": 2.0, "x": 1}],
                 "wall_s": 3.0})
    assert out == {"sim": {"events": 3}, "rows": [{"x": 1}]}
