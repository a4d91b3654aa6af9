"""Per-rank placement of a sampler: its CUDA device, and its SGLang server.

A pool's ranks are processes of one mesh; each learns its rank from the runtime
(``current_rank()``) and picks its own share of the pool here: ``gpus[rank]`` (or
``rank`` modulo the visible devices), ``urls[rank]``, or a launched server on port
``launch.port + rank`` with ``CUDA_VISIBLE_DEVICES`` = its GPU.
"""

from __future__ import annotations

from typing import Any

__all__ = ["rank_device", "sglang_backend"]


def rank_device(device: str, rank: int, gpus: list[int] | None) -> str:
    """``cuda`` becomes ``cuda:<index>`` for this rank; ``cpu`` and ``cuda:i`` stay as given.

    Raises ValueError when ``gpus`` has no entry for the rank or CUDA has no devices.
    """
    if device != "cuda":
        return device
    if gpus is not None:
        if rank >= len(gpus):
            raise ValueError(f"gpus lists {len(gpus)} devices, none for rank {rank}")
        return f"cuda:{gpus[rank]}"
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError("device 'cuda' but no CUDA device is visible to this process")
    return f"cuda:{rank % count}"


def sglang_backend(
    pool: str, model_config: dict[str, Any] | str, rank: int, gpus: list[int] | None, settings: dict[str, Any]
) -> Any:
    """The ``SGLangBackend`` of one rank from the pool's settings (see ``SamplerActor``)."""
    from ._sglang import SGLangBackend

    urls, launch = settings.get("urls"), settings.get("launch")
    common = {
        "pool": pool,
        "model_config": model_config,
        "weights_dir": settings.get("weights_dir"),
        "rank": rank,
        "pause_mode": settings.get("pause_mode", "retract"),
    }
    if urls:
        if rank >= len(urls):
            raise ValueError(f"pool {pool!r}: urls lists {len(urls)} servers, none for rank {rank}")
        return SGLangBackend(url=urls[rank], **common)
    if launch:
        gpu = gpus[rank] if gpus is not None and rank < len(gpus) else rank
        return SGLangBackend(launch=launch, port=int(launch.get("port", 30000)) + rank, gpu=gpu, **common)
    raise ValueError(f"pool {pool!r}: backend 'sglang' needs urls or launch")
