"""GPU check: FP8 matmuls (torch._scaled_mm on 128x128 block-scaled e4m3 weights) on an FP8
GPU -- error against the dequantised weight, and time against a bf16 matmul. A GPU without
FP8 tensor cores reports "skipped" (the engine dequantises there). Needs a CUDA GPU.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from actors.sampler._fp8mm import Fp8Weight, fp8_linear, fp8_matmul_available
from orchestrator.weightsync import dequantize_fp8, quantize_fp8


def timed(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


if __name__ == "__main__":
    dev = torch.device("cuda")
    if not fp8_matmul_available(dev):
        print(
            json.dumps(
                {
                    "check": "fp8_matmul",
                    "status": "skipped",
                    "reason": f"capability {torch.cuda.get_device_capability(dev)} < (8, 9)",
                }
            )
        )
        sys.exit(0)
    w = torch.randn(4096, 4096, device=dev)
    x = torch.randn(256, 4096, device=dev, dtype=torch.bfloat16)
    w8, s = quantize_fp8(w)
    deq = dequantize_fp8(w8, s, torch.bfloat16)
    fw = Fp8Weight.from_wire(w8, s, dev)
    dense, fp8 = torch.nn.functional.linear(x, deq).float(), fp8_linear(x, fw).float()
    rel = float((fp8 - dense).norm() / dense.norm())
    t_bf16 = timed(lambda: torch.nn.functional.linear(x, deq))
    t_fp8 = timed(lambda: fp8_linear(x, fw))
    ok = rel < 0.03
    print(
        json.dumps(
            {
                "check": "fp8_matmul",
                "status": "passed" if ok else "failed",
                "rel_err": rel,
                "bf16_ms": t_bf16 * 1e3,
                "fp8_ms": t_fp8 * 1e3,
            }
        )
    )
    sys.exit(0 if ok else 1)
