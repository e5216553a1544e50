"""Tests of the transformer description (sim/workload/model.py): exact parameter counts against the
published totals, the tensor list, and model FLOPs per token.

Every expected count is written out from the model's dimensions (as its config.json or paper
gives them) by hand, independently of sim/workload/model.py, and then compared with the published
total.
"""

from __future__ import annotations

import pytest

from sim import catalog
from sim.scenario import ModelDims
from sim.workload.model import ModelSpec
from sim.workload.moe import mlp_shapes

LLAMA_VOCAB = 128_256  # Llama 3 tokenizer: vocab_size in every Llama 3 / 3.1 / 3.2 config.json


def llama_params(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int,
                 tied: bool) -> int:
    """Llama layout by hand: per block q (h x h), k and v (kv_dim x h), o (h x h), gate, up,
    down (3 x h x f), two RMSNorm scales (2h); plus the embedding (V x h), the final RMSNorm (h)
    and an LM head (V x h) unless tied. No biases anywhere."""
    kv_dim = kv_heads * (hidden // heads)
    block = 2 * hidden * hidden + 2 * kv_dim * hidden + 3 * hidden * ffn + 2 * hidden
    return layers * block + vocab * hidden + hidden + (0 if tied else vocab * hidden)


def gpt_params(layers: int, hidden: int, vocab: int, positions: int) -> int:
    """GPT layout by hand (ffn = 4h, LayerNorm with bias, biases on every linear, tied head):
    per block 12h^2 weights + 13h biases/norms (qkv 3h, o h, up 4h, down h, two LNs 4h);
    plus token embedding V*h, learned positions P*h and the final LayerNorm 2h."""
    block = 12 * hidden**2 + 13 * hidden
    return layers * block + vocab * hidden + positions * hidden + 2 * hidden


def nemotron_params(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int,
                    vocab: int) -> int:
    """Nemotron-4 layout by hand: per block q and o (h x h), k and v (kv_dim x h), the
    squared-ReLU MLP's up and down (2 x h x f), two LayerNorm scales (2h; their biases are
    not modelled); plus the embedding and the untied LM head (2 x V x h) and the final norm."""
    kv_dim = kv_heads * (hidden // heads)
    block = 2 * hidden * hidden + 2 * kv_dim * hidden + 2 * hidden * ffn + 2 * hidden
    return layers * block + 2 * vocab * hidden + hidden


# name -> (count derived by hand from the published dims, the published total or None)
PUBLISHED: dict[str, tuple[int, int | None]] = {
    # meta-llama/Llama-3.2-1B config.json: 16 layers, h 2048, 32 heads, 8 kv, ffn 8192, tied;
    # the model card / safetensors total is 1,235,814,400.
    "llama3.2-1b": (llama_params(16, 2048, 32, 8, 8192, LLAMA_VOCAB, tied=True), 1_235_814_400),
    # meta-llama/Llama-3.2-3B config.json: 28 layers, h 3072, 24 heads, 8 kv, ffn 8192, tied;
    # the model card quotes 3.21B (checked to 3 significant figures below).
    "llama3.2-3b": (llama_params(28, 3072, 24, 8, 8192, LLAMA_VOCAB, tied=True), None),
    # meta-llama/Meta-Llama-3-8B config.json: 32 layers, h 4096, 32 heads, 8 kv, ffn 14336.
    "llama3-8b": (llama_params(32, 4096, 32, 8, 14336, LLAMA_VOCAB, tied=False), 8_030_261_248),
    # meta-llama/Meta-Llama-3-70B config.json: 80 layers, h 8192, 64 heads, 8 kv, ffn 28672.
    "llama3-70b": (llama_params(80, 8192, 64, 8, 28672, LLAMA_VOCAB, tied=False),
                   70_553_706_496),
    # meta-llama/Llama-3.1-405B config.json: 126 layers, h 16384, 128 heads, 8 kv, ffn 53248.
    "llama3-405b": (llama_params(126, 16384, 128, 8, 53248, LLAMA_VOCAB, tied=False),
                    405_853_388_800),
    # meta-llama/Llama-2-{7b,13b,70b}-hf config.json (2023-07): the Llama 2 tokenizer's 32,000
    # tokens; 7B and 13B without grouped-query attention, 70B with 8 key/value heads. The
    # safetensors totals: 6,738,415,616, 13,015,864,320 and 68,976,648,192.
    "llama2-7b": (llama_params(32, 4096, 32, 32, 11008, 32000, tied=False), 6_738_415_616),
    "llama2-13b": (llama_params(40, 5120, 40, 40, 13824, 32000, tied=False), 13_015_864_320),
    "llama2-70b": (llama_params(80, 8192, 64, 8, 28672, 32000, tied=False), 68_976_648_192),
    # Nemotron-4 15B and 340B technical reports (arXiv 2402.16819 and 2406.11704), Table 1;
    # the reports give the total only split and rounded (test_nemotron_4_matches_its_reports).
    "nemotron-4-15b": (nemotron_params(32, 6144, 48, 8, 24576, 256000), None),
    "nemotron-4-340b": (nemotron_params(96, 18432, 96, 8, 73728, 256000), None),
    # Brown et al. 2020, Table 2.1: 96 layers, d_model 12288, n_ctx 2048; GPT-2 BPE vocab 50,257.
    "gpt3-175b": (gpt_params(96, 12288, 50257, 2048), None),
    # bigscience/bloom config.json: 70 layers, h 14336, vocab 250880, tied, ALiBi (no position
    # table). The model card's 176,247,271,424 also holds the embedding LayerNorm (2h = 28,672),
    # which the catalogue does not model.
    "bloom-176b": (gpt_params(70, 14336, 250880, 0), 176_247_271_424 - 2 * 14336),
}


def test_every_catalogue_model_has_a_published_check():
    # A dense model added to models.yaml must get its published total here (the catalogue
    # says so); mixture-of-experts models get theirs in test_model_moe.py.
    dense = {n for n in catalog.model_names() if "experts" not in catalog.model_entry(n)}
    assert set(PUBLISHED) == dense


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_matches_hand_derivation_and_published_total(name):
    by_hand, published = PUBLISHED[name]
    spec = ModelSpec.from_ref(name, seq_len=4096)
    assert spec.total_params == by_hand
    if published is not None:
        assert by_hand == published


def test_llama32_3b_is_the_model_cards_3_21b():
    # Model card: "3.21B" parameters, i.e. 3.21e9 to three significant figures.
    assert round(ModelSpec.from_ref("llama3.2-3b").total_params / 1e7) == 321


def test_gpt3_is_174_6e9_as_the_paper_dims_give():
    # 96 x (12 x 12288^2 + 13 x 12288) = 173,961,510,912; + 50257 x 12288 = 617,558,016;
    # + 2048 x 12288 = 25,165,824; + 2 x 12288 = 24,576  ->  174,604,259,328 (the "175B").
    total = ModelSpec.from_ref("gpt3-175b").total_params
    assert total == 173_961_510_912 + 617_558_016 + 25_165_824 + 24_576 == 174_604_259_328
    assert round(total / 1e8) == 1746
    assert abs(total - 175e9) / 175e9 < 0.005  # the paper's rounded headline figure


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_tensors_sum_to_total(name):
    spec = ModelSpec.from_ref(name, seq_len=4096)
    tensors = spec.parameter_tensors()
    assert sum(t[1] for t in tensors) == spec.total_params
    # embed, 9 tensors per block (4 attention, 3 or 2 MLP, 2 norms), final norm, LM head if untied
    per_block = 4 + (3 if spec.mlp == "swiglu" else 2) + 2
    assert len(tensors) == 1 + spec.layers * per_block + 1 + (0 if spec.tied_embeddings else 1)
    assert len({t[0] for t in tensors}) == len(tensors)


def test_parameter_tensors_follow_hugging_face_llama_order():
    # HF LlamaForCausalLM.parameters(): embed_tokens, per layer q/k/v/o_proj, gate/up/down_proj,
    # input_layernorm, post_attention_layernorm; then norm and lm_head.
    spec = ModelSpec.from_ref("llama3-8b")
    names = [t[0] for t in spec.parameter_tensors()]
    assert names[:11] == ["embed", "l0.q", "l0.k", "l0.v", "l0.o", "l0.gate", "l0.up", "l0.down",
                          "l0.norm1", "l0.norm2", "l1.q"]
    assert names[-3:] == ["l31.norm2", "norm", "lm_head"]
    by_name = {t[0]: t for t in spec.parameter_tensors()}
    h, kv, f = 4096, 8 * 128, 14336  # 8 kv heads of 4096/32 = 128
    assert by_name["embed"][1:] == (LLAMA_VOCAB * h, "embed", -1)
    assert by_name["l3.q"][1:] == (h * h, "attn", 3)
    assert by_name["l3.k"][1:] == (kv * h, "attn", 3)
    assert by_name["l3.gate"][1:] == (f * h, "mlp", 3)
    assert by_name["l3.down"][1:] == (h * f, "mlp", 3)
    assert by_name["l3.norm1"][1:] == (h, "attn", 3)
    assert by_name["l3.norm2"][1:] == (h, "mlp", 3)
    assert by_name["norm"][1:] == (h, "head", -1)
    assert by_name["lm_head"][1:] == (LLAMA_VOCAB * h, "head", -1)


def test_tied_embeddings_are_counted_once():
    dims = dict(layers=2, hidden=256, heads=4, ffn_hidden=512, vocab=1000)
    tied = ModelSpec.from_ref(ModelDims(**dims, tied_embeddings=True))
    untied = ModelSpec.from_ref(ModelDims(**dims, tied_embeddings=False))
    # The only difference is one V x h matrix.
    assert untied.total_params - tied.total_params == 1000 * 256
    assert "lm_head" not in [t[0] for t in tied.parameter_tensors()]
    assert tied.lm_head_params == 0 and untied.lm_head_params == 1000 * 256
    # Matmul parameters: the tied matrix is the LM head; the untied input table is a lookup.
    assert tied.matmul_params == tied.total_params
    assert untied.matmul_params == untied.total_params - 1000 * 256
    assert tied.matmul_params == untied.matmul_params


def test_matmul_params_exclude_only_lookup_tables():
    # Llama 3 8B: everything but the 128256 x 4096 input embedding.
    m8 = ModelSpec.from_ref("llama3-8b")
    assert m8.matmul_params == 8_030_261_248 - LLAMA_VOCAB * 4096 == 7_504_924_672
    # GPT-3 (tied): everything but the 2048 x 12288 learned-position table.
    g = ModelSpec.from_ref("gpt3-175b")
    assert g.matmul_params == 174_604_259_328 - 2048 * 12288


def test_model_flops_per_token_llama32_1b():
    # 6 x matmul params (all 1,235,814,400: tied) = 7,414,886,400
    # + causal attention 6 x L x S x q_dim = 6 x 16 x 4096 x 2048 = 805,306,368
    spec = ModelSpec.from_ref("llama3.2-1b")
    assert 6 * 1_235_814_400 == 7_414_886_400
    assert 6 * 16 * 4096 * 2048 == 805_306_368
    assert spec.attention_flops_per_token(4096) == 805_306_368
    assert spec.model_flops_per_token(4096) == 7_414_886_400 + 805_306_368 == 8_220_192_768
    assert spec.forward_flops_per_token(4096) == pytest.approx(8_220_192_768 / 3, rel=1e-15)


def test_model_flops_per_token_llama3_70b():
    # matmul params = 70,553,706,496 - 128256 x 8192 = 69,503,033,344
    # 6 x 69,503,033,344 = 417,018,200,064; attention 6 x 80 x 4096 x 8192 = 16,106,127,360
    spec = ModelSpec.from_ref("llama3-70b")
    assert spec.matmul_params == 70_553_706_496 - LLAMA_VOCAB * 8192 == 69_503_033_344
    assert spec.model_flops_per_token(4096) == 417_018_200_064 + 16_106_127_360
    # Attention grows linearly with the sequence: doubling S adds another 16,106,127,360.
    assert (spec.model_flops_per_token(8192) - spec.model_flops_per_token(4096)
            == 16_106_127_360)


def test_inline_gqa_dims():
    # 8 query heads of 512/8 = 64, 2 kv heads -> kv_dim 128.
    spec = ModelSpec.from_ref(ModelDims(layers=2, hidden=512, heads=8, kv_heads=2,
                                        ffn_hidden=1536, vocab=32000))
    assert (spec.head_dim, spec.q_dim, spec.kv_dim) == (64, 512, 128)
    shapes = {n: (o, i) for n, o, i in spec.linear_shapes()}
    assert shapes == {"q": (512, 512), "k": (128, 512), "v": (128, 512), "o": (512, 512),
                      "gate": (1536, 512), "up": (1536, 512), "down": (512, 1536)}
    # SwiGLU defaults: RMSNorm, rotary, no bias, no position table.
    assert (spec.norm, spec.position, spec.bias, spec.max_positions) == ("rmsnorm", "rope",
                                                                        False, 0)
    # block: 2x512^2 + 2x128x512 + 3x512x1536 + 2x512 = 3,015,680; x2 + 2x32000x512 + 512
    assert spec.layer_params == 3_015_680
    assert spec.total_params == 2 * 3_015_680 + 2 * 32000 * 512 + 512 == 38_799_872


def test_kv_heads_default_to_heads():
    spec = ModelSpec.from_ref(ModelDims(layers=1, hidden=256, heads=4, ffn_hidden=512, vocab=10))
    assert spec.kv_heads == 4 and spec.kv_dim == 256


def test_head_dim_override_widens_q_and_o():
    # 8 heads of 128 on a 512-wide residual stream: q is 1024 x 512, o is 512 x 1024.
    spec = ModelSpec.from_ref(ModelDims(layers=1, hidden=512, heads=8, kv_heads=8, head_dim=128,
                                        ffn_hidden=1024, vocab=10))
    shapes = {n: (o, i) for n, o, i in spec.linear_shapes()}
    assert shapes["q"] == (1024, 512) and shapes["o"] == (512, 1024)
    assert spec.attention_flops_per_token(100) == 6 * 1 * 100 * 1024


def test_gelu_defaults_layernorm_bias_learned_positions():
    h, f, v, s = 64, 256, 1000, 128
    spec = ModelSpec.from_ref(ModelDims(layers=2, hidden=h, heads=4, ffn_hidden=f, vocab=v,
                                        mlp="gelu"), seq_len=s)
    assert (spec.norm, spec.position, spec.bias) == ("layernorm", "learned", True)
    assert spec.max_positions == s  # the position table defaults to the sequence length
    assert [n for n, _, _ in spec.linear_shapes()] == ["q", "k", "v", "o", "up", "down"]
    assert spec.norm_params == 2 * h  # LayerNorm weight and bias
    # f = 4h, so the GPT closed form applies: 12h^2 + 13h per block.
    assert spec.layer_params == 12 * h * h + 13 * h == 49_984
    # Untied here (tied_embeddings defaults to False): token table, positions, final LN, head.
    assert spec.total_params == 2 * 49_984 + v * h + s * h + 2 * h + v * h
    assert sum(t[1] for t in spec.parameter_tensors()) == spec.total_params
    # The position table is a lookup: not a matmul parameter.
    assert spec.matmul_params == spec.total_params - v * h - s * h


def test_gelu_with_explicit_llama_style_options():
    # mlp=gelu but RMSNorm, rotary, no bias: no position table, one scale per norm.
    h, f, v = 64, 256, 1000
    spec = ModelSpec.from_ref(ModelDims(layers=2, hidden=h, heads=4, ffn_hidden=f, vocab=v,
                                        mlp="gelu", norm="rmsnorm", position="rope",
                                        bias=False), seq_len=128)
    assert spec.embedding_params == v * h
    assert spec.layer_params == 4 * h * h + 2 * h * f + 2 * h
    assert spec.total_params == 2 * (4 * h * h + 2 * h * f + 2 * h) + v * h + h + v * h


def test_explicit_max_positions_beats_sequence_length():
    spec = ModelSpec.from_ref(ModelDims(layers=1, hidden=64, heads=4, ffn_hidden=256, vocab=10,
                                        mlp="gelu", max_positions=2048), seq_len=128)
    assert spec.embedding_params == 10 * 64 + 2048 * 64


@pytest.mark.parametrize("name,embedding,non_embedding,places", [
    # The reports' figures, in billions: 15B "3.2B embedding and 12.5B non-embedding", 340B
    # "9.4B embedding and 331.6B non-embedding" (untied input and output embeddings).
    ("nemotron-4-15b", 3.2, 12.5, 1),
    ("nemotron-4-340b", 9.4, 331.6, 1),
])
def test_nemotron_4_matches_its_reports(name, embedding, non_embedding, places):
    m = ModelSpec.from_ref(name)
    emb = 2 * m.vocab * m.hidden
    assert round((m.total_params - emb) / 1e9, places) == non_embedding
    # 2 x 256,000 x 6,144 is 3.146e9: the 15B report rounds it up to 3.2.
    assert abs(emb / 1e9 - embedding) <= 0.06
    # Squared ReLU is not gated: two projections, up and down, as GELU's.
    assert [n for n, _, _ in mlp_shapes(m.mlp, m.hidden, m.ffn_hidden)] == ["up", "down"]
