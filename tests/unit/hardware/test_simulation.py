"""The scheduler in a discrete-event simulation with pools of known speed and price.

Pools are single A100s serving a dense 1e9-parameter BF16 model under an ideal roofline: every
sequence advances 2039e9 / 2e9 ≈ 1,020 tokens/s whatever the batch, so a 1,000-token rollout
takes ≈ 0.98 s on a full-speed pool, and price alone orders pools of equal speed.
"""

import pytest

from hardware import FleetSim, ModelSpec, PoolConfig, RooflineAssumptions, Scheduler, ThroughputModel

IDEAL = RooflineAssumptions(bandwidth_efficiency=1.0, compute_efficiency=1.0, gpu_step_overhead_s=0.0)
DENSE = ModelSpec(total_params=1e9, active_params=1e9)
TOKENS = 1000


def a100(name: str, price: float, cap: int = 8, budget: int = 2) -> PoolConfig:
    return PoolConfig(
        name=name,
        gpu="A100-80GB",
        count=1,
        price_per_gpu_hour=price,
        max_concurrent_rollouts=cap,
        staleness_budget=budget,
    )


def simulate(pools, *, batch, step_seconds, steps, **kw):
    sched = Scheduler(pools, ThroughputModel(pools, DENSE, IDEAL), mean_rollout_tokens=TOKENS)
    sim = FleetSim(
        pools,
        DENSE,
        sched,
        batch=batch,
        step_seconds=step_seconds,
        steps=steps,
        rollout_tokens=lambda rng: TOKENS,
        assumptions=IDEAL,
        trace=True,
        **kw,
    )
    return sched, sim.run()


def assert_within_capacity(pools, result):
    for p in pools:
        assert result.pools[p.name].max_in_flight <= p.capacity
        for pl in result.placements:
            assert pl.in_flight[p.name] <= p.capacity - (1 if pl.pool == p.name else 0)


def test_slow_trainer_is_fed_by_the_cheapest_pool_alone():
    pools = [a100("dear", 3.0), a100("cheap", 1.0), a100("mid", 2.0)]
    # The trainer takes 8 rollouts every 10 s; the cheap pool alone makes ~8 per second.
    _sched, r = simulate(pools, batch=8, step_seconds=10.0, steps=6)
    assert [pl.pool for pl in r.placements[:8]] == ["cheap"] * 8
    after_start = [pl for pl in r.placements if pl.t > 0.0]
    assert after_start and all(pl.pool == "cheap" for pl in after_start)
    assert r.trainer_idle_fraction == pytest.approx(0.0, abs=1e-9)
    # Only the initial fill, with the trainer already waiting, looked beyond the cheap pool.
    assert r.pools["mid"].placed <= 1 and r.pools["dear"].placed == 0
    assert_within_capacity(pools, r)


def test_dearer_pools_only_when_the_cheap_one_is_full_and_the_trainer_would_starve():
    pools = [a100("cheap", 1.0), a100("mid", 2.0), a100("dear", 3.0)]
    # 16 rollouts every 0.5 s is ~4× what the cheap pool makes: the trainer starves without help.
    _sched, r = simulate(pools, batch=16, step_seconds=0.5, steps=30, max_ahead_steps=1.0)
    assert r.pools["mid"].placed > 0 and r.pools["dear"].placed > 0
    rank = {"cheap": 0, "mid": 1, "dear": 2}
    consume = 16 / 0.5
    for pl in r.placements:
        cheaper = [p for p in pools if rank[p.name] < rank[pl.pool]]
        # Every cheaper pool was full at the time ...
        assert all(pl.in_flight[p.name] == p.capacity for p in cheaper), pl
        if cheaper:
            # ... and the trainer would have starved: need(T) > supply(T), T = max(h, R).
            T = max(pl.horizon_s, TOKENS * 2e9 / 2039e9)
            need = pl.demand + consume * max(0.0, T - pl.horizon_s)
            assert need > sum(p.capacity for p in cheaper), pl
    assert_within_capacity(pools, r)
    # With the extra pools the trainer waits less than the cheap pool alone would let it.
    _, alone = simulate([a100("cheap", 1.0)], batch=16, step_seconds=0.5, steps=30, max_ahead_steps=1.0)
    assert r.trainer_idle_fraction < alone.trainer_idle_fraction - 0.3
    assert r.usd_per_mtok > alone.usd_per_mtok  # and pays for it


def test_no_rollout_starts_on_a_pool_lagging_beyond_its_budget():
    # The cheap pool receives each version 5 s late, so within a few fast steps it lags far
    # beyond its budget of 1; it must then sit out even though it is cheapest and has room.
    pools = [a100("cheap", 1.0, budget=1), a100("dear", 3.0, budget=2)]
    _sched, r = simulate(pools, batch=8, step_seconds=0.2, steps=20, sync_delay_s={"cheap": 5.0, "dear": 0.0})
    by_name = {p.name: p for p in pools}
    assert all(pl.lag <= by_name[pl.pool].staleness_budget for pl in r.placements)
    skipped = [pl for pl in r.placements if pl.pool == "dear" and pl.in_flight["cheap"] < by_name["cheap"].capacity]
    assert skipped, "the lagging cheap pool never had to be skipped"
    assert r.pools["cheap"].placed < r.pools["dear"].placed
    assert r.steps == 20
    assert_within_capacity(pools, r)


def test_a_pool_that_halves_its_speed_gets_half_the_rollouts_once_the_estimate_adapts():
    pools = [a100("a", 1.0), a100("b", 1.0)]  # equal price and speed: "a" first by name
    change_at = 60.0
    sched, r = simulate(
        pools, batch=16, step_seconds=0.05, steps=220, speed_changes=[(change_at, "a", 0.5)], observe_every_s=2.0
    )
    assert r.sim_seconds > change_at + 60
    assert sched.throughput.factor("a") == pytest.approx(0.5, rel=0.1)
    assert sched.throughput.factor("b") == pytest.approx(1.0, rel=0.1)
    assert sched.ranking() == ["b", "a"]  # "a" now costs twice as much per token
    before = [pl.pool for pl in r.placements if 10.0 < pl.t < change_at]
    after = [pl.pool for pl in r.placements if pl.t > change_at + 20.0]
    assert before.count("a") / before.count("b") == pytest.approx(1.0, rel=0.1)
    assert after.count("a") / after.count("b") == pytest.approx(0.5, rel=0.15)
    assert_within_capacity(pools, r)


def test_billing_is_busy_gpus_whatever_their_batch():
    # A 100 GB dense model needs 2-GPU H100 replicas. One 1,000-token rollout on one replica:
    # each step reads 50 GB per GPU (14.9 ms) and makes one token, and both GPUs are billed.
    model = ModelSpec(total_params=50e9, active_params=50e9)
    pools = [PoolConfig(name="h", gpu="H100-SXM", count=4, price_per_gpu_hour=3.6, max_concurrent_rollouts=16)]
    sched = Scheduler(pools, ThroughputModel(pools, model, IDEAL), mean_rollout_tokens=TOKENS)
    r = FleetSim(
        pools,
        model,
        sched,
        batch=1,
        step_seconds=1.0,
        steps=1,
        rollout_tokens=lambda rng: TOKENS,
        assumptions=IDEAL,
        max_ahead_steps=0.0,
    ).run()
    step = 50e9 / 3350e9
    # The next rollout starts when the trainer takes the first and runs through its 1 s step:
    # unfinished at the end, it is billed and counted, but not trained on.
    seconds = TOKENS * step + 1.0
    assert r.tokens == pytest.approx(TOKENS + 1.0 / step) and r.tokens_trained == TOKENS
    assert r.pools["h"].gpu_seconds == pytest.approx(2 * seconds)
    assert r.cost_usd == pytest.approx(2 * seconds * 3.6 / 3600)
