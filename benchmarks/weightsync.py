"""Benchmark: sparse weight deltas on real AdamW steps (docs/architecture.md, Weight sync).

What: a Qwen3-style model (transformers Qwen3Config, random init, ~125 M
parameters: hidden 768, 12 layers, vocab 32k, untied head) keeps fp32 master
weights and takes real AdamW steps on real gradients (language-model loss on
random tokens, batch 1x64): 10 steps at lr 1e-6, then 10 at lr 1e-5. After
each step the bf16 wire snapshot is diffed against the previous one with
`encode_delta`, sent through ZeroMQ-style frames, and applied by a
`WeightReceiver`, which must end bit-identical to the publisher. The same is
done for the FP8 wire (128x128 block e4m3 + float32 scales, bf16 elsewhere).

Why: samplers far from the trainer are only viable if a step's update is
small on the wire. Per step it reports the fraction of wire elements that
changed, the delta's wire bytes, raw/wire ratio, wire over the entropy bound
(log2 C(n, k) + b*k bits for k of n elements changed, b = element bits; 16 for
bf16), encode and decode+apply GB/s of raw snapshot bytes, plain zstd of the
full snapshot and zstd of the plain XOR for comparison.

The publisher-side snapshots live in shared memory, as a `WeightPublisher` keeps
them, so `encode_delta` runs on the calling thread and a helper process
(`weightsync._shared`). Every step also encodes the same delta from ordinary copies
on two threads (`encode_threads_gbps`, the codec's path for snapshots not in shared
memory), right after the headline one and so on warmer caches, which flatters it;
`deltas_on_helper_processes` counts the deltas the helpers encoded (chunks of 1 MiB and
more stay on threads: none at full size).
Every step also finds the same delta with `DeviceDeltas` on `--device` (cpu by default;
cuda on a GPU), which must give identical frames (`device_frames_identical`), and reports
its GB/s and the bytes it moved to the host (`device_host_*`).
Targets: bit_exact, wire_over_entropy_lr1e-6 <= 1.43, encode/apply >= 1 GB/s
on 2 cores.

How: `python benchmarks/weightsync.py` (~3 min on 2 idle cores) or `--quick`
(a 7.6 M parameter model, 3+3 steps, < 60 s). torch and the codec use 2
threads. Prints a table, then one JSON line: GB/s are medians over steps
(wall clock; `*_core_gbps` per CPU-second, which other load on the machine
does not distort), ratios are totals over a phase.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

# torch's OpenMP workers otherwise spin for milliseconds after every parallel op (the
# training step, the wire snapshot), holding the core the codec's second thread needs:
# measured here, --quick encode 1.25-1.30 GB/s with spinning workers, 1.6 without.
# Set before torch is imported (libgomp reads it once). A trainer that publishes deltas
# on a small machine wants the same setting.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
import zstandard

ROOT = Path(__file__).resolve().parents[1]

from orchestrator.weightsync import (
    DeviceDeltas,
    WeightMessage,
    WeightReceiver,
    encode_delta,
    encode_keyframe,
    helper_stats,
    snapshot_bytes,
    start_helpers,
    wire_snapshot,
)

THREADS = 2


def build_model(quick: bool) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    dims = (
        dict(
            vocab_size=8192,
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=4,
            num_attention_heads=4,
        )
        if quick
        else dict(
            vocab_size=32000,
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=12,
            num_attention_heads=12,
        )
    )
    cfg = Qwen3Config(
        **dims, num_key_value_heads=4, head_dim=64, tie_word_embeddings=False, max_position_embeddings=512
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg).float()


def changed(prev: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> tuple[int, int, float]:
    """(k changed elements, n elements, sum of changed elements' bits)."""
    k = n = 0
    bits = 0.0
    for name, p in prev.items():
        w = p.element_size()
        view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[w]
        c = int((p.view(view) != new[name].view(view)).sum())
        k += c
        n += p.numel()
        bits += 8 * w * c
    return k, n, bits


def entropy_bound_bits(k: int, n: int, value_bits: float) -> float:
    log2_binom = (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)) / math.log(2)
    return log2_binom + value_bits


def plain_zstd(snapshot: dict[str, torch.Tensor]) -> int:
    c = zstandard.ZstdCompressor(level=1, threads=THREADS)
    return sum(len(c.compress(t.view(torch.uint8).numpy())) for t in snapshot.values() if t.numel())


def naive_xor_zstd(prev: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> int:
    """zstd-1 of the raw XOR, no sparse layout or byte planes (the common baseline)."""
    c = zstandard.ZstdCompressor(level=1, threads=THREADS)
    total = 0
    for name, p in prev.items():
        if p.numel():
            x = np.bitwise_xor(p.view(torch.uint8).numpy(), new[name].view(torch.uint8).numpy())
            total += len(c.compress(x))
    return total


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


class Wire:
    """One precision's publisher-side snapshot and a receiver fed through frames."""

    def __init__(self, precision: str, master: dict[str, torch.Tensor], device: str) -> None:
        self.precision = precision
        self.device = torch.device(device)
        # As a WeightPublisher keeps them: in shared memory, encoded by helper processes.
        self.snap = wire_snapshot(master, precision, shared=True)  # type: ignore[arg-type]
        self.raw = snapshot_bytes(self.snap)
        # Ordinary copies of the previous and the new snapshot, for the threads' encode.
        self.plain = {n: t.clone() for n, t in self.snap.items()}
        self.spare = {n: t.clone() for n, t in self.snap.items()}
        self.keyframe = encode_keyframe(self.snap, 0, precision, threads=THREADS)  # type: ignore[arg-type]
        self.receiver = WeightReceiver(precision, threads=THREADS)  # type: ignore[arg-type]
        self.receiver.apply(WeightMessage.from_frames(self.keyframe.to_frames()))
        self.bit_exact = same_bytes(self.receiver.snapshot, self.snap)  # type: ignore[arg-type]
        # The same deltas found where the weights are (`DeviceDeltas`): frames must match.
        self.on_device = DeviceDeltas({n: t.to(self.device) for n, t in self.snap.items()}, 0, threads=THREADS)
        self.device_identical = True

    def encode(
        self, prev: dict[str, torch.Tensor], new: dict[str, torch.Tensor], version: int
    ) -> tuple[WeightMessage, float, float]:
        """The delta, its wall time and its CPU time (this process's and the codec helpers')."""
        c0 = time.process_time() + helper_stats()["helper_cpu_s"]  # read outside the wall time
        t0 = time.perf_counter()
        msg = encode_delta(prev, new, version, version - 1, self.precision, threads=THREADS)  # type: ignore[arg-type]
        wall = time.perf_counter() - t0
        return msg, wall, time.process_time() + helper_stats()["helper_cpu_s"] - c0

    def step(self, version: int, master: dict[str, torch.Tensor], *, baselines: bool) -> dict:
        new = wire_snapshot(master, self.precision, shared=True)  # type: ignore[arg-type]
        # The headline encode runs first, right after the step, as it always has; then the
        # same delta on threads, from ordinary copies, on caches the first one warmed
        # (which flatters the threads).
        for n, t in new.items():  # into buffers kept between steps: no fresh pages per step
            self.spare[n].copy_(t)
        msg, t_enc, c_enc = self.encode(self.snap, new, version)
        t_thr = self.encode(self.plain, self.spare, version)[1]
        received = WeightMessage.from_frames(msg.to_frames())
        t0, c0 = time.perf_counter(), time.process_time()
        self.receiver.apply(received)
        t_apply, c_apply = time.perf_counter() - t0, time.process_time() - c0
        self.bit_exact &= same_bytes(self.receiver.snapshot, new)  # type: ignore[arg-type]
        new_dev = {n: t.to(self.device) for n, t in new.items()}  # the trainer's weights are there
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dmsg = self.on_device.delta(new_dev, version, self.precision)  # type: ignore[arg-type]
        t_dev = time.perf_counter() - t0
        self.device_identical &= dmsg.meta == msg.meta and [bytes(f) for f in dmsg.frames] == [
            bytes(f) for f in msg.frames
        ]
        k, n, bits = changed(self.snap, new)
        row = dict(
            dev_enc_gbps=self.raw / t_dev / 1e9,
            dev_host_bytes=self.on_device.last_host_bytes,
            dev_changed_chunk_bytes=self.on_device.last_changed_chunk_bytes,
            changed_frac=k / n,
            wire=msg.nbytes,
            raw=self.raw,
            bound_bits=entropy_bound_bits(k, n, bits),
            enc_gbps=self.raw / t_enc / 1e9,
            enc_threads_gbps=self.raw / t_thr / 1e9,
            apply_gbps=self.raw / t_apply / 1e9,
            # Per CPU-second: robust to other load on the machine; on an idle
            # machine wall-clock GB/s approaches THREADS x this.
            enc_core_gbps=self.raw / c_enc / 1e9,
            apply_core_gbps=self.raw / c_apply / 1e9,
        )
        if baselines:
            row["plain_zstd"] = plain_zstd(new)
            row["naive_xor_zstd"] = naive_xor_zstd(self.snap, new)
        self.snap = new
        self.plain, self.spare = self.spare, self.plain
        return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small model, 3+3 steps (< 60 s)")
    ap.add_argument("--device", default="cpu", help="where DeviceDeltas keeps the snapshots (cpu, cuda)")
    args = ap.parse_args()
    torch.set_num_threads(THREADS)
    start_helpers(THREADS - 1)  # as a WeightPublisher does when it is made
    steps_per_lr = 3 if args.quick else 10
    model = build_model(args.quick)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size

    def master() -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in model.named_parameters()}

    wires = {p: Wire(p, master(), args.device) for p in ("bf16", "fp8")}
    if not start_helpers(THREADS - 1, wait=30):
        sys.exit("the codec's helper processes did not start")
    helper_encodes = helper_stats()["helper_encodes"]
    keyframe_ratio = wires["bf16"].raw / wires["bf16"].keyframe.nbytes
    print(
        f"model: {params / 1e6:.1f} M params, bf16 snapshot {wires['bf16'].raw / 1e6:.1f} MB, "
        f"fp8 snapshot {wires['fp8'].raw / 1e6:.1f} MB, bf16 keyframe ratio {keyframe_ratio:.2f}x"
    )
    head = (
        f"{'step':>4} {'lr':>6} {'chg%':>6} {'wire MB':>8} {'raw/wire':>8} {'/bound':>6} {'enc GB/s':>8} "
        f"{'threads':>7} {'app GB/s':>8} {'zstd raw':>8} {'xor+zstd':>8} | {'fp8 chg%':>8} {'fp8 wire':>8} {'fp8 r/w':>7} "
        f"{'/bound':>6} {'enc':>5} {'app':>5}"
    )
    print(head)
    rows: list[tuple[float, dict, dict]] = []
    for step in range(1, 2 * steps_per_lr + 1):
        lr = 1e-6 if step <= steps_per_lr else 1e-5
        for g in opt.param_groups:
            g["lr"] = lr
        tokens = torch.randint(0, vocab, (1, 64), generator=gen)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        b = wires["bf16"].step(step, master(), baselines=True)
        f = wires["fp8"].step(step, master(), baselines=False)
        rows.append((lr, b, f))
        print(
            f"{step:>4} {lr:>6.0e} {100 * b['changed_frac']:>6.3f} {b['wire'] / 1e6:>8.3f} "
            f"{b['raw'] / b['wire']:>8.1f} {8 * b['wire'] / b['bound_bits']:>6.3f} {b['enc_gbps']:>8.2f} "
            f"{b['enc_threads_gbps']:>7.2f} {b['apply_gbps']:>8.2f} {b['raw'] / b['plain_zstd']:>8.2f} "
            f"{b['raw'] / b['naive_xor_zstd']:>8.1f} | "
            f"{100 * f['changed_frac']:>8.3f} {f['wire'] / 1e6:>8.3f} {f['raw'] / f['wire']:>7.1f} "
            f"{8 * f['wire'] / f['bound_bits']:>6.3f} {f['enc_gbps']:>5.2f} {f['apply_gbps']:>5.2f}",
            flush=True,
        )

    def phase(lr: float, fp8: bool = False) -> list[dict]:
        return [(f if fp8 else b) for (step_lr, b, f) in rows if step_lr == lr]

    def ratio(rs: list[dict]) -> float:
        return sum(r["raw"] for r in rs) / sum(r["wire"] for r in rs)

    def over_bound(rs: list[dict]) -> float:
        return 8 * sum(r["wire"] for r in rs) / sum(r["bound_bits"] for r in rs)

    def med(rs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rs)

    b6, b5 = phase(1e-6), phase(1e-5)
    f6, f5 = phase(1e-6, True), phase(1e-5, True)
    allb, allf = b6 + b5, f6 + f5
    result = {
        "benchmark": "weightsync",
        "quick": args.quick,
        "params": params,
        "steps_per_lr": steps_per_lr,
        "changed_frac_lr1e-6": statistics.mean(r["changed_frac"] for r in b6),
        "changed_frac_lr1e-5": statistics.mean(r["changed_frac"] for r in b5),
        "ratio_raw_lr1e-6": ratio(b6),
        "ratio_raw_lr1e-5": ratio(b5),
        "wire_over_entropy_lr1e-6": over_bound(b6),
        "wire_over_entropy_lr1e-5": over_bound(b5),
        "encode_gbps": med(allb, "enc_gbps"),
        "encode_threads_gbps": med(allb, "enc_threads_gbps"),
        "apply_gbps": med(allb, "apply_gbps"),
        "encode_gbps_lr1e-6": med(b6, "enc_gbps"),
        "apply_gbps_lr1e-6": med(b6, "apply_gbps"),
        "encode_core_gbps": med(allb, "enc_core_gbps"),
        "apply_core_gbps": med(allb, "apply_core_gbps"),
        "plain_zstd_ratio": med(allb, "raw") / med(allb, "plain_zstd"),
        "naive_xor_zstd_ratio_lr1e-6": sum(r["raw"] for r in b6) / sum(r["naive_xor_zstd"] for r in b6),
        "keyframe_ratio": keyframe_ratio,
        "bit_exact": wires["bf16"].bit_exact,
        "fp8_changed_frac_lr1e-6": statistics.mean(r["changed_frac"] for r in f6),
        "fp8_ratio_raw_lr1e-6": ratio(f6),
        "fp8_ratio_raw_lr1e-5": ratio(f5),
        "fp8_wire_over_entropy_lr1e-6": over_bound(f6),
        "fp8_encode_gbps": med(allf, "enc_gbps"),
        "fp8_encode_threads_gbps": med(allf, "enc_threads_gbps"),
        "fp8_apply_gbps": med(allf, "apply_gbps"),
        "fp8_bit_exact": wires["fp8"].bit_exact,
        "device": args.device,
        "device_frames_identical": wires["bf16"].device_identical and wires["fp8"].device_identical,
        "device_encode_gbps": med(allb, "dev_enc_gbps"),
        "device_host_bytes_per_step": med(allb, "dev_host_bytes"),
        "device_host_over_changed_chunks": sum(r["dev_host_bytes"] for r in allb)
        / max(1, sum(r["dev_changed_chunk_bytes"] for r in allb)),
        "device_host_over_snapshot": sum(r["dev_host_bytes"] for r in allb) / sum(r["raw"] for r in allb),
        "fp8_device_encode_gbps": med(allf, "dev_enc_gbps"),
        "fp8_device_host_over_changed_chunks": sum(r["dev_host_bytes"] for r in allf)
        / max(1, sum(r["dev_changed_chunk_bytes"] for r in allf)),
        "threads": THREADS,
        "deltas_on_helper_processes": f"{helper_stats()['helper_encodes'] - helper_encodes}/{len(allb) + len(allf)}",
    }
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}))


if __name__ == "__main__":
    main()
