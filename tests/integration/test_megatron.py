"""Megatron-LM schedules against closed forms: pipeline bubbles, activation memory (Korthikanti
et al. 2022), tensor-parallel exchanges, bytes per parameter of the optimizers."""

from __future__ import annotations

import pytest
from helpers import DEEP, pipeline_idle_share
from helpers import megatron_scenario as scenario

from sim.api import simulate
from sim.frameworks import JobContext, build_program
from sim.frameworks.megatron.build import schedule
from sim.scenario import ModelDims
from sim.workload.megatron_ops import MegatronLayout, megatron_blocks
from sim.workload.model import ModelSpec


def test_1f1b_order_matches_megatron() -> None:
    # Stage s of p runs min(p - s - 1, m) warm-up forwards, then alternates.
    assert [k for k, _, _ in schedule("1f1b", 4, 1, 6, 1)] == list("FFFBFBFBFBBB")
    assert [k for k, _, _ in schedule("gpipe", 4, 1, 3, 1)] == list("FFFBBB")
    inter = schedule("1f1b", 2, 0, 4, 2)
    assert len(inter) == 2 * 4 * 2 and {c for _, c, _ in inter} == {0, 1}


@pytest.mark.parametrize("p,m", [(4, 4), (4, 16), (2, 8)])
def test_1f1b_bubble_matches_the_closed_form(p: int, m: int) -> None:
    # Near-free communication (fat NVLink, one GPU per stage): the idle share of the pipeline
    # phase is (p-1)/(m+p-1) (Narayanan et al., 2021). The summary's bubble is a share of the
    # whole step, which also holds the optimizer: rescale to the pipeline phase.
    s = scenario({"tp": 1, "pp": p, "dp": 1}, gbs=m, gpn=p)
    r = simulate(s)
    got = pipeline_idle_share(r)
    assert got == pytest.approx((p - 1) / (m + p - 1), abs=0.02)


def test_interleaving_shrinks_the_bubble() -> None:
    plain = simulate(scenario({"tp": 1, "pp": 4, "dp": 1}, gbs=8, gpn=4)).summary
    inter = simulate(scenario({"tp": 1, "pp": 4, "dp": 1, "vp": 2}, gbs=8, gpn=4)).summary
    assert inter["bubble_fraction"] < plain["bubble_fraction"]
    assert inter["step_time_s"] < plain["step_time_s"]


def test_gpipe_holds_every_micro_batch_1f1b_only_p_minus_s() -> None:
    # Activation memory of the first stage: GPipe keeps all m micro-batches in flight, 1F1B
    # at most p (Narayanan et al., 2021, sec. 2.2).
    m, p = 8, 4
    gp = simulate(scenario({"tp": 1, "pp": p, "dp": 1}, gbs=m, gpn=p,
                           framework={"name": "megatron", "pipeline_schedule": "gpipe"}))
    fb = simulate(scenario({"tp": 1, "pp": p, "dp": 1}, gbs=m, gpn=p))
    act_gp = gp.recorder.memory[0].peak_breakdown["activations"]
    act_fb = fb.recorder.memory[0].peak_breakdown["activations"]
    assert act_gp / act_fb == pytest.approx(m / p, rel=0.05)


@pytest.mark.parametrize("t,sp", [(1, False), (4, False), (8, False), (4, True), (8, True)])
def test_activation_memory_matches_korthikanti(t: int, sp: bool) -> None:
    # Korthikanti et al. 2022, Table 2 (16-bit activations, 1-byte dropout masks):
    # TP: sbh(10 + 24/t + 5as/(ht)); TP+SP: sbh(34/t + 5as/(ht)).
    m = ModelSpec.from_dims(ModelDims(layers=2, hidden=2048, heads=16, ffn_hidden=8192,
                                      vocab=50257, mlp="gelu"), 2048)
    b, s, h, a = 2, 2048, 2048, 16
    lay = MegatronLayout(tp=t, sequence_parallel=sp, flash_attention=False, dropout=0.1)
    blocks = megatron_blocks(m, lay, b, s)
    saved = sum(tn.nbytes for k in ("attn_pre", "attn_main", "mlp_pre", "mlp_main")
                for tn in blocks[k].saved if not tn.name.endswith("stats"))
    if sp:
        expected = s * b * h * (34 / t + 5 * a * s / (h * t))
    else:
        expected = s * b * h * (10 + 24 / t + 5 * a * s / (h * t))
    assert saved == pytest.approx(expected, rel=1e-9)


def test_tensor_parallel_exchanges_per_layer() -> None:
    # Two all-reduces per layer in forward and two in backward (Shoeybi et al. 2019); full
    # recomputation repeats the forward's two.
    for ac, per_layer in (("none", 4), ("full", 6)):
        s = scenario({"tp": 4, "pp": 1, "dp": 1}, gbs=1, gpn=4, ac=ac)
        p = build_program(JobContext.from_scenario(s))
        n = sum(1 for op in p.ops if op.collective == "all_reduce" and op.layer is not None)
        assert n == per_layer * DEEP["layers"]


@pytest.mark.parametrize("distributed,grad_fp32,per_param", [
    (False, True, 18), (True, True, None), (False, False, 20)])
def test_bytes_per_parameter_follow_megatron(distributed, grad_fp32, per_param) -> None:
    # docs/user-guide/features/dist_optimizer.md: bf16 params with fp32 grads 18 bytes per
    # parameter (6 + 12/d distributed); fp16 with fp16 grads 20 (4 + 16/d), of which the
    # fp32 gradient copies (4, copy_group_grads' .float()) exist only from the optimizer step:
    # held through the step, 4 at the step itself.
    d = 4
    s = scenario({"tp": 1, "pp": 1, "dp": d}, gbs=d, gpn=d,
                 framework={"name": "megatron", "distributed_optimizer": distributed,
                            "grad_reduce_in_fp32": grad_fp32})
    p = build_program(JobContext.from_scenario(s))
    mem = p.classes[0].initial_memory
    n = mem["parameters"] / 2
    step = next(op for op in p.ops if op.name == "optimizer step")
    total = (sum(mem.values()) + step.transient) / n
    assert total == pytest.approx(per_param if per_param else 6 + 12 / d)
    assert step.transient / n == (0 if grad_fp32 else 4 / (d if distributed else 1))


def test_data_parallel_gradients_and_tied_embeddings() -> None:
    tied = dict(DEEP, tied_embeddings=True)
    s = scenario({"tp": 1, "pp": 2, "dp": 2}, gbs=4, gpn=4, model=tied)
    p = build_program(JobContext.from_scenario(s))
    names = [op.name for op in p.ops if op.kind == "collective"]
    # One bucket per stage: without overlap_grad_reduce Megatron's bucket_size is None.
    assert sum(n.startswith("grad all_reduce") for n in names) == 2
    assert names.count("tied embedding all-reduce") == 2  # first and last stage together


def test_overlapped_gradient_buckets_hide_communication() -> None:
    base = {"tp": 1, "pp": 1, "dp": 16}
    kw = dict(gbs=16, nodes=2, gpn=8, nvlink=450)
    plain = simulate(scenario(base, **kw)).summary
    over = simulate(scenario(base, framework={"name": "megatron", "overlap_grad_reduce": True},
                             **kw)).summary
    assert over["exposed_comm_s"] < plain["exposed_comm_s"]
    assert over["step_time_s"] < plain["step_time_s"]


# --------------------------------------------------------------------------- FP8
def test_fp8_linears_save_their_inputs_in_one_byte_and_run_fp8_gemms() -> None:
    # Transformer Engine saves each linear's input as its E4M3 transpose: the qkv, fc1 and fc2
    # inputs (2h + ffn per token) drop from 2 bytes to 1; the proj input is attention's output,
    # which attention keeps in 16 bits for its own backward anyway, so proj adds its 1-byte
    # copy (q_dim per token). Everything else is unchanged.
    m = ModelSpec.from_ref(ModelDims(**DEEP), 2048)
    tokens = 2048
    plain = megatron_blocks(m, MegatronLayout(), 1, tokens)
    fp8 = megatron_blocks(m, MegatronLayout(fp8="delayed"), 1, tokens)
    saved = {k: sum(t.nbytes for t in b.saved) for k, b in plain.items()}
    saved8 = {k: sum(t.nbytes for t in b.saved) for k, b in fp8.items()}
    halved = tokens * (2 * m.hidden + m.ffn_hidden)   # elements, 2 -> 1 byte
    added = tokens * m.q_dim                          # elements, +1 byte
    assert (saved["attn_main"] + saved["mlp_main"]) - (saved8["attn_main"] + saved8["mlp_main"]) \
        == pytest.approx(halved - added)
    gemms = [k for b in fp8.values() for k in b.forward + b.backward if k.klass == "gemm"]
    assert sum(k.fp8 for k in gemms) == 12          # 4 linears x (fwd, dgrad, wgrad)
    assert not any(k.fp8 for k in plain["head"].forward)


def test_fp8_step_is_faster_but_not_twice_and_tensorwise_pays_its_amax_passes() -> None:
    # The GEMMs run twice as fast; attention, norms, casts and communication do not, so the
    # step gains less than 2x. Current scaling (tensorwise) reads each tensor once more.
    fw = {"name": "megatron"}
    par = {"tp": 2, "pp": 1, "dp": 4, "sequence_parallel": True}

    def run(precision: str, recipe: str = "delayed") -> dict:
        s = scenario(par, gbs=8, framework={**fw, "fp8_recipe": recipe}, precision=precision)
        return simulate(s).summary

    bf16, delayed, tensorwise = run("bf16"), run("fp8"), run("fp8", "tensorwise")
    assert bf16["step_time_s"] / 2 < delayed["step_time_s"] < bf16["step_time_s"]
    assert delayed["step_time_s"] < tensorwise["step_time_s"]
    # FP8 weight copies (2 B per linear parameter) stay resident; MFU is against the FP8 peak
    assert delayed["peak_memory_breakdown_gib"].get("buffers", 0) > 0
    assert delayed["mfu"] < delayed["model_tflops_per_gpu"] * 1e12 / 989.4e12


def test_fp8_needs_transformer_engine_layers() -> None:
    from sim.scenario import ScenarioError

    s = scenario({"tp": 1, "pp": 1}, gbs=8, framework={"name": "megatron",
                                                       "implementation": "local"},
                 precision="fp8")
    with pytest.raises(ScenarioError, match="framework.implementation"):
        build_program(JobContext.from_scenario(s))


def test_embedding_and_loss_count_as_layers_in_the_pipeline_split() -> None:
    # 30 layers + embedding + loss = 32 = 4 stages x 8: stage 0 holds 7 transformer layers
    # and the embedding, stage 3 seven and the output layer, the middle stages 8 each.
    fw = {"name": "megatron", "account_for_embedding_in_pipeline_split": True,
          "account_for_loss_in_pipeline_split": True}
    s = scenario({"tp": 1, "pp": 4, "dp": 1}, gbs=4, gpn=4, framework=fw,
                 model={**DEEP, "layers": 30})
    r = simulate(s)
    fwd_layers = {c.id: {x.op.layer for x in r.recorder.ops if x.cls == c.id
                         and x.op.phase == "fwd" and x.op.layer is not None}
                  for c in r.program.classes}
    assert [len(fwd_layers[st]) for st in range(4)] == [7, 8, 8, 7]
    assert sorted(set().union(*fwd_layers.values())) == list(range(30))
    # without the options 30 layers do not split over 4 stages: refused, naming the key
    from sim.scenario import ScenarioError
    with pytest.raises(ScenarioError, match="parallelism.pp"):
        build_program(JobContext.from_scenario(
            scenario({"tp": 1, "pp": 4, "dp": 1}, gbs=4, gpn=4, model={**DEEP, "layers": 30})))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_full_recompute_adds_one_forward_of_the_layers_whatever_tp(tp: int) -> None:
    # Full activation checkpointing re-runs each layer's forward once per micro-batch: the
    # hardware FLOPs exceed the model's by the layers' forward FLOPs, 2 x (their matmul
    # parameters: all but the LM head's vocab x hidden) + their causal attention's forward
    # (a third of ModelSpec's forward + backward attention), per token, at any tensor
    # parallelism (the blocks are priced per tensor-parallel rank).
    s = scenario({"tp": tp, "pp": 1, "sequence_parallel": tp > 1}, gbs=8, ac="full")
    program = build_program(JobContext.from_scenario(s, "test"))
    m = ModelSpec.from_ref(s.model, s.training.seq_len)
    layers_fwd = (2.0 * (m.active_matmul_params - m.vocab * m.hidden)
                  + m.attention_flops_per_token(s.training.seq_len) / 3.0)
    extra = program.hw_flops_per_step - program.model_flops_per_step
    # 3e-4: ModelSpec counts a causal row's keys with the diagonal, (S + 1) / 2, the flash
    # kernel S / 2 (the bugs this guards against were factors of 2 and of tp).
    assert extra == pytest.approx(layers_fwd * program.tokens_per_step, rel=3e-4)
