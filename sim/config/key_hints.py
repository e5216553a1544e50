"""What an unknown scenario key most likely meant: the key a framework's own flag is called
here, or a near spelling among the keys its section has.

Users write scenarios from the launch scripts they run: Megatron-LM's argument names
(``--expert-model-parallel-size`` as ``expert_model_parallel_size``), torchtitan's
``[parallelism]`` degrees, Hugging Face ``config.json`` fields. The schema refuses every
unknown key (a misspelt key must not be silently ignored); this module turns the refusal into
a pointer to the key that holds the setting here.

Part of the config layer.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Any, get_args

from pydantic import BaseModel

# A framework's own name for a setting -> the dotted key that holds it in a scenario.
FOREIGN_KEYS: Mapping[str, str] = {
    # Megatron-LM / NeMo / Megatron-Bridge arguments (dashes as underscores)
    "tensor_model_parallel_size": "parallelism.tp",
    "pipeline_model_parallel_size": "parallelism.pp",
    "virtual_pipeline_model_parallel_size": "parallelism.vp",
    "context_parallel_size": "parallelism.cp",
    "expert_model_parallel_size": "parallelism.ep",
    "expert_tensor_parallel_size": "parallelism.etp",
    "num_experts": "model.experts",
    "num_moe_experts": "model.experts",
    "moe_router_topk": "model.experts_per_token",
    "moe_ffn_hidden_size": "model.moe_ffn_hidden",
    "moe_shared_expert_intermediate_size": "model.shared_experts",
    "moe_expert_capacity_factor": "model.capacity_factor",
    "moe_router_load_balancing_type": "framework.moe_aux_loss_coeff",
    "num_layers": "model.layers",
    "hidden_size": "model.hidden",
    "num_attention_heads": "model.heads",
    "num_query_groups": "model.kv_heads",
    "ffn_hidden_size": "model.ffn_hidden",
    "seq_length": "training.seq_len",
    "recompute_granularity": "training.activation_checkpointing",
    "recompute_method": "training.activation_checkpointing",
    # torchtitan's [parallelism] and [training]
    "tensor_parallel_degree": "parallelism.tp",
    "pipeline_parallel_degree": "parallelism.pp",
    "context_parallel_degree": "parallelism.cp",
    "expert_parallel_degree": "parallelism.ep",
    "expert_tensor_parallel_degree": "parallelism.etp",
    # torchtitan's model converters: [quantize.grouped_mm.mx] is the experts' MXFP8
    "grouped_mm": "framework.grouped_mm_recipe",
    "converters": "framework.grouped_mm_recipe",
    # DeepSpeed-MoE and Hugging Face config.json
    "ep_size": "parallelism.ep",
    "n_routed_experts": "model.experts",
    "num_local_experts": "model.experts",
    "num_experts_per_tok": "model.experts_per_token",
    "moe_intermediate_size": "model.moe_ffn_hidden",
    "n_shared_experts": "model.shared_experts",
    "first_k_dense_replace": "model.first_k_dense",
    "num_hidden_layers": "model.layers",
    "num_key_value_heads": "model.kv_heads",
    "intermediate_size": "model.ffn_hidden",
    "vocab_size": "model.vocab",
}


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (the first one of a union or an optional)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _submodel(arg)
        if found is not None:
            return found
    return None


def section_keys(path: Sequence[str], data: Mapping[str, Any],
                 root: type[BaseModel], frameworks: Sequence[type[BaseModel]]) -> list[str]:
    """The keys the section at ``path`` (the dotted path without the unknown key) accepts:
    the fields of its pydantic model under ``root``; for ``framework``, those of the options
    of the scenario's ``framework.name`` (all frameworks' when it names none)."""
    model: type[BaseModel] | None = root
    node: Any = data
    for part in path:
        if model is None:
            return []
        node = node.get(part) if isinstance(node, Mapping) else None
        if model is root and part == "framework":
            name = node.get("name") if isinstance(node, Mapping) else None
            named = [m for m in frameworks if m.model_fields["name"].default == name]
            if not named:
                return sorted({k for m in frameworks for k in m.model_fields})
            model = named[0]
            continue
        field = model.model_fields.get(part)
        model = _submodel(field.annotation) if field is not None else None
    return list(model.model_fields) if model is not None else []


def unknown_key_hint(path: Sequence[str], data: Mapping[str, Any],
                     root: type[BaseModel], frameworks: Sequence[type[BaseModel]]) -> str:
    """``"; it is X here"`` for a framework's own flag, ``"; did you mean X?"`` for a near
    spelling of a key of the same section, else ``""``. ``path``: the unknown key's dotted
    path as parts.

    Examples
    --------
    >>> from sim.config.scenario import Scenario, framework_option_models
    >>> fws = framework_option_models()
    >>> unknown_key_hint(["parallelism", "expert_model_parallel_size"], {}, Scenario, fws)
    '; it is parallelism.ep here'
    >>> unknown_key_hint(["parallelism", "sequence_paralel"], {}, Scenario, fws)
    '; did you mean parallelism.sequence_parallel?'
    >>> unknown_key_hint(["framework", "overlap_grad_reduc"], {"framework": {"name": "megatron"}},
    ...                  Scenario, fws)
    '; did you mean framework.overlap_grad_reduce?'
    >>> unknown_key_hint(["parallelism", "zzz"], {}, Scenario, fws)
    ''
    """
    *section, key = path
    target = FOREIGN_KEYS.get(key)
    if target is not None and target != ".".join(path):
        return f"; it is {target} here"
    near = difflib.get_close_matches(key, section_keys(section, data, root, frameworks), n=1,
                                     cutoff=0.8)
    return f"; did you mean {'.'.join([*section, near[0]])}?" if near else ""
