"""Building a pool's mesh from its config: processes, GPUs per rank, host keys, host checks."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import trio

from actors.sampler._placement import rank_device
from hardware import PoolConfig
from orchestrator.entry.pool_mesh import PoolStartError, check_hosts, host_specs, identity_env, pool_gpus, pool_procs
from orchestrator.runtime import Curve


def _pool(**kw) -> PoolConfig:
    return PoolConfig.model_validate({"name": "p", "gpu": "H100", **kw})


def test_one_process_per_gpu_and_one_gpu_per_rank() -> None:
    assert pool_procs(_pool(device="cpu", count=4)) == 1  # an emulated pool: count only prices it
    assert pool_procs(_pool(count=4)) == 4
    assert pool_gpus(_pool(count=3)) == [0, 1, 2]
    assert pool_gpus(_pool(count=2, gpus=[5, 7])) == [5, 7]
    # ranks go round-robin over hosts: each rank takes the next GPU of its own machine
    hosts = ["tcp://10.0.0.1:5555", "tcp://10.0.0.2:5555"]
    assert pool_gpus(_pool(count=4, hosts=hosts)) == [0, 0, 1, 1]
    assert pool_gpus(_pool(device="cpu")) is None
    assert rank_device("cuda", 1, [4, 6]) == "cuda:6"
    assert rank_device("cpu", 3, None) == "cpu" and rank_device("cuda:2", 0, None) == "cuda:2"
    with pytest.raises(ValueError, match="none for rank 2"):
        rank_device("cuda", 2, [0, 1])


def test_host_keys_come_from_the_keys_directory(tmp_path: Path) -> None:
    own = Curve.from_dir(tmp_path / "ctl")
    host = Curve.from_dir(tmp_path / "host")
    (tmp_path / "ctl" / "hosts").mkdir()
    shutil.copy(tmp_path / "host" / "id.key", tmp_path / "ctl" / "hosts" / "10.0.0.5_5555.key")
    pool = _pool(hosts=["tcp://10.0.0.5:5555", "tcp://10.0.0.6:5555"], keys=str(tmp_path / "ctl"))
    specs, curve, sources = host_specs(pool)
    assert curve.public == own.public
    assert specs[0].public_key == host.public.decode() and sources[0].endswith("10.0.0.5_5555.key")
    assert specs[1].public_key == own.public.decode() and "shared key pair" in sources[1]
    assert identity_env([pool])["FLOTILLA_CURVE_PUBLIC"] == own.public.decode()
    assert identity_env([_pool()]) == {}
    other = _pool(name="q", hosts=["tcp://10.0.0.7:1"], keys=str(tmp_path / "other"))
    with pytest.raises(PoolStartError, match="different keys directories"):
        identity_env([pool, other])


async def test_a_host_that_is_down_fails_naming_pool_address_and_reason(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pool = _pool(name="far", hosts=[f"tcp://127.0.0.1:{port}"], keys=str(tmp_path / "k"))
    with trio.fail_after(30), pytest.raises(PoolStartError) as err:
        await check_hosts([pool], timeout_s=2.0)
    text = str(err.value)
    assert "pool 'far'" in text and f"tcp://127.0.0.1:{port}" in text
    assert "no answer within 2 s" in text or "no connection" in text
