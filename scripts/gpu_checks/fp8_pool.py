"""GPU check: an FP8 pool (e4m3 weights in 128x128 blocks, multiplied with torch._scaled_mm)
against a BF16 pool on the same random ~0.5B Qwen3.

Parts (one JSON line each):

- ``matmul``: one 256x4096 @ 4096x4096 FP8 linear against the bf16 matmul of the dequantised
  weight: relative error (< 0.03) and time of each.
- ``kl``: mean KL(fp32 policy || pool) over every position of 4 random 64-token prompts, for the
  BF16 and the FP8 engine. Passes when FP8's KL is finite and below 0.05 nats.
- ``decode``: decode tokens/s at batch 32, FP8 and BF16.

A GPU without FP8 tensor cores (capability < 8.9) reports ``skipped``: the engine dequantises
there, and there is no FP8 matmul to check. ``--device cpu --tiny`` is a dry run on torch's CPU
``_scaled_mm``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from _common import Report, parse_args, peak_mib, timed


def matmul_part(rep: Report, device: str, n: int) -> None:
    from actors.sampler._fp8mm import Fp8Weight, fp8_linear
    from orchestrator.weightsync import dequantize_fp8, quantize_fp8

    dev = torch.device(device)
    w = torch.randn(n, n, device=dev)
    x = torch.randn(256, n, device=dev, dtype=torch.bfloat16)
    w8, s = quantize_fp8(w)
    deq = dequantize_fp8(w8, s, torch.bfloat16)
    fw = Fp8Weight.from_wire(w8, s, dev)
    dense, fp8 = F.linear(x, deq).float(), fp8_linear(x, fw).float()
    err = float((fp8 - dense).norm() / dense.norm())
    t16 = timed(lambda: F.linear(x, deq), dev, reps=20)
    t8 = timed(lambda: fp8_linear(x, fw), dev, reps=20)
    rep.part("matmul", err < 0.03, rel_err=err, bf16_ms=t16 * 1e3, fp8_ms=t8 * 1e3)


def pool_parts(rep: Report, device: str, tiny: bool, quick: bool) -> None:
    from sampler_cuda import config

    from actors.models import build_model, model_weights
    from actors.sampler import DecoderEngine
    from orchestrator.weightsync import wire_snapshot

    cfg = config("qwen3", tiny)
    model = build_model(cfg, seed=0)
    weights = model_weights(model)
    prompts = torch.randint(0, cfg["vocab_size"], (4, 64), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = F.log_softmax(model.to(device)(prompts.to(device)).logits.float(), -1)
    del model
    engines = {}
    kls = {}
    for precision in ("bf16", "fp8"):
        eng = DecoderEngine(cfg, max_slots=32, max_len=128, device=device, compute_dtype=torch.bfloat16,
                            fp8_matmul=precision == "fp8")  # fmt: skip
        eng.load(wire_snapshot(weights, precision))
        got = F.log_softmax(eng.prefill(list(range(4)), prompts.tolist(), all_logits=True).float(), -1)
        kls[precision] = float((ref.exp() * (ref - got)).sum(-1).mean())
        engines[precision] = eng
    ok = all(k == k and k < float("inf") for k in kls.values()) and kls["fp8"] < 0.05
    rep.part("kl", ok, kl_bf16=kls["bf16"], kl_fp8=kls["fp8"])
    steps = 4 if tiny else 32
    rates = {}
    for precision, eng in engines.items():
        slots = list(range(32))
        eng.prefill(slots, [[1 + i % 50] * 16 for i in slots])

        def run(eng=eng, slots=slots) -> None:
            for _ in range(steps):
                eng.decode(slots, [5] * len(slots))
            for s in slots:
                eng.truncate(s, 16)

        rates[f"{precision}_tokens_per_s"] = 32 * steps / timed(run, device, reps=1 if quick else 3)
    rep.part("decode", all(r > 0 for r in rates.values()), batch=32, steps=steps, peak_mib=peak_mib(device), **rates)


if __name__ == "__main__":
    args = parse_args(__doc__)
    rep = Report("fp8_pool")
    if args.device.startswith("cuda"):
        from actors.sampler._fp8mm import fp8_matmul_available

        if not fp8_matmul_available(torch.device(args.device)):
            cap = torch.cuda.get_device_capability(torch.device(args.device))
            rep.skip("all", f"capability {cap} < (8, 9): no FP8 tensor cores, the engine dequantises")
            rep.exit()
    rep.guard("matmul", lambda: matmul_part(rep, args.device, 256 if args.tiny else 4096))
    rep.guard("kl", lambda: pool_parts(rep, args.device, args.tiny, args.quick))
    rep.exit()
