"""The hosts of pools placed on `flotilla host` machines: their keys, and whether one may
join an elastic pool now.

Key files (a pool's ``keys = DIR``): the controller's key pair is ``DIR/id.key_secret``;
the public key of host ``tcp://IP:PORT`` is ``DIR/hosts/IP_PORT.key`` or
``DIR/hosts/IP.key``, else the controller's own (machines sharing one key pair).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import trio

from orchestrator.runtime import ActorDied, ActorError, Curve, HostSpec

__all__ = ["host_specs", "probe_host", "read_hosts_file"]


def _curve(pool: Any) -> Curve:
    return Curve.from_dir(os.path.expanduser(pool.keys))


def _host_key(keys: Path, address: str, own: Curve) -> tuple[str, str]:
    """(public key, where it came from) of the host at ``address``."""
    import zmq.auth

    ip, _, port = address.removeprefix("tcp://").rpartition(":")
    for name in (f"{ip}_{port}.key", f"{ip}.key"):
        f = keys / "hosts" / name
        if f.is_file():
            return zmq.auth.load_certificate(f)[0].decode(), str(f)
    return own.public.decode(), f"the shared key pair {keys / 'id.key'}"


def host_specs(pool: Any, addresses: list[str] | None = None) -> tuple[list[HostSpec], Curve, list[str]]:
    """The pool's hosts (or `addresses`) with their public keys, the controller's identity,
    and each key's source."""
    curve = _curve(pool)
    keys = Path(os.path.expanduser(pool.keys))
    specs, sources = [], []
    for address in pool.hosts if addresses is None else addresses:
        key, source = _host_key(keys, address, curve)
        specs.append(HostSpec(address=address, public_key=key))
        sources.append(source)
    return specs, curve, sources


async def probe_host(pool: Any, address: str, timeout_s: float = 5.0) -> tuple[HostSpec | None, str]:
    """Whether the host at `address` may join elastic `pool` now: (its spec, "") when it
    answers over CurveZMQ with the key the pool expects and is not leaving the run (a host
    that got SIGTERM serves on a while to tell its owners so), else (None, the reason)."""
    from orchestrator.runtime import host as _host  # noqa: F401 - typed endpoints of host handles
    from orchestrator.runtime import host_mesh

    (spec,), curve, _ = host_specs(pool, [address])
    mesh = host_mesh(spec, curve)
    with trio.move_on_after(timeout_s):
        try:
            reason = await mesh[0].joinable.call_one()
            return (spec, "") if not reason else (None, reason)
        except ActorDied as exc:
            return None, exc.reason
        except ActorError as exc:
            return None, f"{exc.remote_type}: {exc.message}"
    return None, f"no answer within {timeout_s:g} s"


def read_hosts_file(path: str) -> list[str]:
    """The `tcp://HOST:PORT` lines of an elastic pool's hosts file (no file: none)."""
    try:
        text = Path(os.path.expanduser(path)).read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("tcp://") and line.rpartition(":")[2].isdigit():
            out.append(line)
    return out
