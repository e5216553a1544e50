"""GPU memory outside the tensors: CUDA context, NCCL buffers, cuBLAS workspaces.

``nvidia-smi`` shows a process's whole footprint on the GPU: the CUDA context, every
segment PyTorch's caching allocator reserved (:mod:`sim.engine.allocator`), and what libraries
allocate behind PyTorch's back (NCCL's communication buffers). ``torch.cuda.memory_reserved``
(what torchtitan and most publications report) counts only the allocator's segments, which
include the cuBLAS workspaces (PyTorch hands cuBLAS memory from its own allocator).
A job runs out of memory when the whole footprint exceeds what CUDA reports as the GPU's
total memory (``usable_memory_gib`` in the GPU catalogue).

Constants and their sources:

* CUDA context. With lazy module loading (PyTorch sets ``CUDA_MODULE_LOADING=LAZY`` since
  1.13; CUDA makes it the default on Linux from 12.2) a bare ``torch`` process holds
  287 MB in ``nvidia-smi`` against 667 MB with eager loading (pytorch/pytorch PR #86509,
  measured by its author; ptrblck in pytorch issue #107667: "~300MB"). A training step then
  loads the modules of its kernels (cuBLAS/cuBLASLt GEMMs, attention, NCCL's device code),
  each only when first used; we take 512 MiB in all, an estimate between the bare 287 MB and
  the eager 667 MB that loads every module.
* NCCL buffers (NCCL ``src/include/device.h``, ``src/init.cc``: ``DEFAULT_BUFFSIZE``,
  ``DEFAULT_LL_BUFFSIZE``, ``DEFAULT_LL128_BUFFSIZE``): every connection of a channel has a
  receive buffer per protocol, Simple ``NCCL_BUFFSIZE`` = 4 MiB, LL128 120 elements x 640
  threads x 8 steps x 8 bytes = 4,915,200 B, LL 8 lines x 512 threads x 8 steps x 16 bytes =
  524,288 B. NCCL connects an algorithm the first time it runs it (``NCCL_RUNTIME_CONNECT=1``,
  the default since 2.22), so a communicator holds ring buffers (one receive connection per
  channel) for its collectives and, for all-reduce across nodes, tree buffers (a parent and
  up to two children per channel in the double binary tree, each receiving). Point-to-point
  peers (pipeline sends) get ``NCCL_NCHANNELS_PER_NET_PEER`` = 2 channels each with a Simple
  buffer in each direction. NVLink SHARP (``src/transport/nvls.cc``,
  ``ncclNvlsBufferSetup``): a communicator with more than two GPUs of one NVSwitch node
  (``ncclNvlsInit``) on Hopper or later maps ``NCCL_NVLS_NCHANNELS`` = 16 channels x 2
  (reduce and broadcast) x ``NCCL_NVLS_CHUNKSIZE`` 128 KiB x ``NCCL_STEPS`` 8 per head, one
  head per local GPU, in physical memory of each GPU, when it first runs an NVLS
  collective (all-reduce, all-gather, reduce-scatter); 256 MiB on an 8-GPU node.
* cuBLAS workspace: PyTorch gives each (cuBLAS handle, stream) a workspace from its caching
  allocator (``aten/src/ATen/cuda/CublasHandlePool.cpp``, ``getChosenWorkspaceSize``;
  ``CUBLAS_WORKSPACE_CONFIG`` default ``:4096:2:16:8`` = 8 MiB + 128 KiB, raised to 32 MiB
  on Hopper and later, PyTorch 2.2+), shared with cuBLASLt. Training runs its GEMMs on one
  stream.
"""

from __future__ import annotations

from dataclasses import dataclass

from sim.fabric.collectives.algorithms import nccl_channel_count
from sim.program.ir import Program, RankClass

MIB = 1 << 20
CUDA_CONTEXT_BYTES = 512 * MIB
"""CUDA context of a training process with lazy module loading (see the module notes)."""
NCCL_SIMPLE_BUFFSIZE = 4 * MIB
NCCL_LL128_BUFFSIZE = 120 * 640 * 8 * 8
NCCL_LL_BUFFSIZE = 8 * 512 * 8 * 16
NCCL_CONNECTION_BYTES = NCCL_SIMPLE_BUFFSIZE + NCCL_LL128_BUFFSIZE + NCCL_LL_BUFFSIZE
"""Receive buffers of one connection, all three protocols."""
NCCL_TREE_RECV_CONNECTIONS = 3
"""Parent and two children of a double-binary-tree channel, each a receive connection."""
NCCL_P2P_CHANNELS_PER_PEER = 2
NCCL_NVLS_CHANNELS = 16
NCCL_NVLS_HEAD_BYTES = NCCL_NVLS_CHANNELS * 2 * 128 * 1024 * 8
"""NVLS buffer per head (local GPU) of a communicator."""
NVLS_ARCHS = ("hopper", "blackwell")
NVLS_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
CUBLAS_WORKSPACE_BYTES = {"hopper": 32 * MIB, "blackwell": 32 * MIB}
CUBLAS_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8


@dataclass(frozen=True)
class Overheads:
    """Bytes one GPU of a rank class holds beside its tensors."""

    cuda_context: float
    nccl: float
    cublas_workspace: float

    @property
    def outside_allocator(self) -> float:
        """What ``nvidia-smi`` adds to PyTorch's reserved memory."""
        return self.cuda_context + self.nccl


def cublas_workspace_bytes(arch: str) -> int:
    """PyTorch's default cuBLAS workspace on a GPU architecture."""
    return CUBLAS_WORKSPACE_BYTES.get(arch, CUBLAS_WORKSPACE_DEFAULT)


def nccl_buffer_bytes(program: Program, cls: RankClass, gpus_per_node: int,
                      arch: str = "") -> float:
    """NCCL's buffers on the first member of ``cls``: every communicator its collectives use
    (ring, tree for all-reduce across nodes, NVLS inside an NVSwitch node on ``arch``) and
    its point-to-point peers."""
    rank = cls.members[0]
    comms: dict[tuple[int, ...], bool] = {}      # group -> runs an all-reduce
    nvls: set[tuple[int, ...]] = set()           # groups running an NVLS-capable collective
    peers: set[int] = set()
    for ops in cls.streams.values():
        for op in ops:
            if op.kind == "collective":
                for g in op.all_groups:
                    if rank in g and len(g) > 1:
                        comms[g] = comms.get(g, False) or op.collective == "all_reduce"
                        if op.collective in NVLS_COLLECTIVES:
                            nvls.add(g)
                        break
            elif op.kind in ("send", "recv"):
                for s, d in op.pairs:
                    if s == rank:
                        peers.add(d)
                    elif d == rank:
                        peers.add(s)
    total = 0.0
    for g, all_reduce in comms.items():
        per_node: dict[int, int] = {}
        for r in g:
            per_node[r // gpus_per_node] = per_node.get(r // gpus_per_node, 0) + 1
        nodes = len(per_node)
        # Across nodes NCCL runs a ring per NIC the group's GPUs drive (one per local GPU
        # on rail-matched nodes), two channels each; inside a node NVSwitch's count.
        local = max(per_node.values())
        channels = nccl_channel_count(nodes, local, local)
        conns = 1 + (NCCL_TREE_RECV_CONNECTIONS if all_reduce and nodes > 1 else 0)
        total += channels * conns * NCCL_CONNECTION_BYTES
        if g in nvls and arch in NVLS_ARCHS and gpus_per_node > 2 and local > 2:
            total += local * NCCL_NVLS_HEAD_BYTES
    total += len(peers) * NCCL_P2P_CHANNELS_PER_PEER * 2 * NCCL_SIMPLE_BUFFSIZE
    return total


def overheads(program: Program, cls: RankClass, arch: str, gpus_per_node: int) -> Overheads:
    """The CUDA context, NCCL buffers and cuBLAS workspace of one GPU of ``cls``."""
    return Overheads(float(CUDA_CONTEXT_BYTES),
                     nccl_buffer_bytes(program, cls, gpus_per_node, arch),
                     float(cublas_workspace_bytes(arch)))
