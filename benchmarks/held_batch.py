"""Benchmark: what a holder pays to pack and send a batch of held trajectories, and a
trainer to turn the fetched batch into trajectories.

What: a `HeldBatch` of `--batch` synthetic trajectories (`--prompt` prompt tokens, `--tokens`
generated tokens, support rows of about `--support` ids; the fleet benchmark's sizes).

- Sending, `--reps` times two ways in turns: packed as `HeldBatch.pack` does it (each field
  concatenated into memory the runtime lends, `orchestrator.runtime.lend_buffer`) and as it
  was packed before (concatenated into fresh memory), each then encoded and its large
  frames moved into shared memory as a send to a peer on this machine does
  (`_shm.export_frames`), and mapped back as the receiver maps them (`import_frames`).
  `pack_ms` / `pack_fresh_ms` time the packing alone, `send_ms` / `send_fresh_ms` all of it.
- Unpacking, `--reps` times two ways in turns: as `HeldBatch.unpack` does it (the batch's
  layouts checked whole by `actors.types.check_layouts`, each trajectory then validated
  without its own layout check), and as every trajectory's own validation would
  (`Trajectory` built from its views, its layout checked one trajectory at a time: what
  unpack did before).

Reports the median milliseconds of each and their ratios.

Why: the holder packs while its episodes wait (one trio loop), and the trainer unpacks
every fetched batch before its step (docs/architecture.md, Data path).

How: `PYTHONPATH=$PWD python benchmarks/held_batch.py [--quick]`. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from actors.held import HeldBatch
from actors.types import TENSOR_DTYPES, TENSOR_FIELDS, Trajectory
from orchestrator.runtime._shm import ENABLED, export_frames, import_frames
from orchestrator.runtime._wire import encode


def synthetic(i: int, prompt: int, tokens: int, support: int) -> Trajectory:
    g = torch.Generator().manual_seed(i)
    sizes = torch.randint(max(1, support // 2), support + support // 2 + 1, (tokens,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)]).to(torch.int32)
    nnz = int(offsets[-1])
    return Trajectory(
        task="bench",
        prompt_id=f"p{i}",
        group_id=f"g{i // 16}",
        pool="pool0",
        tokens=torch.randint(0, 50_000, (prompt + tokens,), generator=g),
        loss_mask=torch.cat([torch.zeros(prompt, dtype=torch.bool), torch.ones(tokens, dtype=torch.bool)]),
        support_ids=torch.randint(0, 50_000, (nnz,), dtype=torch.int32, generator=g),
        support_offsets=offsets,
        support_logq=-torch.rand(nnz, generator=g),
        versions=torch.zeros(tokens, dtype=torch.int32),
        reward=float(i % 2),
        turns=1,
        seconds=0.02,
    )


def unpack_one_by_one(batch: HeldBatch) -> list[Trajectory]:
    """Every trajectory validated on its own, layout included (unpack before the batch check)."""
    parts = [torch.split(t, col.tolist()) for t, col in zip(batch.tensors, batch.lengths.T, strict=True)]
    return [
        Trajectory(**m, **{k: p[i] for k, p in zip(TENSOR_FIELDS, parts, strict=True)})
        for i, m in enumerate(batch.meta)
    ]


def pack_fresh(trajs: list[Trajectory]) -> HeldBatch:
    """The batch as `HeldBatch.pack` built it before: each field concatenated into fresh memory."""
    fields = [[getattr(t, k) for t in trajs] for k in TENSOR_FIELDS]
    return HeldBatch(
        found=[True] * len(trajs),
        meta=[t.model_dump(exclude=set(TENSOR_FIELDS)) for t in trajs],
        lengths=torch.tensor([[x.numel() for x in col] for col in fields], dtype=torch.int64).T.reshape(-1, 6),
        tensors=[
            torch.cat(col) if col else torch.empty(0, dtype=TENSOR_DTYPES[k])
            for k, col in zip(TENSOR_FIELDS, fields, strict=True)
        ],
    )


def send(pack, trajs: list[Trajectory]) -> None:
    """Pack, encode, move the large frames into shared memory and map them back (a local send)."""
    frames: list = [b"{}"]
    encode(pack(trajs), frames)
    got = import_frames(export_frames(frames, 0), 0, log=print)
    del got  # the receiver is done: its segments are free again


def _ms(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a 256-trajectory batch, 5 repetitions")
    ap.add_argument("--batch", type=int, default=None, help="trajectories per batch (default 512; quick 256)")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--support", type=int, default=16)
    ap.add_argument("--reps", type=int, default=None, help="unpacks of each kind (default 9; quick 5)")
    args = ap.parse_args()
    n = args.batch or (256 if args.quick else 512)
    reps = args.reps or (5 if args.quick else 9)
    torch.set_num_threads(1)
    trajs = [synthetic(i, args.prompt, args.tokens, args.support) for i in range(n)]
    packs: dict[str, list[float]] = {"pack": [], "pack_fresh": [], "send": [], "send_fresh": []}
    for r in range(reps):  # in turns, so both see the same machine
        for kind in ("", "_fresh") if r % 2 == 0 else ("_fresh", ""):
            pack = pack_fresh if kind else HeldBatch.pack
            packs["pack" + kind].append(_ms(pack, trajs))
            if ENABLED:
                packs["send" + kind].append(_ms(send, pack, trajs))
    batch = HeldBatch.pack(trajs)
    whole, each = [], []
    for r in range(reps):  # in turns, so both see the same machine
        for kind in ("whole", "each") if r % 2 == 0 else ("each", "whole"):
            if kind == "whole":
                whole.append(_ms(batch.unpack))
            else:
                each.append(_ms(unpack_one_by_one, batch))
    out = {
        "bench": "held_batch",
        "quick": args.quick,
        "batch": n,
        "generated_tokens": args.tokens,
        "batch_mb": round(sum(t.numel() * t.element_size() for t in batch.tensors) / 2**20, 1),
        **{f"{k}_ms": round(statistics.median(v), 2) if v else None for k, v in packs.items()},
        "send_speedup": round(statistics.median(packs["send_fresh"]) / statistics.median(packs["send"]), 2)
        if ENABLED
        else None,
        "unpack_ms": round(statistics.median(whole), 2),
        "unpack_one_by_one_ms": round(statistics.median(each), 2),
        "unpack_speedup": round(statistics.median(each) / statistics.median(whole), 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
