"""A profiled trace's ``deviceProperties`` name picks its catalogue part.

The names as the parts report them (nvidia-smi ``product_name`` / torch
``get_device_name``: "NVIDIA GB300", "NVIDIA B300 SXM6 AC", "NVIDIA GB200", "NVIDIA B200",
"NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"): a Grace part's name contains its HGX
sibling's ("GB300" holds "B300"), so the lookup must try the Grace part first.
"""

from __future__ import annotations

import pytest

from sim.apps.replay.kineto_in import _gpu_key

GIB = 2**30


@pytest.mark.parametrize("name,gib,key", [
    ("NVIDIA GB300", 276.6, "gb300"),
    ("NVIDIA B300 SXM6 AC", 267.7, "b300"),
    ("NVIDIA GB200", 184.3, "gb200"),
    ("NVIDIA B200", 178.4, "b200"),
    ("NVIDIA H100 80GB HBM3", 79.2, "h100-sxm"),
    ("NVIDIA A100-SXM4-40GB", 39.4, "a100-40gb"),
    ("NVIDIA A100-SXM4-80GB", 79.2, "a100-80gb"),
    ("NVIDIA L40S", 44.4, None),
])
def test_device_name_to_catalogue_key(name: str, gib: float, key: str | None) -> None:
    meta = {"deviceProperties": [{"name": name, "totalGlobalMem": gib * GIB}]}
    assert _gpu_key(meta) == key
