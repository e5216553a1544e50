"""Megatron-Core's custom pipeline layout (``--pipeline-model-parallel-layout``,
``TransformerConfig.pipeline_model_parallel_layout``).

``megatron/core/transformer/pipeline_parallel_layer_layout.py`` (``PipelineParallelLayerLayout``)
takes one list per virtual pipeline stage, ``pp x vp`` of them in the order
``vpp_rank * pp + pp_rank`` (so entry ``v`` runs on stage ``v % pp`` as model chunk
``v // pp``, this package's numbering), each a list of layer types: ``embedding``,
``decoder`` (a transformer layer), ``mtp`` (a multi-token prediction module), ``loss``.
The virtual stage count per rank is ``len(layout) // pp``. As a string: one character per
layer (``E`` embedding, ``t`` decoder, ``m`` mtp, ``L`` loss), ``|`` between stages, commas
cosmetic, ``x*n`` and ``(...)*n`` repeat (``parse_str_to_list``). ``get_num_layers_to_build``
(``transformer_block.py``) then builds a stage's ``decoder`` count and numbers the layers in
stage order (``get_layer_offset``: every earlier virtual stage's decoders).

Megatron-Bridge's DeepSeek-V3 recipe (``src/megatron/bridge/recipes/deepseek/deepseek_v3.py``,
``layout_map``) uses, for pp 4 x vp 4 (and 16 x 1, 8 x 2), ``[E t t t t] + [t t t t] x 14 +
[t m L]``; its H100 performance script (``scripts/performance/configs/deepseek/
deepseek_llm_pretrain.py``) passes ``"Et|(tt|)*30mL"`` for pp 8 x vp 4.

``validate_layer_layout`` asks for exactly one embedding, first, and one loss, last; as many
decoders as ``num_layers`` and mtp entries as ``mtp_num_layers``; the MTP modules after
every decoder, together in one rank's last model chunk, never on the first rank. The builder
here also keeps the embedding on the first virtual stage and the output layer with the loss
(and the MTP modules) on the last, where Megatron-Core's ``pre_process`` / ``post_process``
put them; a standalone MTP stage (``mtp_standalone``) is not modelled.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

LAYER_CHARS = {"E": "embedding", "t": "decoder", "m": "mtp", "L": "loss"}
"""``parse_str_to_list``'s characters and the layer types they stand for."""
LAYER_TYPES = frozenset(LAYER_CHARS.values())

_GROUP = re.compile(r"\(([^()]+)\)\*(\d+)")
_SINGLE = re.compile(r"(.)\*(\d+)")
_MAX_EXPANDED = 100_000   # a layout longer than any model (bounds the repeats' expansion)

Layout = list[list[str]]
"""One list of layer types per virtual stage, in ``vpp_rank * pp + pp_rank`` order."""


def parse_layout(text: str) -> Layout:
    """The stage lists of a layout string (``PipelineParallelLayerLayout.parse_str_to_list``).

    Examples
    --------
    >>> [len(s) for s in parse_layout("Et|(tt|)*30mL")][:2], len(parse_layout("Et|(tt|)*30mL"))
    ([2, 2], 32)
    >>> parse_layout("Et*2|t,L")
    [['embedding', 'decoder', 'decoder'], ['decoder', 'loss']]
    """
    s = text.replace(",", "").replace(" ", "")
    for pattern in (_GROUP, _SINGLE):
        def unroll(m: re.Match[str]) -> str:
            if len(m.group(1)) * int(m.group(2)) > _MAX_EXPANDED:
                raise ValueError(f"layout {text!r} repeats beyond {_MAX_EXPANDED} layers")
            return m.group(1) * int(m.group(2))
        s = pattern.sub(unroll, s)
    out: Layout = []
    for stage in s.split("|"):
        bad = sorted({ch for ch in stage if ch not in LAYER_CHARS})
        if bad:
            raise ValueError(f"layout {text!r}: unknown layer character(s) {''.join(bad)} "
                             f"(E embedding, t decoder, m mtp, L loss, | between stages)")
        out.append([LAYER_CHARS[ch] for ch in stage])
    return out


def as_layout(value: str | Sequence[Sequence[str]]) -> Layout:
    """A layout given as a string or as lists of layer-type names (case-insensitive, as
    ``PipelineParallelLayerLayout.__init__`` lower-cases them)."""
    if isinstance(value, str):
        return parse_layout(value)
    out: Layout = []
    for stage in value:
        row = [str(x).strip().lower() for x in stage]
        bad = sorted(set(row) - LAYER_TYPES)
        if bad:
            raise ValueError(f"unknown layer type(s) {bad} (one of {sorted(LAYER_TYPES)})")
        out.append(row)
    return out


def layout_vp(layout: Layout, p: int) -> int:
    """Virtual stages per rank the layout implies (``len(layout) // pp``); ValueError when
    its length is no multiple of pp."""
    if len(layout) % p:
        raise ValueError(f"{len(layout)} stage entries do not divide over pp = {p}")
    return len(layout) // p


def layout_chunks(layout: Layout, p: int, layers: int, mtp_layers: int | None = None
                  ) -> list[list[int]]:
    """Transformer layers of each virtual stage of a checked layout: stage ``v`` builds its
    ``decoder`` count, numbered after every earlier virtual stage's
    (``get_num_layers_to_build``, ``get_layer_offset``). ``mtp_layers`` None: the MTP
    count is not checked (the planner's split knows only the layers).

    Examples
    --------
    Megatron-Bridge's DeepSeek-V3 layout for pp 4 x vp 4 (61 layers, 1 MTP module):

    >>> lay = [["embedding"] + ["decoder"] * 4] + [["decoder"] * 4] * 14 + \\
    ...     [["decoder", "mtp", "loss"]]
    >>> ch = layout_chunks(lay, 4, 61, 1)
    >>> [len(c) for c in ch[:2]], ch[15], ch[14][-1]
    ([4, 4], [60], 59)
    """
    check_layout(layout, p, layers, mtp_layers)
    out, start = [], 0
    for stage in layout:
        k = stage.count("decoder")
        out.append(list(range(start, start + k)))
        start += k
    return out


def check_layout(layout: Layout, p: int, layers: int, mtp_layers: int | None) -> None:
    """``validate_layer_layout``'s rules and the placements this builder models; ValueError
    naming the first broken one."""
    vp = layout_vp(layout, p)
    flat = [x for stage in layout for x in stage]
    if flat.count("embedding") != 1 or flat.count("loss") != 1:
        raise ValueError("the layout needs exactly one embedding (E) and one loss (L)")
    if not flat or flat[0] != "embedding" or flat[-1] != "loss":
        raise ValueError("the layout must start with the embedding (E) and end with the "
                         "loss (L)")
    if "embedding" not in layout[0] or "loss" not in layout[-1]:
        raise ValueError("the embedding (E) must be in the first virtual stage and the loss "
                         "(L) in the last (Megatron-Core's pre_process / post_process stages)")
    if flat.count("decoder") != layers:
        raise ValueError(f"the layout has {flat.count('decoder')} decoder layers (t), the "
                         f"model {layers}")
    if mtp_layers is not None and flat.count("mtp") != mtp_layers:
        raise ValueError(f"the layout has {flat.count('mtp')} MTP modules (m), the model "
                         f"{mtp_layers} (mtp_layers)")
    n_mtp = flat.count("mtp")
    if n_mtp:
        if "decoder" in flat[flat.index("mtp"):]:
            raise ValueError("decoder layers must be placed before the MTP modules")
        if layout[-1].count("mtp") != n_mtp:
            last = f"pp rank {p - 1}, model chunk {vp - 1}"
            raise ValueError(f"every MTP module must be in the last virtual stage ({last}) "
                             "with the loss; a standalone MTP stage is not modelled")
