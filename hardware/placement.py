"""Where a pool's samplers run and what serves them: backend, remote hosts, GPUs per rank.

These are the `[[pools]]` fields that reach real hardware (the rest of ``PoolConfig`` prices
and models a pool). The models stay pure data: nothing here starts a process, opens a
socket, reads a key file or imports torch -- the orchestrator does that
(``orchestrator/entry/pool_mesh.py``) and the sampler actor (``actors/sampler``).

GPU labels versus GPUs present: ``gpu_matches(label, device_name)`` compares a pool's
catalog label with the name the CUDA driver reports (``torch.cuda.get_device_name``), so a
run can warn when a pool priced as an H100 actually runs on something else.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from hardware.catalog import canonical_gpu

__all__ = ["SGLangLaunch", "detected_gpu", "gpu_mismatch"]


class SGLangLaunch(BaseModel):
    """How a sampler launches its own SGLang server (one per GPU, `python -m <module>`)."""

    model_config = ConfigDict(extra="forbid")

    model_path: str = Field(min_length=1)
    """Checkpoint directory (or hub id the server may resolve itself) passed as
    `--model-path`; weight updates are later loaded from `weights_dir`."""
    args: list[str] = Field(default_factory=list)
    """Extra command-line arguments (`["--mem-fraction-static", "0.8"]`); `--model-path`,
    `--host` and `--port` are set by Flotilla."""
    port: int = Field(default=30000, ge=1, le=65535)
    """Port of rank 0's server; rank r listens on `port + r` (all on 127.0.0.1)."""
    module: str = "sglang.launch_server"
    """Module run with `python -m`; change it only to wrap SGLang's launcher."""
    python: str | None = None
    """Interpreter that has sglang installed; None: the sampler's own `sys.executable`."""
    health_timeout_s: float = Field(default=900.0, gt=0)
    """How long a server may take to answer `GET /health` before the run fails to start
    (model loading and CUDA-graph capture take minutes on large models)."""


# Substrings of CUDA device names (torch.cuda.get_device_name) per catalog entry. Order
# matters: "H100" must not claim an "H200", "A100" is checked with its memory size elsewhere.
_DEVICE_NAMES: tuple[tuple[str, str], ...] = (
    ("B200", "B200"),
    ("H200", "H200"),
    ("H100", "H100-SXM"),
    ("A100", "A100-80GB"),
    ("L40S", "L40S"),
)


def detected_gpu(device_name: str) -> str | None:
    """The catalog name of a CUDA device name ("NVIDIA H100 80GB HBM3" -> "H100-SXM"), or None."""
    upper = device_name.upper()
    for needle, canon in _DEVICE_NAMES:
        if needle in upper:
            return canon
    return canonical_gpu(device_name)


def gpu_mismatch(pool: str, label: str, device_names: list[str]) -> str | None:
    """A warning naming the pool when its GPUs are not what its `gpu` label says; else None.

    The label prices and models the pool, so a mismatch makes the cost report wrong but
    does not stop the run: this is a warning, not an error.
    """
    wrong = sorted({n for n in device_names if detected_gpu(n) != label})
    if not wrong:
        return None
    return (
        f"pool {pool!r} is labelled gpu {label!r} but runs on {', '.join(wrong)}: "
        "its prices and throughput model assume the label"
    )
