"""The two per-step costs measured on the lent H200's profiled steps (h200-step-gaps.json):
the moment a stream idles between two kernels, and Hugging Face's host-bound forward start."""

from __future__ import annotations

import pytest

from sim import catalog
from sim.hardware.compute import KERNEL_BOUNDARY_S, ComputeModel
from sim.workload.block_pricing import kernel_time, price_block, priced_kernels
from sim.workload.kernels import Style
from sim.workload.layer_ops import HF_FORWARD_START_HOST_S, embedding_block, mlp_block
from sim.workload.model import ModelSpec

MODEL = ModelSpec.from_ref("llama3-8b")
CM = ComputeModel(catalog.gpu("h200"))


@pytest.mark.parametrize("style", [Style("autocast"), Style("bf16"),
                                   Style("hf_bf16", compile=True)])
def test_a_blocks_gpu_time_is_its_kernels_plus_a_boundary_each(style: Style) -> None:
    block = mlp_block(MODEL, style, 1, 4096)
    fwd, bwd = priced_kernels(block, style)
    cost = price_block(block, style, CM)
    for kernels, gpu_s in ((fwd, cost.fwd_gpu_s), (bwd, cost.bwd_gpu_s)):
        own = sum(kernel_time(CM, k) for k in kernels)
        assert gpu_s == pytest.approx(own + len(kernels) * KERNEL_BOUNDARY_S, rel=1e-12)


@pytest.mark.parametrize("style,pays", [
    (Style("autocast"), True),                                 # Hugging Face, eager
    (Style("hf_bf16"), True),
    (Style("hf_bf16", compile=True), True),                    # FSDP2 compiles each layer only
    (Style("autocast", compile=True, sdpa_mask=True), False),  # the whole model traced
    (Style("bf16"), False),                                    # torchtitan's code: no mask check
])
def test_hugging_faces_forward_start_is_paid_unless_traced_whole(style: Style,
                                                                 pays: bool) -> None:
    block = embedding_block(MODEL, style, 1, 4096)
    assert block.exposed_host_s == (HF_FORWARD_START_HOST_S if pays else 0.0)
    cost = price_block(block, style, CM)
    assert cost.fwd_s - cost.fwd_gpu_s >= (HF_FORWARD_START_HOST_S if pays else 0.0) - 1e-12
