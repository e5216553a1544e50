"""Fused attention given an explicit mask tensor: how much slower than the unmasked call.

Hugging Face transformers calls SDPA with ``is_causal=True`` and no mask only when it is not
being traced: ``masking_utils._ignore_causal_mask_sdpa`` returns False under
``torch.compile`` (``is_tracing``), so a whole model compiled with ``torch.compile`` hands every
layer's SDPA a ``[batch, 1, seq, seq]`` causal mask, and ``sdpa_attention.use_gqa_in_sdpa``
(no mask required) fails, so ``repeat_kv`` first expands grouped keys and values to every
query head (transformers 5.17). A kernel given an arbitrary mask cannot skip the tiles above
the diagonal: it runs the whole score rectangle and adds the mask tile to each score tile.

Measured on the H200 (``sim/catalog/calibration/h200-masked-attention.json``, PyTorch 2.11,
cuDNN 9.19, whose kernels ran every variant): the masked call costs 1.5-2.0x the unmasked
full-rectangle call of the same shape (the boolean and the additive bf16 mask alike, so not
the mask's bytes: 3.2-3.5x the causal call), forward and backward, head dim 64 and 128,
1k-16k tokens. The slowdown is read from that table, at the measured head dim nearest the
call's, interpolated in log2 of the sequence length and held at the ends. Measured on cuDNN
and Hopper only; other kernels and generations are priced with the same slowdown over their
own full-rectangle call.

Examples
--------
>>> round(masked_slowdown("fwd", 64, 4096), 2), round(masked_slowdown("bwd", 128, 4096), 2)
(1.82, 1.93)
"""

from __future__ import annotations

import math
from functools import cache
from typing import Literal

from sim import catalog

MEASURED = "h200-masked-attention.json"


@cache
def _table() -> dict[tuple[str, int], list[tuple[float, float]]]:
    """(pass, head_dim) -> sorted [(log2 seq, boolean-mask time / unmasked full time)]."""
    rows = catalog.calibration(MEASURED)["rows"]
    full = {(r["head_dim"], r["seq"]): r for r in rows if r["variant"] == "full"}
    out: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in rows:
        if r["variant"] != "bool_mask":
            continue
        base = full[(r["head_dim"], r["seq"])]
        for pass_ in ("fwd", "bwd"):
            out.setdefault((pass_, r["head_dim"]), []).append(
                (math.log2(r["seq"]), r[f"{pass_}_s"] / base[f"{pass_}_s"]))
    return {k: sorted(v) for k, v in out.items()}


def masked_slowdown(pass_: Literal["fwd", "bwd"], head_dim: int, seq: int) -> float:
    """Time of a masked fused-attention call over the unmasked full-rectangle call."""
    table = _table()
    dims = sorted({d for p, d in table if p == pass_})
    # The nearest measured head dim; a tie goes to the wider one.
    dim = min(dims, key=lambda d: (abs(d - head_dim), -d))
    points = table[(pass_, dim)]
    x = math.log2(seq)
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]
