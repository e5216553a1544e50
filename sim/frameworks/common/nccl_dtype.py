"""The NCCL element type of a collective's tensor, for :attr:`sim.program.ir.Op.dtype`.

A builder knows the bytes per element of what it communicates (4: fp32 master weights or
fp32 gradients; 2: the 16-bit training type; 1: float8 data) and the training precision;
these give the ``ncclDataType_t`` the framework's process group passes to NCCL, by the name
NCCL's kernels carry (NCCL src/device/generate.py, ``all_tys``). A label only: it never
feeds timing (``nbytes`` does).
"""

from __future__ import annotations

from sim.program.ir import NcclType


def half(precision: str) -> NcclType:
    """The 16-bit type of a training precision: fp16 runs ``ncclFloat16``; bf16, and fp8
    training (whose tensors between its float8 GEMMs stay bf16), ``ncclBfloat16``."""
    return "f16" if precision == "fp16" else "bf16"


def element_type(bytes_per_element: float, precision: str) -> NcclType:
    """NCCL's type of a tensor of ``bytes_per_element`` in a job of training ``precision``.

    One byte is float8 data, which NCCL moves as ``ncclUint8``: PyTorch's
    ProcessGroupNCCL maps the float8 dtypes to ncclUint8 unless built with NCCL's own fp8
    types (``getNcclDataType``), FSDP2's ``foreach_all_gather`` gathers a unit whose
    tensors differ in dtype (float8 weights, bf16 norms) as torch.uint8, and Transformer
    Engine keeps a Float8Tensor's data as torch.uint8 (``Float8Tensor._data``).

    Examples
    --------
    >>> element_type(4, "bf16"), element_type(2, "fp16"), element_type(1, "fp8")
    ('f32', 'f16', 'u8')
    """
    if bytes_per_element == 4:
        return "f32"
    if bytes_per_element == 2:
        return half(precision)
    if bytes_per_element == 1:
        return "u8"
    raise ValueError(f"no NCCL element type of {bytes_per_element} bytes")
