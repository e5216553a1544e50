"""Measure whole single-GPU training steps of Hugging Face Llama models (issue 11, item 6).

``sim/catalog/calibration/h200-train-step.json`` holds one measured step (Llama 3.2 1B, plain
bf16 autocast); the issue names the regimes the simulator is judged on: plain AMP and FSDP2,
1B- and 8B-architecture models, with and without recomputation, and torch.compile's gain. This
script measures each on the GPU it runs on, the same way as that file's step:

* the model: ``transformers.LlamaForCausalLM`` built from a config (random weights, SDPA
  attention, ``use_cache=False``, fp32 parameters on the GPU);
  ``loss = model(input_ids, labels=input_ids).loss``;
* ``plain``: forward and loss under ``torch.autocast(bfloat16)``, ``loss.backward()``;
* ``fsdp2``: ``fully_shard`` on every decoder layer and the root on a one-rank process group,
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, no autocast (torchtitan's
  recipe); the one-rank collectives are copies, so what is measured is FSDP2's own work;
* ``recompute``: ``model.gradient_checkpointing_enable()`` (transformers 5: non-reentrant
  ``torch.utils.checkpoint`` around every decoder layer);
* ``compile``: ``torch.compile`` of the whole model, loss included (``model``), or of each
  decoder layer with the norm, output layer and loss eager (``layers``, as torchtitan compiled
  before its loss was compiled; FSDP2 runs compile this way);
* then ``torch.optim.AdamW(fused=True)``'s step and ``zero_grad(set_to_none=True)``.

Step time is the median of ``--steps`` steps after ``--warmup`` (CUDA synchronised, wall clock;
the forward-backward and the optimizer timed apart). Peak memory: ``max_memory_allocated`` and
``max_memory_reserved`` over the timed steps. Runs are written to ``--out`` as each finishes,
and runs left when ``--budget`` seconds have passed are listed as skipped. Needs PyTorch and
transformers; nothing in the package imports it.

Example::

    python tools/measure_train_step.py --out h200-train-steps.json
    python tools/measure_train_step.py --device cpu --runs tiny-plain tiny-fsdp2 --out x.json
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

#: Model dimensions (transformers' LlamaConfig keys): Llama 3.2 1B as published; Llama 3 8B's
#: layer and vocabulary with four layers, so the optimizer's fp32 state fits beside the
#: activations of a 2 x 4096 batch without recomputation; Llama 3 70B's layer with two layers
#: (the largest GEMMs of the Llama 3 family, 3.8B parameters); a tiny one for checking the script.
MODELS: dict[str, dict[str, Any]] = {
    "llama3.2-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                    "tie_word_embeddings": True},
    "llama3-8b-4l": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 4,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                     "tie_word_embeddings": False},
    "llama3-70b-2l": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 2,
                      "num_attention_heads": 64, "num_key_value_heads": 8,
                      "vocab_size": 128256, "tie_word_embeddings": False},
    "tiny": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
             "tie_word_embeddings": True},
}
SHARED = {"rope_theta": 500000.0, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
          "attention_bias": False, "mlp_bias": False}

#: name -> (model, wrapper, recompute, compile, seq, micro batch); in the order they run.
#: compile: "" (eager), "model" (the whole model and its loss) or "layers" (decoder layers).
RUNS: dict[str, tuple[str, str, bool, str, int, int]] = {
    "1b-plain": ("llama3.2-1b", "plain", False, "", 4096, 4),
    "1b-recompute": ("llama3.2-1b", "plain", True, "", 4096, 4),
    "1b-fsdp2": ("llama3.2-1b", "fsdp2", False, "", 4096, 4),
    "1b-fsdp2-recompute": ("llama3.2-1b", "fsdp2", True, "", 4096, 4),
    "8b4l-plain": ("llama3-8b-4l", "plain", False, "", 4096, 2),
    "8b4l-recompute": ("llama3-8b-4l", "plain", True, "", 4096, 2),
    "8b4l-fsdp2": ("llama3-8b-4l", "fsdp2", False, "", 4096, 2),
    "1b-plain-8k": ("llama3.2-1b", "plain", False, "", 8192, 2),
    "1b-compile": ("llama3.2-1b", "plain", False, "model", 4096, 4),
    "1b-fsdp2-compile": ("llama3.2-1b", "fsdp2", False, "layers", 4096, 4),
    "8b4l-compile": ("llama3-8b-4l", "plain", False, "model", 4096, 2),
    "1b-compile-layers": ("llama3.2-1b", "plain", False, "layers", 4096, 4),
    "70b2l-plain": ("llama3-70b-2l", "plain", False, "", 4096, 2),
    "70b2l-recompute": ("llama3-70b-2l", "plain", True, "", 4096, 2),
    "tiny-plain": ("tiny", "plain", False, "", 256, 2),
    "tiny-fsdp2": ("tiny", "fsdp2", True, "", 256, 2),
    "tiny-compile": ("tiny", "plain", False, "model", 256, 2),
    "tiny-compile-layers": ("tiny", "plain", False, "layers", 256, 2),
    "tiny-fsdp2-compile": ("tiny", "fsdp2", False, "layers", 256, 2),
}
DEFAULT_RUNS = [name for name in RUNS if not name.startswith("tiny")]


def ensure_process_group(device: str) -> None:
    """A one-rank process group for FSDP2 (NCCL on a GPU, gloo on the CPU)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)


def build(name: str, device: str) -> tuple[Any, Any, dict[str, Any]]:
    """The model (wrapped as the run says), its fused AdamW, and the run's description."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    model_name, wrapper, recompute, compiled, seq, batch = RUNS[name]
    config = LlamaConfig(**MODELS[model_name], **SHARED)
    config._attn_implementation = "sdpa"
    config.use_cache = False    # training: no key/value cache is built
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    if recompute:
        model.gradient_checkpointing_enable()
    if compiled == "layers":
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = torch.compile(layer)
    if wrapper == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        ensure_process_group(device)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
    elif compiled == "model":
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    describe = {"name": name, "model": model_name, "config": MODELS[model_name],
                "wrapper": wrapper, "activation_checkpointing": recompute, "compiled": compiled,
                "seq": seq, "micro_batch": batch, "params": params}
    return model, optimizer, describe


def kernel_profile(one: Any, device: str, top: int = 60) -> dict[str, Any]:
    """One more step under ``torch.profiler``: its GPU kernels by name (calls, total us, the
    ``top`` longest), how many, the time the GPU was busy (kernel intervals merged) and the
    span from the first kernel's start to the last one's end."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts, record_shapes=True) as prof:
        wall = sum(one())
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    by_name: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            calls_us = by_name.setdefault(e.name, [0, 0.0])
            calls_us[0] += 1
            calls_us[1] += e.time_range.end - e.time_range.start
    busy, reach = 0.0, float("-inf")
    for start, end in spans:               # union of the kernel intervals
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    # The operators (with their input shapes) whose own kernels took the GPU time.
    ops = sorted((o for o in prof.key_averages(group_by_input_shape=True)
                  if o.self_device_time_total > 0), key=lambda o: -o.self_device_time_total)
    return {"step_s": wall, "kernels": len(spans), "busy_s": busy / 1e6,
            "span_s": (spans[-1][1] - spans[0][0]) / 1e6 if spans else 0.0,
            "top": [{"name": n[:200], "calls": c, "us": round(us, 1)} for n, (c, us) in ranked],
            "ops": [{"op": o.key, "shapes": str(o.input_shapes)[:200], "calls": o.count,
                     "us": round(o.self_device_time_total, 1)} for o in ops[:2 * top]]}


def step_times(model: Any, optimizer: Any, run: dict[str, Any], device: str,
               warmup: int, steps: int, profiled: bool = False) -> dict[str, Any]:
    """Warm-up, then ``steps`` timed steps: forward-backward and optimizer apart (and, if
    ``profiled``, one more step's kernels)."""
    import torch

    vocab = run["config"]["vocab_size"]
    ids = torch.randint(0, vocab, (run["micro_batch"], run["seq"]), device=device)
    autocast = run["wrapper"] == "plain"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def one() -> tuple[float, float]:
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        sync()
        t1 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        return t1 - t0, time.perf_counter() - t1

    t_compile = time.perf_counter()
    for _ in range(warmup):
        one()
    warm_s = time.perf_counter() - t_compile
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timed = [one() for _ in range(steps)]
    totals = [a + b for a, b in timed]
    out = {"fwd_bwd_s": statistics.median(a for a, _ in timed),
           "optimizer_s": statistics.median(b for _, b in timed),
           "step_s": statistics.median(totals), "step_s_all": totals, "warmup_s": warm_s,
           "tokens_per_s": run["micro_batch"] * run["seq"] / statistics.median(totals)}
    if device == "cuda":
        out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        out["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    if profiled:
        out["profile"] = kernel_profile(one, device)
    return out


def release() -> None:
    """Free the last run's model, optimizer state and compiled graphs before the next."""
    import torch

    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def meta(device: str, warmup: int, steps: int) -> dict[str, Any]:
    import torch
    import transformers

    doc = __doc__ or ""
    return {"measured": time.strftime("%Y-%m-%d"),
            "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu",
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__,
            "cudnn": torch.backends.cudnn.version() if device == "cuda" else None,
            "method": " ".join(doc.split("\n\n")[2:4]) + f" Warm-up {warmup} steps, "
                      f"{steps} timed.",
            "script": "tools/measure_train_step.py"}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, choices=sorted(RUNS))
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--profile", nargs="*", default=[], metavar="RUN",
                    help="runs that get one more step under torch.profiler")
    ap.add_argument("--budget", type=float, default=float("inf"),
                    help="seconds after which the remaining runs are skipped")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    start = time.monotonic()
    result: dict[str, Any] = {"meta": meta(a.device, a.warmup, a.steps), "runs": [],
                              "skipped": [], "failed": []}
    for name in a.runs:
        if time.monotonic() - start > a.budget:
            result["skipped"].append(name)
            continue
        try:
            model, optimizer, run = build(name, a.device)
            run.update(step_times(model, optimizer, run, a.device, a.warmup, a.steps,
                                  profiled=name in a.profile))
            result["runs"].append(run)
            print(f"{name:20s} step {run['step_s']:.4f} s (fwd+bwd {run['fwd_bwd_s']:.4f}, "
                  f"opt {run['optimizer_s']:.4f}), warm-up {run['warmup_s']:.1f} s, peak "
                  f"{run.get('peak_allocated_bytes', 0) / 2**30:.1f} GiB", flush=True)
        except Exception as err:  # noqa: BLE001 - one run's failure is recorded, not fatal
            result["failed"].append({"name": name, "error": f"{type(err).__name__}: {err}"})
            print(f"{name:20s} FAILED {type(err).__name__}: {err}", flush=True)
        model = optimizer = None
        release()
        a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
