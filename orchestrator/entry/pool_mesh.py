"""A sampler pool's mesh, built from its ``[[pools]]`` config (``hardware.PoolConfig``).

The run composes pools through three calls:

* ``await check_hosts(pools)`` before anything starts: every ``flotilla host`` a pool names
  answers a ping over tcp + CurveZMQ, or the run stops with ``PoolStartError`` naming the
  pool, the address and the reason (down, key refused, wrong host key);
* ``pool_mesh(pool, model_config, seed=..., env=...)``: the ``open_mesh`` context of the
  pool's ``SamplerActor`` ranks -- on the controller's machine or spread round-robin over
  the pool's hosts; with its backend (torch or SGLang: servers given by ``urls`` or
  launched per rank) and, for ``device = "cuda"``, one GPU per rank;
* ``await gpu_warnings(pool, mesh)`` once it is open: the CUDA devices the ranks report,
  checked against the pool's ``gpu`` label (a mismatch is a warning: the run goes on).

Key files (``keys = DIR``): the controller's key pair is ``DIR/id.key_secret`` (created on
first use); the public key of host ``tcp://IP:PORT`` is ``DIR/hosts/IP_PORT.key`` or
``DIR/hosts/IP.key``, else the controller's own (machines that share one key pair, as the
Kubernetes recipe's Secret does). Each host needs the controller's ``DIR/id.key`` in its
``allowed/``.
"""

from __future__ import annotations

import os
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import trio

from orchestrator.controller.hosts import host_specs
from orchestrator.runtime import ActorDied, ActorError, Curve, HostSpec, Mesh, open_mesh
from orchestrator.state.config import ConfigError

__all__ = ["PoolStartError", "check_hosts", "gpu_warnings", "pool_gpus", "pool_mesh", "pool_procs"]

HOST_TIMEOUT_S = 15.0
"""How long a host may take to answer its ping (the connection itself gives up after 10 s)."""


class PoolStartError(ConfigError):
    """A pool that cannot start; the message names the pool, the address and the reason."""


def pool_procs(pool: Any) -> int:
    """Sampler processes of a pool: one per GPU, except a CPU-emulated torch pool (one
    process; its ``count`` only prices it)."""
    return 1 if pool.device == "cpu" and pool.backend == "torch" else pool.count


def pool_gpus(pool: Any) -> list[int] | None:
    """The CUDA index of each rank: the pool's ``gpus``, or automatic -- the rank's position
    among the ranks on its machine (ranks go round-robin over hosts)."""
    if pool.device != "cuda":
        return None
    if pool.gpus is not None:
        return list(pool.gpus)
    per = max(1, len(pool.hosts))
    return [r // per for r in range(pool.count)]


async def check_hosts(pools: list[Any], timeout_s: float = HOST_TIMEOUT_S) -> dict[str, list[str]]:
    """Ping every host of every pool, concurrently; ``PoolStartError`` naming each that
    fails, except for elastic pools, which need only ``min_hosts`` of theirs to answer.
    Returns the hosts that answered, per pool with hosts.

    Cancellation abandons the pings. Nothing is spawned on any host.
    """
    from orchestrator.runtime import host as _host  # noqa: F401 - typed endpoints of host handles

    failures: list[str] = []
    answered: dict[str, list[str]] = {p.name: [] for p in pools if p.hosts}
    elastic_failures: dict[str, list[str]] = {}

    async def ping(pool: Any, spec: HostSpec, curve: Curve, source: str) -> None:
        mesh: Mesh[Any] = Mesh(
            f"host {spec.address}",
            "orchestrator.runtime.host:HostActor",
            ["ping"],
            [spec.address],
            [spec.public_key],
            identity=curve,
        )
        reason = None
        with trio.move_on_after(timeout_s):
            try:
                await mesh[0].ping.call_one()
                answered[pool.name].append(spec.address)
                return
            except ActorDied as exc:
                reason = exc.reason
            except ActorError as exc:
                reason = f"{exc.remote_type}: {exc.message}"
        reason = reason or f"no answer within {timeout_s:g} s"
        (elastic_failures.setdefault(pool.name, []) if pool.elastic else failures).append(
            f"pool {pool.name!r}: host {spec.address} cannot be used: {reason}. Check that "
            f"`flotilla host` runs there, that its public key is {source}, and that this "
            f"controller's key ({Path(os.path.expanduser(pool.keys)) / 'id.key'}) is in the "  # noqa: ASYNC240 - no I/O
            "host's allowed/ directory"
        )

    async with trio.open_nursery() as nursery:
        for pool in pools:
            if pool.hosts:
                specs, curve, sources = host_specs(pool)
                for spec, source in zip(specs, sources, strict=True):
                    nursery.start_soon(ping, pool, spec, curve, source)
    for pool in pools:
        if pool.elastic and len(answered.get(pool.name, [])) < pool.min_hosts:
            failures.extend(elastic_failures.get(pool.name, []))
    if failures:
        raise PoolStartError("\n".join(sorted(failures)))
    return {name: [h for h in p.hosts if h in answered[name]] for name, p in ((p.name, p) for p in pools if p.hosts)}


def pool_mesh(
    pool: Any,
    model_config: dict[str, Any] | str,
    *,
    seed: int,
    env: dict[str, str],
    max_len: int | None = None,
    weights_key: str | None = None,
    restart_timeout: float | None = None,
    present: list[str] | None = None,
) -> AbstractAsyncContextManager[Mesh[Any]]:
    """The ``open_mesh`` context of the pool's samplers (see the module docstring).

    An elastic pool has ``max_hosts`` ranks: one on each host of ``present`` (those that
    answered ``check_hosts``; default: all its hosts), the others vacant until a host
    joins (``MeshPool.place``).

    Samplers start with no weights (version -1) and wait for the trainer's keyframe.
    ``max_len``: tokens per KV-cache slot (the run's ``[model] max_seq_len``);
    ``weights_key``: the run's key that sealed weight messages must carry;
    ``restart_timeout``: seconds a respawned rank may take to start (``open_mesh``).
    """
    from actors.sampler import SamplerActor

    placement: dict[str, Any] = {}
    procs = pool_procs(pool)
    if pool.elastic:
        specs, curve, _ = host_specs(pool)
        specs = [s for s in specs if present is None or s.address in present]
        procs = len(specs)
        placement = {"hosts": specs, "curve": curve, "vacant": pool.max_hosts - procs}
    elif pool.hosts:
        specs, curve, _ = host_specs(pool)
        placement = {"hosts": specs, "curve": curve}
    sglang = None
    if pool.backend == "sglang":
        sglang = {
            "urls": pool.urls,
            "weights_dir": pool.weights_dir,
            "launch": pool.launch.model_dump() if pool.launch is not None else None,
        }
    return open_mesh(
        SamplerActor,
        pool.name,
        pool.precision,
        model_config,
        pool.device,
        init_seed=None,
        max_batch=pool.capacity,
        max_len=max_len,
        staleness_budget=pool.staleness_budget,
        weights_key=weights_key,
        seed=seed,
        backend=pool.backend,
        sglang=sglang,
        gpus=[0] * pool.max_hosts if pool.elastic and pool.device == "cuda" else pool_gpus(pool),
        prefix_cache=pool.prefix_cache,
        stale_prefix=pool.stale_prefix,
        emulate_quant=pool.emulate_quant,
        procs=procs,
        name=f"sampler-{pool.name}",
        env=env,
        restart_timeout=restart_timeout,
        **placement,
    )


async def gpu_warnings(pool: Any, mesh: Mesh[Any]) -> list[str]:
    """Warnings for a ``cuda`` pool whose ranks run on GPUs other than its ``gpu`` label."""
    from hardware import gpu_mismatch

    if pool.device != "cuda":
        return []
    names = [n for rank in await mesh.device_names.call() for n in rank]
    warning = gpu_mismatch(pool.name, pool.gpu, names) if names else None
    return [warning] if warning else []


def identity_env(pools: list[Any]) -> dict[str, str]:
    """Environment that gives local actor processes (environments call samplers) the
    controller's CurveZMQ identity when some pool runs on hosts; empty otherwise.

    Raises PoolStartError when remote pools name different key directories: a process
    presents one identity.
    """
    dirs = sorted({os.path.expanduser(p.keys) for p in pools if p.hosts or p.elastic})
    if not dirs:
        return {}
    if len(dirs) > 1:
        raise PoolStartError(
            f"pools with hosts name different keys directories ({', '.join(dirs)}); use one for all of them"
        )
    return Curve.from_dir(dirs[0]).to_env()
