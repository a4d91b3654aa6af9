"""CurveZMQ identities for tcp meshes.

Trust model: every process has one keypair, used as its server key when it
serves actors and as its client key when it calls them. A serving process
accepts a client only if the client's public key is in its allowed set. Actor
processes also accept their own key, so actors of one mesh can call each other;
an actor *host* (`orchestrator.runtime.host`) does not, unless started with
``--trust-own-key``: its ``spawn`` imports and runs code, so only the keys in
its ``allowed/`` directory may call it. Across machines, put every
participant's public key in every host's ``allowed/`` directory.

Key files: a key directory is mode 0700 and its secret key file 0600. A new
secret key is created that way; an existing one that others can read, or that
sits in a directory others can enter, is refused (`KeyFileError`, naming the
file and the chmod that fixes it), as ssh refuses an unprotected private key.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.auth

__all__ = ["Curve", "KeyFileError", "default_identity", "set_default_identity", "start_authenticator"]

TRUST_SELF_ENV = "FLOTILLA_CURVE_TRUST_SELF"
"""Set to "0" in a serving process that must not accept its own public key (an actor host)."""


class KeyFileError(PermissionError):
    """A key directory or secret key file is readable (or enterable) by other users."""


def _private_dir(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o700)


def _check_private(path: Path, *, want: int) -> None:
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        what = "key directory" if path.is_dir() else "secret key file"
        raise KeyFileError(f"{what} {path} is accessible to other users (mode {mode:04o}); run: chmod {want:o} {path}")


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
        """Load ``id.key_secret`` (created on first use, mode 0600 in a 0700 directory) and
        the keys in ``allowed/*.key``. Raises KeyFileError for a secret others can read."""
        root = Path(path)
        secret_file = root / "id.key_secret"
        if not secret_file.exists():
            _private_dir(root)  # before the secret exists: no moment where others can read it
            zmq.auth.create_certificates(root, "id")
            os.chmod(secret_file, 0o600)
        _check_private(root, want=0o700)
        _check_private(secret_file, want=0o600)
        public, secret = zmq.auth.load_certificate(secret_file)
        assert secret is not None
        allowed = set()
        if (root / "allowed").is_dir():
            for f in sorted((root / "allowed").glob("*.key")):
                allowed.add(zmq.auth.load_certificate(f)[0])
        return cls(public, secret, frozenset(allowed))

    def to_env(self) -> dict[str, str]:
        """How a spawner hands this identity to a child process it trusts."""
        return {
            "FLOTILLA_CURVE_PUBLIC": self.public.decode(),
            "FLOTILLA_CURVE_SECRET": self.secret.decode(),
            "FLOTILLA_CURVE_ALLOWED": ",".join(k.decode() for k in sorted(self.allowed)),
        }

    @classmethod
    def from_env(cls) -> Curve | None:
        public = os.environ.get("FLOTILLA_CURVE_PUBLIC")
        secret = os.environ.get("FLOTILLA_CURVE_SECRET")
        if not public or not secret:
            return None
        allowed = os.environ.get("FLOTILLA_CURVE_ALLOWED", "")
        return cls(public.encode(), secret.encode(), frozenset(k.encode() for k in allowed.split(",") if k))

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


def start_authenticator(ctx: zmq.Context[Any], curve: Curve, *, trust_self: bool = True) -> Any:
    """A ZAP handler (thread) accepting only ``curve.allowed``, plus our own key when
    ``trust_self``."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(
        domain="*", credentials_provider=_Allowed(curve.allowed | ({curve.public} if trust_self else set()))
    )
    return auth
