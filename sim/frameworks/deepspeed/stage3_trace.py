"""ZeRO-3's view of the model: the Hugging Face module tree's parameters in construction order
(persistent or not, padded to the world), each submodule's own parameters, and the order in
which the module hooks fire around the kernels of :mod:`sim.workload.layer_ops`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from sim.frameworks.deepspeed.constants import _pad
from sim.program.ir import Phase
from sim.workload.layer_ops import Kernel
from sim.workload.model import ModelSpec


@dataclass(frozen=True)
class _Param:
    """One ZeRO-3 parameter (``ds_id`` = pid, in module-construction order)."""

    pid: int
    name: str
    shape: tuple[int, ...]
    persist: bool
    aligned: int
    """Elements padded to a multiple of the world size (partition_parameters._aligned_size)."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class _Seg:
    """Kernels run between two hook events: one compute op."""

    module: str
    kernels: list[Kernel]
    backward: bool
    phase: Phase
    unit: tuple[str, int, str]
    """(block, layer, fwd|bwd): the block op of :func:`micro_batch_ops` whose memory effects
    and model FLOPs this segment shares."""
    grads: tuple[int, ...] = ()
    """Parameters whose 16-bit gradient this segment materialises."""
    ready: tuple[int, ...] = ()
    """Parameters whose AccumulateGrad hook fires after it."""


# Event: ("pre", module, forward) | ("post", module) | ("run", _Seg)
_Event = tuple


def _tree(m: ModelSpec, world: int, persistence: int
          ) -> tuple[list[_Param], dict[str, tuple[int, ...]]]:
    """The parameters of a Hugging Face Llama/GPT causal LM in construction order, and the
    parameters each submodule owns directly (``named_parameters(recurse=False)``)."""
    params: list[_Param] = []
    modules: dict[str, tuple[int, ...]] = {}

    def param(name: str, *shape: int) -> int:
        numel = math.prod(shape)
        pid = len(params)
        # parameter_offload.mark_persistent_parameters: ds_numel <= threshold
        params.append(_Param(pid, name, shape, numel <= persistence, _pad(numel, world)))
        return pid

    def linear(key: str, out_f: int, in_f: int) -> None:
        ids = [param(f"{key}.weight", out_f, in_f)]
        if m.bias:
            ids.append(param(f"{key}.bias", out_f))
        modules[key] = tuple(ids)

    def norm(key: str) -> None:
        ids = [param(f"{key}.weight", m.hidden)]
        if m.norm == "layernorm" and m.bias:
            ids.append(param(f"{key}.bias", m.hidden))
        modules[key] = tuple(ids)

    h = m.hidden
    for c in ("root", "model", "rotary"):
        modules[c] = ()
    modules["embed"] = (param("embed_tokens.weight", m.vocab, h),)
    if m.position == "learned":
        modules["wpe"] = (param("wpe.weight", m.max_positions, h),)
    for layer in range(m.layers):
        pre = f"L{layer}."
        for c in ("layer", "attn", "mlp", "act"):
            modules[pre + c] = ()
        for name, o, i in m.linear_shapes():
            linear(pre + name, o, i)
        norm(pre + "ln1")
        norm(pre + "ln2")
    norm("norm")
    if m.tied_embeddings:
        modules["lm_head"] = modules["embed"]
    else:
        linear("lm_head", m.vocab, h)
    return params, modules


_LAYER_ROUTES = {"norm": "ln", "norm_out": "ln", "resid": "layer", "resid_in": "layer",
                 "silu": "act", "g_silu": "act", "gelu": "act", "g_gelu": "act"}


def _route(block: str, kernel: str) -> str:
    """The module whose forward/backward a kernel of :mod:`sim.workload.layer_ops` belongs to."""
    head = kernel.split(".")[0]
    if block == "embed":
        return "wpe" if head in ("add_pos", "g_pos_sum") else "embed"
    if block == "head":
        return head if head in ("norm", "lm_head") else "root"
    if head in ("q", "k", "v", "o", "gate", "up", "down"):
        return head
    r = _LAYER_ROUTES.get(head, "attn" if block == "attn" else "mlp")
    return ("ln1" if block == "attn" else "ln2") if r == "ln" else r


def _scripts(m: ModelSpec) -> dict[str, list[tuple[str, str]]]:
    """Hook and kernel order per block and pass, as HF's module nesting fires them: pre and
    post forward hooks around each submodule's forward; pre-backward hooks when the
    gradient of a module's output arrives (reverse order), post-backward when its inputs'
    gradients are done."""
    def wrap(key: str) -> list[tuple[str, str]]:
        return [("pre", key), ("run", key), ("post", key)]

    swiglu = m.mlp == "swiglu"
    attn_f = ([("pre", "layer")] + wrap("ln1") + [("pre", "attn")] + wrap("q") + wrap("k")
              + wrap("v") + [("run", "attn")] + wrap("o") + [("post", "attn"), ("run", "layer")])
    mlp_inner_f = (wrap("gate") + wrap("act") + wrap("up") + [("run", "mlp")] + wrap("down")
                   if swiglu else wrap("up") + wrap("act") + wrap("down"))
    mlp_f = (wrap("ln2") + [("pre", "mlp")] + mlp_inner_f
             + [("post", "mlp"), ("run", "layer"), ("post", "layer")])
    mlp_inner_b = (wrap("down") + [("run", "mlp")] + wrap("up") + wrap("act") + wrap("gate")
                   if swiglu else wrap("down") + wrap("act") + wrap("up"))
    mlp_b = ([("pre", "layer"), ("pre", "mlp")] + mlp_inner_b
             + [("post", "mlp")] + wrap("ln2") + [("run", "layer")])
    attn_b = ([("pre", "attn")] + wrap("o") + [("run", "attn")] + wrap("v") + wrap("k")
              + wrap("q") + [("post", "attn")] + wrap("ln1")
              + [("run", "layer"), ("post", "layer")])
    embed_f = [("pre", "root"), ("pre", "model")] + wrap("embed")
    if m.position == "learned":
        embed_f += wrap("wpe")
    else:
        embed_f += [("pre", "rotary"), ("post", "rotary")]
    head_f = (wrap("norm") + [("post", "model")] + wrap("lm_head")
              + [("run", "root"), ("post", "root")])
    head_b = ([("pre", "root"), ("run", "root")] + wrap("lm_head")
              + [("pre", "model")] + wrap("norm"))
    embed_b = (wrap("wpe") if m.position == "learned" else []) + wrap("embed")
    return {"embed/fwd": embed_f, "attn/fwd": attn_f, "mlp/fwd": mlp_f, "head/fwd": head_f,
            "head/bwd": head_b, "mlp/bwd": mlp_b, "attn/bwd": attn_b, "embed/bwd": embed_b}
