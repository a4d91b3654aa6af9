"""GPU catalog: memory, bandwidth, dense tensor throughput and a typical on-demand price.

Every figure names its public source and date. Throughput figures are *dense* (no 2:4
sparsity) peak tensor-core numbers from NVIDIA's datasheets, which print the sparse figure
first and the dense one as half of it. Prices are on-demand list prices per GPU-hour of one
provider (Modal, per-second billing, so a busy GPU-second is what is paid for), chosen because
the reference heterogeneous run ran there and because one provider keeps the ratios between
GPU types consistent. Prices move; re-check them before quoting a cost report as money.

Sources are listed in SOURCES (keys S1..S8); each figure below names its key.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CATALOG", "SOURCES", "GpuSpec", "canonical_gpu", "catalog_markdown", "gpu_spec"]

SOURCES: dict[str, str] = {
    "S1": "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column (2021 revision).",
    "S2": "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column (2023 revision).",
    "S3": "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column (2024).",
    "S4": "NVIDIA HGX B200 / DGX B200 datasheets (2024); per GPU = 8-GPU system figure / 8 "
    "(1,440 GB, 64 TB/s, 72 PFLOPS sparse FP8, 36 PFLOPS sparse BF16).",
    "S5": "NVIDIA L40S GPU datasheet (2023).",
    "S6": "modal.com/pricing per-second rates x 3600, as copied by third-party price comparisons "
    "verified 2026-05-07 (techbytes.app, 'Serverless GPU Pricing Matrix') and 2026-06-27 "
    "(beam.cloud, 'Modal Pricing Explained'): H100 $0.001097/s, A100-80GB $0.000694/s, "
    "L40S $0.000542/s, CPU $0.0000131 per physical core per second.",
    "S7": "modal.com/pricing H200 $0.001261/s and B200 $0.001736/s as listed in 2025; recalled, "
    "not re-verified against a 2026 copy when this catalog was written (2026-11-30).",
    "S8": "Measured on this machine class (2 vCPU = 1 physical core, Xeon Sapphire Rapids with "
    "AMX-BF16, 23 GiB RAM) on 2026-11-30, torch 2.13, 2 threads, other jobs sharing the machine: "
    "256 MiB read ~12 GB/s, 2048^3 BF16 matmul ~0.73 TFLOPS.",
}


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One accelerator type; figures per GPU."""

    name: str
    memory_gb: float
    """Device memory in GB (10^9 bytes)."""
    bandwidth_gbps: float
    """Peak memory bandwidth in GB/s."""
    bf16_tflops: float
    """Dense BF16 tensor throughput, TFLOPS."""
    fp8_tflops: float | None
    """Dense FP8 tensor throughput, TFLOPS; None where the chip has no FP8 arithmetic."""
    price_per_hour: float
    """Typical on-demand price of one GPU for one hour, USD."""
    sources: str
    """Where the figures come from (keys into this module's source list) and their date."""

    @property
    def has_fp8(self) -> bool:
        return self.fp8_tflops is not None


CATALOG: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in (
        GpuSpec(
            name="A100-80GB",
            memory_gb=80.0,  # S1: 80GB HBM2e
            bandwidth_gbps=2039.0,  # S1: 2,039 GB/s (SXM)
            bf16_tflops=312.0,  # S1: BF16 312 | 624* TFLOPS (*sparsity)
            fp8_tflops=None,  # Ampere has no FP8 tensor cores (S1 lists none)
            price_per_hour=2.4984,  # S6: $0.000694/s
            sources="S1 (2021); price S6 (2026-05)",
        ),
        GpuSpec(
            name="H100-SXM",
            memory_gb=80.0,  # S2: 80GB HBM3
            bandwidth_gbps=3350.0,  # S2: 3.35 TB/s
            bf16_tflops=989.0,  # S2: BF16 1,979* TFLOPS sparse -> 989 dense
            fp8_tflops=1979.0,  # S2: FP8 3,958* TFLOPS sparse -> 1,979 dense
            price_per_hour=3.9492,  # S6: $0.001097/s
            sources="S2 (2023); price S6 (2026-05)",
        ),
        GpuSpec(
            name="H200",
            memory_gb=141.0,  # S3: 141GB HBM3e
            bandwidth_gbps=4800.0,  # S3: 4.8 TB/s
            bf16_tflops=989.0,  # S3: BF16 1,979* sparse -> 989 dense
            fp8_tflops=1979.0,  # S3: FP8 3,958* sparse -> 1,979 dense
            price_per_hour=4.5396,  # S7: $0.001261/s (2025 listing)
            sources="S3 (2024); price S7 (2025)",
        ),
        GpuSpec(
            name="B200",
            memory_gb=180.0,  # S4: 1,440 GB per 8 GPUs
            bandwidth_gbps=8000.0,  # S4: 64 TB/s per 8 GPUs
            bf16_tflops=2250.0,  # S4: 36 PFLOPS sparse per 8 -> 2.25 PFLOPS dense per GPU
            fp8_tflops=4500.0,  # S4: 72 PFLOPS sparse per 8 -> 4.5 PFLOPS dense per GPU
            price_per_hour=6.2496,  # S7: $0.001736/s (2025 listing)
            sources="S4 (2024); price S7 (2025)",
        ),
        GpuSpec(
            name="L40S",
            memory_gb=48.0,  # S5: 48GB GDDR6 with ECC
            bandwidth_gbps=864.0,  # S5: 864 GB/s
            bf16_tflops=362.05,  # S5: BF16 362.05 | 733* TFLOPS
            fp8_tflops=733.0,  # S5: FP8 733 | 1,466* TFLOPS (Ada has FP8 tensor cores)
            price_per_hour=1.9512,  # S6: $0.000542/s
            sources="S5 (2023); price S6 (2026-05)",
        ),
        GpuSpec(
            # The embedded default: one "GPU" is one physical core (2 vCPUs) of this machine.
            name="cpu",
            memory_gb=23.0,  # S8: this VM's RAM
            bandwidth_gbps=12.0,  # S8: measured, shared machine (a lower bound)
            bf16_tflops=0.73,  # S8: measured torch BF16 matmul (AMX)
            fp8_tflops=None,  # no FP8 arithmetic on CPUs; torch dequantises to compute
            price_per_hour=0.04716,  # S6: $0.0000131 per physical core per second
            sources="S8 measured (2026-11-30); price S6 (2026-06)",
        ),
    )
}

# Names people type for the same chip; the catalog keeps one canonical spelling.
_ALIASES = {
    "a100": "A100-80GB",
    "a100-80gb": "A100-80GB",
    "a100-sxm": "A100-80GB",
    "a100-80gb-sxm": "A100-80GB",
    "h100": "H100-SXM",
    "h100-sxm": "H100-SXM",
    "h100-sxm5": "H100-SXM",
    "h200": "H200",
    "h200-sxm": "H200",
    "b200": "B200",
    "l40s": "L40S",
    "cpu": "cpu",
}


def canonical_gpu(name: str) -> str | None:
    """The catalog spelling of `name` (case-insensitive, common aliases), or None if unknown."""
    return _ALIASES.get(name.strip().lower())


def gpu_spec(name: str) -> GpuSpec:
    """The catalog entry for `name`; KeyError naming the known types if there is none."""
    canon = canonical_gpu(name)
    if canon is None:
        raise KeyError(f"unknown GPU {name!r}; known: {', '.join(CATALOG)}")
    return CATALOG[canon]


def _fmt(x: float | None, digits: int = 0) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


def catalog_markdown() -> str:
    """The catalog as a Markdown table (what `flotilla hardware` prints first)."""
    lines = [
        "| GPU | memory GB | bandwidth GB/s | BF16 TFLOPS | FP8 TFLOPS | $/GPU-hour | sources |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for s in CATALOG.values():
        lines.append(
            f"| {s.name} | {_fmt(s.memory_gb)} | {_fmt(s.bandwidth_gbps)} | "
            f"{_fmt(s.bf16_tflops, 2 if s.bf16_tflops < 10 else 0)} | {_fmt(s.fp8_tflops)} | "
            f"{s.price_per_hour:.4f} | {s.sources} |"
        )
    lines.append("")
    lines.append("Throughput figures are dense (no sparsity); prices are on-demand USD per GPU-hour.")
    lines += [f"- {key}: {text}" for key, text in SOURCES.items()]
    return "\n".join(lines)
