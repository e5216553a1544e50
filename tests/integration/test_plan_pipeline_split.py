"""The planner's pipeline split for layer counts no even split takes (DeepSeek-V3's 61).

The shipped DeepSeek-V3 scenario splits 61 layers over 16 stages as 4 first, 14 x 4, 1 last
(``decoder_first/last_pipeline_num_layers``). Kept in layouts of another pipeline depth, those
keys refused every one of them, and ``fabricsim plan`` on that scenario found nothing to
recommend (216,514 layouts, none built). A scenario's split now holds for its own ``pp x vp``
only, and layouts without interleaving take Megatron-Core's uneven first and last stage where
nothing even fits (sim/frameworks/megatron/search.py ``uneven_split``).
"""

from __future__ import annotations

from sim.apps.plan.layouts import Layout, layout_scenario
from sim.frameworks.megatron.pipeline import chunk_layers
from sim.frameworks.megatron.search import megatron_split
from sim.scenario import load_scenario

DSV3 = "deepseek-v3-megatron-tp2pp16ep64-1024xh100"


def test_pipeline_depths_without_interleaving_split_61_layers_evenly_enough() -> None:
    found = []
    for pp in range(2, 31):
        split = dict(megatron_split(61, pp, 1) or ())
        if not split:
            continue
        found.append(pp)
        sizes = [len(c) for c in chunk_layers(
            61, pp, 1, bool(split.get("account_for_embedding_in_pipeline_split")),
            bool(split.get("account_for_loss_in_pipeline_split")),
            split.get("decoder_first_pipeline_num_layers"),
            split.get("decoder_last_pipeline_num_layers"))]
        assert sum(sizes) == 61 and len(sizes) == pp
        # No stage holds more than an even share rounded up: the split is balanced.
        assert max(sizes) <= -(-61 // pp) + 1, (pp, sizes)
    assert {2, 4, 8, 16} <= set(found)   # the depths DeepSeek-V3 recipes run


def test_a_layout_of_another_depth_drops_the_scenarios_split() -> None:
    base = load_scenario(DSV3)
    assert base.framework.decoder_first_pipeline_num_layers == 4
    options = tuple(sorted(megatron_split(61, 8, 1) or ()))
    layout = Layout("megatron", 2, 8, 64, 1, 1, 1, "selective", options, ep=64, etp=1)
    s = layout_scenario(base, layout)
    assert (s.framework.decoder_first_pipeline_num_layers,
            s.framework.decoder_last_pipeline_num_layers) == (8, 5)
    # Its own depth keeps the scenario's split.
    same = Layout("megatron", 2, 16, 32, 1, 1, 1, "selective", (), ep=64, etp=1)
    s16 = layout_scenario(base, same)
    assert (s16.framework.decoder_first_pipeline_num_layers,
            s16.framework.decoder_last_pipeline_num_layers) == (4, 1)
