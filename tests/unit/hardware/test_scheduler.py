"""Placement decisions, with the starvation test checked against hand-computed supply."""

import math
import random

import pytest

from hardware import CATALOG, ModelSpec, PoolConfig, RooflineAssumptions, Scheduler, ThroughputModel

IDEAL = RooflineAssumptions(bandwidth_efficiency=1.0, compute_efficiency=1.0, gpu_step_overhead_s=0.0)
DENSE = ModelSpec(total_params=1e9, active_params=1e9)
# A100, 1e9 params in BF16, batch 4: a step reads 2e9 B at 2039 GB/s; every sequence makes one
# token per step, so a 1,000-token rollout takes R = 1000 × 2e9 / 2039e9 s.
R = 1000 * 2e9 / 2039e9


def a100(name: str, price: float, cap: int = 4, budget: int = 2) -> PoolConfig:
    return PoolConfig(
        name=name,
        gpu="A100-80GB",
        count=1,
        price_per_gpu_hour=price,
        max_concurrent_rollouts=cap,
        staleness_budget=budget,
    )


def make(pools, **kw) -> Scheduler:
    return Scheduler(pools, ThroughputModel(pools, DENSE, IDEAL), mean_rollout_tokens=1000, **kw)


def fill(s: Scheduler, n: int) -> list:
    return [s.place() for _ in range(n)]


def test_ranking_by_cost_per_token_with_ties_by_name():
    pools = [a100("z-cheap", 1.0), a100("dear", 3.0), a100("b-tie", 2.0), a100("a-tie", 2.0)]
    s = make(pools)
    assert s.ranking() == ["z-cheap", "a-tie", "b-tie", "dear"]
    states = s.states()
    assert [st.rank for st in states] == [0, 1, 2, 3]
    assert states[0].usd_per_mtok == pytest.approx(1.0 / 3600 / (4 * 2039e9 / 2e9) * 1e6)


def test_cheapest_pool_fills_first_even_without_demand():
    s = make([a100("cheap", 1.0), a100("dear", 2.0)])
    s.set_trainer(0, demand=0)
    assert fill(s, 4) == ["cheap"] * 4
    assert s.place() is None  # cheap full, trainer needs nothing: wait
    assert s.in_flight("cheap") == 4 and s.in_flight("dear") == 0


def test_spill_only_when_cheap_pools_cannot_deliver_in_time():
    s = make([a100("cheap", 1.0), a100("dear", 2.0)])
    s.set_trainer(0, demand=0)
    fill(s, 4)
    # Horizon 10 s: the full cheap pool finishes 4 × 10 / R ≈ 40.8 rollouts by then.
    supply = 4 * 10 / R
    s.set_trainer(0, demand=40, horizon_s=10.0)
    assert s.place() is None and not s.would_spill("dear")
    s.set_trainer(0, demand=41, horizon_s=10.0)
    assert supply < 41 and s.would_spill("dear")
    assert s.place() == "dear"
    # Trainer waiting now: a rollout on "dear" lands at R, when "cheap" has finished its 4.
    s2 = make([a100("cheap", 1.0), a100("dear", 2.0)])
    fill(s2, 4)
    s2.set_trainer(0, demand=4, horizon_s=0.0)
    assert s2.place() is None
    s2.set_trainer(0, demand=5, horizon_s=0.0)
    assert s2.place() == "dear"
    # That rollout now counts as supply: 4 + 1 >= 5, so no second spill.
    assert s2.place() is None


def test_consumption_rate_extends_the_need_beyond_the_next_step():
    s = make([a100("cheap", 1.0), a100("dear", 2.0)])
    fill(s, 4)
    s.set_trainer(0, demand=0, horizon_s=0.0, consume_per_s=2.0)  # need(R) = 2R ≈ 1.96 < 4
    assert s.place() is None
    s.set_trainer(0, demand=0, horizon_s=0.0, consume_per_s=5.0)  # need(R) = 5R ≈ 4.9 > 4
    assert s.place() == "dear"


def test_lagging_pools_get_nothing_and_capacity_is_never_exceeded():
    s = make([a100("cheap", 1.0, budget=1), a100("dear", 2.0, budget=3)])
    s.set_trainer(2, demand=100)  # cheap holds version 0: lag 2 > budget 1
    got = fill(s, 6)
    assert got == ["dear"] * 4 + [None, None]
    assert s.in_flight("dear") == s.capacity("dear") == 4 and s.in_flight("cheap") == 0
    s.set_pool_version("cheap", 1)  # lag 1: eligible again, and cheapest
    assert s.place() == "cheap"
    s.set_trainer(5, demand=100)  # lag 4 and 5: nobody eligible
    assert s.place() is None
    s.complete("dear", tokens=1000)
    assert s.in_flight("dear") == 3


def test_round_robin_cycles_by_name_skipping_full_and_lagging():
    s = make([a100("b", 1.0, cap=1), a100("a", 1.0, cap=2), a100("c", 1.0, cap=2, budget=0)], policy="round_robin")
    s.set_trainer(0, demand=0)
    assert fill(s, 6) == ["a", "b", "c", "a", "c", None]
    s.complete("b")
    s.set_trainer(1, demand=0)  # c now lags beyond its budget of 0
    s.complete("c")
    assert fill(s, 2) == ["b", None]


def test_decisions_are_deterministic():
    rng = random.Random(3)
    pools = [a100(f"p{i}", rng.choice([1.0, 2.0, 3.0]), cap=rng.randint(1, 5)) for i in range(12)]

    def run() -> list:
        s = make(list(reversed(pools)))
        out = []
        r = random.Random(7)
        for step in range(300):
            s.set_trainer(step // 50, demand=r.randint(-5, 40), horizon_s=r.random() * 3)
            name = s.place()
            out.append(name)
            if name is not None and r.random() < 0.5:
                s.complete(name, tokens=r.randint(100, 2000))
            if step % 25 == 0:
                s.set_pool_version(pools[r.randrange(12)].name, step // 50)
        return out

    assert run() == run()


def test_misuse_is_refused_clearly():
    s = make([a100("a", 1.0)])
    with pytest.raises(KeyError, match="no pool 'x'; pools: a"):
        s.complete("x")
    with pytest.raises(ValueError, match="no rollout in flight"):
        s.complete("a")
    with pytest.raises(ValueError, match="policy"):
        make([a100("a", 1.0)], policy="random")
    with pytest.raises(ValueError, match="at least one pool"):
        Scheduler([], ThroughputModel([], DENSE))


def test_observe_reranks_pools():
    s = make([a100("a", 1.0), a100("b", 1.5)])
    assert s.ranking() == ["a", "b"]
    per_gpu = 4 * 2039e9 / 2e9
    for _ in range(10):
        s.observe("a", tokens=per_gpu * 0.4, gpu_seconds=1.0, batch_per_gpu=4)  # a runs at 40%
    assert s.throughput.factor("a") == pytest.approx(0.4, rel=0.05)
    assert s.ranking() == ["b", "a"]


def test_a_decision_with_100_pools_walks_to_the_last_pool():
    # How long a decision takes is measured by benchmarks/scheduling.py (decision_us).
    pools = []
    kinds = [("A100-80GB", "bf16"), ("H100-SXM", "fp8"), ("H200", "bf16"), ("B200", "bf16"), ("L40S", "fp8")]
    for i in range(100):
        gpu, prec = kinds[i % 5]
        pools.append(
            PoolConfig(
                name=f"p{i:03d}",
                gpu=gpu,
                precision=prec,
                count=2,
                max_concurrent_rollouts=8,
                price_per_gpu_hour=CATALOG[gpu].price_per_hour * (1 + i / 100),
            )
        )
    s = Scheduler(pools, ThroughputModel(pools, DENSE), mean_rollout_tokens=1000)
    ranking = s.ranking()
    s.set_trainer(0, demand=10**9)
    for name in ranking[:99]:  # worst case: every decision walks the whole ranking and sums supply
        for _ in range(8):
            assert s.place() == name
    for _ in range(200):
        name = s.place()
        assert name == ranking[-1]
        s.complete(name)


def test_base_pools_stay_full_when_the_steady_consumption_needs_them():
    # Each pool makes 4 × 1,020 ≈ 4,078 tokens/s = 4.08 rollouts/s of 1,000 tokens. The trainer
    # has more than it needs waiting (demand −100), so nothing is short right now.
    pools = [a100("cheap", 1.0), a100("mid", 2.0), a100("dear", 3.0)]
    s = make(pools)
    s.set_trainer(0, demand=-100, horizon_s=5.0, consume_per_s=9.0)  # needs cheap + mid, not dear
    assert fill(s, 9) == ["cheap"] * 4 + ["mid"] * 4 + [None]
    s = make(pools)
    s.set_trainer(0, demand=-100, horizon_s=5.0, consume_per_s=7.0)  # cheap + most of mid
    assert fill(s, 5) == ["cheap"] * 4 + [None]


def test_a_spill_wakes_a_replica_and_tops_it_up_when_the_batch_is_known():
    # dear: one A100 replica of 8 slots. The trainer waits for 5 rollouts and takes 16 every
    # 4 s; cheap (4 slots) makes 4.08 rollouts/s, so 4.0 of the 5 by the time one on dear lands.
    pools = [a100("cheap", 1.0), a100("dear", 2.0, cap=8)]
    s = make(pools)
    fill(s, 4)
    s.set_trainer(0, demand=5, horizon_s=0.0, consume_per_s=4.0, batch=16)
    assert s.would_spill("dear")
    # The woken replica is billed whole: it is filled (8 slots ≤ shortfall + one batch).
    assert fill(s, 9) == ["dear"] * 8 + [None]
    assert [st.busy_replicas for st in s.states()] == [1, 1]


def test_a_busy_replica_is_topped_up_only_when_the_look_ahead_needs_it():
    # cheap (2 slots) makes 2.04 rollouts/s; the trainer takes 16 every 4 s (4/s), its next
    # step starts in 2 s and finds enough. Two rollouts already run on dear's only replica.
    pools = [a100("cheap", 0.2, cap=2), a100("dear", 2.0, cap=8)]
    for lookahead, expected in ((0.0, [None]), (1.0, ["dear"] * 6 + [None])):
        s = make(pools, lookahead_steps=lookahead)
        s.set_trainer(0, demand=4)  # cheap delivers 2 by the time one on dear lands: spill 2
        assert fill(s, 5) == ["cheap", "cheap", "dear", "dear", None]
        s.set_trainer(0, demand=0, horizon_s=2.0, consume_per_s=4.0, batch=16)
        assert not s.would_spill("dear")
        # Look-ahead (one step, to t = 6 s): 16 needed, 2.04 × 6 + 2 ≈ 14.2 supplied.
        assert fill(s, len(expected)) == expected


def test_a_small_shortfall_goes_where_its_few_tokens_are_cheapest():
    # A 100 GB dense model: an H100 replica needs 2 GPUs, a B200 replica one. "big" (H100)
    # is cheaper per token full (1.0 / 268 vs 1.5 / 320 $/h per tokens/s), but one sequence
    # on it keeps two GPUs busy: 1.0 / 33.5 vs 1.5 / 80 on "small".
    model = ModelSpec(total_params=50e9, active_params=50e9)
    pools = [
        PoolConfig(name="base", gpu="B200", count=1, price_per_gpu_hour=0.5, max_concurrent_rollouts=4),
        PoolConfig(name="big", gpu="H100-SXM", count=2, price_per_gpu_hour=1.0, max_concurrent_rollouts=8),
        PoolConfig(name="small", gpu="B200", count=1, price_per_gpu_hour=1.5, max_concurrent_rollouts=4),
    ]
    tp = ThroughputModel(pools, model, IDEAL)
    assert (tp.replica_gpus("big"), tp.slots_per_replica("big"), tp.replica_gpus("small")) == (2, 8, 1)
    assert tp.roofline("big", 0.5) == pytest.approx(0.5 / (50e9 / 3350e9))
    for demand, expected in ((5, "small"), (100, "big")):
        s = Scheduler(pools, ThroughputModel(pools, model, IDEAL), mean_rollout_tokens=1000)
        assert s.ranking() == ["base", "big", "small"]
        fill(s, 4)
        # A rollout on big lands after 1,000 × 4 / 268 ≈ 14.9 s; base delivers 0.32/s × 14.9 ≈
        # 4.8 by then: demand 5 leaves a shortfall of one rollout, demand 100 a full replica's.
        s.set_trainer(0, demand=demand, horizon_s=0.0)
        assert s.place() == expected


def test_the_mean_rollout_length_is_a_flow_and_errs_long_after_a_synchronised_start():
    s = make([a100("a", 1.0)])  # 4 slots, prior 1,000 tokens counted as one fill (4 rollouts)
    s.set_trainer(0, demand=4)
    fill(s, 4)
    s.complete("a", tokens=100)  # the two short ones finish first
    s.complete("a", tokens=100)
    assert s.mean_rollout_tokens == pytest.approx((4 * 1000 + 200) / 6)  # stand-in: finished ones
    # The pool reports 3,000 tokens generated: 200 by the finished two, 1,400 each so far by
    # the two still running.
    s.observe("a", tokens=3000, gpu_seconds=1.0, batch_per_gpu=4)
    keep = math.exp(-3000 / (4 * 4 * (4200 / 6)))
    expected = (keep * 4000 + 3000) / (keep * 4 + 2)
    assert s.mean_rollout_tokens == pytest.approx(expected)
    assert s.mean_rollout_tokens > 1000  # long, not the 100 the finished ones suggest


def _observed_mean(undo: str) -> float:
    """Mean rollout length after 4 finished rollouts of 500 tokens and 6 hold-backs undone
    with `undo`, on an observed pool."""
    s = make([a100("cheap", 1.0, cap=16)])
    s.set_trainer(0, demand=100)
    s.observe("cheap", tokens=1000, gpu_seconds=1.0)  # observed: finished rollouts feed a flow
    for _ in range(4):
        s.place()
        s.complete("cheap", tokens=500)
    for _ in range(6):
        s.place()
        getattr(s, undo)("cheap")
    assert s.in_flight("cheap") == 0
    s.observe("cheap", tokens=2000, gpu_seconds=1.0)
    return s.mean_rollout_tokens


def test_release_undoes_a_placement_without_moving_the_rollout_length_estimate():
    s = make([a100("cheap", 1.0, cap=16)])
    s.set_trainer(0, demand=100)
    s.observe("cheap", tokens=1000, gpu_seconds=1.0)
    for _ in range(4):
        s.place()
        s.complete("cheap", tokens=500)
    s.observe("cheap", tokens=2000, gpu_seconds=1.0)
    untouched = s.mean_rollout_tokens
    assert _observed_mean("release") == pytest.approx(untouched)
    # Undoing hold-backs with complete() counts them as empty rollouts: the estimate drops.
    assert _observed_mean("complete") < 0.9 * untouched
    with pytest.raises(ValueError, match="release"):
        s.release("cheap")


def test_an_unavailable_pool_gets_nothing_and_its_supply_is_not_counted():
    s = make([a100("cheap", 1.0), a100("dear", 2.0)])
    s.set_trainer(0, demand=100)
    assert fill(s, 2) == ["cheap"] * 2
    s.set_available("cheap", False)  # its only sampler froze: what it runs may never land
    assert fill(s, 5) == ["dear"] * 4 + [None]
    s.release("cheap")
    s.release("cheap")  # its rollouts were abandoned and re-queued
    assert s.place() is None  # dear full, cheap out
    s.set_available("cheap", True)
    assert s.place() == "cheap"
    s2 = make([a100("b", 1.0, cap=1), a100("a", 1.0, cap=1)], policy="round_robin")
    s2.set_trainer(0, demand=0)
    s2.set_available("a", False)
    assert fill(s2, 2) == ["b", None]


def test_take_claims_a_chosen_pools_slot_only_when_it_has_room_and_is_eligible():
    s = make([a100("cheap", 1.0, cap=2, budget=1), a100("dear", 2.0, cap=2)])
    s.set_trainer(0, demand=100)
    assert s.take("dear") and s.take("dear")  # a caller's choice: not the cheapest pool
    assert not s.take("dear") and s.in_flight("dear") == 2  # full: nothing changes
    s.set_trainer(2, demand=100)  # cheap holds version 0: lag 2 > budget 1
    assert not s.take("cheap") and s.in_flight("cheap") == 0
    s.set_available("dear", False)
    s.release("dear")
    assert not s.take("dear") and s.in_flight("dear") == 1
    s.complete("dear", tokens=1000)
    assert s.in_flight("dear") == 0
    with pytest.raises(KeyError, match="pools: cheap, dear"):
        s.take("nowhere")
