"""Coarse weight formats a pool can emulate (`emulate_quant`): rounding bounds, the engine
computing with the rounded weights, and the pool setting."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from actors.models import build_model, default_model_config, model_weights
from actors.sampler import Qwen3Engine
from actors.sampler._emulate import emulate_quant
from hardware.pools import PoolConfig
from orchestrator.weightsync import wire_snapshot

torch.set_num_threads(1)


def _weight(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # ragged width (the last int4 group is partial) and column scales spanning 300x
    return torch.randn(40, 75, generator=g) * torch.linspace(0.01, 3, 75)


@pytest.mark.parametrize(("fmt", "top"), [("int4_group", 8), ("int3_group", 4), ("int2_group", 2)])
def test_int_group_has_its_levels_per_group_and_the_half_step_bound(fmt: str, top: int) -> None:
    w = _weight()
    q = emulate_quant(w, fmt)
    assert q.shape == w.shape and q.dtype == w.dtype
    for lo in range(0, 75, 32):
        g, qg = w[:, lo : lo + 32], q[:, lo : lo + 32]
        step = g.abs().amax(dim=1, keepdim=True) / (top - 1)
        levels = torch.round(qg / step)
        torch.testing.assert_close(levels * step, qg)  # every value is an integer multiple of its step
        assert levels.min() >= -top and levels.max() <= top - 1
        assert ((qg - g).abs() <= step / 2 + 1e-6).all()
        assert levels.max() == top - 1  # each row's largest magnitude is a level
    assert (q != w).float().mean() > 0.9  # it really rounds


def test_fewer_bits_round_further() -> None:
    w = _weight(2)
    err = {fmt: float((emulate_quant(w, fmt) - w).pow(2).mean()) for fmt in ("int4_group", "int3_group", "int2_group")}
    assert err["int4_group"] < err["int3_group"] < err["int2_group"]


def test_e5m2_tensor_keeps_two_mantissa_bits_with_one_scale() -> None:
    w = _weight(1)
    q = emulate_quant(w, "e5m2_tensor")
    s = w.abs().max() / 57344.0
    v = w / s
    normal = v.abs() >= 2.0**-14
    rel = ((q - w).abs() / w.abs())[normal]
    assert rel.max() <= 2.0**-3 + 1e-6  # half an ulp of a 2-bit mantissa
    assert rel.max() > 2.0**-5  # coarser than e4m3's 2^-4 bound would allow in places
    torch.testing.assert_close(emulate_quant(q, "e5m2_tensor"), q)  # idempotent: already representable


def test_zero_weight_and_bad_input() -> None:
    z = torch.zeros(4, 40)
    for fmt in ("int4_group", "int3_group", "int2_group", "e5m2_tensor"):
        assert (emulate_quant(z, fmt) == 0).all()
        with pytest.raises(ValueError, match="2-D"):
            emulate_quant(torch.ones(3), fmt)
        with pytest.raises(ValueError, match="non-finite"):
            emulate_quant(torch.tensor([[1.0, float("nan")]]), fmt)
    with pytest.raises(ValueError, match="must be one of"):
        emulate_quant(z, "int3")


def test_engine_computes_with_the_rounded_linear_weights() -> None:
    cfg = default_model_config()
    snap = wire_snapshot(model_weights(build_model(cfg, seed=0)), "bf16")
    coarse = Qwen3Engine(cfg, max_slots=1, emulate="int4_group")
    coarse.load(snap)
    # the reference: the same snapshot with every linear weight rounded by hand, loaded plainly
    linear = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    by_hand = {n: emulate_quant(t.float(), "int4_group") if any(k in n for k in linear) else t for n, t in snap.items()}
    ref = Qwen3Engine(cfg, max_slots=1)
    ref.load(by_hand)
    plain = Qwen3Engine(cfg, max_slots=1)
    plain.load(snap)
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6]]
    a, b, c = coarse.prefill([0], prompt), ref.prefill([0], prompt), plain.prefill([0], prompt)
    torch.testing.assert_close(a, b)
    assert (a - c).abs().max() > 1e-4  # and it differs from the weights as delivered
    assert not coarse.fp8_matmul
    with pytest.raises(ValueError, match="emulate_quant must be one of"):
        Qwen3Engine(cfg, max_slots=1, emulate="int2")


def test_pool_setting() -> None:
    pool = PoolConfig(name="coarse", gpu="cpu", emulate_quant="int4_group")
    assert pool.emulate_quant == "int4_group"
    assert PoolConfig(name="p", gpu="cpu").emulate_quant is None
    with pytest.raises(ValidationError, match="emulate_quant"):
        PoolConfig(name="p", gpu="cpu", emulate_quant="int2")
    with pytest.raises(ValidationError, match="torch-backend"):
        PoolConfig(
            name="s", gpu="H100-SXM", device="cuda", backend="sglang", urls=["http://h:1"], emulate_quant="int4_group"
        )
