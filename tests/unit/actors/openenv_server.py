"""``serve_openenv``: the example OpenEnv environment's server (examples/libraries/openenv_env.py)
as a real uvicorn process on a free loopback port, for as long as the context lasts."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_openenv(log: Path) -> Iterator[str]:
    """Yield the server's base URL once ``/health`` answers (60 s at most); stop it after."""
    port = _free_port()
    with log.open("wb") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "--app-dir",
                str(ROOT / "examples/libraries"),
                "openenv_env:app",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--log-level",
                "warning",
            ],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):  # the server imports fastapi and gradio first
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"the OpenEnv server exited: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        else:
            raise RuntimeError("the OpenEnv server did not answer /health within 60 s")
        yield url
    finally:
        proc.kill()
        proc.wait()
