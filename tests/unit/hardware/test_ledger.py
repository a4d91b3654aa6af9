"""Cost arithmetic with hand-computed numbers; report rendering; `describe`."""

import json

import pytest
from pydantic import ValidationError

from hardware import (
    CostLedger,
    HardwareConfig,
    ModelSpec,
    PoolConfig,
    RooflineAssumptions,
    Scheduler,
    ThroughputModel,
    describe,
)

IDEAL = RooflineAssumptions(bandwidth_efficiency=1.0, compute_efficiency=1.0, gpu_step_overhead_s=0.0)
# 4e9 dense params in BF16 on a B200 at batch 10: 8e9 B / 8000 GB/s = 1 ms per step -> 10,000 tokens/s/GPU.
DENSE4 = ModelSpec(total_params=4e9, active_params=4e9)


def pools(dear_device: str = "cuda") -> list[PoolConfig]:
    return [
        PoolConfig(name="cheap", gpu="A100-80GB", count=2, price_per_gpu_hour=2.0, device="cuda"),
        PoolConfig(
            name="dear", gpu="B200", count=1, price_per_gpu_hour=6.0, device=dear_device, max_concurrent_rollouts=10
        ),
    ]


def filled(ledger: CostLedger) -> CostLedger:
    ledger.record_busy("cheap", 1800.0)  # both GPUs for half an hour: 1 GPU-hour, $2.00
    for _ in range(3):
        ledger.record_rollout("cheap", 12_000_000)
    ledger.record_busy("dear", 900.0, gpus=1)  # 0.25 GPU-hour, $1.50
    ledger.record_rollout("dear", 9_000_000, staleness=3)
    for s in (0, 1, 2):
        ledger.record_staleness("cheap", s)
    ledger.record_mismatch("cheap", kl=0.1, masked_fraction=0.2, tokens=100)
    ledger.record_mismatch("cheap", kl=0.3, masked_fraction=0.4, tokens=300)
    ledger.record_mismatch("dear", kl=0.5, masked_fraction=0.0, tokens=100)
    return ledger


def test_pool_costs_and_totals_by_hand():
    rep = filled(CostLedger(pools())).report()
    cheap, dear = rep.pools
    assert (cheap.gpu_hours, cheap.cost_usd, cheap.rollouts, cheap.tokens) == (1.0, 2.0, 3, 36_000_000)
    assert cheap.usd_per_mtok == pytest.approx(2.0 / 36)
    assert cheap.mean_staleness == pytest.approx(1.0)
    assert cheap.mismatch_kl == pytest.approx(0.25)  # (0.1·100 + 0.3·300) / 400
    assert cheap.masked_fraction == pytest.approx(0.35)  # (0.2·100 + 0.4·300) / 400
    assert (dear.gpu_hours, dear.cost_usd, dear.tokens, dear.billing) == (0.25, 1.5, 9_000_000, "measured")
    assert dear.mean_staleness == 3.0
    t = rep.totals
    assert t.cost_usd == pytest.approx(cheap.cost_usd + dear.cost_usd) == pytest.approx(3.5)
    assert t.gpu_hours == pytest.approx(1.25) and t.tokens == 45_000_000 and t.rollouts == 4 and t.gpus == 3
    assert t.usd_per_mtok == pytest.approx(3.5 / 45)
    assert t.mean_staleness == pytest.approx(1.5)  # (0 + 1 + 2 + 3) / 4
    assert t.mismatch_kl == pytest.approx(0.3)  # (10 + 90 + 50) / 500
    assert t.masked_fraction == pytest.approx(0.28)  # (20 + 120 + 0) / 500


def test_counterfactual_on_the_dearest_gpu_by_hand():
    # Measured basis (no model): dear made 9e6 tokens in 900 GPU-s = 10,000 tokens/s per GPU.
    # 45e6 tokens / 10,000 = 4,500 GPU-s = 1.25 GPU-hours × $6 = $7.50; saving 1 − 3.5/7.5.
    rep = filled(CostLedger(pools())).report()
    c = rep.counterfactual
    assert (c.pool, c.gpu, c.basis) == ("dear", "B200", "measured")
    assert c.tokens_per_s_per_gpu == pytest.approx(10_000)
    assert c.gpu_hours == pytest.approx(1.25) and c.cost_usd == pytest.approx(7.5)
    assert c.saving_pct == pytest.approx(100 * (1 - 3.5 / 7.5))
    # Estimate basis: the roofline gives the same 10,000 tokens/s per GPU, hence the same $7.50.
    p = pools()
    rep2 = filled(CostLedger(p, throughput=ThroughputModel(p, DENSE4, IDEAL))).report()
    assert rep2.counterfactual.basis == "estimate"
    assert rep2.counterfactual.cost_usd == pytest.approx(7.5)
    assert rep2.counterfactual.saving_pct == pytest.approx(53.333, abs=1e-3)


def test_emulated_pools_are_billed_modelled_gpu_seconds():
    p = pools(dear_device="cpu")  # a B200 pool emulated on this machine
    ledger = CostLedger(p, throughput=ThroughputModel(p, DENSE4, IDEAL))
    ledger.record_busy("dear", 50_000.0)  # the CPU's seconds: not what a B200 would have cost
    ledger.record_rollout("dear", 9_000_000)
    row = ledger.report().pools[1]
    assert row.billing == "modelled"
    assert row.gpu_hours == pytest.approx(9e6 / 10_000 / 3600)  # 0.25
    assert row.cost_usd == pytest.approx(1.5)
    # Without a throughput model the measured seconds are all there is.
    plain = CostLedger(p)
    plain.record_busy("dear", 3600.0)
    plain.record_rollout("dear", 10)
    assert plain.report().pools[1].billing == "measured" and plain.report().pools[1].cost_usd == pytest.approx(6.0)


def test_empty_ledger_and_bad_records():
    rep = CostLedger(pools()).report()
    assert rep.totals.cost_usd == 0 and rep.totals.usd_per_mtok is None and rep.counterfactual is None
    assert rep.pools[0].mismatch_kl is None and rep.pools[0].mean_staleness is None
    ledger = CostLedger(pools())
    with pytest.raises(KeyError, match="no pool 'x'"):
        ledger.record_rollout("x", 1)
    with pytest.raises(ValueError, match="seconds"):
        ledger.record_busy("cheap", -1.0)
    with pytest.raises(ValueError, match="masked_fraction"):
        ledger.record_mismatch("cheap", 0.1, 1.5, 10)
    with pytest.raises(ValueError, match="staleness"):
        ledger.record_staleness("cheap", -1)


def test_json_and_markdown(tmp_path):
    rep = filled(CostLedger(pools())).report()
    data = json.loads(rep.to_json())
    assert data["totals"]["cost_usd"] == pytest.approx(3.5)
    assert [p["pool"] for p in data["pools"]] == ["cheap", "dear"]
    assert data["counterfactual"]["saving_pct"] == pytest.approx(53.333, abs=1e-3)
    md = rep.to_markdown()
    assert "| cheap | A100-80GB | bf16 | 2 | 1.0000 | 2.0000 | 3 | 36000000 | 0.0556 | 1.00 | 0.25 | 0.35 |" in md
    assert "| **total** | | | 3 | 1.2500 | 3.5000 | 4 | 45000000 | 0.0778 |" in md
    assert "Saving: 53.3%" in md and "B200" in md
    j, m = rep.write(tmp_path / "run")
    assert j.name == "cost_report.json" and json.loads(j.read_text()) == data
    assert m.read_text() == md


def test_describe_catalog_and_config(tmp_path):
    out = describe(None)
    assert "| H100-SXM | 80 | 3,350 | 989 | 1,979 | 3.9492 |" in out and "S2:" in out
    cfg = tmp_path / "pools.toml"
    cfg.write_text(
        """
[model]
total_params = 4e9
active_params = 4e9
hidden_size = 64  # the sampler's own keys are ignored here

[[pools]]
name = "b"
gpu = "B200"
max_concurrent_rollouts = 10
device = "cuda"

[[pools]]
name = "tiny"
gpu = "cpu"
"""
    )
    out = describe(str(cfg))
    line = next(ln for ln in out.splitlines() if ln.startswith("| b |"))
    # Default assumptions: 10 / (8e9 / 5.6e12 + 1e-3) tokens/s.
    tps = 10 / (8e9 / 5.6e12 + 1e-3)
    assert f"{tps:,.1f}" in line and f"{6.2496 / 3600 / tps * 1e6:.4f}" in line
    # One CPU core at batch 64 is compute-bound: 64 × 8e9 FLOP at 0.73 TFLOPS × 50%, + 4 ms.
    cpu_tps = 64 / (64 * 8e9 / (0.73e12 * 0.5) + 0.004)
    assert f"| {cpu_tps:,.1f} |" in next(ln for ln in out.splitlines() if ln.startswith("| tiny |"))
    cfg.write_text(cfg.read_text().replace("4e9", "400e9"))
    assert "does not fit" in next(ln for ln in describe(str(cfg)).splitlines() if ln.startswith("| tiny |"))
    cfg.write_text('[[pools]]\nname = "a"\ngpu = "B200"\n')
    assert "No estimates" in describe(str(cfg))
    cfg.write_text('[[pools]]\nname = "a"\ngpu = "A100"\nprecision = "fp8"\n')
    with pytest.raises(ValueError, match="precision") as e:
        describe(str(cfg))
    assert str(cfg) in str(e.value) and isinstance(e.value.__cause__, ValidationError)


def test_the_controller_path_from_toml_to_report(tmp_path):
    """Config -> throughput model -> scheduler -> ledger -> report, as the controller wires them."""
    hw = HardwareConfig.from_toml_text(
        """
[[pools]]
name = "h200-fp8"
gpu = "H200"
precision = "fp8"
device = "cpu"
max_concurrent_rollouts = 2

[[pools]]
name = "b200"
gpu = "B200"
device = "cpu"
max_concurrent_rollouts = 2
"""
    )
    tp = ThroughputModel(hw.pools, ModelSpec(total_params=1e6, active_params=1e6))
    sched = Scheduler(hw.pools, tp, mean_rollout_tokens=100)
    ledger = CostLedger(hw.pools, throughput=tp)
    sched.set_trainer(version=0, demand=4)
    placed = [sched.place() for _ in range(5)]
    assert placed.count(None) == 1 and set(placed) - {None} <= {"h200-fp8", "b200"}
    for pool in placed[:4]:
        sched.complete(pool, tokens=100)
        ledger.record_busy(pool, 0.5)
        ledger.record_rollout(pool, 100, staleness=0)
        sched.observe(pool, tokens=100, gpu_seconds=0.5)
    rep = ledger.report()
    assert rep.totals.rollouts == 4 and rep.totals.tokens == 400
    assert all(p.billing == "modelled" for p in rep.pools)
    assert rep.counterfactual is not None and rep.counterfactual.pool == "b200"
    _json_path, md_path = rep.write(tmp_path)
    assert "(emulated)" in md_path.read_text()


def test_hosts_are_accounted_over_the_time_they_were_present(tmp_path):
    ledger = CostLedger(pools())
    ledger.record_presence("cheap", "tcp://10.0.0.5:5555", 1800.0)
    ledger.record_presence("cheap", "tcp://10.0.0.5:5555", 1800.0)
    ledger.record_presence("cheap", "tcp://10.0.0.6:5555", 900.0)
    row = next(p for p in ledger.report().pools if p.pool == "cheap")
    assert row.host_hours == {"tcp://10.0.0.5:5555": 1.0, "tcp://10.0.0.6:5555": 0.25}
    assert row.host_cost_usd == {"tcp://10.0.0.5:5555": 2.0, "tcp://10.0.0.6:5555": 0.5}  # one GPU, $2/h
    assert "| cheap | tcp://10.0.0.6:5555 | 0.2500 | $0.5000 |" in ledger.report().to_markdown()
    restored = CostLedger(pools())
    restored.load_state(json.loads(json.dumps(ledger.state())))
    again = next(p for p in restored.report().pools if p.pool == "cheap")
    assert (again.host_hours, again.host_cost_usd) == (row.host_hours, row.host_cost_usd)
    # fixed hosts: each bills the ranks that land on it (5 ranks over 2 hosts: 3 and 2)
    fixed = PoolConfig(
        name="remote",
        gpu="H100-SXM",
        count=5,
        price_per_gpu_hour=3.0,
        device="cuda",
        hosts=["tcp://10.0.0.5:5555", "tcp://10.0.0.6:5555"],
    )
    by_host = CostLedger([fixed])
    for host in fixed.hosts:
        by_host.record_presence("remote", host, 3600.0)
    assert by_host.report().pools[0].host_cost_usd == {"tcp://10.0.0.5:5555": 9.0, "tcp://10.0.0.6:5555": 6.0}
    with pytest.raises(ValueError, match="seconds"):
        ledger.record_presence("cheap", "tcp://10.0.0.5:5555", -1.0)
