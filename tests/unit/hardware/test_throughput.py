"""Roofline arithmetic against hand-computed numbers, and the online correction."""

import math

import pytest
from pydantic import ValidationError

from hardware import (
    CATALOG,
    ModelSpec,
    PoolConfig,
    RooflineAssumptions,
    ThroughputModel,
    bytes_per_param,
    decode_step_seconds,
    fit_batch_per_gpu,
    replica_gpus,
    roofline_tokens_per_s,
)

IDEAL = RooflineAssumptions(bandwidth_efficiency=1.0, compute_efficiency=1.0, gpu_step_overhead_s=0.0)


def test_dense_decode_is_bandwidth_bound_by_hand():
    # 4e9 params × 2 B = 8e9 B per step at 8000 GB/s -> 1 ms; 10 tokens × 8e9 FLOP = 8e10 FLOP
    # at 2250 TFLOPS -> 35.6 µs, so memory wins: 10 tokens per 1 ms = 10,000 tokens/s.
    dense = ModelSpec(total_params=4e9, active_params=4e9)
    b200 = CATALOG["B200"]
    assert decode_step_seconds(b200, "bf16", dense, 10, IDEAL) == pytest.approx(1e-3)
    assert roofline_tokens_per_s(b200, "bf16", dense, 10, IDEAL) == pytest.approx(10_000)
    # Defaults: 70% of bandwidth and 1 ms overhead -> 8e9 / 5.6e12 + 1e-3 s.
    step = 8e9 / 5.6e12 + 1e-3
    assert roofline_tokens_per_s(b200, "bf16", dense, 10) == pytest.approx(10 / step)
    # FP8 halves the weight bytes (plus one FP32 scale per 128×128 block).
    assert bytes_per_param("fp8") == pytest.approx(1 + 4 / 16384)
    assert decode_step_seconds(b200, "fp8", dense, 10, IDEAL) == pytest.approx(4e9 * (1 + 4 / 16384) / 8e12)


def test_compute_bound_at_large_batch():
    dense = ModelSpec(total_params=1e9, active_params=1e9)
    a100 = CATALOG["A100-80GB"]
    # batch 4096: FLOPs 4096 × 2e9 = 8.192e12 at 312 TFLOPS = 26.3 ms > 2e9 B / 2039 GB/s = 0.98 ms
    assert decode_step_seconds(a100, "bf16", dense, 4096, IDEAL) == pytest.approx(4096 * 2e9 / 312e12)


def test_moe_reads_active_params_at_batch_one_and_all_experts_at_large_batch():
    moe = ModelSpec(total_params=35e9, active_params=3e9, shared_params=1e9)
    assert moe.params_read(1) == pytest.approx(3e9)
    f = 2e9 / 34e9
    assert moe.params_read(8) == pytest.approx(1e9 + 34e9 * (1 - (1 - f) ** 8))
    assert moe.params_read(10_000) == pytest.approx(35e9)
    dense = ModelSpec(total_params=7e9, active_params=7e9)
    assert dense.params_read(1) == dense.params_read(100) == 7e9


def test_kv_cache_adds_bytes_and_decides_replica_size():
    m = ModelSpec(total_params=35e9, active_params=35e9, kv_bytes_per_token=1e5, context_tokens=1e4)  # 1 GB/seq
    h100 = CATALOG["H100-SXM"]  # 80 GB × 0.9 = 72 GB usable
    a = RooflineAssumptions()
    assert replica_gpus(h100, "bf16", m, 1, a) == 1  # 70 + 1 <= 72
    assert replica_gpus(h100, "bf16", m, 10, a) == 2  # 62 GB room per GPU: 2 × 62 >= 70
    assert replica_gpus(h100, "bf16", m, 72, a) is None  # KV alone fills the memory
    assert roofline_tokens_per_s(h100, "bf16", m, 72, a) == 0.0
    # Per GPU of a 2-GPU replica at batch 10: (70 GB + 20 GB) / 2 read per step at 3350 GB/s.
    step = (70e9 + 20e9) / 2 / 3350e9
    assert decode_step_seconds(h100, "bf16", m, 10, IDEAL) == pytest.approx(step)
    # A 70 GB model takes half of a 2-GPU replica's 144 GB; the other 74 GB hold 37 seqs per GPU.
    assert fit_batch_per_gpu(h100, "bf16", m) == 37
    big = ModelSpec(total_params=100e9, active_params=100e9)
    assert fit_batch_per_gpu(CATALOG["cpu"], "bf16", big) == 0  # 200 GB needs more than 8 × 23 GB


def test_model_spec_refuses_inconsistent_counts():
    with pytest.raises(ValidationError, match="active_params"):
        ModelSpec(total_params=1e9, active_params=2e9)
    with pytest.raises(ValidationError, match="shared_params"):
        ModelSpec(total_params=3e9, active_params=2e9, shared_params=2.5e9)
    with pytest.raises(ValidationError):
        ModelSpec(total_params=0, active_params=0)


def test_online_factor_is_a_log_space_ewma_and_drives_the_estimate():
    pools = [PoolConfig(name="a", gpu="B200", count=2, max_concurrent_rollouts=20)]
    dense = ModelSpec(total_params=4e9, active_params=4e9)
    tp = ThroughputModel(pools, dense, IDEAL, alpha=0.3)
    assert tp.batch_per_gpu("a") == 10
    assert tp.roofline("a") == pytest.approx(10_000)
    assert tp.factor("a") == 1.0
    # 5,000 tokens/s per GPU measured at the full batch: ratio 0.5.
    f1 = tp.observe("a", tokens=50_000, gpu_seconds=10.0)
    assert f1 == pytest.approx(math.exp(0.3 * math.log(0.5)))
    for _ in range(40):
        tp.observe("a", tokens=50_000, gpu_seconds=10.0)
    assert tp.factor("a") == pytest.approx(0.5, rel=1e-4)
    assert tp.estimate("a") == pytest.approx(5_000, rel=1e-4)
    assert tp.usd_per_token("a") == pytest.approx(CATALOG["B200"].price_per_hour / 3600 / 5_000, rel=1e-4)
    # A measurement at a smaller batch is compared with the roofline at that batch.
    tp2 = ThroughputModel(pools, dense, IDEAL, alpha=1.0)
    tp2.observe("a", tokens=2_000, gpu_seconds=1.0, batch_per_gpu=2)  # roofline at b=2: 2,000
    assert tp2.factor("a") == pytest.approx(1.0)
    assert tp2.observe("a", tokens=0, gpu_seconds=1.0) == pytest.approx(1.0)  # ignored
    assert tp2.observations("a") == 1
    with pytest.raises(KeyError, match="no pool 'b'"):
        tp.estimate("b")


def test_emulated_pools_are_corrected_against_the_cpu_roofline():
    # Two pools emulated on the CPU run at the same real speed; each keeps its own GPU's
    # modelled speed, so the B200 stays faster than the A100 after measurements.
    pools = [
        PoolConfig(name="b", gpu="B200", device="cpu", max_concurrent_rollouts=8),
        PoolConfig(name="a", gpu="A100-80GB", device="cpu", max_concurrent_rollouts=8),
    ]
    dense = ModelSpec(total_params=1e6, active_params=1e6)
    tp = ThroughputModel(pools, dense, alpha=1.0)
    cpu = roofline_tokens_per_s(CATALOG["cpu"], "bf16", dense, 8)
    for name in ("a", "b"):
        assert tp.observe(name, tokens=cpu * 0.5, gpu_seconds=1.0) == pytest.approx(0.5)
    assert tp.estimate("b") / tp.estimate("a") == pytest.approx(tp.roofline("b") / tp.roofline("a"))
    assert tp.estimate("b") > tp.estimate("a")


def test_a_pool_keeps_the_replica_size_of_its_full_batch():
    # 35e9 dense BF16 (70 GB) with 1 GB of KV cache per sequence on H100s (72 GB usable):
    # 10 sequences per GPU need 2-GPU replicas, one sequence alone would fit on one GPU.
    m = ModelSpec(total_params=35e9, active_params=35e9, kv_bytes_per_token=1e5, context_tokens=1e4)
    pools = [
        PoolConfig(name="h", gpu="H100-SXM", count=4, max_concurrent_rollouts=40),
        PoolConfig(name="lone", gpu="H100-SXM", count=1, max_concurrent_rollouts=10),
    ]
    tp = ThroughputModel(pools, m, IDEAL)
    assert (tp.replica_gpus("h"), tp.slots_per_replica("h")) == (2, 20)
    # At one sequence per GPU the pool still runs 2-GPU replicas: 2 sequences per step read
    # (70 + 2) GB, half on each GPU.
    assert tp.roofline("h", 1) == pytest.approx(1 / ((70e9 + 2e9) / 2 / 3350e9))
    assert roofline_tokens_per_s(CATALOG["H100-SXM"], "bf16", m, 1, IDEAL) == pytest.approx(1 / (71e9 / 3350e9))
    # One sequence on a 2-GPU replica: each GPU makes half a token per step.
    assert tp.roofline("h", 0.5) == pytest.approx(0.5 / ((70e9 + 1e9) / 2 / 3350e9))
    # One H100 cannot hold a replica: no speed, infinite cost.
    assert (tp.replica_gpus("lone"), tp.slots_per_replica("lone"), tp.roofline("lone")) == (0, 0, 0.0)
    assert math.isinf(tp.usd_per_token("lone"))
    assert tp.usd_per_token("h", 1) == pytest.approx(pools[0].price / 3600 / tp.roofline("h", 1))


def test_throughput_state_round_trips_through_json():
    import json

    pools = [
        PoolConfig(name="a", gpu="B200", count=2, max_concurrent_rollouts=20),
        PoolConfig(name="b", gpu="A100-80GB", count=1, max_concurrent_rollouts=4),
    ]
    dense = ModelSpec(total_params=4e9, active_params=4e9)
    tp = ThroughputModel(pools, dense, IDEAL)
    tp.observe("a", tokens=50_000, gpu_seconds=10.0)
    tp.observe("a", tokens=30_000, gpu_seconds=10.0, batch_per_gpu=4)
    again = ThroughputModel(pools, dense, IDEAL)
    again.load_state(json.loads(json.dumps(tp.state())))
    for name in ("a", "b"):
        assert again.factor(name) == tp.factor(name) and again.observations(name) == tp.observations(name)
        assert again.usd_per_token(name) == tp.usd_per_token(name)
    with pytest.raises(ValueError, match="unknown pool.*'c'"):
        again.load_state({"pools": {"c": {"log_factor": 0.0, "observations": 1}}})
    with pytest.raises(ValueError, match="observations"):
        again.load_state({"pools": {"a": {"log_factor": 0.0, "observations": -1}}})
    with pytest.raises(ValueError, match="finite"):
        again.load_state({"pools": {"a": {"log_factor": float("inf"), "observations": 1}}})
    assert again.factor("a") == tp.factor("a")  # refused states change nothing
