"""Recipe loss + backward: full-vocabulary logits vs the union-of-supports projection.

What: one trainer micro-batch of the recipe (mask replay + MIS + score centering,
`RecipeConfig()` defaults) for 4,096 generated tokens, hidden size 1,024 and Qwen's
vocabulary of 151,936, with sampler supports of at most 128 ids per token. Two paths on
the same inputs:

* full:    logits = hidden @ Wᵀ ([T, V]) -> `replay_logprobs` -> `recipe_loss` -> backward
* support: `replay_logprobs_from_hidden` (hidden @ W[U]ᵀ by row blocks, U = union of the
           supports) -> `recipe_loss` -> backward

Both compute gradients for hidden and W (as a trainer would). The loss, every replayed
log-probability and both gradients are compared; `max_abs_diff` is the largest
difference among them.

Why: docs/architecture.md (The recipe, 2) claims the trainer never needs [T, V] logits for
the recipe; this measures the memory and time that saves.

How memory is measured: each path runs in a fresh subprocess that builds the inputs,
returns freed heap to the OS (malloc_trim), resets the kernel's peak-RSS counter
(`echo 5 > /proc/self/clear_refs`), runs one warm-up and the timed repetitions, and
reads the peak (VmHWM) from /proc/self/status. `*_peak_mb` is that peak minus the RSS
just before the run: every byte the path touched, torch allocator included, that was
not already resident (inputs, W itself and the torch runtime are excluded; the [V, H]
gradient of W is included on both paths). Both workers run with glibc's mmap threshold
pinned at 1 MiB (MALLOC_MMAP_THRESHOLD_), so freed large buffers leave RSS at once and
the peak is live memory rather than allocator caching. Linux only.

Supports: each token keeps k ~ U{1..128} ids drawn without replacement from a Zipf(1)
law over a random permutation of the vocabulary (frequent tokens dominate top-p sets),
so the union size (reported as `union_ids`) is realistic rather than the worst case;
the support path's peak memory does not depend on it (blocks), its time does.

Run:  .venv/bin/python benchmarks/recipe.py            (full size, a few minutes on 2 cores)
      .venv/bin/python benchmarks/recipe.py --quick    (T=1024, H=512, V=32768; < 60 s)
Last line: JSON with tokens, vocab, full_ms, support_ms, full_peak_mb, support_peak_mb,
max_abs_diff (plus hidden, union_ids, quick, threads, repeats).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MAX_SUPPORT = 128


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _build_inputs(tokens: int, hidden: int, vocab: int, seed: int):
    import torch

    from policies import SupportRecord

    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=gen)
    w = torch.randn(vocab, hidden, generator=gen) / hidden**0.5
    perm = torch.randperm(vocab, generator=gen)
    log_zipf = -torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))
    sizes = torch.randint(1, MAX_SUPPORT + 1, (tokens,), generator=gen)
    rows = []
    for a in range(0, tokens, 256):  # Gumbel-top-k = sampling without replacement
        b = min(a + 256, tokens)
        u = torch.rand(b - a, vocab, generator=gen).clamp_(min=1e-20)
        keys = log_zipf - torch.log(-torch.log(u))
        rows.append(perm[torch.topk(keys, MAX_SUPPORT, dim=-1).indices])
    cand = torch.cat(rows)
    keep = torch.arange(MAX_SUPPORT)[None, :] < sizes[:, None]
    ids = cand[keep].to(torch.int32)
    offsets = torch.zeros(tokens + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(sizes, 0).to(torch.int32)
    scores = torch.randn(tokens, MAX_SUPPORT, generator=gen) * 1.5 - 0.05 * torch.arange(MAX_SUPPORT)
    logq = torch.log_softmax(scores.masked_fill(~keep, float("-inf")), -1)[keep]
    pick = (torch.rand(tokens, generator=gen) * sizes).long()
    y = cand[torch.arange(tokens), pick]
    adv = torch.randn(tokens, generator=gen)
    return h, w, SupportRecord(ids, offsets, logq.float()), y, adv


def _worker(args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import save_file

    from policies import (
        RecipeConfig,
        recipe_loss,
        replay_logprobs,
        replay_logprobs_from_hidden,
    )

    torch.set_num_threads(args.threads)
    h0, w0, support, y, adv = _build_inputs(args.tokens, args.hidden, args.vocab, args.seed)
    cfg = RecipeConfig()

    def run():
        h = h0.clone().requires_grad_()
        w = w0.detach().requires_grad_()
        if args.worker == "full":
            rep = replay_logprobs(h @ w.T, support, y, cfg.temperature)
        else:
            rep = replay_logprobs_from_hidden(h, w, support, y, cfg.temperature)
        loss, _ = recipe_loss(cfg, support, y, adv, replay=rep, num_loss_tokens=args.tokens)
        loss.backward()
        return loss.detach(), rep.logp_support.detach(), h.grad, w.grad

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base_kb = _status_kb("VmRSS")
    out = run()  # warm-up (first-touch, thread pools)
    del out
    times = []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        out = run()
        times.append((time.perf_counter() - t0) * 1e3)
        if i < args.repeats - 1:
            del out
    peak_mb = (_status_kb("VmHWM") - base_kb) / 1024
    loss, logp_s, g_h, g_w = out
    union = torch.unique(support.ids.long())
    outside = torch.ones(args.vocab, dtype=torch.bool)
    outside[union] = False
    save_file(
        {
            "loss": loss.reshape(1),
            "logp_support": logp_s,
            "grad_hidden": g_h,
            "grad_w_union": g_w[union].contiguous(),
            "grad_w_outside_absmax": g_w[outside].abs().max().reshape(1) if bool(outside.any()) else torch.zeros(1),
            "input_check": torch.stack([h0.double().sum(), w0.double().sum(), support.logq.double().sum()]),
        },
        args.out,
    )
    print(json.dumps({"ms": min(times), "peak_mb": peak_mb, "union_ids": union.numel()}))


def _spawn(path: str, args: argparse.Namespace, out: str) -> dict:
    cmd = [
        sys.executable, __file__, "--worker", path, "--out", out,
        "--tokens", str(args.tokens), "--hidden", str(args.hidden), "--vocab", str(args.vocab),
        "--threads", str(args.threads), "--repeats", str(args.repeats), "--seed", str(args.seed),
    ]  # fmt: skip
    # glibc's dynamic mmap threshold lets freed tens-of-MB buffers linger on the heap, so
    # RSS would measure allocator caching; pinning it (same for both paths) makes big
    # buffers return to the OS when freed and the peak reflect live memory.
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MALLOC_MMAP_THRESHOLD_="1048576")
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"{path} worker failed ({res.returncode}):\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="T=1024, H=512, V=32768 (< 60 s)")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=None, help="timed runs after one warm-up (min is reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--worker", choices=["full", "support"], help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.tokens = args.tokens or (1024 if args.quick else 4096)
    args.hidden = args.hidden or (512 if args.quick else 1024)
    args.vocab = args.vocab or (32768 if args.quick else 151936)
    args.repeats = args.repeats or (3 if args.quick else 1)
    if args.worker:
        _worker(args)
        return

    import torch
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        results, tensors = {}, {}
        for path in ("full", "support"):
            out = str(Path(tmp) / f"{path}.safetensors")
            results[path] = _spawn(path, args, out)
            tensors[path] = load_file(out)
            print(f"{path:8s} {results[path]['ms']:10.1f} ms  peak {results[path]['peak_mb']:9.1f} MB",
                  flush=True)  # fmt: skip
    a, b = tensors["full"], tensors["support"]
    if not torch.equal(a["input_check"], b["input_check"]):
        raise RuntimeError("the two workers did not build identical inputs")
    diffs = {k: float((a[k].double() - b[k].double()).abs().max()) for k in
             ("loss", "logp_support", "grad_hidden", "grad_w_union")}  # fmt: skip
    diffs["grad_w_outside"] = float(max(a["grad_w_outside_absmax"].item(), b["grad_w_outside_absmax"].item()))
    print("max |diff| per output: " + json.dumps(diffs), flush=True)
    line = {
        "tokens": args.tokens,
        "hidden": args.hidden,
        "vocab": args.vocab,
        "max_support": MAX_SUPPORT,
        "union_ids": results["support"]["union_ids"],
        "full_ms": round(results["full"]["ms"], 1),
        "support_ms": round(results["support"]["ms"], 1),
        "full_peak_mb": round(results["full"]["peak_mb"], 1),
        "support_peak_mb": round(results["support"]["peak_mb"], 1),
        "max_abs_diff": max(diffs.values()),
        "quick": args.quick,
        "threads": args.threads,
        "repeats": args.repeats,
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
