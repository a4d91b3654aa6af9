"""Benchmark: what a trainer pays to turn a fetched batch of held trajectories into trajectories.

What: a `HeldBatch` of `--batch` synthetic trajectories (`--prompt` prompt tokens, `--tokens`
generated tokens, support rows of about `--support` ids; the fleet benchmark's sizes) is
packed once, as an environment actor packs it, and unpacked `--reps` times two ways, in
turns: as `HeldBatch.unpack` does it (the batch's layouts checked whole by
`actors.types.check_layouts`, each trajectory then validated without its own layout check),
and as every trajectory's own validation would (`Trajectory` built from its views, its
layout checked one trajectory at a time: what unpack did before). Reports the median
milliseconds of each and of `pack`, and their ratio.

Why: the trainer unpacks every fetched batch before its step (docs/architecture.md, Data
path); what it spends there is time the step waits.

How: `PYTHONPATH=$PWD python benchmarks/held_batch.py [--quick]`. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from actors.held import HeldBatch
from actors.types import TENSOR_FIELDS, Trajectory


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
    pack_ms = statistics.median(_ms(HeldBatch.pack, trajs) for _ in range(3))
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
        "pack_ms": round(pack_ms, 2),
        "unpack_ms": round(statistics.median(whole), 2),
        "unpack_one_by_one_ms": round(statistics.median(each), 2),
        "unpack_speedup": round(statistics.median(each) / statistics.median(whole), 2),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
