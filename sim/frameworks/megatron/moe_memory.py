"""The token-dispatch buffers of one Megatron-Core MoE layer in memory (the ``moe_dispatch``
category of the recorder and the memory plot).

What the layer's blocks save for backward (the router's map and row ids, each expert GEMM's
input, fc1 output and probs: :mod:`sim.workload.moe_ops`) is already in the layer's
``activations``, held from its forward to its backward. The dispatcher's communication
buffers are not saved and live only around their collectives; per micro-batch and layer, on
the busiest EP rank under skew (each rank class of a split at its own load:
:mod:`.moe_rank_memory`) (``alltoall`` dispatcher, ``token_dispatcher.py``):

* dispatch: the permuted tokens and probs (``permute``'s output, the all-to-all's send
  buffer), allocated by the permutation and released when their all-to-all ends; the received
  tokens and probs (``all_to_all``'s output), released once the grouped GEMMs have read them,
  unless they are themselves the first GEMM's saved input (one local expert, no expert-TP
  gather, no FP8 padding: then they are in ``activations`` already);
* combine: the experts' output (the combine all-to-all's send buffer), released when it ends,
  and the received rows, released by the unpermutation;
* backward: the same two pairs for the gradients (the unpermutation's gradient rows out and
  the experts' input gradient back, with the probs' gradient).

The ``allgather`` dispatcher holds the gathered tokens, probs and routing map until the
permutation, and the unpermuted output (16-bit and its fp32 copy) until the reduce-scatter;
in backward the gathered fp32 output gradient and the gathered tokens' and probs' gradients.
The engine allocates an op's memory when a compute op starts (a collective's output is
allocated by the compute op before it) and frees it when the freeing op ends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sim.program.ir import Op

if TYPE_CHECKING:
    from sim.frameworks.megatron.moe_plan import MoEPlan

CATEGORY = "moe_dispatch"


def _add(op: Op, field: str, nbytes: float) -> None:
    if nbytes > 0:
        setattr(op, field, (*getattr(op, field), (CATEGORY, nbytes)))


def _find(ops: list[Op], name: str) -> Op | None:
    return next((o for o in ops if o.name == name), None)


def _recv_saved(pl: MoEPlan) -> bool:
    """Whether the dispatch all-to-all's output is the first grouped GEMM's saved input."""
    local = len(pl.ops.tokens_per_expert)
    return pl.etp == 1 and local == 1 and not any(
        k.fp8 for k in pl.ops.experts.forward if k.gemm is not None)


def alltoall_buffers(pl: MoEPlan) -> dict[str, float]:
    """Bytes of each dispatch buffer of one layer and micro-batch on the pace-setting rank:
    tokens and probs this rank sends by the dispatch (``send``, ``send_p``) and receives
    (``recv``, ``recv_p``); the combine sends ``recv``'s size back and receives ``send``'s;
    the backward's buffers are the same sizes. All zero when ``ep`` is 1."""
    a = (pl.pace.ops if pl.pace is not None else pl.ops).alltoall
    if pl.ep == 1:
        return dict.fromkeys(("send", "send_p", "recv", "recv_p"), 0.0)
    return {"send": sum(a["dispatch_fwd"].send_bytes),
            "send_p": sum(a["dispatch_probs_fwd"].send_bytes),
            "recv": sum(a["dispatch_fwd"].recv_bytes),
            "recv_p": sum(a["dispatch_probs_fwd"].recv_bytes)}


def attach_alltoall(pl: MoEPlan, ops: list[Op], backward: bool, label: str) -> None:
    """Allocate and free the ``alltoall`` dispatcher's buffers on one layer's ops (named
    ``label`` and their role)."""
    b = alltoall_buffers(pl)
    if not b["send"]:
        return
    need = [" router", " dispatch fwd", " dispatch probs fwd", " experts", " combine fwd",
            " combine", " combine bwd", " dispatch bwd", " dispatch probs bwd"]
    at = {k: _find(ops, label + k) for k in need}
    if not backward:
        router, experts, unperm = at[" router"], at[" experts"], at[" combine"]
        a_tok, a_prob, a_comb = at[" dispatch fwd"], at[" dispatch probs fwd"], \
            at[" combine fwd"]
        if None in (router, experts, unperm, a_tok, a_prob, a_comb):
            return
        assert router and experts and unperm and a_tok and a_prob and a_comb
        recv = 0.0 if _recv_saved(pl) else b["recv"] + b["recv_p"]
        _add(router, "alloc", b["send"] + b["send_p"] + recv)
        _add(a_tok, "free", b["send"])
        _add(a_prob, "free", b["send_p"])
        _add(experts, "free", recv)
        # The experts' output goes out by the combine; the rows that come back wait for the
        # unpermutation.
        _add(experts, "alloc", b["recv"] + b["send"])
        _add(a_comb, "free", b["recv"])
        _add(unperm, "free", b["send"])
        return
    unperm, experts, router = at[" combine"], at[" experts"], at[" router"]
    a_comb, a_tok, a_prob = at[" combine bwd"], at[" dispatch bwd"], at[" dispatch probs bwd"]
    if None in (unperm, experts, router, a_comb, a_tok, a_prob):
        return
    assert unperm and experts and router and a_comb and a_tok and a_prob
    # The unpermutation's gradient rows leave by the combine's reverse all-to-all and arrive
    # as the experts' output gradient, read by the grouped GEMMs' backward.
    _add(unperm, "alloc", b["send"] + b["recv"])
    _add(a_comb, "free", b["send"])
    _add(experts, "free", b["recv"])
    # The experts' input gradient (and the probs') goes back by the dispatch's reverse
    # all-to-alls; what arrives is summed back by the permutation's backward (router op).
    _add(experts, "alloc", b["recv"] + b["recv_p"] + b["send"] + b["send_p"])
    _add(a_tok, "free", b["recv"])
    _add(a_prob, "free", b["recv_p"])
    _add(router, "free", b["send"] + b["send_p"])


def attach_allgather(pl: MoEPlan, ops: list[Op], backward: bool, label: str) -> None:
    """The ``allgather`` dispatcher's gathered buffers on one layer's ops."""
    assert pl.model.moe is not None
    n = pl.ep * pl.etp
    if n == 1:
        return
    g, h, e = pl.gathered, pl.model.hidden, pl.model.moe.experts
    router, permute, unperm = _find(ops, label + " router"), _find(ops, label + " permute"), \
        _find(ops, label + " unpermute")
    if backward:
        cast = _find(ops, label + " combine")
        gather = _find(ops, label + " ag output grad all_gather")
        rs_tok = _find(ops, label + " ag tokens grad reduce_scatter")
        rs_prob = _find(ops, label + " ag probs grad reduce_scatter")
        if None in (cast, gather, unperm, permute, rs_tok, rs_prob):
            return
        assert cast and gather and unperm and permute and rs_tok and rs_prob
        # The gathered fp32 output gradient and its 16-bit cast, until the unpermutation's
        # backward; the gathered tokens' and probs' gradients until their reduce-scatters.
        _add(cast, "alloc", g * h * 6)
        _add(unperm, "free", g * h * 6)
        _add(permute, "alloc", g * h * 2 + g * e * 4)
        _add(rs_tok, "free", g * h * 2)
        _add(rs_prob, "free", g * e * 4)
        return
    rs = _find(ops, label + " ag output reduce_scatter")
    if None in (router, permute, unperm, rs):
        return
    assert router and permute and unperm and rs
    # Gathered tokens, probs (fp32) and routing map (bool) until the permutation has read
    # them; the unpermuted output and its fp32 copy until the reduce-scatter.
    _add(router, "alloc", g * h * 2 + g * e * 5)
    _add(permute, "free", g * h * 2 + g * e * 5)
    _add(unperm, "alloc", g * h * 6)
    _add(rs, "free", g * h * 6)
