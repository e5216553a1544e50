"""Megatron-Core's custom pipeline layout (``framework.pipeline_model_parallel_layout``,
issue 14: uneven pipeline layouts with virtual stages).

Independent truths: Megatron-Core's ``PipelineParallelLayerLayout``
(megatron/core/transformer/pipeline_parallel_layer_layout.py): entries in
``vpp_rank * pp + pp_rank`` order, a stage builds its ``decoder`` count
(``get_num_layers_to_build``) from the offset of every earlier virtual stage
(``get_layer_offset``), recomputed here from the layout lists themselves; NVIDIA
Megatron-Bridge's DeepSeek-V3 layouts (src/megatron/bridge/recipes/deepseek/deepseek_v3.py
``layout_map``; scripts/performance/configs/deepseek/deepseek_llm_pretrain.py, H100
``"Et|(tt|)*30mL"``); conservation of parameters (a layout moves layers between stages, it
adds or drops none); the interleaved 1F1B bubble, (p - 1) / (vp x m + p - 1) of the pipeline
phase (Narayanan et al., SC'21, sec. 2.2.2), for an even layout written out.
"""

from __future__ import annotations

import pytest
from helpers import DEEP, activations_left, megatron_scenario, pipeline_idle_share

from sim.api import simulate
from sim.apps.validation.published_moe import entries, scenario_of
from sim.frameworks import JobContext, build_program
from sim.frameworks.megatron.layout import as_layout, layout_chunks, parse_layout
from sim.frameworks.megatron.pipeline import chunk_layers
from sim.frameworks.megatron.shape import megatron_shape
from sim.scenario import ScenarioError

E, T, M, L = "embedding", "decoder", "mtp", "loss"


def _bridge_layout(pp: int, vp: int, mtp: int = 1) -> list[list[str]]:
    """Megatron-Bridge's deepseek_v3.py ``layout_map`` (61 layers), written out here."""
    last = [M] * mtp + [L]
    return {
        (4, 1): [[E] + [T] * 16, [T] * 16, [T] * 16, [T] * 13 + last],
        (8, 1): [[E] + [T] * 8] + [[T] * 8] * 6 + [[T] * 5 + last],
        (4, 2): [[E] + [T] * 8] + [[T] * 8] * 6 + [[T] * 5 + last],
        (16, 1): [[E] + [T] * 4] + [[T] * 4] * 14 + [[T] + last],
        (8, 2): [[E] + [T] * 4] + [[T] * 4] * 14 + [[T] + last],
        (4, 4): [[E] + [T] * 4] + [[T] * 4] * 14 + [[T] + last],
    }[(pp, vp)]


def _megatron_layers(layout: list[list[str]], pp: int, pp_rank: int, vpp_rank: int
                     ) -> list[int]:
    """get_layer_id_list: the 2-D layout[pp_rank][vpp_rank], offset by every stage before it
    (all ranks of earlier model chunks, the earlier ranks of this one)."""
    grid = [[layout[v * pp + r] for v in range(len(layout) // pp)] for r in range(pp)]
    offset = sum(grid[r][v].count(T) for v in range(vpp_rank + 1)
                 for r in range(pp if v < vpp_rank else pp_rank))
    return list(range(offset, offset + grid[pp_rank][vpp_rank].count(T)))


@pytest.mark.parametrize("pp,vp", [(4, 1), (8, 1), (4, 2), (16, 1), (8, 2), (4, 4)])
def test_chunks_are_megatrons_for_the_published_layouts(pp: int, vp: int) -> None:
    lay = _bridge_layout(pp, vp)
    ch = chunk_layers(61, pp, vp, layout=lay)
    for r in range(pp):
        for v in range(vp):
            assert ch[v * pp + r] == _megatron_layers(lay, pp, r, v), (r, v)
    assert sorted(la for c in ch for la in c) == list(range(61))


def test_h100_layout_string_is_parsed_as_megatron_does() -> None:
    # "Et|(tt|)*30mL": E + 1, thirty stages of 2, then MTP and loss alone: pp 8 x vp 4.
    lay = parse_layout("Et|(tt|)*30mL")
    assert len(lay) == 32 and lay[0] == [E, T] and lay[-1] == [M, L]
    assert all(s == [T, T] for s in lay[1:31])
    ch = layout_chunks(lay, 8, 61, 1)
    assert [len(c) for c in ch] == [1] + [2] * 30 + [0]
    # The same layout as lists, and the 4 x 4 recipe as a string.
    assert as_layout([["Embedding", " DECODER"]]) == [[E, T]]
    assert parse_layout("Etttt|(tttt|)*14tmL") == _bridge_layout(4, 4)


def _tiny(layout: str | None, par: dict, fw: dict | None = None):
    opts = {"name": "megatron", **(fw or {})}
    if layout is not None:
        opts["pipeline_model_parallel_layout"] = layout
    return megatron_scenario(par, gbs=8, framework=opts, gpn=8,
                             model=dict(DEEP, layers=8), seq=1024)


@pytest.mark.parametrize("layout", [None, "Ettt|t|ttt|tL", "Et|ttt|tttt|L", "E|tttt|tttt|L"])
def test_stage_parameters_are_conserved_by_any_layout(layout) -> None:
    # Layers move between stages; the stage parameters add up to the same total (the model,
    # with the output layer on the last stage since embeddings are untied).
    par = {"tp": 1, "pp": 2, "vp": 2, "dp": 4}
    sh = megatron_shape(JobContext.from_scenario(_tiny(layout, par), "s.yaml"))
    ref = megatron_shape(JobContext.from_scenario(_tiny(None, par), "s.yaml"))
    total = sum(sh.stage_params(st) for st in range(sh.p))
    assert total == pytest.approx(sum(ref.stage_params(st) for st in range(ref.p)), rel=1e-12)
    assert total == pytest.approx(sh.model.total_params, rel=1e-12)
    assert sh.stage_layer_count == [sum(len(sh.chunks[v]) for v in range(st, 4, 2))
                                    for st in range(2)]


def test_an_even_layout_written_out_is_the_default_split() -> None:
    par = {"tp": 1, "pp": 2, "vp": 2, "dp": 4}
    a = simulate(_tiny(None, par)).summary
    b = simulate(_tiny("Ett|tt|tt|ttL", par)).summary
    assert b["step_time_s"] == a["step_time_s"]
    assert b["peak_memory_gib"] == a["peak_memory_gib"]


def test_interleaved_bubble_closed_form_holds_for_an_even_layout() -> None:
    # Near-free communication, one GPU per stage, 32 layers over pp 4 x vp 2 written out
    # as a layout: the idle share of the pipeline phase is (p - 1) / (vp m + p - 1).
    p, vp, m = 4, 2, 8
    s = megatron_scenario({"tp": 1, "pp": p, "vp": vp, "dp": 1}, gbs=m, gpn=p,
                          framework={"name": "megatron", "pipeline_model_parallel_layout":
                                     "Etttt|(tttt|)*6ttttL"})
    assert [len(c) for c in megatron_shape(JobContext.from_scenario(s)).chunks] == [4] * 8
    got = pipeline_idle_share(simulate(s))
    assert got == pytest.approx((p - 1) / (vp * m + p - 1), abs=0.02)


def test_an_empty_virtual_stage_passes_the_tensor_on() -> None:
    # A stage entry without layers still receives, sends and frees what it allocated.
    r = simulate(_tiny("Etttt|tttt||L", {"tp": 1, "pp": 2, "vp": 2, "dp": 4}))
    for c in r.program.classes:
        assert activations_left(c) == pytest.approx(0.0, abs=1.0)
    assert r.summary["step_time_s"] > 0


def test_one_layer_a_chunk_with_embedding_and_loss_counted_matches_its_layout() -> None:
    # 6 layers + embedding + loss over pp 2 x vp 4 (Megatron-Bridge's Llama 3.1 405B GB200
    # MXFP8 config is this shape: 126 + 2 over 16 x 8): the first chunk holds only the
    # embedding and the last only the loss, the layout "E|t|t|t|t|t|t|L" written out.
    par = {"tp": 1, "pp": 2, "vp": 4, "dp": 4}
    fw = {"account_for_embedding_in_pipeline_split": True,
          "account_for_loss_in_pipeline_split": True}

    def tiny(layout: str | None, opts: dict):
        s = _tiny(layout, par, opts)
        return s.model_copy(update={"model": s.model.model_copy(update={"layers": 6})})

    counted = tiny(None, fw)
    assert [len(c) for c in chunk_layers(6, 2, 4, True, True)] == [0, 1, 1, 1, 1, 1, 1, 0]
    a = simulate(counted).summary
    b = simulate(tiny("E|t|t|t|t|t|t|L", {})).summary
    assert a["step_time_s"] == b["step_time_s"]


@pytest.mark.parametrize("layout,fw,match", [
    ("Ett|tt|tt|tt", {}, r"one embedding \(E\) and one loss"),
    ("Ett|tt|tt|tL", {}, r"7 decoder layers"),
    ("Etttt|ttttL", {}, r"1 virtual stages per rank, not vp = 2"),
    ("tEtt|tt|tt|ttL", {}, r"must start with the embedding"),
    ("Ett|tt|ttL|tt", {}, r"must start with the embedding|in the last"),
    ("Ett|tt|tt|ttL", {"decoder_first_pipeline_num_layers": 4}, r"cannot be combined"),
    ("Ett|tt|tt|ttX", {}, r"unknown layer character"),
])
def test_bad_layouts_name_the_key(layout, fw, match) -> None:
    s = _tiny(layout, {"tp": 1, "pp": 2, "vp": 2, "dp": 4}, fw)
    with pytest.raises(ScenarioError,
                       match=rf"^s\.yaml: framework\.pipeline_model_parallel_layout: .*{match}"):
        build_program(JobContext.from_scenario(s, "s.yaml"))


def test_mtp_must_sit_with_the_loss() -> None:
    model = {"layers": 4, "hidden": 1024, "heads": 8, "ffn_hidden": 2048, "vocab": 32768,
             "experts": 8, "experts_per_token": 2, "moe_ffn_hidden": 512,
             "first_k_dense": 1, "mtp_layers": 1}
    # pp rank 1 of 3 holds the module apart from the loss: Megatron's mtp_standalone.
    fw = {"name": "megatron", "pipeline_model_parallel_layout": "Ett|ttm|L"}
    s = megatron_scenario({"tp": 1, "pp": 3}, 8, framework=fw, model=model, gpn=6)
    with pytest.raises(ScenarioError, match=r"standalone MTP stage is not modelled"):
        build_program(JobContext.from_scenario(s, "s.yaml"))


def test_published_deepseek_v3_rows_now_build() -> None:
    # The published-moe suite's DeepSeek-V3 rows (pp 4 x vp 4 on GB200, pp 16 on B200 in FP8
    # and MXFP8, pp 8 x vp 4 on H100, and the Megatron Core MoE report's pp 8 x vp 4 on GB200
    # and H100 and pp 8 x vp 2 on GB200, Megatron-Bridge 26.04's pp 16 on B200 and pp 4 x vp 4
    # on GB200, 26.06's pp 4 x vp 4 on GB200, 26.04.01's pp 8 x vp 2 on B200, 26.04's pp 16
    # on B300 and pp 2 x vp 8 on GB300, Megatron-LM's own recipes at pp 8 x vp 2 on B200 and
    # pp 4 x vp 4 on GB200 and GB300, the verification cards' pp 8 x vp 4 on H100, pp 4 x vp 4
    # on GB200 and pp 2 x vp 8 on GB300, Megatron-LM's GB200 optimization log's pp 8 x vp 4
    # baseline and final configuration, and DeepSeek's own run on DualPipe's two directions of
    # pp 16, NeMo 2.0's 25.04 recipe in DGX Cloud Benchmarking: 64 / pp layers a middle
    # stage, one fewer on the first and two fewer on the last, at pp 16, 8 and 4, and
    # Megatron-LM PRs 6311 / 6429's 14-layer cut at pp 4 x vp 2, without and with the EP
    # overlap) carry their scripts' layouts
    # and shape without a refusal.
    rows = {e["id"]: e for e in entries() if "deepseek-v3" in e["id"]
            and scenario_of(e).framework.name == "megatron"}   # not AutoModel's fsdp2 rows
    want = {"tp2pp16ep64": [3] + [4] * 14 + [2], "tp2pp8ep64": [7] + [8] * 6 + [6],
            "tp2pp4ep": [15, 16, 16, 14],
            "dualpipe": ([4] * 15 + [1]) * 2, "pp4vp4": [4] * 15 + [1],
            "pp16": [4] * 15 + [1],
            "pp8vp4": [1] + [2] * 30 + [0], "pp8vp2": [4] * 15 + [1],
            "pp2vp8": [4] * 15 + [1],
            # Megatron-LM PRs 6311 / 6429: the benchmark recipe at 14 layers, Ett|(tt|)*6mL.
            "14l-64xh100": [2] * 7 + [0]}
    assert len(rows) == 32
    for rid, e in rows.items():
        sh = megatron_shape(JobContext.from_scenario(scenario_of(e), rid))
        key = next(k for k in want if k in rid)
        assert [len(c) for c in sh.chunks] == want[key], rid
        assert (sh.mtp is None) == ("nomtp" in rid)
