"""The summary object's type: the JSON object ``fabricsim run --json`` prints, as TypedDicts.

CONTRACT.md ("Summary object") defines the keys; the contract only grows, so every key here
stays. At run time a summary is a plain ``dict`` (``result.summary["gpus"]`` and
``json.dumps`` work as they always did); the types let mypy check every key a reader uses.
:func:`sim.analysis.collect.collect_summary` builds it, key by key in this order (the JSON's
order). Units are SI (seconds, bytes, FLOPs) unless the name says otherwise (``_gib``: 2**30
bytes, ``_gb``: 1e9 bytes, ``usd_``: US dollars); all per optimizer step unless the name says
otherwise.

This module imports nothing of the project: everything else in :mod:`sim.analysis` and above
may import it.
"""

# No ``from __future__ import annotations``: TypedDict reads NotRequired off evaluated
# annotations only (Summary.__optional_keys__ would miss ``claims`` with postponed ones).
from typing import NotRequired, TypedDict


class BytesByClass(TypedDict):
    """``bytes``: bytes carried per step by links of each class (:data:`LINK_KINDS
    <sim.fabric.topology.links.LINK_KINDS>`, in that order), each hop counted; the zone and
    region classes count each byte once per boundary crossed (what clouds bill)."""

    nvlink: float
    pcie: float
    network: float
    cross_az: float
    cross_region: float


def bytes_items(b: BytesByClass) -> list[tuple[str, float]]:
    """``bytes`` as (link class, bytes per step) pairs in the JSON's order, each a float to
    the type checker (``dict.items`` of a TypedDict gives ``object`` values).

    Examples
    --------
    >>> bytes_items({"nvlink": 4.0, "pcie": 0.0, "network": 2.0, "cross_az": 0.0,
    ...              "cross_region": 0.0})[:3]
    [('nvlink', 4.0), ('pcie', 0.0), ('network', 2.0)]
    """
    return [("nvlink", b["nvlink"]), ("pcie", b["pcie"]), ("network", b["network"]),
            ("cross_az", b["cross_az"]), ("cross_region", b["cross_region"])]


class Cost(TypedDict):
    """``cost``: :func:`sim.analysis.cost.cost_summary`'s object (CONTRACT.md's keys first)."""

    usd_per_hour: float
    usd_per_step: float
    egress_usd_per_step: float
    usd_per_million_tokens: float
    run_hours: float | None
    """Null without ``training.tokens_total``."""
    run_usd: float | None
    """Null without ``training.tokens_total``."""
    usd_per_day: float
    egress_gb_per_step: float
    egress_gb_per_day: float
    egress_usd_per_day: float
    gpu_hour_usd: float
    egress_usd_per_gb: float
    region_egress_usd_per_gb: float
    instance: str | None
    """The catalogue instance the GPU price came from, or null."""


class SimStats(TypedDict):
    """``sim``: what the simulation itself cost."""

    wall_s: float
    events: int
    """Engine events processed plus the network's rate solves."""
    ranks_simulated: int
    """Rank classes simulated (each stands for all its member ranks)."""


class Claim(TypedDict):
    """One verdict of ``claims`` (:func:`sim.analysis.claims.verdict`)."""

    metric: str
    claimed: float
    simulated: float
    verdict: str
    """``consistent``, ``off by +N%`` or ``physically impossible``."""
    reason: str


class MemoryOverheads(TypedDict, total=False):
    """``memory_overheads_gib``: memory beside the caching allocator's, on the rank class
    with the most. Empty when the recorder has no overheads (:func:`sim.api.simulate` always
    records them)."""

    cuda_context: float
    nccl: float
    cublas_workspace: float


class RankClassMemory(TypedDict):
    """One row of ``memory_by_rank_class``: a rank class's own peaks."""

    rank_class: int
    label: str
    ranks: int
    peak_gib: float
    peak_time_s: float
    breakdown_gib: dict[str, float]
    """Live bytes by category at the allocated peak (``parameters``, ``activations``, ...)."""
    peak_reserved_gib: float
    peak_reserved_time_s: float
    peak_nvidia_smi_gib: float
    oom: bool
    allocator_retries: int
    """cudaMalloc failures the allocator survived by freeing its cache and retrying."""


class MemorySummary(TypedDict):
    """The memory keys of the summary (:func:`sim.analysis.metrics.memory_summary`)."""

    peak_memory_gib: float
    peak_reserved_gib: float
    peak_nvidia_smi_gib: float
    gpu_memory_gib: float
    oom: bool
    memory_overheads_gib: MemoryOverheads
    peak_memory_breakdown_gib: dict[str, float]
    memory_by_rank_class: list[RankClassMemory]


class RunLength(TypedDict):
    """``run``: the whole run (:func:`sim.apps.runlength.run_length`), there only when the
    scenario has a ``run:`` block. CONTRACT.md's keys first; days are wall-clock days."""

    ettr: float
    """Effective training time ratio: useful training time / wall time of the expected run."""
    expected_days: float
    days_p5: float
    days_p95: float
    expected_usd: float
    checkpoint_interval_steps: int
    optimal_checkpoint_interval_steps: int
    """The interval maximising the expected ETTR."""
    interruptions_expected: float
    """Interruptions per run, planned stops included."""
    ettr_p5: float
    ettr_p95: float
    young_daly_interval_steps: float | None
    """sqrt(2 x checkpoint cost x MTBF) in steps; null without unplanned interruptions."""
    steps_total: int
    mtbf_hours: float | None
    """Mean time between unplanned interruptions of the job."""
    downtime_minutes: float
    """Mean stop per unplanned interruption (restart and replacement waits)."""
    checkpoint_gb: float
    checkpoint_write_s: float
    checkpoint_blocking_s: float
    checkpoint_write_gbytes_per_s: float
    failures: str
    """The catalogue name, or ``custom``."""
    samples: int
    # With ``run.zone_outage`` only (sim.apps.runlength.zones): the outages are in the ETTR
    # and days above.
    zone_outage_policy: NotRequired[str]
    zone_outages_expected: NotRequired[float]
    """Zone outages per run."""
    zone_outage_days_lost: NotRequired[float]
    """Days the outages cost a run: work lost, stops, and the shrunk layout's slower pace
    (negative when the surviving zones step faster than the whole cluster)."""
    zone_outage_checkpoint_survives: NotRequired[bool]
    shrunk_step_time_s: NotRequired[float | None]
    """``shrink``: the step time simulated on the surviving zones."""
    shrunk_dp: NotRequired[int | None]
    shrunk_nodes: NotRequired[int | None]
    checkpoint_simulated: bool
    """The checkpoint figures above were measured on the timeline (``run.checkpoint.simulate``,
    the summary's ``checkpoint``): write and blocking times with their contention; the step
    time is the clean step's. False: the closed form."""
    checkpoint_closed_form_write_s: float
    """The closed form's write time (bytes over the storage's rate), for checks."""
    checkpoint_closed_form_blocking_s: float
    checkpoint_egress_usd_per_save: float
    """Billed zone and region crossings of one save (storage in another zone or region)."""


class CheckpointFigures(TypedDict):
    """``checkpoint``: the saves simulated on the timeline (``run.checkpoint.simulate``),
    measured (:mod:`sim.analysis.checkpoint_figures`); there only with that key."""

    saves: int
    """Saves in the simulated window (after steps 1, 1 + interval, ...)."""
    window_steps: int
    """Steps simulated."""
    storage: str
    asynchronous: bool
    gb_per_save: float
    """Bytes one save writes (each rank's share of the sharded states, summed), in GB."""
    clean_step_s: float
    """The first step's training work alone (nothing before it, the save after it)."""
    blocking_s: float
    """What the first save adds to its step: the whole write (synchronous) or the staging
    device-to-host copy (asynchronous)."""
    d2h_s: float
    """The first save's device-to-host staging copy, the longest of the rank classes'
    (asynchronous; 0 when synchronous)."""
    write_s: float
    """The first save from its first byte to its last on the storage."""
    write_gbytes_per_s: float
    contention_s_per_save: float
    """Training time per save lost to background writes sharing links with the next steps:
    the later steps' training spans above the clean step, per save."""
    write_ends_in_window: bool
    """Whether the first save's write ended before the window's last step did (if not, the
    contention after the window is not measured)."""
    cross_az_gb_per_save: float
    cross_region_gb_per_save: float


class StepSpread(TypedDict):
    """``step_times``: the spread of the steps' durations, there only with ``faults.jitter``
    (steps differ only then): percentiles over the simulated steps."""

    steps: int
    min_s: float
    p50_s: float
    p90_s: float
    p99_s: float
    max_s: float


class Summary(TypedDict):
    """The summary object (CONTRACT.md, "Summary object"), in the JSON's key order.

    The keys after ``sim`` go beyond the contract's first list (it only grows): what the
    numbers rest on. ``claims`` is there only when the scenario has a claims block, ``run``
    only when it has a ``run:`` block, ``step_times`` only with ``faults.jitter``.
    """

    scenario: str
    gpus: int
    step_time_s: float
    tokens_per_step: float
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    model_flops_per_step: float
    mfu: float
    hfu: float
    model_tflops_per_gpu: float
    peak_memory_gib: float
    peak_reserved_gib: float
    peak_nvidia_smi_gib: float
    gpu_memory_gib: float
    oom: bool
    compute_time_s: float
    comm_time_s: float
    exposed_comm_s: float
    overlap_fraction: float
    bubble_fraction: float
    bytes: BytesByClass
    cost: Cost
    sim: SimStats
    framework: str
    attention_backend: str
    sm_clock_mhz: float | None
    """The SM clock tensor-core kernels were priced at (``cluster.sm_clock: balanced``);
    null under ``held``, the kernel tables' own clocks."""
    model_params: int
    active_params: int
    """Parameters one token uses: model_params with only the top-k routed experts of each
    mixture-of-experts layer (CONTRACT.md); equal to model_params for a dense model."""
    micro_batches: int
    host_bound_s: float
    """Time in the step the critical rank class runs nothing while an op whose inputs are
    there waits for its host to issue it (Python and kernel-launch overhead the GPU does
    not hide): a host-paced step's share of its idle time. A lower bound on what the host
    costs: an op it delays may delay others through their dependencies, waits not counted."""
    memory_overheads_gib: MemoryOverheads
    peak_memory_breakdown_gib: dict[str, float]
    memory_by_rank_class: list[RankClassMemory]
    """Each rank class's own peaks (pipeline stages and the stages holding the embedding or
    the LM head differ), and whether that class runs out of memory."""
    claims: NotRequired[list[Claim]]
    run: NotRequired[RunLength]
    step_times: NotRequired[StepSpread]
    checkpoint: NotRequired[CheckpointFigures]
