"""Cost accounting and the cost report.

Cost of a pool = busy GPU-seconds × its price per GPU-hour ÷ 3600. A GPU is busy while it
serves at least one rollout; the controller reports busy time per sampler (`record_busy`).
Pools emulated on this machine's CPU (device `cpu`, gpu not `cpu`) have no GPU time to bill:
with a throughput model they are billed *modelled* GPU-seconds, tokens ÷ the emulated GPU's
roofline tokens/s per GPU at full batch (no online correction, since the measurement is of
the CPU); without one, their measured seconds. The report says which (`billing`).

Counterfactual: the same tokens on a homogeneous fleet of the dearest pool's GPU type
(highest price per GPU-hour, ties by name):

    counterfactual_usd = total_tokens ÷ tps_ref ÷ 3600 × price_ref
    saving_pct         = 100 × (1 − total_usd ÷ counterfactual_usd)

where tps_ref is tokens/s per GPU of that pool: the throughput model's estimate at full batch
(roofline × online factor; the bare roofline for an emulated pool) when a model is given
(basis "estimate"), else its measured tokens ÷ billed GPU-seconds (basis "measured").
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hardware._state import parse_state
from hardware.pools import PoolConfig
from hardware.throughput import ThroughputModel

__all__ = ["CostLedger", "CostReport", "CostTotals", "Counterfactual", "PoolCost"]


class PoolCost(BaseModel):
    """One pool's line of the cost report."""

    pool: str
    """Pool name."""
    gpu: str
    """GPU type."""
    precision: str
    """Weight precision served."""
    device: str
    """`cuda`, or `cpu` when emulated on this machine."""
    region: str
    """Pool region."""
    gpus: int
    """GPUs in the pool."""
    price_per_gpu_hour: float
    """USD per GPU-hour used."""
    billing: Literal["measured", "modelled"]
    """Whether GPU-hours are measured busy time or modelled from tokens (emulated pools)."""
    gpu_hours: float
    """Billed GPU-hours."""
    cost_usd: float
    """gpu_hours × price_per_gpu_hour."""
    rollouts: int
    """Rollouts finished on the pool."""
    tokens: int
    """Tokens generated on the pool."""
    usd_per_mtok: float | None
    """cost_usd ÷ tokens × 10^6 (None without tokens)."""
    mean_staleness: float | None
    """Mean staleness (versions) of its trajectories at train time, when provided."""
    mismatch_kl: float | None
    """Token-weighted mean sampler/trainer KL of its tokens, when provided."""
    masked_fraction: float | None
    """Token-weighted fraction of its tokens masked by the importance weights, when provided."""
    host_hours: dict[str, float] = Field(default_factory=dict)
    """Pools on `flotilla host` machines: hours each host was present in the run (joined
    and answering), by address."""
    host_cost_usd: dict[str, float] = Field(default_factory=dict)
    """What each host costs over the hours it was present, as a provider bills a rented
    machine: hours × its GPUs (its share of the pool's ranks, round-robin over `hosts`; one
    per host in an elastic pool) × price_per_gpu_hour. Beside `cost_usd`, which bills the
    pool's busy (or modelled) GPU time."""


class CostTotals(BaseModel):
    """Sums over pools (means are weighted by their samples or tokens)."""

    gpus: int
    """All GPUs."""
    gpu_hours: float
    """Sum of billed GPU-hours."""
    cost_usd: float
    """Sum of pool costs."""
    rollouts: int
    """Sum of rollouts."""
    tokens: int
    """Sum of tokens."""
    usd_per_mtok: float | None
    """cost_usd ÷ tokens × 10^6."""
    mean_staleness: float | None
    """Mean over all staleness samples."""
    mismatch_kl: float | None
    """Token-weighted over pools that reported it."""
    masked_fraction: float | None
    """Token-weighted over pools that reported it."""


class Counterfactual(BaseModel):
    """The same tokens on a homogeneous fleet of the dearest pool's GPU type."""

    pool: str
    """The dearest pool (highest price per GPU-hour, ties by name)."""
    gpu: str
    """Its GPU type."""
    precision: str
    """Its precision."""
    price_per_gpu_hour: float
    """Its price."""
    tokens_per_s_per_gpu: float
    """Reference speed tps_ref."""
    basis: Literal["estimate", "measured"]
    """Where tps_ref comes from (see module docstring)."""
    gpu_hours: float
    """total tokens ÷ tps_ref ÷ 3600."""
    cost_usd: float
    """gpu_hours × price."""
    saving_pct: float
    """100 × (1 − actual total ÷ counterfactual)."""


class CostReport(BaseModel):
    """The run's cost report (`cost_report.json` / `cost_report.md`)."""

    pools: list[PoolCost]
    """Per pool, in configuration order."""
    totals: CostTotals
    """Sums over pools."""
    counterfactual: Counterfactual | None
    """None when there are no tokens or no reference speed."""

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2)

    def to_markdown(self) -> str:
        def f(x: float | None, fmt: str) -> str:
            return "—" if x is None else format(x, fmt)

        lines = [
            "# Cost report",
            "",
            "| pool | GPU | precision | GPUs | GPU-hours | cost $ | rollouts | tokens | $/Mtok "
            "| mean staleness | mismatch KL | masked fraction |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for p in self.pools:
            gpu = p.gpu + (" (emulated)" if p.billing == "modelled" else "")
            lines.append(
                f"| {p.pool} | {gpu} | {p.precision} | {p.gpus} | {p.gpu_hours:.4f} | {p.cost_usd:.4f} "
                f"| {p.rollouts} | {p.tokens} | {f(p.usd_per_mtok, '.4f')} | {f(p.mean_staleness, '.2f')} "
                f"| {f(p.mismatch_kl, '.3g')} | {f(p.masked_fraction, '.3g')} |"
            )
        t = self.totals
        lines.append(
            f"| **total** | | | {t.gpus} | {t.gpu_hours:.4f} | {t.cost_usd:.4f} | {t.rollouts} | {t.tokens} "
            f"| {f(t.usd_per_mtok, '.4f')} | {f(t.mean_staleness, '.2f')} | {f(t.mismatch_kl, '.3g')} "
            f"| {f(t.masked_fraction, '.3g')} |"
        )
        lines.append("")
        c = self.counterfactual
        if c is None:
            lines.append("Counterfactual: not available (no tokens or no reference speed).")
        else:
            lines += [
                f"Counterfactual: the same {t.tokens} tokens on {c.gpu} ({c.precision}) only, at "
                f"{c.tokens_per_s_per_gpu:.1f} tokens/s per GPU ({c.basis}) and ${c.price_per_gpu_hour:.4f}/GPU-hour: "
                f"{c.gpu_hours:.4f} GPU-hours, ${c.cost_usd:.4f}. Saving: {c.saving_pct:.1f}%.",
            ]
        hosts = [(p, h, hours) for p in self.pools for h, hours in p.host_hours.items()]
        if hosts:
            lines += ["", "| pool | host | hours present | cost while present |", "|---|---|---:|---:|"]
            lines += [f"| {p.pool} | {h} | {hours:.4f} | ${p.host_cost_usd.get(h, 0.0):.4f} |" for p, h, hours in hosts]
        if any(p.billing == "modelled" for p in self.pools):
            lines += [
                "",
                "Emulated pools ran on this machine's CPU; their GPU-hours are modelled as tokens ÷ "
                "the emulated GPU's roofline tokens/s, so their cost shows the model, not a bill.",
            ]
        return "\n".join(lines) + "\n"

    def write(self, directory: str | Path) -> tuple[Path, Path]:
        """Write `cost_report.json` and `cost_report.md` into `directory`; returns both paths."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        j, m = d / "cost_report.json", d / "cost_report.md"
        j.write_text(self.to_json())
        m.write_text(self.to_markdown())
        return j, m


def _gpus_on(p: PoolConfig, host: str) -> int:
    """GPUs of pool `p` on `host`: one sampler per host in an elastic pool, else the ranks
    spread round-robin over `hosts` that land on it."""
    if p.elastic or host not in p.hosts:
        return 1
    return len(range(p.hosts.index(host), p.count, len(p.hosts)))


class _Acc(BaseModel):
    """One pool's accumulators (also its entry in `CostLedger.state()`)."""

    model_config = ConfigDict(extra="forbid")

    gpu_seconds: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    """Measured busy GPU-seconds."""
    rollouts: int = Field(default=0, ge=0)
    """Rollouts finished."""
    tokens: int = Field(default=0, ge=0)
    """Tokens generated by those rollouts."""
    stale_sum: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    """Sum of staleness samples."""
    stale_n: int = Field(default=0, ge=0)
    """Number of staleness samples."""
    kl_sum: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    """Token-weighted sum of mismatch KL."""
    mask_sum: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    """Token-weighted sum of masked fractions."""
    mm_tokens: int = Field(default=0, ge=0)
    """Tokens the mismatch figures cover."""
    host_seconds: dict[str, float] = Field(default_factory=dict)
    """Seconds each `flotilla host` (by address) was present."""


class _LedgerState(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pools: dict[str, _Acc] = Field(default_factory=dict)
    """Accumulators per pool name."""


def _check(name: str, value: float) -> None:
    if not value >= 0.0 or math.isinf(value):
        raise ValueError(f"{name} must be a finite number ≥ 0, got {value}")


class CostLedger:
    """Accumulates what each pool cost and produced. Synchronous, not thread-safe."""

    def __init__(self, pools: Sequence[PoolConfig], *, throughput: ThroughputModel | None = None) -> None:
        self._pools = list(pools)
        self._by_name = {p.name: p for p in self._pools}
        self._acc = {p.name: _Acc() for p in self._pools}
        self.throughput = throughput

    def _a(self, pool: str) -> _Acc:
        try:
            return self._acc[pool]
        except KeyError:
            raise KeyError(f"no pool {pool!r}; pools: {', '.join(self._acc)}") from None

    def record_busy(self, pool: str, seconds: float, gpus: int | None = None) -> None:
        """`seconds` of wall time during which `gpus` GPUs of `pool` (default: all) were busy."""
        a = self._a(pool)
        _check("seconds", seconds)
        n = self._by_name[pool].count if gpus is None else gpus
        if n < 0:
            raise ValueError(f"gpus must be ≥ 0, got {n}")
        a.gpu_seconds += seconds * n

    def record_presence(self, pool: str, host: str, seconds: float) -> None:
        """`seconds` during which `host` (an address) served `pool` (joined and answering)."""
        a = self._a(pool)
        _check("seconds", seconds)
        a.host_seconds[host] = a.host_seconds.get(host, 0.0) + seconds

    def record_rollout(self, pool: str, tokens: int, *, staleness: int | None = None) -> None:
        """A finished rollout of `tokens` generated tokens; its staleness at train time if known."""
        a = self._a(pool)
        if tokens < 0:
            raise ValueError(f"tokens must be ≥ 0, got {tokens}")
        a.rollouts += 1
        a.tokens += tokens
        if staleness is not None:
            self.record_staleness(pool, staleness)

    def record_staleness(self, pool: str, staleness: int) -> None:
        """One trajectory's staleness (trainer step − oldest token version) when trained on."""
        a = self._a(pool)
        if staleness < 0:
            raise ValueError(f"staleness must be ≥ 0, got {staleness}")
        a.stale_sum += staleness
        a.stale_n += 1

    def record_mismatch(self, pool: str, kl: float, masked_fraction: float, tokens: int) -> None:
        """Sampler/trainer mismatch of `tokens` tokens from `pool`: mean KL and masked fraction."""
        a = self._a(pool)
        _check("kl", kl)
        if not 0.0 <= masked_fraction <= 1.0:
            raise ValueError(f"masked_fraction must be in [0, 1], got {masked_fraction}")
        if tokens <= 0:
            return
        a.kl_sum += kl * tokens
        a.mask_sum += masked_fraction * tokens
        a.mm_tokens += tokens

    def state(self) -> dict[str, Any]:
        """Every pool's accumulators as JSON-serialisable data (for a controller checkpoint)."""
        return {"pools": {name: acc.model_dump() for name, acc in self._acc.items()}}

    def load_state(self, state: dict[str, Any]) -> None:
        """Restore what `state()` returned: the pools it names take its accumulators, others
        keep theirs. A malformed state, or one naming a pool this ledger does not have (its
        cost would vanish from the report), raises ValueError naming the field or pool and
        changes nothing."""
        parsed = parse_state(_LedgerState, state, "cost ledger state", lambda s: s.pools, self._acc)
        self._acc.update(parsed.pools)

    def _billed_gpu_seconds(self, p: PoolConfig) -> tuple[float, Literal["measured", "modelled"]]:
        a = self._acc[p.name]
        if p.emulated and self.throughput is not None:
            tps = self.throughput.roofline(p.name)
            if tps > 0:
                return a.tokens / tps, "modelled"
        return a.gpu_seconds, "measured"

    def report(self) -> CostReport:
        rows: list[PoolCost] = []
        for p in self._pools:
            a = self._acc[p.name]
            gpu_s, billing = self._billed_gpu_seconds(p)
            cost = gpu_s / 3600.0 * p.price
            rows.append(
                PoolCost(
                    pool=p.name,
                    gpu=p.gpu,
                    precision=p.precision,
                    device=p.device,
                    region=p.region,
                    gpus=p.count,
                    price_per_gpu_hour=p.price,
                    billing=billing,
                    gpu_hours=gpu_s / 3600.0,
                    cost_usd=cost,
                    rollouts=a.rollouts,
                    tokens=a.tokens,
                    usd_per_mtok=cost / a.tokens * 1e6 if a.tokens else None,
                    mean_staleness=a.stale_sum / a.stale_n if a.stale_n else None,
                    mismatch_kl=a.kl_sum / a.mm_tokens if a.mm_tokens else None,
                    masked_fraction=a.mask_sum / a.mm_tokens if a.mm_tokens else None,
                    host_hours={h: s / 3600.0 for h, s in a.host_seconds.items()},
                    host_cost_usd={h: s / 3600.0 * _gpus_on(p, h) * p.price for h, s in a.host_seconds.items()},
                )
            )
        accs = list(self._acc.values())
        tokens = sum(r.tokens for r in rows)
        cost = sum(r.cost_usd for r in rows)
        stale_n = sum(a.stale_n for a in accs)
        mm = sum(a.mm_tokens for a in accs)
        totals = CostTotals(
            gpus=sum(r.gpus for r in rows),
            gpu_hours=sum(r.gpu_hours for r in rows),
            cost_usd=cost,
            rollouts=sum(r.rollouts for r in rows),
            tokens=tokens,
            usd_per_mtok=cost / tokens * 1e6 if tokens else None,
            mean_staleness=sum(a.stale_sum for a in accs) / stale_n if stale_n else None,
            mismatch_kl=sum(a.kl_sum for a in accs) / mm if mm else None,
            masked_fraction=sum(a.mask_sum for a in accs) / mm if mm else None,
        )
        return CostReport(pools=rows, totals=totals, counterfactual=self._counterfactual(rows, tokens, cost))

    def _counterfactual(self, rows: list[PoolCost], tokens: int, cost: float) -> Counterfactual | None:
        if tokens <= 0:
            return None
        dear = min(self._pools, key=lambda p: (-p.price, p.name))
        row = next(r for r in rows if r.pool == dear.name)
        tps: float = 0.0
        basis: Literal["estimate", "measured"] = "estimate"
        if self.throughput is not None:
            tps = self.throughput.roofline(dear.name) if dear.emulated else self.throughput.estimate(dear.name)
        if tps <= 0.0 and row.tokens > 0 and row.gpu_hours > 0:
            tps, basis = row.tokens / (row.gpu_hours * 3600.0), "measured"
        if tps <= 0.0:
            return None
        gpu_hours = tokens / tps / 3600.0
        cf_cost = gpu_hours * dear.price
        return Counterfactual(
            pool=dear.name,
            gpu=dear.gpu,
            precision=dear.precision,
            price_per_gpu_hour=dear.price,
            tokens_per_s_per_gpu=tps,
            basis=basis,
            gpu_hours=gpu_hours,
            cost_usd=cf_cost,
            saving_pct=100.0 * (1.0 - cost / cf_cost) if cf_cost > 0 else 0.0,
        )
