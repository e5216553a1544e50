"""Verdicts on published figures: consistent, off by N%, or physically impossible (and why).

Physics first: a throughput claim is impossible when the model FLOPs it implies exceed the
GPU's dense peak; a memory claim when it is below what the model states alone occupy under
the scenario's sharding, or above the GPU's memory. Otherwise the claim is compared with the
simulation: within 10% is consistent.
"""

from __future__ import annotations

from typing import Any

from sim.catalog import GpuSpec
from sim.scenario import Claims

CONSISTENT_WITHIN = 0.10
GIB = float(2**30)


def judge(claims: Claims, summary: dict[str, Any], gpu: GpuSpec, precision: str,
          flops_per_token: float, model_state_bytes: float) -> list[dict[str, Any]]:
    """One verdict per claimed figure.

    ``flops_per_token``: model FLOPs per trained token; ``model_state_bytes``: parameters,
    gradients and optimizer states per GPU under the scenario's sharding.
    """
    out: list[dict[str, Any]] = []
    peak = gpu.peak_flops(precision)
    gpus = summary["gpus"]
    mem_cap = gpu.usable_memory_gib

    def verdict(metric: str, claimed: float, simulated: float, impossible: str | None) -> None:
        if impossible:
            v, reason = "physically impossible", impossible
        else:
            err = (claimed - simulated) / simulated if simulated else float("inf")
            if abs(err) <= CONSISTENT_WITHIN:
                v, reason = "consistent", f"within {CONSISTENT_WITHIN:.0%} of the simulation"
            else:
                v = f"off by {err:+.0%}"
                reason = f"claimed {claimed:.4g} vs simulated {simulated:.4g}"
        out.append({"metric": metric, "claimed": claimed, "simulated": simulated,
                    "verdict": v, "reason": reason})

    def throughput_check(tok_per_gpu: float) -> str | None:
        need = tok_per_gpu * flops_per_token
        if need > peak:
            return (f"needs {need / 1e12:,.0f} TFLOP/s per GPU of model math "
                    f"({flops_per_token / 1e9:,.1f} GFLOP per token), above the "
                    f"{gpu.name}'s dense {precision} peak of {peak / 1e12:,.0f} TFLOP/s")
        return None

    def memory_check(gib: float) -> str | None:
        if gib > mem_cap:
            return f"above the {gpu.name}'s {mem_cap:.1f} GiB of memory"
        if gib * GIB < model_state_bytes:
            return (f"parameters, gradients and optimizer states alone need "
                    f"{model_state_bytes / GIB:.1f} GiB per GPU with this sharding")
        return None

    if claims.tokens_per_s_per_gpu is not None:
        c = claims.tokens_per_s_per_gpu
        verdict("tokens_per_s_per_gpu", c, summary["tokens_per_s_per_gpu"], throughput_check(c))
    if claims.tokens_per_s is not None:
        c = claims.tokens_per_s
        verdict("tokens_per_s", c, summary["tokens_per_s"], throughput_check(c / gpus))
    if claims.step_time_s is not None:
        c = claims.step_time_s
        tok = summary["tokens_per_step"] / c / gpus
        verdict("step_time_s", c, summary["step_time_s"], throughput_check(tok))
    if claims.mfu is not None:
        c = claims.mfu
        verdict("mfu", c, summary["mfu"], "MFU cannot exceed 1" if c > 1 else None)
    if claims.peak_memory_gib is not None:
        c = claims.peak_memory_gib
        verdict("peak_memory_gib", c, summary["peak_memory_gib"], memory_check(c))
    if claims.peak_memory_gb is not None:
        c = claims.peak_memory_gb
        verdict("peak_memory_gb", c, summary["peak_memory_gib"] * GIB / 1e9,
                memory_check(c * 1e9 / GIB))
    return out
