"""GPU check: the trainer on CUDA -- FSDP2 over NCCL, bf16 mixed precision, activation
checkpointing, distributed checkpoints.

Parts (one JSON line each):

- ``fsdp2_one_rank``: a trainer process (an FSDP2 group of one over NCCL) on a ~100M-parameter
  model, bf16, activation checkpointing: median step time over 3 steps, tokens/s, and the
  memory the trainer measured after its first step. Passes when every step applied with a
  finite loss.
- ``two_ranks_vs_one``: 2 ranks (one GPU each) against one process, fp32, one step, within
  1e-4; skipped with a reason on one GPU (NCCL refuses two ranks on one device).
- ``bf16_speed``: step tokens/s, bf16 vs fp32, in-process; must be > 1.
- ``act_ckpt_memory``: peak CUDA memory of a step with and without activation checkpointing
  at 8 layers; ratio must be <= 0.7 (CUDA only: CPU has no peak-memory counter).
- ``dcp_roundtrip``: a bf16 trainer's checkpoint resumes to the same digest.

``--quick`` runs ``fsdp2_one_rank`` and ``act_ckpt_memory`` only; ``--device cpu --tiny`` is a
dry run (gloo instead of NCCL).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
import trio
from _common import Report, parse_args, sync

from actors.trainer import Trainer, TrainerConfig, open_trainer
from benchmarks.trainer import model, synthetic_batch


def shapes(tiny: bool) -> tuple[dict, int]:
    if tiny:
        return model(64, 2, 512, 128, heads=4, kv=2), 512
    return model(1024, 8, 8192, 2816, heads=16, kv=8), 8192


async def fsdp2_one_rank(rep: Report, device: str, tiny: bool) -> None:
    m, vocab = shapes(tiny)
    batch = synthetic_batch(vocab, 16, 256, 256, seed=1) if not tiny else synthetic_batch(vocab, 4, 16, 16, seed=1)
    cfg = TrainerConfig(device=device, model=m, dtype="bf16", activation_checkpointing=True, lr=1e-4)
    results = []
    async with open_trainer(cfg) as tr:
        for _ in range(4):
            results.append(await tr.train_step(batch))
    ok = all(r.applied and r.loss == r.loss for r in results)
    sec = statistics.median(r.seconds for r in results[1:])
    rep.part("fsdp2_one_rank", ok, step_s=sec, tokens_per_s=results[-1].tokens / sec, memory=results[0].memory,
             losses=[r.loss for r in results])  # fmt: skip


async def two_ranks(rep: Report, device: str, tiny: bool) -> None:
    if device.startswith("cuda") and torch.cuda.device_count() < 2:
        rep.skip("two_ranks_vs_one", "one GPU visible; NCCL needs a GPU per rank")
        return
    m, vocab = shapes(True)
    cfg = TrainerConfig(device=device, model=m, lr=1e-3)
    batch = synthetic_batch(vocab, 8, 16, 16, seed=1)
    async with open_trainer(cfg.model_copy(update={"procs": 2})) as two:
        await two.train_step(batch)
        got = await two.full_weights()
    single = Trainer(cfg)
    single.train_step(batch)
    want = {k: v.cpu() for k, v in single.master_weights().items()}
    diff = max(float((want[k] - got[k]).abs().max()) for k in want)
    rep.part("two_ranks_vs_one", diff <= 1e-4, max_abs_diff=diff)


def _tokens_per_s(cfg: TrainerConfig, batch: list, padded: int) -> float:
    tr = Trainer(cfg)
    tr.train_step(batch)
    times = []
    for _ in range(3):
        sync(cfg.device)
        t0 = time.perf_counter()
        tr.train_step(batch)
        sync(cfg.device)
        times.append(time.perf_counter() - t0)
    return padded / statistics.median(times)


def bf16_speed(rep: Report, device: str, tiny: bool) -> None:
    m, vocab = shapes(tiny)
    n, p = (4, 16) if tiny else (16, 256)
    batch = synthetic_batch(vocab, n, p, p, seed=2)
    fp32 = _tokens_per_s(TrainerConfig(device=device, model=m), batch, n * 2 * p)
    bf16 = _tokens_per_s(TrainerConfig(device=device, model=m, dtype="bf16"), batch, n * 2 * p)
    # On CPU bf16 is emulated and slower: the dry run checks that both run, not the ratio.
    ok = bf16 > 0 and fp32 > 0 and (bf16 / fp32 > 1.0 or not device.startswith("cuda"))
    rep.part("bf16_speed", ok, fp32_tokens_per_s=fp32, bf16_tokens_per_s=bf16, ratio=bf16 / fp32)


def act_ckpt_memory(rep: Report, device: str, tiny: bool) -> None:
    if not device.startswith("cuda"):
        rep.skip("act_ckpt_memory", "CPU dry run: no peak-memory counter on CPU")
        return
    m = model(512, 8, 4096, 1376)
    batch = synthetic_batch(4096, 16, 256, 256, seed=3)
    peaks = []
    for ckpt in (False, True):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        tr = Trainer(TrainerConfig(device=device, model=m, activation_checkpointing=ckpt))
        tr.train_step(batch)
        peaks.append((torch.cuda.max_memory_allocated() - base) / 2**20)
        del tr
    ratio = peaks[1] / peaks[0]
    rep.part("act_ckpt_memory", ratio <= 0.7, no_ckpt_mib=peaks[0], ckpt_mib=peaks[1], ratio=ratio)


async def dcp_roundtrip(rep: Report, device: str) -> None:
    m, vocab = shapes(True)
    cfg = TrainerConfig(device=device, model=m, dtype="bf16")
    batch = synthetic_batch(vocab, 8, 16, 16, seed=4)
    ck = str(Path(tempfile.mkdtemp()) / "ck")
    async with open_trainer(cfg) as t:
        await t.train_step(batch)
        await t.save_checkpoint(ck)
        want = await t.digest()
    async with open_trainer(cfg, ck) as t:
        got = await t.digest()
    rep.part("dcp_roundtrip", got == want)


if __name__ == "__main__":
    args = parse_args(__doc__)
    rep = Report("trainer")
    dev = "cuda" if args.device.startswith("cuda") else "cpu"
    # Trainer processes first: an in-process Trainer joins a process group of its own and
    # leaves MASTER_ADDR/MASTER_PORT in this process's environment, which a trainer mesh
    # opened afterwards would take as its rendezvous (a port already held).
    rep.guard("fsdp2_one_rank", lambda: trio.run(fsdp2_one_rank, rep, dev, args.tiny))
    if not args.quick:
        rep.guard("dcp_roundtrip", lambda: trio.run(dcp_roundtrip, rep, dev))
        rep.guard("two_ranks_vs_one", lambda: trio.run(two_ranks, rep, dev, args.tiny))
    rep.guard("act_ckpt_memory", lambda: act_ckpt_memory(rep, dev, args.tiny))
    if not args.quick:
        rep.guard("bf16_speed", lambda: bf16_speed(rep, dev, args.tiny))
    rep.exit()
