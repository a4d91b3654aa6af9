"""CurveZMQ identities for tcp meshes.

Trust model: every process has one keypair, used as its server key when it
serves actors and as its client key when it calls them. A serving process
accepts a client only if the client's public key is in its allowed set (its
own key is always allowed, so actors of one mesh can call each other). Across
machines, put every participant's public key in every host's ``allowed/``
directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.auth

__all__ = ["Curve", "default_identity", "set_default_identity", "start_authenticator"]


@dataclass(frozen=True)
class Curve:
    """A CurveZMQ keypair (z85 bytes) and the client public keys a server accepts."""

    public: bytes
    secret: bytes
    allowed: frozenset[bytes] = field(default_factory=frozenset)

    @classmethod
    def generate(cls, allowed: tuple[bytes, ...] = ()) -> Curve:
        public, secret = zmq.curve_keypair()
        return cls(public, secret, frozenset(allowed))

    def allowing(self, *keys: bytes | str) -> Curve:
        """A copy that also accepts clients with these public keys."""
        extra = {k.encode() if isinstance(k, str) else k for k in keys}
        return Curve(self.public, self.secret, self.allowed | extra)

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Curve:
        """Load ``id.key_secret`` (created on first use) and the keys in ``allowed/*.key``."""
        root = Path(path)
        secret_file = root / "id.key_secret"
        if not secret_file.exists():
            root.mkdir(parents=True, exist_ok=True)
            zmq.auth.create_certificates(root, "id")
        public, secret = zmq.auth.load_certificate(secret_file)
        assert secret is not None
        allowed = set()
        if (root / "allowed").is_dir():
            for f in sorted((root / "allowed").glob("*.key")):
                allowed.add(zmq.auth.load_certificate(f)[0])
        return cls(public, secret, frozenset(allowed))

    def to_env(self) -> dict[str, str]:
        """How a spawner hands this identity to a child process it trusts."""
        return {"FLOTILLA_CURVE_PUBLIC": self.public.decode(),
                "FLOTILLA_CURVE_SECRET": self.secret.decode(),
                "FLOTILLA_CURVE_ALLOWED": ",".join(k.decode() for k in sorted(self.allowed))}

    @classmethod
    def from_env(cls) -> Curve | None:
        public = os.environ.get("FLOTILLA_CURVE_PUBLIC")
        secret = os.environ.get("FLOTILLA_CURVE_SECRET")
        if not public or not secret:
            return None
        allowed = os.environ.get("FLOTILLA_CURVE_ALLOWED", "")
        return cls(public.encode(), secret.encode(),
                   frozenset(k.encode() for k in allowed.split(",") if k))

    def serve(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` a CurveZMQ server with this keypair."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True


_identity: Curve | None = None


def default_identity() -> Curve | None:
    """The keypair this process presents as a client when a handle says nothing else."""
    global _identity
    if _identity is None:
        _identity = Curve.from_env()
    return _identity


def set_default_identity(curve: Curve) -> None:
    """Use ``curve`` for handles that arrive without one, unless an identity is already set."""
    global _identity
    if default_identity() is None:
        _identity = curve


class _Allowed:
    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return zmq.utils.z85.encode(key) in self.keys if len(key) == 32 else key in self.keys


def start_authenticator(ctx: zmq.Context[Any], curve: Curve) -> Any:
    """A ZAP handler (thread) accepting only ``curve.allowed`` plus our own key."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_Allowed(
        curve.allowed | {curve.public}))
    return auth
