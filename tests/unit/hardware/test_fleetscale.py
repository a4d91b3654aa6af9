"""The scale simulator's arithmetic on fleets small enough to check by hand.

Unless a test says otherwise: one GPU of 4 slots decoding 100 tokens/s (25 tokens/s per
slot), rollouts of exactly 100 tokens (4 s of decode each), a trainer taking batches of 4
rollouts in 1 s, no controller cost, no link delay, $3.60 per GPU-hour ($0.001 per second).
"""

import math

import pytest

from hardware.fleetscale import ScalePool, ScaleSim


def gpu(name="p", *, count=1, tps=100.0, slots=4, price=3.6, **kw) -> ScalePool:
    return ScalePool(
        name=name,
        provider="x",
        gpu="H100-SXM",
        count=count,
        tokens_per_s_per_gpu=tps,
        slots_per_gpu=slots,
        price_per_gpu_hour=price,
        **kw,
    )


def run(pools, *, batch=4, step_seconds=1.0, steps=3, tokens=100.0, **kw):
    kw.setdefault("controller_s_per_rollout", 0.0)
    return ScaleSim(
        pools, batch=batch, step_seconds=step_seconds, steps=steps, rollout_tokens=lambda rng: tokens, **kw
    ).run()


def test_one_gpu_steps_at_the_decode_rate_and_bills_rented_time():
    # Slots refill at 4 s (controller is free), so a batch of 4 is ready every 4 s; the
    # trainer's 1 s step fits between them: steps end at 5, 9, 13 s.
    r = run([gpu()], max_ahead_steps=0.0)
    assert [s.t for s in r.log] == pytest.approx([5.0, 9.0, 13.0])
    assert r.rollouts_completed == 12
    assert r.tokens == pytest.approx(1200.0)
    assert r.cost_usd == pytest.approx(13.0 * 0.001)
    assert r.usd_per_mtok_trained == pytest.approx(13.0 * 0.001 / 1200.0 * 1e6)
    # With max_ahead 0 a rollout starts only after the previous batch was taken, before the
    # trainer publishes: each batch is one version old, except the first.
    assert r.staleness == {0: 4, 1: 8}


def test_busy_billing_charges_tokens_at_full_batch_speed():
    r = run([gpu()], billing="busy", max_ahead_steps=0.0)
    # 1200 tokens ÷ 100 tokens/s = 12 GPU-seconds at $0.001.
    assert r.cost_usd == pytest.approx(0.012)
    assert r.log[0].cost_usd == pytest.approx(0.004)


def test_link_bandwidth_delays_the_update_and_adds_staleness():
    # 1.25e9 bytes over 1 Gbit/s = 10 s per update. The pool keeps version 0 until 10 s after
    # each step, so with a budget of 5 every rollout started before t = 15 carries version 0.
    pool = gpu(link_gbps=1.0, delta_bytes=1.25e9, staleness_budget=5)
    assert pool.update_s == pytest.approx(10.0)
    r = run([pool], steps=4, max_ahead_steps=0.0)
    fast = run([gpu(staleness_budget=5)], steps=4, max_ahead_steps=0.0)
    assert r.staleness_mean > fast.staleness_mean
    assert max(r.staleness) >= 2


def test_staleness_budget_holds_back_a_lagging_pool():
    # Budget 0 and a 10 s update: after step 1 the pool may start nothing until its weights
    # arrive, so step 2 cannot end before 5 + 10 + 4 + 1 = 20 s.
    r = run([gpu(link_gbps=1.0, delta_bytes=1.25e9, staleness_budget=0)], steps=2, max_ahead_steps=0.0)
    assert r.log[1].t == pytest.approx(20.0)
    assert r.staleness == {0: 8}


def test_controller_cost_caps_the_rate_at_its_ceiling():
    # 10 GPUs × 4 slots of 1 s rollouts decode 40 rollouts/s; one core at 0.1 s per rollout
    # serves 10/s, the ceiling. Shared between the waiting rollouts, they finish together, so
    # the core idles while the first rollouts decode and while a freed batch decodes again.
    fleet = [gpu(count=10, tps=400.0)]
    r = run(fleet, batch=40, steps=5, controller_s_per_rollout=0.1, max_ahead_steps=1.0)
    assert r.controller_ceiling_rollouts_per_s == pytest.approx(10.0)
    assert r.rollouts_per_s <= 10.0 + 1e-9
    assert r.controller_busy_fraction > 0.7
    # Busy core-seconds: 0.1 s per rollout served, plus the first half (0.05 s) of at most
    # the 80 rollouts the controller may have outstanding.
    busy = r.controller_busy_fraction * r.sim_seconds
    assert 0.1 * r.rollouts_served - 1e-9 <= busy <= 0.1 * r.rollouts_served + 0.05 * 80
    # Two cores double the ceiling and the rate.
    r2 = run(fleet, batch=40, steps=5, controller_s_per_rollout=0.1, controller_cores=2, max_ahead_steps=1.0)
    assert r2.controller_ceiling_rollouts_per_s == pytest.approx(20.0)
    assert r2.rollouts_per_s > 1.5 * r.rollouts_per_s
    # Without a controller cost the GPUs set the pace: 40 rollouts/s.
    r0 = run(fleet, batch=40, steps=5, max_ahead_steps=1.0)
    assert r0.rollouts_per_s > 30.0


def test_cheapest_pool_is_filled_first():
    cheap, dear = gpu("cheap", price=1.0), gpu("dear", price=9.0)
    # The outstanding limit (4) fits in the cheap pool's 4 slots: the dear one does nothing.
    r = run([dear, cheap], billing="busy", max_ahead_steps=0.0)
    assert r.pools["dear"].started == 0
    assert r.pools["cheap"].started == 16  # batches at 4, 8 and 12 s, and the next started at 12 s


def test_preemption_loses_rollouts_in_flight_and_the_replacement_returns():
    # A very high rate: the GPU is preempted within its first rollouts; the replacement boots
    # in 1 s and loads 1.25e8 bytes at 1 Gbit/s (1 s), and the run still completes.
    pool = gpu(spot=True, preemptions_per_gpu_hour=3600.0 / 3.0, restart_s=1.0, link_gbps=1.0, keyframe_bytes=1.25e8)
    assert pool.keyframe_s == pytest.approx(1.0)
    r = run([pool], steps=2, max_ahead_steps=0.0, seed=1)
    assert r.preemptions >= 1
    assert r.rollouts_lost >= 1
    assert r.tokens_lost > 0
    assert r.steps == 2
    assert r.rollouts_trained == 8
    # Tokens trained never exceed tokens finished; lost ones are counted apart.
    assert r.tokens_trained <= r.tokens


def test_window_cost_leaves_out_the_fill():
    r = run([gpu()], steps=3, max_ahead_steps=0.0)
    # Steps 2 and 3 end at 9 and 13 s: 4 s at $0.001 for 400 trained tokens.
    assert r.window_usd_per_mtok_trained(2) == pytest.approx(0.004 / 400 * 1e6)
    with pytest.raises(ValueError, match="first_step"):
        r.window_usd_per_mtok_trained(3)


def test_staleness_quantiles():
    r = run([gpu()], max_ahead_steps=0.0)
    assert r.staleness_quantile(0.3) == 0
    assert r.staleness_quantile(0.5) == 1
    assert r.staleness_mean == pytest.approx(8 / 12)


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"count": 0}, "count must be ≥ 1"),
        ({"tps": 0.0}, "tokens_per_s_per_gpu must be > 0"),
        ({"preemptions_per_gpu_hour": 1.0}, "on-demand pool is not preempted"),
        ({"link_gbps": 0.0}, "link_gbps must be > 0"),
    ],
)
def test_bad_pools_are_refused_with_one_line(kw, msg):
    with pytest.raises(ValueError, match=msg):
        gpu(**kw)


def test_bad_simulation_parameters_are_refused():
    with pytest.raises(ValueError, match="unique names"):
        ScaleSim([gpu(), gpu()], batch=1, step_seconds=1, steps=1, rollout_tokens=lambda r: 1.0)
    with pytest.raises(ValueError, match="billing"):
        ScaleSim([gpu()], batch=1, step_seconds=1, steps=1, rollout_tokens=lambda r: 1.0, billing="x")
    assert math.isinf(run([gpu()], steps=1).controller_ceiling_rollouts_per_s)
    with pytest.raises(ValueError, match="controller_cores"):
        run([gpu()], controller_cores=0)


@pytest.mark.parametrize(("step_seconds", "staleness"), [(0.25, {0: 2}), (1.0, {0: 1, 1: 1})])
def test_a_rollout_takes_the_version_of_its_first_token(step_seconds, staleness):
    # One slot decoding 10 tokens/s; rollouts of 10 tokens in 2 turns of 5; 0.1 s of controller
    # work per token before each turn. A rollout: 0.5 s controller, 0.5 s decode, twice = 2 s.
    # The second rollout starts at 2 s and decodes its first token at 2.5 s: a trainer step of
    # 0.25 s has published version 1 by then, one of 1 s has not.
    r = run(
        [gpu(tps=10.0, slots=1)],
        batch=1,
        steps=2,
        tokens=10.0,
        step_seconds=step_seconds,
        max_ahead_steps=0.0,
        controller_s_per_token=0.1,
        tokens_per_turn=5.0,
    )
    assert [s.t for s in r.log] == pytest.approx([2.0 + step_seconds, 4.0 + step_seconds])
    assert r.staleness == staleness
