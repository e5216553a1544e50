"""``framework.apply_rope_fusion`` with multi-head latent attention, end to end.

Independent truths: Megatron-Core core_v0.14.0 multi_latent_attention.py
(``qkv_up_proj_and_rope_apply``: with ``apply_rope_fusion`` the query is q rotated in place,
so ``mla_up_proj``'s checkpoint frees the same query, key and value bytes; the fusion only
changes MLA's path, a standard attention's rotary embedding is untouched) and the tensors'
shapes (16-bit activations, fp32 norm statistics).
"""

from __future__ import annotations

from helpers import megatron_scenario

from sim.api import simulate
from sim.frameworks import JobContext, build_program

MLA = {"layers": 4, "hidden": 1024, "heads": 8, "ffn_hidden": 2048, "vocab": 32768,
       "experts": 8, "experts_per_token": 2, "moe_ffn_hidden": 512, "shared_experts": 1,
       "first_k_dense": 1, "attention": "mla", "q_lora_rank": 256, "kv_lora_rank": 128,
       "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64}
GQA = {"layers": 4, "hidden": 1024, "heads": 8, "kv_heads": 2, "ffn_hidden": 2048,
       "vocab": 32768, "experts": 8, "experts_per_token": 2, "moe_ffn_hidden": 512,
       "first_k_dense": 1}
T = 2048


def _scn(fusion: bool, mods: list[str] | None = None, model: dict = MLA):
    fw: dict = {"name": "megatron", "apply_rope_fusion": fusion}
    if mods is not None:
        fw["recompute_modules"] = mods
    return megatron_scenario({"tp": 1}, 1, model=model, seq=T, ac="selective", gpn=1,
                             framework=fw)


def _hold(s, layer: int) -> float:
    p = build_program(JobContext.from_scenario(s, "s.yaml"))
    ops = [op for c in p.classes[:1] for o in c.streams.values() for op in o]
    op = next(o for o in ops if o.name == f"fwd attn L{layer} mb0")
    return sum(b for pool, b in op.alloc if pool == "activations")


def test_mla_up_proj_frees_the_same_bytes_with_the_fused_rope() -> None:
    # The normed latents (256 + 128 wide), their fp32 statistics, and the query, key and
    # value core attention saved (8 heads of 64 + 32, 64 + 32 and 64).
    freed = T * (256 + 128) * 2 + 2 * T * 4 + T * 8 * (64 + 32) * 2 * 2 + T * 8 * 64 * 2
    for layer in (0, 1):
        assert _hold(_scn(True, []), layer) - _hold(_scn(True, ["mla_up_proj"]), layer) \
            == freed
        assert _hold(_scn(True, []), layer) == _hold(_scn(False, []), layer)


def test_the_fused_rope_shortens_an_mla_step_and_leaves_gqa_alone() -> None:
    fused, plain = (simulate(_scn(f, [])).summary for f in (True, False))
    assert fused["step_time_s"] < plain["step_time_s"]
    g1, g0 = (simulate(_scn(f, [], GQA)).summary for f in (True, False))
    assert g1["step_time_s"] == g0["step_time_s"]
