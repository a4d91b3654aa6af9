"""Benchmark: what loading one weight delta into the torch engine costs, by names vs by elements.

What: wan.py's ~125 M-parameter Qwen3-style model (random init from its config) takes real
AdamW steps at lr 1e-6 (language-model loss on random tokens); each step is published by a
real `WeightPublisher` and applied by a `WeightReceiver`. Two `DecoderEngine`s (CPU, float32
compute) hold the same weights; per delta one is loaded the old way (`load(snapshot,
names)`: every fused block with a changed tensor converted and re-concatenated) and the
other by the receiver's `last_changed` (`load(snapshot, elements)`: only the changed
elements written in place). Which goes first alternates per delta. Reports the seconds of
each (p50, max), the share of elements the deltas changed, and whether the two engines'
compute weights are bit-identical at the end.

Why: a remote sampler's update time is the link plus the receiver's apply plus this load;
before element loads the load rewrote all 125 M parameters for a ~2 % change.

How: `PYTHONPATH=$PWD python benchmarks/sampler_apply.py` (6 deltas) or `--quick` (3 deltas,
about a minute on a loaded 2-core machine). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from wan import LARGE  # wan.py sits beside this script


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 deltas instead of 6")
    args = ap.parse_args()
    import torch

    from actors.models import build_model
    from actors.sampler import DecoderEngine
    from orchestrator.weightsync import WeightPublisher, WeightReceiver

    torch.set_num_threads(2)
    deltas = 3 if args.quick else 6
    model = build_model(LARGE, seed=0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    pub = WeightPublisher(keyframe_interval=10_000, threads=2)
    rx = WeightReceiver("bf16")

    def master() -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in model.named_parameters()}

    (kf,) = pub.publish(0, master())
    rx.apply(kf)
    assert rx.snapshot is not None
    by_names = DecoderEngine(LARGE, max_slots=1, max_len=64)
    by_elements = DecoderEngine(LARGE, max_slots=1, max_len=64)
    by_names.load(rx.snapshot)
    by_elements.load(rx.snapshot)
    gen = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {"names": [], "elements": []}
    shares = []
    total = sum(t.numel() for t in rx.snapshot.values())
    for version in range(1, deltas + 1):
        tokens = torch.randint(0, LARGE["vocab_size"], (1, 64), generator=gen)
        model(input_ids=tokens, labels=tokens).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        (delta,) = pub.publish(version, master())
        rx.apply(delta)
        changed = rx.last_changed
        if changed is None:
            raise RuntimeError(f"delta v{version}: the receiver reports no changed elements")
        shares.append(sum(rx.snapshot[n].numel() if x is None else len(x) for n, x in changed.items()) / total)
        order = [("names", by_names, list(changed)), ("elements", by_elements, changed)]
        for key, engine, arg in order if version % 2 else order[::-1]:
            t0 = time.perf_counter()
            engine.load(rx.snapshot, arg)
            times[key].append(time.perf_counter() - t0)
        print(
            f"sampler_apply: v{version} names {times['names'][-1]:.3f} s, elements {times['elements'][-1]:.3f} s",
            file=sys.stderr,
            flush=True,
        )

    def weights(e: DecoderEngine) -> list[torch.Tensor]:
        return list(e._top.values()) + [t for layer in e._layers for t in layer.values()]

    same = all(torch.equal(a, b) for a, b in zip(weights(by_names), weights(by_elements), strict=True))
    out = {
        "benchmark": "sampler_apply",
        "quick": args.quick,
        "params": total,
        "deltas": deltas,
        "changed_share_mean": statistics.mean(shares),
        "load_names_s_p50": statistics.median(times["names"]),
        "load_names_s_max": max(times["names"]),
        "load_elements_s_p50": statistics.median(times["elements"]),
        "load_elements_s_max": max(times["elements"]),
        "bit_identical": same,
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
