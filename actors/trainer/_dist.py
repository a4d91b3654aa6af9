"""The trainer's process group: rendezvous, each rank's share of a batch, small collectives.

A trainer mesh of N processes forms one ``torch.distributed`` group: gloo on CPU,
NCCL on CUDA. Rank 0's rendezvous address is ``[trainer] rendezvous`` when given
(multi-node), else ``MASTER_ADDR``/``MASTER_PORT`` from the environment when set
(torchrun style), else a free loopback port chosen by whoever opens the mesh. Every
rank then sees torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``) in its environment and joins with ``env://``.

Every rank receives the whole batch, so the quantities that span it (GRPO advantages,
the global loss-token count N) are computed identically everywhere; each rank then
trains on its share of the trajectories, chosen by tokens (``token_shares``). Because
the loss of every token is divided by the same N and the ranks' gradients are SUMMED
(not averaged), the step equals the single-process step on the whole batch.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["World", "all_max", "free_port", "gather_json", "init_group", "rendezvous_address", "token_shares"]


@dataclass(frozen=True)
class World:
    """This process's place in the trainer group (``size`` 1: no group, or a group of one)."""

    rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that talks to the controller about versions and publishes."""
        return self.rank == 0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rendezvous_address(configured: str | None, env: Mapping[str, str] = os.environ) -> str:
    """``host:port`` of rank 0: the configured address, else torchrun's ``MASTER_ADDR`` /
    ``MASTER_PORT``, else a free loopback port. Raises ValueError for a malformed address."""
    if configured is None and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        configured = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    if configured is None:
        return f"127.0.0.1:{free_port()}"
    host, sep, port = configured.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"trainer.rendezvous must be 'host:port', got {configured!r}")
    return configured


def init_group(address: str, world: World, device: str, timeout_s: float = 300.0) -> None:
    """Join the trainer group at ``address`` as ``world.rank`` (blocks until all ranks are in).

    Sets torchrun's environment variables first, so code that reads them sees this
    group. On CUDA the process takes GPU ``LOCAL_RANK`` (rank modulo the visible GPUs).
    Collectives fail after ``timeout_s`` instead of hanging forever when a peer is gone.
    """
    host, _, port = address.rpartition(":")
    local = world.rank
    if device == "cuda":
        local = world.rank % max(1, torch.cuda.device_count())
        torch.cuda.set_device(local)
    os.environ.update(
        MASTER_ADDR=host, MASTER_PORT=port, RANK=str(world.rank), WORLD_SIZE=str(world.size), LOCAL_RANK=str(local)
    )
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        init_method="env://",
        rank=world.rank,
        world_size=world.size,
        timeout=timedelta(seconds=timeout_s),
    )


def token_shares(sizes: Sequence[int], parts: int) -> list[list[int]]:
    """Split items of ``sizes`` tokens into ``parts`` lists of indices with balanced token
    totals: longest first onto the lightest part (ties: lowest part). Deterministic, so
    every rank computes the same split; a part may be empty when items are few."""
    loads = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        k = min(range(parts), key=lambda p: (loads[p], p))
        out[k].append(i)
        loads[k] += sizes[i]
    return [sorted(p) for p in out]


def all_max(value: int, device: torch.device) -> int:
    """The largest ``value`` over the group (every rank calls it)."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def gather_json(value: Any, world: World, device: torch.device) -> list[Any]:
    """Every rank's JSON-able ``value``, in rank order, on every rank. Travels as UTF-8
    bytes in a uint8 tensor: nothing is pickled."""
    if world.size == 1:
        return [value]
    raw = torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world.size)]
    dist.all_gather(sizes, torch.tensor([raw.numel()], dtype=torch.int64, device=device))
    width = max(int(s.item()) for s in sizes)
    buf = torch.zeros(width, dtype=torch.uint8, device=device)
    buf[: raw.numel()] = raw.to(device)
    bufs = [torch.empty_like(buf) for _ in range(world.size)]
    dist.all_gather(bufs, buf)
    return [json.loads(bytes(b[: int(s.item())].cpu().numpy().tobytes())) for b, s in zip(bufs, sizes, strict=True)]
