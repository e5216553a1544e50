"""Runs collectives and transfers of a program as flows on the fabric, as NCCL would.

For each collective the runner builds the flow plan of every algorithm NCCL could use
(:mod:`sim.fabric.collectives.algorithms`), predicts each (algorithm, protocol) with NCCL's cost
model (:mod:`sim.fabric.collectives.nccl`) and runs the one of least predicted time, or the one the
scenario's ``nccl`` section forces: it waits NCCL's latency term, the pipeline fill and the
long-haul propagation along the algorithm's chain of dependent steps
(:mod:`sim.fabric.collectives.chain`), then starts the plan's flows (one lock-step flow per ring
channel or tree), capped by the protocol's share of each flow's path and by NCCL's buffer
window (``buffsize`` bytes in flight per channel and peer: a long link cannot be kept full by
a small buffer), and ends when the last flow ends. The time it takes comes out of
the max-min sharing with everything else on the fabric.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import simpy

from sim.fabric.collectives import alltoall, hybridep_kernel, nccl, nccl_plans
from sim.fabric.collectives import fused_kernel as fused_kernel_model
from sim.fabric.collectives.algorithms import FlowPlan, PlanBuilder
from sim.fabric.network import FlowNetwork
from sim.fabric.topology import CROSS_AZ, CROSS_REGION, NETWORK, NVLINK, PCIE, Fabric


def transport_capacity(fabric: Fabric, arch: str, nic_transport: str = "infiniband"
                       ) -> np.ndarray:
    """Link capacity as NCCL's transports achieve it (see :mod:`sim.fabric.collectives.nccl`): the
    flow network runs on these, so sharing divides what a transfer can really get."""
    eff = np.ones(len(fabric.capacity))
    net = nccl.NETWORK_EFFICIENCY_BY_TRANSPORT[nic_transport]
    eff[fabric.kind == NVLINK] = nccl.NVLINK_EFFICIENCY[arch]
    eff[(fabric.kind == NETWORK) | (fabric.kind == CROSS_AZ) | (fabric.kind == CROSS_REGION)] = net
    eff[fabric.kind == PCIE] = nccl.PCIE_EFFICIENCY
    # NVMe links carry the drives' own sequential rates (already what a transfer gets), as
    # a checkpoint storage endpoint's link its write rate (sim.fabric.topology.storage).
    for i, (a, b) in enumerate(fabric.endpoints):
        if a[0] in ("nvme", "storage") or b[0] in ("nvme", "storage"):
            eff[i] = 1.0
        elif a[0] == "cpu" or b[0] == "cpu":   # a Grace's NVLink-C2C (host class, not PCIe)
            eff[i] = nccl.C2C_EFFICIENCY
    return fabric.capacity * eff


@dataclass(frozen=True)
class NcclSettings:
    """The NCCL knobs a scenario sets (``nccl:`` section)."""

    algo: str = "auto"
    proto: str = "auto"
    buffsize: float = 4 * 2**20
    cross_nic: int = 2
    collnet_enable: bool = False
    pxn: bool = True
    """Sends go by PXN (``NCCL_PXN_DISABLE=0``, NCCL's default since 2.12;
    :mod:`sim.fabric.collectives.alltoall`)."""


@dataclass(frozen=True)
class Choice:
    """What NCCL runs for one collective call."""

    op: str
    algorithm: str
    protocol: str
    nbytes: float
    predicted_s: float


# (the groups of more than one rank, an id of that list, whether all sit in one node each)
_GroupSet = tuple[list[tuple[int, ...]], int, bool]
# An all-to-all with uneven splits: (plan, estimate, predicted time, groups it stands for)
_A2A = tuple[FlowPlan | None, nccl.Estimate | None, float, int]


class CollectiveRunner:
    """Runs collectives on one fabric.

    Parameters
    ----------
    env, net : the simulation and its flow network (built on :func:`transport_capacity`)
    fabric : the fabric graph
    arch : GPU generation (volta, ampere, hopper, blackwell)
    settings : the scenario's NCCL settings
    """

    def __init__(self, env: simpy.Environment, net: FlowNetwork, fabric: Fabric, arch: str,
                 settings: NcclSettings | None = None) -> None:
        self.env = env
        self.net = net
        self.fabric = fabric
        self.arch = arch
        self.settings = settings or NcclSettings()
        self.builder = PlanBuilder(fabric, net.capacity, self.settings.cross_nic,
                                   self.settings.pxn)
        self._plans: dict[tuple[str, tuple[int, ...]], list[FlowPlan]] = {}
        self._pat: dict[tuple[str, tuple[int, ...]], FlowPlan] = {}
        self._selected: dict[tuple[str, tuple[int, ...], float],
                             tuple[FlowPlan, nccl.Estimate, float]] = {}
        self._group_sets: dict[tuple[tuple[int, ...], ...], _GroupSet] = {}
        self._group_ids: dict[int, tuple[object, _GroupSet]] = {}
        self._group_choice: dict[tuple[int, str, float], tuple[
            list[tuple[FlowPlan, nccl.Estimate, float]], float, bool]] = {}
        self._disjoint: dict[tuple[object, ...], bool] = {}
        self._p2p_ids: dict[int, tuple[object, FlowPlan | None]] = {}
        self._p2p: dict[tuple[tuple[int, int], ...], FlowPlan] = {}
        self._caps: dict[tuple[int, str, str], np.ndarray] = {}
        self._flow_arrays: dict[tuple[int, str, str, float, float, int], tuple[
            FlowPlan, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                            float]]] = {}
        self._a2a: dict[tuple[int, alltoall.PeerMatrix, int, str], _A2A] = {}
        self._a2a_ids: dict[tuple[int, int, tuple[int, str]],
                            tuple[alltoall.PeerMatrix, _A2A]] = {}
        self.chosen: list[Choice] = []
        self.fold_across_nodes = True
        """Whether alike groups across nodes on disjoint links fold into one group's flows
        (:meth:`_same_and_disjoint`). Off when several jobs share the fabric
        (:mod:`sim.apps.multijob`): another job's flows may cross the links of the groups
        left out, so every group's flows must be on the fabric."""

    # ------------------------------------------------------------------ planning
    @property
    def _nvswitch(self) -> bool:
        return (self.fabric.spec.gpus_per_node >= 2 and self.arch in nccl.NVLS_EFFICIENCY)

    @property
    def cpu_vendor(self) -> str:
        """The host CPU NCCL's tuning tables are indexed by (topology's ``cpu_vendor``)."""
        return getattr(self.fabric.spec, "cpu_vendor", nccl.DEFAULT_CPU_VENDOR)

    def _collnet(self, forced: bool) -> bool:
        # CollNet needs SHARP switches (topology ``sharp``), NCCL_COLLNET_ENABLE (off by
        # default in NCCL; forcing NCCL_ALGO=CollNet* implies it here) and, for Direct, an
        # NVSwitch (tuning.cc: disabled when nvsCount == 0).
        return bool(getattr(self.fabric.spec, "sharp", False)) and (
            forced or self.settings.collnet_enable)

    def plans(self, op: str, group: tuple[int, ...]) -> list[FlowPlan]:
        """The algorithms NCCL could run for ``op`` over ``group``, as flow plans (which of
        them NCCL enables follows ncclTopoTuneModel and enqueue.cc updateCollCostTable)."""
        return [self._built(op, group, p) for p in self._candidates(op, group)]

    def _built(self, op: str, group: tuple[int, ...], plan: FlowPlan) -> FlowPlan:
        """``plan`` with its flows: a candidate that NCCL's cost model needed only the bus
        bandwidth of (PAT, :func:`nccl_plans.pat_bus_only`) is built here, once."""
        if plan.algorithm != "pat" or plan.n_flows:
            return plan
        full = self._pat.get((op, group))
        if full is None:
            full = self._pat[(op, group)] = nccl_plans.pat(self.builder, op, group)
        return full

    def _candidates(self, op: str, group: tuple[int, ...]) -> list[FlowPlan]:
        """:meth:`plans`, with PAT's flows left out until it wins (they are 1 + log2(n)
        times a ring's, and NCCL's choice reads only their bus bandwidth)."""
        key = (op, group)
        cached = self._plans.get(key)
        if cached is not None:
            return cached
        b = self.builder
        by_node: dict[int, int] = {}
        for r in group:
            by_node[b.node_of[r]] = by_node.get(b.node_of[r], 0) + 1
        n_nodes, ppn = len(by_node), min(by_node.values())
        max_local = max(by_node.values())
        forced = self.settings.algo
        plans: list[FlowPlan] = []
        if op in ("all_reduce", "all_gather", "reduce_scatter"):
            plans.append(b.ring(op, group))
        nvls_ok = self._nvswitch and ppn >= 2
        if nvls_ok:
            eff = nccl.NVLS_EFFICIENCY[self.arch]
            ch = nccl.NVLS_CHANNELS[self.arch]
            # NCCL's NVLS bandwidth counts (nChannels-1)/nChannels (tuning.cc).
            eff *= (ch - 1) / ch
        if op == "all_reduce":
            # NCCL models trees in one node too (a chain); it keeps them as candidates.
            plans.append(b.tree(group, self.settings.buffsize))
            if nvls_ok:
                if n_nodes == 1:
                    plans.append(b.nvls(group, eff, ch))
                else:
                    plans.append(b.nvls_tree(group, eff, ch, self.settings.buffsize))
            if (n_nodes > 1 and max_local <= nccl.MAX_COLLNET_LOCAL_RANKS
                    and len(group) == n_nodes * ppn):
                if self._collnet(forced == "collnet_direct") and self._nvswitch:
                    plans.append(nccl_plans.collnet_direct(b, group, self.settings.buffsize))
                if self._collnet(forced == "collnet_chain"):
                    plans.append(nccl_plans.collnet_chain(b, group, self.settings.buffsize))
        if op in ("all_gather", "reduce_scatter"):
            # PAT: one GPU per node only (tuning.cc ncclPatEnable: nNodes == nRanks, SM60+,
            # host network; NCCL 2.23 and later).
            if n_nodes == len(group) and n_nodes > 1:
                plans.append(nccl_plans.pat_bus_only(b, op, group))
            # NVLS all-gather/reduce-scatter: inside one node (across nodes it needs CollNet
            # all-gather support), at most NCCL_MAX_NVLS_ARITY local ranks.
            if nvls_ok and n_nodes == 1 and len(group) <= nccl.MAX_NVLS_ARITY:
                plans.append(nccl_plans.nvls_gather(b, op, group, eff, ch))
        if op == "broadcast":
            plans.append(b.chain_broadcast(group, group[0]))
        if op == "all_to_all":
            # nccl-tests' even split: 1/n of the message to each peer, as per-peer sends
            # (sim.fabric.collectives.alltoall); a group of 2+ ranks always has a flow.
            a2a = alltoall.peer_plan(b, [group], alltoall.even_matrix(len(group), 1.0),
                                     coflow=False,
                                     nvlink_share=alltoall.nccl_nvlink_share(self.arch),
                                     network_share=alltoall.P2P_NETWORK_SHARE)
            assert a2a is not None
            plans.append(a2a)
        if op == "sendrecv":
            n = len(group)
            plans.append(b.p2p([(group[i], group[(i + 1) % n]) for i in range(n)], 1.0))
        if not plans:
            raise ValueError(f"no algorithm for {op}")
        self._plans[key] = plans
        return plans

    def _fill_s(self, plan: FlowPlan, est: nccl.Estimate, nbytes: float | None = None
                ) -> float:
        """Pipeline fill (execution only, never in NCCL's choice): with Simple, the first
        chunk crosses ``fill_stages`` stages before every edge is busy, each at one channel's
        share of the slowest link. The chunk is NCCL's (``chunk_bytes``) or, for a smaller
        message, the channel's own part of it: a message below one chunk fills with its own
        size."""
        if nbytes is None and est.fill_s >= 0:
            return est.fill_s
        if not plan.fill_stages or not plan.n_flows or est.protocol != "simple":
            # LL and LL128 forward each 16- or 128-byte line as soon as its flag lands
            # (prims_ll.h, prims_ll128.h): no chunk to wait for beyond the per-hop latency
            # NCCL's hwLat already charges.
            return 0.0
        chunk = plan.chunk_bytes
        if nbytes is not None:
            heads = max(1, plan.n_ranks // max(1, plan.n_nodes))
            if plan.algorithm == "nvls":
                # Single-node NVLS: calcCollChunking cuts the 128 KiB NVLS chunk to 64 KiB
                # below 1 GiB, but each channel step moves a loop of nHeads chunks
                # (all_reduce.h, RunWorkColl NVLS: loopCount = nHeads x chunkSize). Neither
                # reading alone matches the published 64 MiB point (+11.5% / -11.2%); the
                # default NCCL_NVLS_CHUNKSIZE is kept as the pipeline unit.
                chunk = plan.chunk_bytes
            else:
                chunk = nccl.chunk_bytes(plan.algorithm, nbytes, plan.channels, heads,
                                         plan.n_nodes, self.settings.buffsize)
            chunk = min(chunk, nbytes / max(1, plan.channels))
        sharing = plan.channels if plan.algorithm == "nvls" else 1
        per_channel = float(plan.bottleneck.min()) * est.bw_factor / sharing
        return plan.fill_stages * chunk / per_channel

    def select(self, op: str, group: tuple[int, ...], nbytes: float
               ) -> tuple[FlowPlan, nccl.Estimate, float]:
        """The (plan, estimate, predicted time) NCCL would pick, honouring forced settings.
        The estimate carries the fill this size pays in execution (``fill_s``)."""
        key = (op, group, nbytes)
        hit = self._selected.get(key)
        if hit is None:
            plan, est, t = self._select(op, group, nbytes)
            est = replace(est, fill_s=self._fill_s(plan, est, nbytes))
            hit = self._selected[key] = (plan, est, t)
        return hit

    def _select(self, op: str, group: tuple[int, ...], nbytes: float
                ) -> tuple[FlowPlan, nccl.Estimate, float]:
        """ncclTopoGetAlgoTime over every (algorithm, protocol): latency + bytes / bandwidth
        with the tree's size correction; the least time wins (enqueue.cc topoGetAlgoInfo)."""
        best: tuple[FlowPlan, nccl.Estimate, float] | None = None
        candidates = self._candidates(op, group)
        forced = [p for p in candidates if p.algorithm == self.settings.algo]
        if forced:
            candidates = forced  # an algorithm that does not apply to this op is ignored
        cpu = self.cpu_vendor
        for plan in candidates:
            if plan.algorithm == "p2p":
                call = alltoall.nvlink_call_s(self.builder, plan) if op == "all_to_all" else 0.0
                ests = [nccl.Estimate("p2p", "simple", _p2p_latency(plan) + call,
                                      plan.bus_bw, 1.0)]
            else:
                ests = nccl.estimates(plan.algorithm, op, plan.n_ranks, plan.n_nodes,
                                      self.arch, plan.bus_bw,
                                      plan.nccl_channels or plan.channels, cpu, nbytes)
            if plan.n_nodes > 1 and not getattr(self.fabric.spec, "gdr", True):
                # tuning.cc: LL128 is on by default only for inter-node paths up to PXN (PXB
                # before Hopper); without GPUDirect RDMA the path goes through the CPU (PHB).
                ests = [e for e in ests if e.protocol != "ll128"] or ests
            protos = [e for e in ests if self.settings.proto in ("auto", e.protocol)] or ests
            for est in protos:
                if est.bus_bw_bytes_per_s <= 0:
                    continue
                t = nccl.algo_time(est, op, nbytes, plan.volume, self.arch, cpu)
                if best is None or t < best[2]:
                    best = (plan, est, t)
        assert best is not None
        return self._built(op, group, best[0]), best[1], best[2]

    # ------------------------------------------------------------------ running
    def run_collective(self, op: str, group: Sequence[int], nbytes: float, tag: object = None
                       ) -> Generator[simpy.Event, object, Choice | None]:
        """Process: one collective of ``nbytes`` (nccl-tests' message size) over ``group``;
        its value is what NCCL ran (None when there was nothing to move)."""
        group = tuple(group)
        if len(group) <= 1 or nbytes <= 0:
            return None
        plan, est, predicted = self.select(op, group, nbytes)
        choice = Choice(op, plan.algorithm, est.protocol, nbytes, predicted)
        self.chosen.append(choice)
        yield self.env.timeout(est.latency_s + self._fill_s(plan, est) + plan.chain_latency_s)
        yield self._start(plan, est, nbytes, tag)
        return choice

    def run_collective_groups(self, op: str, groups: Sequence[Sequence[int]], nbytes: float,
                              tag: object = None, peer_bytes: alltoall.PeerMatrix = (),
                              fused_sms: int = 0, fused_kernel: str = ""
                              ) -> Generator[simpy.Event, object, Choice | None]:
        """Process: the same collective in several disjoint groups at once; its value is
        what NCCL ran in the first group (None when there was nothing to move).

        ``peer_bytes`` (an ``all_to_all``'s group-size matrix of bytes, ``Op.peer_bytes``)
        runs it as per-peer sends of those sizes in every group (:meth:`run_all_to_all_v`),
        by a fused kernel of ``fused_sms`` SMs when not 0 (``Op.sm_ctas``; ``fused_kernel``:
        which, ``Op.fused_kernel``).

        Groups that each sit inside one node, all of one size, use disjoint NVLink ports of
        their nodes: one group's flows stand for all of them (``count`` = number of groups),
        as the architecture's folding asks. Groups across nodes fold the same way when their
        plans are alike and share no link (:meth:`_same_and_disjoint`). Otherwise every
        group's flows run.
        """
        if peer_bytes and op == "all_to_all":
            return (yield from self.run_all_to_all_v(groups, peer_bytes, nbytes, tag,
                                                     fused_sms, fused_kernel))
        if nbytes <= 0:
            return None
        if len(groups) == 1:
            # One group (an op's ``group``: a fresh 1-tuple of it on every call).
            return (yield from self.run_collective(op, groups[0], nbytes, tag))
        tgroups, kid, local = self._group_set(groups)
        if not tgroups:
            return None
        if len(tgroups) == 1:
            return (yield from self.run_collective(op, tgroups[0], nbytes, tag))
        if local:
            plan, est, predicted = self.select(op, tgroups[0], nbytes)
            choice = Choice(op, plan.algorithm, est.protocol, nbytes, predicted)
            self.chosen.append(choice)
            yield self.env.timeout(est.latency_s + self._fill_s(plan, est)
                                   + plan.chain_latency_s)
            yield self._start(plan, est, nbytes, tag, count=len(tgroups))
            return choice
        # What NCCL runs in each group, the longest wait and whether one group's flows stand
        # for all depend only on (groups, op, size): worked out once, not per call.
        ckey = (kid, op, nbytes)
        hit = self._group_choice.get(ckey)
        if hit is None:
            chosen = [self.select(op, grp, nbytes) for grp in tgroups]
            wait = max(est.latency_s + self._fill_s(plan, est) + plan.chain_latency_s
                       for plan, est, _ in chosen)
            fkey = (kid, op, chosen[0][0].algorithm, chosen[0][1].protocol)
            foldable = self._disjoint.get(fkey)
            if foldable is None:
                foldable = self._disjoint[fkey] = self._same_and_disjoint(chosen)
            hit = self._group_choice[ckey] = (chosen, wait, foldable)
        chosen, wait, foldable = hit
        choice = Choice(op, chosen[0][0].algorithm, chosen[0][1].protocol, nbytes, chosen[0][2])
        self.chosen.append(choice)
        yield self.env.timeout(wait)
        if foldable:
            yield self._start(chosen[0][0], chosen[0][1], nbytes, tag, count=len(chosen))
            return choice
        # All groups' flows start together: one rate solve, not one per group.
        yield self._start_all([(plan, est) for plan, est, _ in chosen], nbytes, tag)
        return choice

    def run_all_to_all_v(self, groups: Sequence[Sequence[int]], matrix: alltoall.PeerMatrix,
                         nbytes: float = 0.0, tag: object = None,
                         fused_sms: int = 0, fused_kernel: str = ""
                         ) -> Generator[simpy.Event, object, Choice | None]:
        """Process: an all-to-all with ``matrix[i][j]`` bytes from each group's ``i``-th
        member to its ``j``-th, in every group at once, as NCCL runs it: grouped
        ``ncclSend``/``ncclRecv`` per peer (:mod:`sim.fabric.collectives.alltoall`), one
        send/recv latency (as :meth:`run_p2p`: NCCL sizes its p2p channels so every peer fits
        one round, :func:`~sim.fabric.collectives.alltoall.channels_per_peer`), then every
        transfer as its own flow on its PXN route. Its value
        reports ``nbytes`` (the op's size) and the predicted time of the busiest rank alone.
        ``fused_sms``: run by a fused kernel of that many SMs (DeepEP's normal kernels) instead
        of NCCL: its SMs and its share of NVLink bound each rank's NVLink sends
        (:mod:`sim.fabric.collectives.fused_kernel`; ``fused_kernel == "hybridep"``:
        Hybrid-EP's, :mod:`sim.fabric.collectives.hybridep_kernel`)."""
        tgroups, kid, local = self._group_set(groups)
        if not tgroups:
            return None
        # By the matrix's identity (an op's peer_bytes, passed on every call; the entry keeps
        # it alive so its id is not reused), then by content: hashing a 64 x 64 matrix on
        # every call would cost more than the call.
        fused = (fused_sms, fused_kernel)
        by_id = self._a2a_ids.get((kid, id(matrix), fused))
        hit = by_id[1] if by_id is not None and by_id[0] is matrix else None
        if hit is None:
            hit = self._a2a_plan(kid, tgroups, local, matrix, fused_sms, fused_kernel)
            self._a2a_ids[(kid, id(matrix), fused)] = (matrix, hit)
        plan, est, predicted, count = hit
        if plan is None or est is None:
            return None
        choice = Choice("all_to_all", "p2p", "simple", nbytes, predicted)
        self.chosen.append(choice)
        yield self.env.timeout(est.latency_s + plan.chain_latency_s)
        yield self._start(plan, est, 1.0, tag, count=count)
        return choice

    def _a2a_plan(self, kid: int, tgroups: list[tuple[int, ...]], local: bool,
                  matrix: alltoall.PeerMatrix, fused_sms: int = 0,
                  fused_kernel: str = "") -> _A2A:
        """(plan, estimate, predicted time, count) of :meth:`run_all_to_all_v`, cached by the
        groups and the matrix's content."""
        key = (kid, matrix, fused_sms, fused_kernel)
        hit = self._a2a.get(key)
        if hit is None:
            # Groups inside one node each, of one size, never share a link (see _group_set),
            # nor do groups across nodes whose plans are alike on disjoint links
            # (_same_and_disjoint: expert-parallel groups of distinct nodes): one group's
            # flows stand for all of them. Otherwise every group's flows run.
            b = self.builder
            kernel = hybridep_kernel if fused_kernel == "hybridep" else fused_kernel_model
            rate = kernel.nvlink_send_rate(fused_sms)
            nccl_op = not fused_kernel and fused_sms <= 0
            share = kernel.nvlink_share(fused_sms, self.arch)
            # NCCL's own sends across the network at their measured share; a fused kernel's
            # keep the ring's rate (their own published rates, sim.fabric.collectives).
            net_share = alltoall.P2P_NETWORK_SHARE if nccl_op else 1.0

            def planned(gs: list[tuple[int, ...]]) -> FlowPlan | None:
                return alltoall.peer_plan(b, gs, matrix, nvlink_send_rate=rate,
                                          nvlink_share=share, network_share=net_share)

            plan = planned(tgroups[:1])
            count = len(tgroups)
            if not local and count > 1 and plan is not None:
                each = [planned([g]) for g in tgroups]
                est0 = nccl.Estimate("p2p", "simple", 0.0, 0.0, 1.0)
                if not self._same_and_disjoint([(q, est0, 0.0) for q in each
                                                if q is not None]):
                    plan, count = planned(tgroups), 1
            if plan is None:
                hit = self._a2a[key] = (None, None, 0.0, count)
            else:
                # Plus the kernel's own fixed time a call (Hybrid-EP across NVLink domains).
                latency = (_p2p_latency(plan) + kernel.fixed_call_s(plan.n_nodes)
                           + (alltoall.nvlink_call_s(b, plan) if nccl_op else 0.0))
                e = nccl.Estimate("p2p", "simple", latency, plan.bus_bw, 1.0)
                predicted = e.latency_s + plan.chain_latency_s + plan.volume / plan.bus_bw
                hit = self._a2a[key] = (plan, e, predicted, count)
        return hit

    def _group_set(self, groups: Sequence[Sequence[int]]
                   ) -> _GroupSet:
        """(the groups of more than one rank as tuples, an id of that list, whether each group
        sits inside one node and all are of one size). Cached by the list's content and, for
        a tuple of tuples (an op's ``groups``, passed on every call), by its identity: the
        entry keeps it alive, so its id is not reused, and a call costs no pass over the
        GPUs."""
        by_id = self._group_ids.get(id(groups))
        if by_id is not None and by_id[0] is groups:
            return by_id[1]
        tgroups: list[tuple[int, ...]] = [tuple(g) for g in groups if len(g) > 1]
        key = tuple(tgroups)
        out = self._group_sets.get(key)
        if out is None:
            # Each group inside one node, all of one size: their flows use only their own
            # GPUs' NVLink ports to the node's non-blocking NVSwitch, so the groups (several
            # may share a node: tensor-parallel groups of 2 or 4) never meet on a link and
            # any one of them behaves like the others.
            b = self.builder
            nodes = [{b.node_of[r] for r in g} for g in tgroups]
            size = len(tgroups[0]) if tgroups else 0
            local = (all(len(n) == 1 for n in nodes)
                     and all(len(grp) == size for grp in tgroups))
            out = self._group_sets[key] = (tgroups, len(self._group_sets), local)
        if type(groups) is tuple and all(type(g) is tuple for g in groups):
            self._group_ids[id(groups)] = (groups, out)
        return out

    def _same_and_disjoint(self, chosen: Sequence[tuple[FlowPlan, nccl.Estimate, float]]
                           ) -> bool:
        """Whether the groups' plans run the same algorithm and protocol over link paths of
        the same kinds and capacities, on pairwise disjoint links: then no group's flows meet
        another's, and one group's flows stand for all (the data-parallel groups of each
        tensor-parallel rank, one per rail, or context-parallel pairs across nodes)."""
        if not self.fold_across_nodes:
            return False
        first, est0, _ = chosen[0]
        cap, kind = self.fabric.capacity, self.fabric.kind
        seen: set[int] = set()
        for plan, est, _ in chosen:
            if (plan.algorithm != first.algorithm or est.protocol != est0.protocol
                    or plan.n_flows != first.n_flows
                    or not np.array_equal(plan.lengths, first.lengths)
                    or not np.array_equal(cap[plan.flat], cap[first.flat])
                    or not np.array_equal(kind[plan.flat], kind[first.flat])
                    or not np.array_equal(plan.share, first.share)):
                return False
            links = set(plan.flat.tolist())
            if links & seen:
                return False
            seen |= links
        return True

    def _start_all(self, plans: Sequence[tuple[FlowPlan, nccl.Estimate]], nbytes: float,
                   tag: object) -> simpy.Event:
        """Start several plans' flows as one group (one rate solve); the event fires when the
        last flow of any of them ends."""
        parts = [self._flows(plan, est, nbytes, 1) for plan, est in plans]
        return self.net.start_group(np.concatenate([p[0] for p in parts]),
                                    np.concatenate([p[1] for p in parts]),
                                    np.concatenate([p[2] for p in parts]),
                                    np.concatenate([p[3] for p in parts]),
                                    np.concatenate([p[4] for p in parts]), tag=tag,
                                    payload=sum(p[5] for p in parts))

    def _start(self, plan: FlowPlan, est: nccl.Estimate, nbytes: float, tag: object,
               count: int = 1) -> simpy.Event:
        flat, lengths, sizes, counts, caps, payload = self._flows(plan, est, nbytes, count)
        return self.net.start_group(flat, lengths, sizes, counts, caps, tag=tag,
                                    payload=payload)

    def _flows(self, plan: FlowPlan, est: nccl.Estimate, nbytes: float, count: int
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, float]:
        """The flows of ``plan`` for a message of ``nbytes``: (links, lengths, sizes, counts,
        caps, payload) as :meth:`FlowNetwork.start_group` takes them."""
        # The protocol's overhead travels on the wire (LL's flags, LL128's lines): a flow
        # carries payload / wire_factor bytes. Where NCCL also caps the protocol's bandwidth
        # (LL's maximum, LL128's per-channel limit), the flows are capped in proportion.
        wire = est.wire_factor if est.wire_factor > 0 else 1.0
        # The same collective of a rank class runs once per micro-batch with the same plan
        # and size: its arrays are made once (the network only reads them). The entry keeps
        # the plan, so its id is not reused while the entry lives.
        fkey = (id(plan), est.algorithm, est.protocol, wire, nbytes, count)
        hit = self._flow_arrays.get(fkey)
        if hit is not None and hit[0] is plan:
            return hit[1]
        ckey = (id(plan), est.algorithm, est.protocol)
        caps = self._caps.get(ckey)
        if caps is None:
            cap_scale = min(1.0, est.bw_factor / wire)
            caps = plan.bottleneck * cap_scale
            # At most one NCCL_BUFFSIZE in flight per channel and peer (NCCL_STEPS slots of
            # buffsize/8, device.h), and each flow stands for plan.flow_channels channels:
            # rate <= channels x buffsize / RTT, RTT over the flow's longest hop.
            rtt = 2.0 * plan.path_latency
            per_channel = plan.window_bytes or self.settings.buffsize
            window = np.where(rtt > 0, plan.flow_channels * per_channel
                              / np.maximum(rtt, 1e-15), np.inf)
            caps = self._caps[ckey] = np.minimum(caps, window)
        n = plan.n_flows
        # Read-only (views of the plan's): the network may then know them again by identity
        # (sim.fabric.network_fold._plan_for).
        arrays = [plan.flat.view(), plan.lengths.view(), plan.share * nbytes / wire,
                  np.full(n, float(count)), caps.view()]
        for a in arrays:
            a.flags.writeable = False
        flows = (arrays[0], arrays[1], arrays[2], arrays[3], arrays[4],
                 plan.delivered * nbytes * count)
        if len(self._flow_arrays) >= 4096:
            self._flow_arrays.clear()
        self._flow_arrays[fkey] = (plan, flows)
        return flows

    def run_p2p(self, pairs: Sequence[tuple[int, int]], nbytes: float, tag: object = None
                ) -> Generator[simpy.Event, object, Choice | None]:
        """Process: point-to-point transfers (NCCL send/recv, Simple protocol), one flow per
        (source, destination) pair, all at once."""
        if nbytes <= 0:
            return None
        plan = self._p2p_plan(pairs)
        if plan is None:
            return None
        est = nccl.Estimate("p2p", "simple", _p2p_latency(plan), plan.bus_bw, 1.0)
        # A send pays its path's long-haul propagation once (sim.fabric.collectives.chain).
        yield self.env.timeout(est.latency_s + plan.chain_latency_s)
        yield self._start(plan, est, nbytes, tag)
        return Choice("sendrecv", "p2p", "simple", nbytes, est.latency_s + plan.chain_latency_s)


    def _p2p_plan(self, pairs: Sequence[tuple[int, int]]) -> FlowPlan | None:
        """The plan of the pairs that move data (None: none do), cached by content and, for a
        tuple of tuples (an op's ``pairs``: 1,024 of them per pipeline send at 16k GPUs), by
        identity: the entry keeps it alive, so its id is not reused."""
        hit = self._p2p_ids.get(id(pairs))
        if hit is not None and hit[0] is pairs:
            return hit[1]
        key = tuple((s, d) for s, d in pairs if s != d)
        plan = None
        if key:
            plan = self._p2p.get(key)
            if plan is None:
                plan = self._p2p[key] = self.builder.p2p(key, 1.0)
        if type(pairs) is tuple and all(type(p) is tuple for p in pairs):
            self._p2p_ids[id(pairs)] = (pairs, plan)
        return plan


def _p2p_latency(plan: FlowPlan) -> float:
    # NCCL send/recv: the Simple protocol's base latency plus one hop of its link type.
    link = "nvlink" if plan.n_nodes <= 1 else "network"
    return (nccl.BASE_LAT_US["ring"]["simple"] + nccl.HW_LAT_US[link]["ring"]["simple"]) * 1e-6
