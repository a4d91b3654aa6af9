"""Pool fields that reach real hardware: backend, SGLang servers, hosts, GPUs per rank."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from hardware import PoolConfig, detected_gpu, gpu_mismatch


def _pool(**kw) -> PoolConfig:
    return PoolConfig.model_validate({"name": "p", "gpu": "H100", **kw})


def test_sglang_pool_connects_or_launches() -> None:
    p = _pool(backend="sglang", count=2, urls=["http://a:30000", "http://b:30000"])
    assert p.backend == "sglang" and p.device == "cuda"
    q = _pool(backend="sglang", launch={"model_path": "/ckpt", "args": ["--disable-radix-cache"]})
    assert q.launch is not None and q.launch.module == "sglang.launch_server" and q.launch.port == 30000


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"backend": "sglang"}, "exactly one of urls"),
        ({"backend": "sglang", "urls": ["http://a:1"], "launch": {"model_path": "m"}}, "exactly one of urls"),
        ({"backend": "sglang", "count": 2, "urls": ["http://a:1"]}, "urls lists 1 servers for count 2"),
        ({"backend": "sglang", "urls": ["a:1"]}, "http:// or https://"),
        ({"backend": "sglang", "device": "cpu", "urls": ["http://a:1"]}, "device must be 'cuda'"),
        ({"urls": ["http://a:1"]}, "belong to backend 'sglang'"),
        ({"backend": "vllm"}, "backend"),
        ({"hosts": ["10.0.0.5:5555"]}, "is not tcp://HOST:PORT"),
        ({"count": 2, "gpus": [0]}, "gpus must list 2 device indices"),
        ({"device": "cpu", "gpus": [0]}, "gpus is for device 'cuda' pools"),
        ({"backend": "sglang", "launch": {"model_path": "m", "port": 0}}, "port"),
        ({"backend": "sglang", "urls": ["http://a:1"], "stale_prefix": "recompute"}, "torch-backend settings"),
        ({"backend": "sglang", "urls": ["http://a:1"], "prefix_cache": False}, "torch-backend settings"),
        ({"stale_prefix": "sometimes"}, "stale_prefix"),
    ],
)
def test_impossible_placements_are_refused_naming_the_field(fields, message) -> None:
    with pytest.raises(ValidationError, match=message):
        _pool(**fields)


def test_prefix_cache_switches_load_from_the_pool_table() -> None:
    from hardware import HardwareConfig

    a, b = HardwareConfig.from_toml_text("""
[[pools]]
name = "a"
gpu = "cpu"
prefix_cache = false
[[pools]]
name = "b"
gpu = "cpu"
stale_prefix = "recompute"
""").pools
    assert (a.prefix_cache, a.stale_prefix) == (False, "reuse")
    assert (b.prefix_cache, b.stale_prefix) == (True, "recompute")


def test_device_names_map_to_the_catalog_and_mismatches_warn() -> None:
    assert detected_gpu("NVIDIA H100 80GB HBM3") == "H100-SXM"
    assert detected_gpu("NVIDIA H200") == "H200"
    assert detected_gpu("NVIDIA A100-SXM4-80GB") == "A100-80GB"
    assert detected_gpu("NVIDIA GeForce RTX 4090") is None
    assert gpu_mismatch("p", "H100-SXM", ["NVIDIA H100 80GB HBM3"] * 2) is None
    warning = gpu_mismatch("fp8-pool", "H100-SXM", ["NVIDIA H100 80GB HBM3", "NVIDIA L40S"])
    assert warning is not None and "'fp8-pool'" in warning and "NVIDIA L40S" in warning
