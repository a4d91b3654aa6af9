"""What `flotilla hardware [CONFIG]` prints: the catalog, then a config's pools with estimates."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from hardware.catalog import catalog_markdown
from hardware.pools import HardwareConfig
from hardware.throughput import ModelSpec, ThroughputModel

__all__ = ["describe", "model_spec_from_table"]


def model_spec_from_table(table: dict[str, Any]) -> ModelSpec | None:
    """A ModelSpec from a TOML `[model]` table that has `active_params` (other keys, such as
    an architecture config for the sampler, are ignored); None without `active_params`.
    `total_params` defaults to `active_params` (a dense model)."""
    if "active_params" not in table:
        return None
    keys = set(ModelSpec.model_fields)
    data = {k: v for k, v in table.items() if k in keys}
    data.setdefault("total_params", data["active_params"])
    return ModelSpec.model_validate(data)


def describe(config_path: str | None) -> str:
    """The GPU catalog as Markdown and, given a TOML file with `[[pools]]` (and optionally a
    `[model]` table with `active_params`, `total_params`, `shared_params`,
    `kv_bytes_per_token`, `context_tokens`), its pools with roofline tokens/s per GPU and the
    estimated cost per million tokens at full batch.

    Raises ValueError naming the file and the offending field for an invalid config, and
    OSError if the file cannot be read."""
    out = ["## GPU catalog", "", catalog_markdown()]
    if config_path is None:
        return "\n".join(out) + "\n"
    text = Path(config_path).read_text()
    try:
        data = tomllib.loads(text)
        hw = HardwareConfig.from_toml_text(text)
        model_table = data.get("model", {})
        model = model_spec_from_table(model_table) if isinstance(model_table, dict) else None
    except ValueError as e:  # tomllib.TOMLDecodeError and pydantic.ValidationError are ValueErrors
        raise ValueError(f"{config_path}: {e}") from e
    tp = ThroughputModel(hw.pools, model) if model is not None else None
    out += [
        "",
        f"## Pools in {config_path}",
        "",
        "| pool | GPU | precision | GPUs | device | region | $/GPU-hour | staleness budget "
        "| max rollouts | est. tokens/s/GPU | est. $/Mtok |",
        "|---|---|---|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for p in hw.pools:
        if tp is None:
            tps_s = cost_s = "—"
        else:
            tps = tp.roofline(p.name)
            tps_s = f"{tps:,.1f}" if tps > 0 else "does not fit"
            cost_s = f"{p.price / 3600.0 / tps * 1e6:.4f}" if tps > 0 else "—"
        out.append(
            f"| {p.name} | {p.gpu} | {p.precision} | {p.count} | {p.device} | {p.region} | {p.price:.4f} "
            f"| {p.staleness_budget} | {p.capacity} | {tps_s} | {cost_s} |"
        )
    out.append("")
    if model is None:
        out.append("No estimates: add a [model] table with active_params (and total_params for a MoE).")
    else:
        out.append(
            f"Estimates: decode roofline at each pool's full batch for a model of {model.total_params:.3g} "
            f"parameters ({model.active_params:.3g} active), before any measured correction."
        )
    return "\n".join(out) + "\n"
