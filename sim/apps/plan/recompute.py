"""How much two layouts' recomputation settings recompute, compared.

A layout recomputes nothing (``none``), a selection of each layer (``selective``: the
framework's own, or Megatron's ``recompute_modules`` the planner sets, ``Layout.recompute``)
or everything but each layer's input (``full``). One setting *covers* another when it
recomputes everything the other does: it then keeps no more activations (the memory rule of
:class:`~sim.apps.plan.memory.MemoryPruning`) and runs no fewer kernels (the time rule of
:class:`LighterFits`). Settings neither covers are not compared. Part of ``fabricsim plan``
(:mod:`sim.apps.plan`; docs/planner.md).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from sim.apps.plan.layouts import Layout

RECOMPUTE_RANK = {"none": 0, "selective": 1, "full": 2}
"""Activation checkpointing from the most memory to the least (none keeps every activation,
selective drops the attention core's or the ops torchtitan's policy re-runs, full keeps
only each layer's input)."""

FULL: frozenset[str] = frozenset({"<full>"})
"""What full recomputation recomputes: everything (covers every setting)."""
DEFAULT_SELECTION = "<default>"
"""The framework's own selective recomputation (Megatron-Core's ``core_attn``, torchtitan's
op policy), as one module no planner-set selection contains."""
CONTAINS = {"moe": frozenset({"moe_act", "shared_experts"})}
"""Megatron modules whose checkpoint contains others' (``moe``: the whole MoE layer, its
experts' activation and shared experts included; sim/frameworks/megatron/recompute.py)."""


def recomputed(layout: Layout) -> frozenset[str]:
    """What the layout recomputes: no module, its selection, or :data:`FULL`.

    Examples
    --------
    >>> x = Layout("megatron", 1, 1, 8, 1, 1, 1, "selective", (), 8, 1, ("layernorm", "moe"))
    >>> sorted(recomputed(x))
    ['layernorm', 'moe', 'moe_act', 'shared_experts']
    """
    ac = layout.activation_checkpointing
    if ac == "full":
        return FULL
    if ac != "selective":
        return frozenset()
    if not layout.recompute:
        return frozenset({DEFAULT_SELECTION})
    mods = set(layout.recompute)
    for m in layout.recompute:
        mods |= CONTAINS.get(m, frozenset())
    return frozenset(mods)


def covers(more: frozenset[str], less: frozenset[str]) -> bool:
    """Whether recomputing ``more`` recomputes everything ``less`` does.

    Examples
    --------
    >>> covers(FULL, frozenset({"moe_act"})), covers(frozenset({"moe_act"}), frozenset())
    (True, True)
    >>> covers(frozenset({"moe_act"}), frozenset({DEFAULT_SELECTION}))
    False
    """
    return more == FULL or less <= more


def weight(layout: Layout) -> tuple[int, int]:
    """An order of a family's layouts by recomputation, most last: the activation
    checkpointing's :data:`RECOMPUTE_RANK`, then the modules selected (for the layout a
    family is probed with first: the one that needs the least memory)."""
    return RECOMPUTE_RANK[layout.activation_checkpointing], len(layout.recompute)


class LighterFits:
    """The time rule for mixture-of-experts layouts: more recomputation only adds kernels,
    so once a layout fits in memory, the same layout (same family and micro-batch size)
    recomputing everything it does and more is never faster and is not built or simulated
    (each layout is tried with the least recomputation first, by its lower bound, and the
    rest only while none fits). A layout that fitted by its estimate but whose simulation
    ran out of memory no longer counts (:meth:`retract`): what it ruled out is tried again.
    Dense layouts are not ruled out so (their plans as before the light recomputation
    sets)."""

    def __init__(self) -> None:
        self.fitted: dict[tuple[Any, ...], dict[int, frozenset[str]]] = defaultdict(dict)
        """Per (family, micro-batch size): each fitting candidate's index and what it
        recomputes."""
        self.ruled_out: dict[int, list[int]] = defaultdict(list)
        """The candidates each fitting one ruled out."""

    def fits(self, family: tuple[Any, ...], layout: Layout, index: int) -> None:
        """Record that candidate ``index`` (``layout``) fits by its memory estimate."""
        if layout.moe:
            self.fitted[family + (layout.micro_batch_size,)][index] = recomputed(layout)

    def slower(self, family: tuple[Any, ...], layout: Layout, index: int) -> str | None:
        """Why candidate ``index`` is no faster than one that fits (remembered), or None."""
        if not layout.moe:
            return None
        mine = recomputed(layout)
        for other, theirs in self.fitted.get(family + (layout.micro_batch_size,), {}).items():
            if theirs != mine and covers(mine, theirs):
                self.ruled_out[other].append(index)
                return "slower (less recomputation of the same layout fits)"
        return None

    def retract(self, family: tuple[Any, ...], layout: Layout, index: int) -> list[int]:
        """Candidate ``index`` does not fit after all (its simulation ran out of memory):
        forget it, and return the candidates it ruled out."""
        self.fitted.get(family + (layout.micro_batch_size,), {}).pop(index, None)
        return self.ruled_out.pop(index, [])
