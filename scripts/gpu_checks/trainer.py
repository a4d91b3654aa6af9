"""GPU check: the trainer on CUDA -- FSDP2 over NCCL, bf16 mixed precision, activation
checkpointing, distributed checkpoints.

Parts (one JSON line each; exit non-zero on a failure):

- ``nccl_group``: a 2-rank trainer mesh (NCCL, one GPU per rank) takes one fp32 step and
  matches a single-process CUDA trainer within 1e-4 (skipped with a reason on 1 GPU:
  NCCL refuses two ranks on one device); a 1-rank bf16 trainer (an NCCL group of one)
  always runs.
- ``bf16_speed``: tokens/s of a step, bf16 vs fp32, on a ~100M-parameter model; must be > 1.
- ``act_ckpt_memory``: ``torch.cuda.max_memory_allocated`` with and without activation
  checkpointing at 8 layers; ratio must be <= 0.7.
- ``dcp_roundtrip``: a bf16 trainer's checkpoint resumes to the same digest.

What has and has not run on a GPU: docs/gpus.md.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import trio

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from actors.trainer import Trainer, TrainerConfig, open_trainer
from benchmarks.trainer import model, synthetic_batch


def report(part: str, ok: bool, **fields: object) -> bool:
    print(json.dumps({"check": f"trainer.{part}", "status": "passed" if ok else "failed", **fields}), flush=True)
    return ok


def skip(part: str, reason: str) -> bool:
    print(json.dumps({"check": f"trainer.{part}", "status": "skipped", "reason": reason}), flush=True)
    return True


async def nccl_group() -> bool:
    cfg = TrainerConfig(device="cuda", lr=1e-3)
    batch = synthetic_batch(128, 8, 16, 16, seed=1)
    ok = True
    async with open_trainer(cfg.model_copy(update={"dtype": "bf16"})) as one:
        r = await one.train_step(batch)
        ok = report("nccl_group.bf16_one_rank", r.applied and r.loss == r.loss, loss=r.loss) and ok
    if torch.cuda.device_count() < 2:
        return skip("nccl_group.two_ranks", "one GPU visible; NCCL needs a GPU per rank") and ok
    single = Trainer(cfg)
    single.train_step(batch)
    want = {k: v.cpu() for k, v in single.master_weights().items()}
    async with open_trainer(cfg.model_copy(update={"procs": 2})) as two:
        await two.train_step(batch)
        got = await two.full_weights()
    diff = max(float((want[k] - got[k]).abs().max()) for k in want)
    return report("nccl_group.two_ranks_vs_one", diff <= 1e-4, max_abs_diff=diff) and ok


def _tokens_per_s(cfg: TrainerConfig, batch: list, padded: int) -> float:
    tr = Trainer(cfg)
    tr.train_step(batch)
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tr.train_step(batch)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return padded / statistics.median(times)


def bf16_speed() -> bool:
    m = model(1024, 8, 8192, 2816, heads=16, kv=8)
    batch = synthetic_batch(8192, 16, 256, 256, seed=2)
    padded = 16 * 512
    fp32 = _tokens_per_s(TrainerConfig(device="cuda", model=m), batch, padded)
    bf16 = _tokens_per_s(TrainerConfig(device="cuda", model=m, dtype="bf16"), batch, padded)
    return report("bf16_speed", bf16 / fp32 > 1.0, fp32_tokens_per_s=fp32, bf16_tokens_per_s=bf16, ratio=bf16 / fp32)


def act_ckpt_memory() -> bool:
    m = model(512, 8, 4096, 1376)
    batch = synthetic_batch(4096, 16, 256, 256, seed=3)
    peaks = []
    for ckpt in (False, True):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        tr = Trainer(TrainerConfig(device="cuda", model=m, activation_checkpointing=ckpt))
        tr.train_step(batch)
        peaks.append((torch.cuda.max_memory_allocated() - base) / 2**20)
        del tr
    return report(
        "act_ckpt_memory", peaks[1] / peaks[0] <= 0.7, no_ckpt_mb=peaks[0], ckpt_mb=peaks[1], ratio=peaks[1] / peaks[0]
    )


async def dcp_roundtrip() -> bool:
    cfg = TrainerConfig(device="cuda", dtype="bf16")
    batch = synthetic_batch(128, 8, 16, 16, seed=4)
    ck = str(Path(tempfile.mkdtemp()) / "ck")
    async with open_trainer(cfg) as t:
        await t.train_step(batch)
        await t.save_checkpoint(ck)
        want = await t.digest()
    async with open_trainer(cfg, ck) as t:
        got = await t.digest()
    return report("dcp_roundtrip", got == want)


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print(json.dumps({"check": "trainer", "status": "failed", "reason": "no CUDA device"}))
        sys.exit(1)
    ok = trio.run(nccl_group)
    ok = bf16_speed() and ok
    ok = act_ckpt_memory() and ok
    ok = trio.run(dcp_roundtrip) and ok
    sys.exit(0 if ok else 1)
