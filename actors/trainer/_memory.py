"""What the trainer holds: parameter counts, bytes per rank, and the measured peak.

Bytes are counted from the tensors this rank owns (its FSDP2 shards, or everything in
a single process): parameters, gradients of trained parameters (fp32, like the master
weights), and AdamW's two moments plus its step counter. The peak is measured, not
estimated: the process's resident-set high-water mark (``getrusage`` ``ru_maxrss``,
which includes the interpreter, libraries and allocator slack) and, on CUDA,
``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["memory_line", "peak_rss_mb", "size_report"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(ts: Iterable[torch.Tensor]) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in ts)


def peak_rss_mb() -> float:
    """This process's peak resident set size so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def size_report(
    model: torch.nn.Module, trained: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer, rank: int, ranks: int
) -> dict[str, Any]:
    """Counts and this rank's bytes; optimizer bytes count the state that exists now (zero
    before the first step), so call it again after one step for the steady state."""
    params = list(model.parameters())
    opt: list[torch.Tensor] = [v for st in optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    fp32 = 4
    report: dict[str, Any] = {
        "rank": rank,
        "ranks": ranks,
        "pid": os.getpid(),
        "params": sum(p.numel() for p in params),
        "trainable_params": sum(p.numel() for p in trained.values()),
        "param_bytes": _bytes(params),
        "grad_bytes": sum(_local(p).numel() * fp32 for p in trained.values()),
        "optimizer_bytes": _bytes(opt),
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        report["peak_cuda_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return report


def memory_line(report: dict[str, Any]) -> str:
    """One human line of a ``size_report``."""
    mb = 2**20
    line = (
        f"trainer: {report['params']:,} parameters ({report['trainable_params']:,} trained), "
        f"{report['ranks']} rank(s); per rank: parameters {report['param_bytes'] / mb:.1f} MiB, "
        f"gradients {report['grad_bytes'] / mb:.1f} MiB, optimizer "
        f"{report['optimizer_bytes'] / mb:.1f} MiB; peak RSS after the first step "
        f"{report['peak_rss_mb']:.0f} MiB"
    )
    if "peak_cuda_mb" in report:
        line += f", peak CUDA {report['peak_cuda_mb']:.0f} MiB"
    return line
