"""Benchmark: the trainer mesh (issue 14): FSDP2 equivalence and memory, bf16, LoRA deltas,
activation checkpointing.

What, each configuration in a FRESH subprocess (ranks are subprocesses of their own),
one optimizer step of the real trainer (``actors.trainer.Trainer``: recipe loss over
replayed supports, AdamW) on the same synthetic batch (random tokens; each generated
token's support is itself plus 3 random ids with a uniform log q):

- ``fsdp2_vs_single_max_abs_diff``: fp32 weights after one step, 2 FSDP2 ranks (gloo)
  vs one process. Target <= 1e-5.
- ``fsdp2_peak_mb_per_rank / single_peak_mb``: a >= 50M-parameter Qwen3 (hidden 1024,
  4 layers, vocab 2048), 2 ranks vs 1. Memory is the process's resident-set high-water
  mark (``getrusage`` ``ru_maxrss``) after the step, minus the same process's RSS just
  before the model is built (after importing torch, transformers, FSDP2 and peft, joining
  the process group and one forward/backward of the tiny built-in model), so the
  interpreter and libraries (~0.5 GB, the same in every process) do not dilute the
  ratio. Both raw and net figures are printed. Target <= 0.65.
- ``bf16_tokens_per_s / fp32_tokens_per_s``: padded tokens per second of a step, bf16
  (FSDP2 MixedPrecisionPolicy, one rank) vs fp32 (the plain trainer), median of 3 steps
  after a warm-up. Reported; on CPU bf16 matmuls are usually not faster.
- ``lora_delta_bytes / full_delta_bytes``: wire bytes of the bf16 XOR/zstd delta of one
  step at lr 1e-5, LoRA r=16 (q,k,v,o) vs full fine-tuning. Flotilla sends the MERGED
  weights (samplers need no adapter support): every element of an adapted matrix may
  change, so this ratio is about the adapted matrices' share of the model. Also
  reported: ``lora_adapter_bytes / full_delta_bytes``, the raw bf16 bytes of the adapter
  tensors alone, what a backend that loads adapters would need.
- ``act_ckpt_peak_mb / no_ckpt_peak_mb``: 8 decoder layers, 8 x 256-token sequences,
  net peak RSS as above. Target <= 0.7.

How: ``python benchmarks/trainer.py`` (a few minutes on 2 shared cores) or ``--quick``
(smaller models and batches, < 1 min idle; the 50M-parameter condition is then not met
and ``quick`` is true in the JSON). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def model(hidden: int, layers: int, vocab: int, inter: int, heads: int = 8, kv: int = 4) -> dict[str, Any]:
    from actors.models import default_model_config

    cfg = default_model_config(vocab)
    cfg.update(
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=inter,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hidden // heads,
        max_position_embeddings=1024,
    )
    return cfg


def synthetic_batch(vocab: int, n: int, prompt: int, gen: int, seed: int) -> list[Any]:
    import torch

    from actors.types import Trajectory

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        tokens = torch.randint(1, vocab, (prompt + gen,), generator=g)
        ids, offs = [], [0]
        for y in tokens[prompt:].tolist():
            row = torch.unique(torch.cat([torch.tensor([y]), torch.randint(1, vocab, (3,), generator=g)]))
            ids.append(row)
            offs.append(offs[-1] + row.numel())
        sup = torch.cat(ids).to(torch.int32)
        logq = torch.cat([torch.full((r.numel(),), -float(torch.log(torch.tensor(float(r.numel()))))) for r in ids])
        out.append(
            Trajectory(
                task="bench",
                prompt_id=f"p{i // 4}",
                group_id=f"g{i // 4}",
                pool="a",
                tokens=tokens,
                loss_mask=torch.tensor([False] * prompt + [True] * gen),
                support_ids=sup,
                support_offsets=torch.tensor(offs, dtype=torch.int32),
                support_logq=logq,
                versions=torch.zeros(gen, dtype=torch.int32),
                reward=float(i % 2),
                turns=1,
                seconds=0.0,
            )
        )
    return out


# ---------------------------------------------------------------------------- worker side
def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One rank (or the single process) of one configuration; see the module docstring."""
    import torch

    torch.set_num_threads(1)
    from actors.trainer import Trainer, TrainerConfig
    from actors.trainer._dist import World, init_group
    from actors.trainer._memory import peak_rss_mb

    world = World(spec.get("rank", 0), spec.get("procs", 1))
    cfg = TrainerConfig(**spec["config"])
    if world.size > 1:
        init_group(spec["address"], world, "cpu")
    _warm_up()
    base = peak_rss_mb()
    trainer = Trainer(cfg, world=world)
    b = spec["batch"]
    batch = synthetic_batch(trainer.model_config["vocab_size"], b["n"], b["prompt"], b["gen"], seed=1)
    padded = len(batch) * (b["prompt"] + b["gen"])
    times = []
    publisher = None
    if spec.get("delta"):
        from orchestrator.weightsync import WeightPublisher

        publisher = WeightPublisher(keyframe_interval=100, precisions=("bf16",))
        publisher.publish(0, trainer.master_weights())
    for _ in range(spec.get("steps", 1)):
        t0 = time.perf_counter()
        trainer.train_step(batch)
        times.append(time.perf_counter() - t0)
    peak = peak_rss_mb()
    out: dict[str, Any] = {
        "rank": world.rank,
        "base_mb": base,
        "peak_mb": peak,
        "net_mb": peak - base,
        "step_s": times,
        "params": sum(p.numel() for p in trainer.model.parameters()),
        "tokens_per_s": padded / statistics.median(times[1:] or times),
    }
    weights = trainer.master_weights()  # after the peak was read: gathering is not training
    if spec.get("weights_out") and world.is_main:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in weights.items()}, spec["weights_out"])
    if publisher is not None:
        msgs = publisher.publish(1, weights)
        out["delta_bytes"] = min(m.nbytes for m in msgs if not m.is_keyframe)
        out["adapter_bytes"] = sum(p.numel() * 2 for n, p in trainer.params.items() if "lora_" in n)
    return out


def _warm_up() -> None:
    """Import and exercise, before the baseline is read, what every configuration loads
    anyway (transformers' Qwen3, FSDP2, peft, autograd kernels on a tiny model), so the
    net peak is the configuration's own memory, not library start-up."""
    import peft  # noqa: F401
    import torch
    import torch.distributed.checkpoint
    import torch.distributed.fsdp
    from torch.distributed._composable import checkpoint  # noqa: F401

    from actors.models import build_model, default_model_config

    tiny = build_model(default_model_config(), seed=0)
    tiny(input_ids=torch.ones(1, 4, dtype=torch.int64)).logits.sum().backward()


def _spawn(spec: dict[str, Any]) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, __file__, "--worker", json.dumps(spec)], env=env, stdout=subprocess.PIPE, text=True
    )


def run(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Run a configuration in fresh processes (``procs`` ranks); each rank's result."""
    from actors.trainer._dist import rendezvous_address

    procs = spec.get("procs", 1)
    address = rendezvous_address(None, {}) if procs > 1 else None
    ps = [_spawn({**spec, "rank": r, "address": address}) for r in range(procs)]
    results = []
    for p in ps:
        out, _ = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"benchmark worker failed ({p.returncode}) for {spec['name']}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller models and batches (< 1 min)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    q = args.quick
    big = model(512, 2, 1024, 1376) if q else model(1024, 4, 2048, 2816)
    small = model(64, 2, 128, 128, heads=4, kv=2)
    deep = model(128, 8, 512, 344, heads=4, kv=2)
    lora_model = model(256, 2, 512, 688) if q else model(512, 4, 1024, 1376)
    short = {"n": 8, "prompt": 16, "gen": 16}
    tmp = Path(tempfile.mkdtemp(prefix="flotilla-bench-"))
    fig: dict[str, Any] = {"quick": q}

    # 1. one fp32 step: 2 FSDP2 ranks vs 1 process, weights compared in full
    from safetensors.torch import load_file

    one = {"config": {"model": small, "lr": 1e-3}, "batch": short}
    run({**one, "name": "diff-1", "weights_out": str(tmp / "w1.safetensors")})
    run(
        {
            **one,
            "name": "diff-2",
            "procs": 2,
            "config": {**one["config"], "procs": 2},
            "weights_out": str(tmp / "w2.safetensors"),
        }
    )
    w1, w2 = load_file(str(tmp / "w1.safetensors")), load_file(str(tmp / "w2.safetensors"))
    fig["fsdp2_vs_single_max_abs_diff"] = max(float((w1[k] - w2[k]).abs().max()) for k in w1)

    # 2. memory per rank, FSDP2 x2 vs single
    mem = {"config": {"model": big, "lr": 1e-4}, "batch": {"n": 4, "prompt": 32, "gen": 32}}
    single = run({**mem, "name": "mem-1"})[0]
    ranks = run({**mem, "name": "mem-2", "procs": 2, "config": {**mem["config"], "procs": 2}})
    fig["model_params"] = single["params"]
    fig["single_peak_mb"] = round(single["net_mb"], 1)
    fig["fsdp2_peak_mb_per_rank"] = round(max(r["net_mb"] for r in ranks), 1)
    fig["single_peak_rss_raw_mb"] = round(single["peak_mb"], 1)
    fig["fsdp2_peak_rss_raw_mb_per_rank"] = round(max(r["peak_mb"] for r in ranks), 1)
    fig["fsdp2_peak_mb_per_rank / single_peak_mb"] = round(fig["fsdp2_peak_mb_per_rank"] / fig["single_peak_mb"], 3)

    # 3. bf16 vs fp32 throughput on CPU
    speed = {"batch": {"n": 8, "prompt": 32, "gen": 32}, "steps": 3 if q else 4}
    fp32 = run({**speed, "name": "fp32", "config": {"model": lora_model}})[0]
    bf16 = run({**speed, "name": "bf16", "config": {"model": lora_model, "dtype": "bf16"}})[0]
    fig["fp32_tokens_per_s"] = round(fp32["tokens_per_s"], 1)
    fig["bf16_tokens_per_s"] = round(bf16["tokens_per_s"], 1)
    fig["bf16_tokens_per_s / fp32_tokens_per_s"] = round(bf16["tokens_per_s"] / fp32["tokens_per_s"], 3)

    # 4. one step's bf16 wire delta: LoRA r=16 (merged weights) vs full fine-tuning
    delta = {"batch": short, "delta": True}
    full = run({**delta, "name": "full-delta", "config": {"model": lora_model, "lr": 1e-5}})[0]
    lora = run(
        {
            **delta,
            "name": "lora-delta",
            "config": {
                "model": lora_model,
                "lr": 1e-5,
                "lora": {"r": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
            },
        }
    )[0]
    fig["full_delta_bytes"] = full["delta_bytes"]
    fig["lora_delta_bytes"] = lora["delta_bytes"]
    fig["lora_delta_bytes / full_delta_bytes"] = round(lora["delta_bytes"] / full["delta_bytes"], 4)
    fig["lora_adapter_bytes"] = lora["adapter_bytes"]
    fig["lora_adapter_bytes / full_delta_bytes"] = round(lora["adapter_bytes"] / full["delta_bytes"], 4)

    # 5. activation checkpointing, 8 decoder layers
    act = {"batch": {"n": 8, "prompt": 128, "gen": 128} if not q else {"n": 4, "prompt": 64, "gen": 64}}
    no_ck = run({**act, "name": "no-ckpt", "config": {"model": deep}})[0]
    ck = run({**act, "name": "ckpt", "config": {"model": deep, "activation_checkpointing": True}})[0]
    fig["no_ckpt_peak_mb"] = round(no_ck["net_mb"], 1)
    fig["act_ckpt_peak_mb"] = round(ck["net_mb"], 1)
    fig["act_ckpt_peak_mb / no_ckpt_peak_mb"] = round(ck["net_mb"] / no_ck["net_mb"], 3)
    fig["load_average_1m"] = round(os.getloadavg()[0], 2)

    for k, v in fig.items():
        print(f"{k:45s} {v}")
    print(json.dumps(fig, sort_keys=True))


if __name__ == "__main__":
    main()
