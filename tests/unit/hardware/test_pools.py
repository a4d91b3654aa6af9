"""Catalog contents, pool validation (every refusal names its field and pool), TOML loading."""

import math

import pytest
from pydantic import BaseModel, ValidationError

from hardware import CATALOG, SOURCES, HardwareConfig, PoolConfig, PoolList, catalog_markdown, gpu_spec


def test_catalog_has_the_required_types_with_sources():
    for name in ("A100-80GB", "H100-SXM", "H200", "B200", "L40S", "cpu"):
        s = CATALOG[name]
        assert s.memory_gb > 0 and s.bandwidth_gbps > 0 and s.bf16_tflops > 0 and s.price_per_hour > 0
        assert any(key in s.sources for key in SOURCES), name
    assert CATALOG["A100-80GB"].fp8_tflops is None and not CATALOG["A100-80GB"].has_fp8
    assert CATALOG["cpu"].fp8_tflops is None
    for name in ("H100-SXM", "H200", "B200", "L40S"):
        assert CATALOG[name].fp8_tflops == pytest.approx(2 * CATALOG[name].bf16_tflops, rel=0.02)
    assert gpu_spec("h100").name == "H100-SXM"
    with pytest.raises(KeyError, match="unknown GPU 'X1'"):
        gpu_spec("X1")
    table = catalog_markdown()
    assert "| B200 | 180 | 8,000 |" in table and "S4:" in table


def test_defaults_come_from_the_catalog_and_aliases_are_canonical():
    p = PoolConfig(name="p", gpu="h200", count=3, precision="fp8")
    assert p.gpu == "H200"
    assert p.price == CATALOG["H200"].price_per_hour == p.price_per_gpu_hour
    assert p.capacity == 64 * 3
    assert p.staleness_budget == 2 and p.device == "cuda" and not p.emulated
    assert PoolConfig(name="e", gpu="H200", device="cpu").emulated
    c = PoolConfig(name="c", gpu="cpu")
    assert c.device == "cpu" and not c.emulated
    # The resolved config (what a run saves) carries the numbers actually used.
    dumped = p.model_dump()
    assert dumped["price_per_gpu_hour"] == CATALOG["H200"].price_per_hour
    assert dumped["max_concurrent_rollouts"] == 192
    assert PoolConfig.model_validate(dumped) == p


def _refusal(field: str, pool: str, **kw) -> str:
    with pytest.raises(ValidationError) as e:
        PoolConfig(name=pool, **{"gpu": "H100-SXM", **kw})
    errors = e.value.errors()
    assert len(errors) == 1, errors
    assert errors[0]["loc"] == (field,), errors
    text = str(e.value)
    assert field in text and (pool in text or errors[0]["type"] == "literal_error")
    return text


def test_unknown_gpu_is_refused_naming_field_and_pool():
    text = _refusal("gpu", "west", gpu="X100")
    assert "unknown GPU 'X100'" in text and "B200" in text


def test_fp8_on_a_gpu_without_fp8_is_refused():
    text = _refusal("precision", "old", gpu="A100-80GB", precision="fp8")
    assert "pool 'old'" in text and "A100-80GB" in text and "fp8" in text
    _refusal("precision", "cpu-pool", gpu="cpu", precision="fp8")


@pytest.mark.parametrize("count", [0, -2])
def test_count_must_be_positive(count):
    text = _refusal("count", "zero", count=count)
    assert f"got {count}" in text


@pytest.mark.parametrize("price", [-0.01, math.nan])
def test_price_must_not_be_negative(price):
    text = _refusal("price_per_gpu_hour", "cheap", price_per_gpu_hour=price)
    assert "pool 'cheap'" in text


def test_other_refusals_name_their_field():
    _refusal("staleness_budget", "s", staleness_budget=-1)
    _refusal("max_concurrent_rollouts", "m", max_concurrent_rollouts=0)
    _refusal("device", "d", gpu="cpu", device="cuda")
    _refusal("precision", "p", precision="int4")
    with pytest.raises(ValidationError) as e:
        PoolConfig(name="x", gpu="B200", colour="red")
    assert e.value.errors()[0]["loc"] == ("colour",)


def test_duplicate_pool_names_are_refused_naming_pools_and_positions():
    with pytest.raises(ValidationError) as e:
        HardwareConfig(pools=[{"name": "a", "gpu": "B200"}, {"name": "b", "gpu": "H200"}, {"name": "a", "gpu": "L40S"}])
    err = e.value.errors()[0]
    assert err["loc"] == ("pools",)
    assert "duplicate pool name 'a' at positions 0 and 2" in str(e.value)


def test_pool_list_works_nested_in_another_config():
    class RunConfig(BaseModel):
        pools: PoolList

    ok = RunConfig(pools=[{"name": "a", "gpu": "B200"}])
    assert ok.pools[0].price == CATALOG["B200"].price_per_hour
    with pytest.raises(ValidationError) as e:
        RunConfig(pools=[{"name": "a", "gpu": "B200"}, {"name": "a", "gpu": "B200"}])
    assert "duplicate pool name 'a'" in str(e.value)
    with pytest.raises(ValidationError) as e:
        RunConfig(pools=[{"name": "a", "gpu": "B200"}, {"name": "b", "gpu": "B200", "count": 0}])
    assert e.value.errors()[0]["loc"] == ("pools", 1, "count")
    assert "pool 'b'" in str(e.value)


def test_pools_load_from_toml(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        """
[model]
hidden_size = 64

[[pools]]
name = "fast"
gpu = "B200"
count = 8
device = "cuda"
region = "us-east"

[[pools]]
name = "cheap"
gpu = "H200"
precision = "fp8"
price_per_gpu_hour = 3.5
staleness_budget = 4
max_concurrent_rollouts = 100
"""
    )
    hw = HardwareConfig.from_toml(path)
    assert [p.name for p in hw.pools] == ["fast", "cheap"]
    fast, cheap = hw.pool("fast"), hw.pool("cheap")
    assert fast.count == 8 and fast.region == "us-east" and fast.capacity == 512
    assert cheap.price == 3.5 and cheap.precision == "fp8" and cheap.capacity == 100
    with pytest.raises(KeyError, match="no pool 'x'; pools: fast, cheap"):
        hw.pool("x")
    with pytest.raises(ValidationError) as e:
        HardwareConfig.from_toml_text('[[pools]]\nname = "a"\ngpu = "A100"\nprecision = "fp8"\n')
    assert e.value.errors()[0]["loc"] == ("pools", 0, "precision")
    with pytest.raises(ValidationError):
        HardwareConfig.from_toml_text("[model]\nx = 1\n")  # no pools at all


def test_elastic_pools_check_their_host_bounds():
    p = PoolConfig(name="spot", gpu="L40S", elastic=True, hosts_file="hosts.txt")
    assert p.max_hosts == 1 and p.min_hosts == 0
    p = PoolConfig(name="spot", gpu="L40S", elastic=True, hosts=["tcp://10.0.0.5:5555"], max_hosts=4, min_hosts=1)
    assert p.max_hosts == 4
    with pytest.raises(ValidationError, match="min_hosts <= len\\(hosts\\) <= max_hosts"):
        PoolConfig(name="spot", gpu="L40S", elastic=True, hosts=["tcp://10.0.0.5:5555"] * 2, max_hosts=1)
    with pytest.raises(ValidationError, match="min_hosts <= len"):
        PoolConfig(name="spot", gpu="L40S", elastic=True, min_hosts=1)
    with pytest.raises(ValidationError, match="are for elastic pools"):
        PoolConfig(name="fixed", gpu="L40S", max_hosts=2)
    with pytest.raises(ValidationError, match="one torch sampler per host"):
        PoolConfig(name="spot", gpu="L40S", elastic=True, count=2)
