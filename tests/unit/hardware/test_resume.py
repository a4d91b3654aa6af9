"""Controller resume: ledger, throughput model and scheduler state survive state → JSON → load."""

import json
import random

import pytest

from hardware import CostLedger, ModelSpec, PoolConfig, RooflineAssumptions, Scheduler, ThroughputModel

IDEAL = RooflineAssumptions(bandwidth_efficiency=1.0, compute_efficiency=1.0, gpu_step_overhead_s=0.0)
DENSE = ModelSpec(total_params=1e9, active_params=1e9)


def fleet() -> list[PoolConfig]:
    return [
        PoolConfig(name="cheap", gpu="A100-80GB", count=1, price_per_gpu_hour=1.0, max_concurrent_rollouts=4),
        PoolConfig(name="mid", gpu="A100-80GB", count=2, price_per_gpu_hour=1.5, max_concurrent_rollouts=8),
        PoolConfig(name="dear", gpu="B200", count=1, price_per_gpu_hour=6.0, max_concurrent_rollouts=8),
    ]


def parts(pools):
    tp = ThroughputModel(pools, DENSE, IDEAL)
    return tp, Scheduler(pools, tp, mean_rollout_tokens=1000), CostLedger(pools, throughput=tp)


def drive(sched: Scheduler, ledger: CostLedger, rng: random.Random, n: int) -> list:
    """A deterministic stretch of controller traffic; returns the decisions."""
    out = []
    for k in range(n):
        sched.set_trainer(
            k // 20,
            demand=rng.randint(-4, 30),
            horizon_s=rng.random() * 3,
            consume_per_s=rng.choice([0.0, 4.0, 12.0]),
            batch=rng.choice([0, 16]),
        )
        name = sched.place()
        out.append(name)
        if name is not None and rng.random() < 0.6:
            tokens = rng.randint(50, 3000)
            sched.complete(name, tokens)
            ledger.record_rollout(name, tokens, staleness=rng.randint(0, 2))
            ledger.record_busy(name, rng.random() * 5)
        if k % 15 == 14:
            pool = rng.choice(["cheap", "mid", "dear"])
            sched.observe(pool, tokens=rng.randint(1000, 9000), gpu_seconds=1.0 + rng.random())
            ledger.record_mismatch(pool, kl=rng.random() * 0.1, masked_fraction=rng.random() * 0.2, tokens=100)
        if k % 10 == 0:
            sched.set_pool_version(rng.choice(["cheap", "mid", "dear"]), k // 20)
    return out


def drain(sched: Scheduler) -> None:
    for st in sched.states():
        for _ in range(st.in_flight):
            sched.complete(st.name)


def test_state_json_load_gives_the_same_report_ranking_and_decisions():
    pools = fleet()
    tp, sched, ledger = parts(pools)
    drive(sched, ledger, random.Random(1), 300)
    drain(sched)  # a resumed run starts with nothing in flight; so does the original here
    # The controller checkpoints after a step's accounting has observed every pool: no
    # finished rollouts wait for the tokens of their pool's next observation.
    for name in ("cheap", "mid", "dear"):
        sched.observe(name, tokens=1000, gpu_seconds=1.0)
    blob = json.dumps({"ledger": ledger.state(), "scheduler": sched.state()})

    tp2, sched2, ledger2 = parts(pools)
    saved = json.loads(blob)
    ledger2.load_state(saved["ledger"])
    sched2.load_state(saved["scheduler"])

    assert ledger2.report().model_dump() == ledger.report().model_dump()
    assert sched2.ranking() == sched.ranking()
    assert sched2.mean_rollout_tokens == sched.mean_rollout_tokens
    assert [(p.name, p.usd_per_mtok, p.tokens_per_s_per_gpu) for p in sched2.states()] == [
        (p.name, p.usd_per_mtok, p.tokens_per_s_per_gpu) for p in sched.states()
    ]
    for name in ("cheap", "mid", "dear"):
        assert (tp2.factor(name), tp2.observations(name)) == (tp.factor(name), tp.observations(name))
    # Same inputs from here on give the same decisions (pool versions come from the next sync).
    for s in (sched, sched2):
        for name in ("cheap", "mid", "dear"):
            s.set_pool_version(name, 20)
    assert drive(sched2, ledger2, random.Random(2), 200) == drive(sched, ledger, random.Random(2), 200)
    assert ledger2.report().model_dump() == ledger.report().model_dump()


def test_round_robin_position_is_resumed():
    pools = fleet()
    a = Scheduler(pools, ThroughputModel(pools, DENSE), policy="round_robin")
    assert [a.place() for _ in range(2)] == ["cheap", "dear"]
    b = Scheduler(pools, ThroughputModel(pools, DENSE), policy="round_robin")
    b.load_state(json.loads(json.dumps(a.state())))
    assert b.place() == a.place() == "mid"


def test_bad_states_are_refused_and_change_nothing():
    pools = fleet()
    _tp, sched, ledger = parts(pools)
    drive(sched, ledger, random.Random(3), 100)
    before = (ledger.report().model_dump(), sched.state())
    sched.load_state({})  # nothing saved yet (first checkpoint of an old run): no change
    bad_ledger = ledger.state()
    bad_ledger["pools"]["gone"] = bad_ledger["pools"].pop("mid")
    with pytest.raises(ValueError, match="unknown pool.*'gone'"):
        ledger.load_state(bad_ledger)
    with pytest.raises(ValueError, match="tokens"):
        ledger.load_state({"pools": {"mid": {"tokens": -1}}})
    with pytest.raises(ValueError, match="rollouts"):
        sched.load_state({"lengths": {"mid": {"tokens": 1.0, "rollouts": 0.0, "observed": True}}})
    with pytest.raises(ValueError, match="unknown pool.*'gone'"):
        sched.load_state({"lengths": {"gone": {"tokens": 1.0, "rollouts": 1.0, "observed": True}}})
    with pytest.raises(ValueError, match="unknown pool.*'gone'"):
        sched.load_state({"throughput": {"pools": {"gone": {"log_factor": 0.0, "observations": 1}}}})
    with pytest.raises(ValueError, match="mean_rollout_tokens"):
        sched.load_state({"mean_rollout_tokens": 5.0})
    assert (ledger.report().model_dump(), sched.state()) == before
