"""GPU check: weight deltas found on the GPU (`weightsync.DeviceDeltas`) against the CPU codec.

A ~0.5B-parameter bf16 snapshot (and its FP8 wire form) lies on the GPU; each step moves a
random 1% of its elements by a small amount, as an optimizer step does in bf16. Per
precision, one JSON line: whether every delta's frames are bit-identical to `encode_delta`
on host copies, GB/s of weights scanned (raw snapshot bytes / wall time of `delta`), host
bytes moved per step, and their ratio to the changed chunks' bytes and to the snapshot.
Passes when frames are identical on every step; also reports whether the wire snapshot
cast (and FP8-quantised) on the device equals the CPU's, bit for bit. ``--device cpu --tiny`` is a dry run.
"""

from __future__ import annotations

import statistics
import time

import torch
from _common import Report, parse_args, sync

from orchestrator.weightsync import DeviceDeltas, encode_delta, snapshot_bytes, wire_snapshot


def master_state(tiny: bool, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    hidden, inter, layers, vocab = (64, 128, 2, 512) if tiny else (1024, 3072, 28, 151936)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        for part, shape in (("self_attn.q_proj", (hidden * 2, hidden)), ("self_attn.o_proj", (hidden, hidden * 2)),
                            ("mlp.gate_proj", (inter, hidden)), ("mlp.down_proj", (hidden, inter))):  # fmt: skip
            shapes[f"model.layers.{i}.{part}.weight"] = shape
        shapes[f"model.layers.{i}.input_layernorm.weight"] = (hidden,)
    return {n: torch.randn(s, generator=g, device=device) * 0.02 for n, s in shapes.items()}


def nudge(state: dict[str, torch.Tensor], g: torch.Generator, frac: float = 0.01) -> None:
    for t in state.values():
        mask = torch.rand(t.shape, generator=g, device=t.device) < frac
        t.add_(mask * torch.randn(t.shape, generator=g, device=t.device) * 1e-3)


def run(rep: Report, precision: str, device: str, tiny: bool, steps: int) -> None:
    master = master_state(tiny, device)
    g = torch.Generator(device=device).manual_seed(1)
    snap = wire_snapshot(master, precision, keep_device=True)  # type: ignore[arg-type]
    raw = snapshot_bytes(snap)
    # Informative: the snapshot cast (and FP8-quantised) on the device against the CPU's.
    cpu_snap = wire_snapshot({n: t.cpu() for n, t in master.items()}, precision)  # type: ignore[arg-type]
    same_as_cpu = all(torch.equal(snap[n].cpu().view(torch.uint8), t.view(torch.uint8)) for n, t in cpu_snap.items())
    del cpu_snap
    enc = DeviceDeltas(snap, 0)
    prev_host = {n: t.cpu() for n, t in snap.items()}
    identical, rates, host, chunks = True, [], [], []
    for step in range(1, steps + 1):
        nudge(master, g)
        new = wire_snapshot(master, precision, keep_device=True)  # type: ignore[arg-type]
        sync(device)
        t0 = time.perf_counter()
        msg = enc.delta(new, step, precision)  # type: ignore[arg-type]
        rates.append(raw / (time.perf_counter() - t0) / 1e9)
        host.append(enc.last_host_bytes)
        chunks.append(enc.last_changed_chunk_bytes)
        new_host = {n: t.cpu() for n, t in new.items()}
        want = encode_delta(prev_host, new_host, step, step - 1, precision)  # type: ignore[arg-type]
        identical &= msg.meta == want.meta and [bytes(f) for f in msg.frames] == [bytes(f) for f in want.frames]
        prev_host = new_host
    rep.part(precision, identical, wire_snapshot_same_as_cpu=same_as_cpu, steps=steps, snapshot_bytes=raw, scanned_gbps=statistics.median(rates),
             host_bytes_per_step=statistics.median(host), host_over_changed_chunks=sum(host) / max(1, sum(chunks)),
             host_over_snapshot=sum(host) / (raw * steps), wire_bytes_last=msg.nbytes)  # fmt: skip


if __name__ == "__main__":
    args = parse_args(__doc__)
    rep = Report("weight_delta")
    for precision in ("bf16", "fp8"):
        rep.guard(precision, run, rep, precision, args.device, args.tiny, 2 if args.quick or args.tiny else 5)
    rep.exit()
