"""FP8 matmuls (torch._scaled_mm on e4m3 weights with 128x128 block scales), run here on CPU
against the dequantised path. On a GPU this path has never run here (no GPU); see
scripts/gpu_check.sh."""

from __future__ import annotations

import torch

from actors.models import build_model, default_model_config, model_weights
from actors.sampler import Qwen3Engine
from actors.sampler._fp8mm import Fp8Weight, fp8_linear, fp8_matmul_available
from orchestrator.weightsync import dequantize_fp8, quantize_fp8, wire_snapshot

torch.set_num_threads(1)


def test_block_scaled_fp8_linear_matches_the_dequantised_weight() -> None:
    g = torch.Generator().manual_seed(0)
    # ragged sizes: the last row and column blocks are partial
    w = torch.randn(200, 300, generator=g) * torch.linspace(0.01, 3, 300)
    x = torch.randn(5, 7, 300, generator=g)
    w8, s = quantize_fp8(w)
    dense = torch.nn.functional.linear(x, dequantize_fp8(w8, s, torch.float32))
    fp8 = fp8_linear(x, Fp8Weight.from_wire(w8, s, torch.device("cpu")))
    assert fp8.shape == dense.shape == (5, 7, 200)
    # only the activations' rounding to e4m3 (3 mantissa bits) separates them
    rel = (fp8 - dense).norm() / dense.norm()
    assert rel < 0.03, rel
    fused = Fp8Weight.cat([Fp8Weight.from_wire(w8, s, torch.device("cpu"))] * 2)
    assert fused.shape == (400, 300)
    torch.testing.assert_close(fp8_linear(x, fused), torch.cat([fp8, fp8], dim=-1))


def test_engine_with_fp8_matmuls_keeps_fp8_weights_and_close_logits() -> None:
    cfg = default_model_config()
    snap = wire_snapshot(model_weights(build_model(cfg, seed=0)), "fp8")
    deq = Qwen3Engine(cfg, max_slots=1, fp8_matmul=False)
    real = Qwen3Engine(cfg, max_slots=1, fp8_matmul=True)
    for e in (deq, real):
        e.load(snap)
    assert isinstance(real._layers[0]["qkv"], Fp8Weight) and isinstance(real._layers[0]["down"], Fp8Weight)
    assert not isinstance(deq._layers[0]["qkv"], Fp8Weight)
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6]]
    a, b = deq.prefill([0], prompt), real.prefill([0], prompt)
    assert (a - b).abs().max() < 0.05 * a.abs().max(), (a - b).abs().max()
    assert not fp8_matmul_available(torch.device("cpu"))  # auto: only on FP8 GPUs
