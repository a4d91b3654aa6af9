"""GPU offers of three providers: on-demand and spot prices, preemption and link estimates.

What the scale simulation (`hardware.fleetscale`) is fed. Every price names its source
(keys P1..P6 below, or the catalog's S6/S7) and the date it was read; figures no source gives
are marked `estimate` in `basis` and say how they were chosen. Prices move daily (spot prices
more so); re-check them before reading a simulated cost as money.

Assumption shared by every link figure: the trainer runs in a Modal region, so Modal pools
reach it inside one provider's network and the others over the public internet.
"""

from __future__ import annotations

from dataclasses import dataclass

from hardware.catalog import CATALOG

__all__ = ["OFFERS", "PROVIDER_SOURCES", "Offer", "offers_markdown"]

PROVIDER_SOURCES: dict[str, str] = {
    "P1": "introl.com, 'Spot Instances and Preemptible GPUs' (updated 2025-12-08): AWS cut on-demand "
    "H100 prices 44% in June 2025 to ~$3.90/GPU-hour; p5.48xlarge (8×H100) listed $98.32/hour before.",
    "P2": "costnimbus.com, 'GPU cost management for ML teams' (March 2026): AWS EC2 P5 H100 on-demand "
    "~$3.90/GPU-hour; AWS P5 spot ~$2.00–$2.50/GPU-hour.",
    "P3": "pricegpu.pages.dev, 'Spot vs On-Demand GPU Instances' (2026): A100 80GB on RunPod ~$1.89/hour "
    "on-demand, ~$0.79/hour spot (58% saving).",
    "P4": "thundercompute.com, 'Cloud GPU Spot Instance Availability and Interruption Rates' (data from "
    "the AWS Spot Instance Advisor, 2026-02-24): interruption band p5 (H100) 15–20%, p4d (A100) 5–10% "
    "(share of instances interrupted over the trailing month).",
    "P5": "PULSE (arXiv 2602.03839), via /work/shared/REFERENCES.md: sparse bf16 weight deltas compress "
    "~79× on average.",
    "P6": "thundercompute.com (as P4): AWS gives a 2-minute interruption notice, Google Cloud up to 30 s.",
}


@dataclass(frozen=True)
class Offer:
    """One provider's price for one GPU type, and what the simulation assumes about it."""

    provider: str
    gpu: str
    """Catalog name (`hardware.catalog.CATALOG`)."""
    on_demand_per_hour: float
    """USD per GPU-hour, on-demand."""
    spot_per_hour: float | None
    """USD per GPU-hour on spot capacity; None where the provider sells none for this GPU."""
    link_gbps: float
    """Bandwidth from the trainer to a pool of this offer, Gbit/s."""
    basis: str
    """Source keys per figure; `estimate` marks a figure no source gives."""


# Spot preemption rate: the AWS bands (P4) are a share of instances interrupted per month,
# 15–20% for p5, i.e. ≈ 0.2 / 720 h ≈ 3e-4 per instance-hour if spread evenly. A simulation of
# minutes would see none, so the benchmark's default (0.05 per GPU-hour) is a deliberately
# pessimistic estimate, configurable on its command line.
OFFERS: dict[str, Offer] = {
    "modal-b200": Offer(
        "modal",
        "B200",
        CATALOG["B200"].price_per_hour,
        None,
        100.0,
        "price S7 (2025 listing); no spot price in the source; link 100 Gbit/s estimate (same provider as the trainer)",
    ),
    "modal-h200": Offer(
        "modal",
        "H200",
        CATALOG["H200"].price_per_hour,
        None,
        100.0,
        "price S7 (2025 listing); no spot price in the source; link 100 Gbit/s estimate (same provider as the trainer)",
    ),
    "modal-l40s": Offer(
        "modal",
        "L40S",
        CATALOG["L40S"].price_per_hour,
        None,
        100.0,
        "price S6 (2026-05); no spot price in the source; link 100 Gbit/s estimate (same provider as the trainer)",
    ),
    "aws-h100": Offer(
        "aws",
        "H100-SXM",
        3.90,
        2.25,
        10.0,
        "on-demand P1, P2 (2025-12, 2026-03); spot P2 midpoint of $2.00–2.50; link 10 Gbit/s estimate "
        "(public internet between providers)",
    ),
    "runpod-a100": Offer(
        "runpod",
        "A100-80GB",
        1.89,
        0.79,
        5.0,
        "on-demand and spot P3 (2026); link 5 Gbit/s estimate (public internet, smaller provider)",
    ),
}


def offers_markdown() -> str:
    """The offers as a Markdown table with their sources."""
    lines = [
        "| offer | provider | GPU | on-demand $/GPU-h | spot $/GPU-h | link Gbit/s | basis |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for name, o in OFFERS.items():
        spot = "—" if o.spot_per_hour is None else f"{o.spot_per_hour:.2f}"
        lines.append(
            f"| {name} | {o.provider} | {o.gpu} | {o.on_demand_per_hour:.4f} | {spot} | {o.link_gbps:g} | {o.basis} |"
        )
    lines.append("")
    lines += [f"- {key}: {text}" for key, text in PROVIDER_SOURCES.items()]
    return "\n".join(lines)
