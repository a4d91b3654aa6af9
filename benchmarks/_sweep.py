"""The mismatch-tolerance sweep of benchmarks/stability.py (`--sweep`).

Mismatch is raised step by step along two axes, each (precision, staleness budget) pair
one level:

* sampler precision: `bf16` (the demo's BF16 pool), `fp8` (its FP8 pool: e4m3 weights
  with 128x128 block scales), `int4` (the BF16 pool with `emulate_quant = "int4_group"`:
  every linear weight rounded to 4-bit integers, one scale per 32 columns -- a
  deliberately coarse pool), `int3` and `int2` (the same with `int3_group` and
  `int2_group`: coarser than any real pool, to find where the full recipe itself breaks);
* staleness budget: 0, 2, 4, 8, 16 versions, one async pool.

At each level the variants (`SWEEP_VARIANTS`, RecipeConfig switches) train the demo task
from that one pool; `onpolicy` (the demo's BF16 pool in sync mode, staleness 0, full
recipe) is the reference, run once per seed. Each run's figures are those of
`stability.run_figures`; a cell is one (level, variant), its figures the means over seeds.

The mismatch axis: a level's KL (`level_kl`) is the mismatch KL measured in that level's
`full` runs (k3 estimate of KL(q || p^S) on the replayed support: the sampler's weights,
precision and staleness against the trainer's), so every variant of a level sits at the
same x. Each cell also keeps the KL measured under its own loss (`mismatch_kl`); variants
without replay compare the trainer's full-vocabulary softmax with the sampler's top-k/top-p
renormalised q there, so their KL also counts the truncation of the support, present
even at bf16 with staleness 0.

Tolerance (`tolerance`): per variant, its levels ordered by level KL; the "drop KL" of a
variant at threshold x is the level KL of the first level in that order where the
variant's final reward is below x times the on-policy final reward. `full_tolerance_ratio` is the
drop KL of `full` at 0.95 over that of `plain_grpo` at 0.8. When `full` never drops the
ratio is null and `full_tolerance_lower_bound` = (the largest KL `full` was measured at) /
(plain GRPO's drop KL): full survives at least that much more mismatch. When plain GRPO
never drops the ratio is null and `full_tolerance_upper_bound` = (full's drop KL) / (the
largest KL plain GRPO was measured at). When neither drops, all three are null.
`tolerance_note` says which case held, and when a variant already dropped at the lowest
level measured (its drop KL is then only an upper bound).
"""

from __future__ import annotations

import statistics
from typing import Any

from _runs import demo_raw

PRECISIONS = ("bf16", "fp8", "int4", "int3", "int2")
BUDGETS = (0, 2, 4, 8, 16)
QUICK_LEVELS = ("int4:4",)

SWEEP_BASE: dict[str, dict[str, Any]] = {"trainer": {"lr": 2e-3, "lr_final_ratio": 1.0}, "recipe": {"top_p": 0.99}}
"""Settings the sweep pins over the demo config: the demo's own until 2026-12-03 (lr 2e-3,
top_p 0.99, a constant rate), which learn the task within the sweep's 300 steps. The demo
now runs the recipe's defaults at lr 1e-3, decaying over the run, and plateaus later;
pinned here, its changes do not move the sweep's runs, and each recorded run carries a
hash of its config (`_runs.config_hash`) so that a changed config is run again instead of
mixed with the record."""

SWEEP_VARIANTS: dict[str, dict[str, Any]] = {
    "full": {"mask_replay": True, "importance": "mis", "score_centering": True},
    "plain_grpo": {"mask_replay": False, "importance": "none", "score_centering": False},
    "tis": {"mask_replay": False, "importance": "tis", "score_centering": False},
    "icepop": {"mask_replay": False, "importance": "icepop", "score_centering": False},
    "seq_mask": {"mask_replay": False, "importance": "seq_mask", "score_centering": False},
    "no_replay": {"mask_replay": False, "importance": "mis", "score_centering": False},
    "no_centering": {"mask_replay": True, "importance": "mis", "score_centering": False},
}
"""The field's corrections (tis, icepop, seq_mask) run as the field runs them: on the
trainer's full-vocabulary log-probs against the sampler's, without replay or centering."""

REFERENCE = "onpolicy"
FULL_KEEP = 0.95
GRPO_KEEP = 0.8


def default_levels() -> list[str]:
    return [f"{p}:{b}" for p in PRECISIONS for b in BUDGETS]


def parse_level(level: str) -> tuple[str, int]:
    """ "fp8:4" -> ("fp8", 4); raises ValueError naming the problem."""
    prec, sep, budget = level.partition(":")
    if not sep or prec not in PRECISIONS or not budget.isdigit():
        raise ValueError(f"level {level!r} is not PRECISION:BUDGET with PRECISION in {PRECISIONS} and BUDGET >= 0")
    return prec, int(budget)


def cell_name(level: str, variant: str) -> str:
    return f"{level}/{variant}"


def run_names(levels: list[str], variants: list[str]) -> list[str]:
    """Record names in run order: the reference, `full` and `plain_grpo` at every level,
    then the other variants level by level from the last level given (the most mismatched
    in the default grid) back: a sweep stopped early has the tolerance curve's two
    variants everywhere and every variant at the highest mismatch first."""
    first = [v for v in ("full", "plain_grpo") if v in variants]
    rest = [v for v in variants if v not in first]
    names = [REFERENCE] + [cell_name(lv, v) for v in first for lv in levels]
    return names + [cell_name(lv, v) for lv in reversed(levels) for v in rest]


def build_sweep_raw(name: str, seed: int, steps: int) -> dict[str, Any]:
    """The run config of one record name (`onpolicy` or LEVEL/VARIANT) and seed."""
    raw = demo_raw()
    for section, values in SWEEP_BASE.items():
        raw[section] = {**raw.get(section, {}), **values}
    raw.update(steps=steps, seed=seed)
    raw.setdefault("model", {})["seed"] = seed
    by_precision = {p["precision"]: p for p in raw["pools"]}
    if "bf16" not in by_precision or "fp8" not in by_precision:
        raise SystemExit(f"stability --sweep: the demo config needs a BF16 and an FP8 pool ({raw['pools']})")
    if name == REFERENCE:
        raw.update(name=f"sweep-onpolicy-s{seed}", mode="sync")
        raw["pools"] = [by_precision["bf16"]]
        return raw
    level, _, variant = name.partition("/")
    prec, budget = parse_level(level)
    pool = dict(by_precision["fp8" if prec == "fp8" else "bf16"])
    pool["staleness_budget"] = budget
    if prec.startswith("int"):
        pool["emulate_quant"] = f"{prec}_group"
    raw.update(name=f"sweep-{prec}-b{budget}-{variant}-s{seed}", mode="async")
    raw["pools"] = [pool]
    raw["recipe"] = {**raw.get("recipe", {}), **SWEEP_VARIANTS[variant]}
    return raw


def _mean(vals: list[float]) -> float:
    vals = [v for v in vals if v == v]  # NaN-free
    return statistics.fmean(vals) if vals else float("nan")


def cells(runs: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """Per record name: mean final/AUC/KL over seeds, max grad norm, collapses, seeds."""
    out: dict[str, dict[str, Any]] = {}
    for name, per_seed in runs.items():
        out[name] = {
            "final_reward": round(_mean([r["final_reward"] for r in per_seed]), 4),
            "final_reward_per_seed": [round(r["final_reward"], 4) for r in per_seed],
            "auc_reward": round(_mean([r["auc_reward"] for r in per_seed]), 4),
            "mismatch_kl": float(f"{_mean([r['mismatch_kl'] for r in per_seed]):.4g}"),
            "max_grad_norm": round(max(r["max_grad_norm"] for r in per_seed), 4),
            "collapses": int(sum(r["collapsed"] for r in per_seed)),
            "seeds": len(per_seed),
        }
    return out


def drop_kl(points: list[tuple[float, float]], threshold: float) -> float | None:
    """KL of the first (kl, final) point, in increasing KL, with final < threshold; None if none."""
    for kl, final in sorted(points):
        if final < threshold:
            return kl
    return None


def level_kls(table: dict[str, dict[str, Any]], levels: list[str]) -> dict[str, float]:
    """Level -> the mismatch KL of its full-recipe cell (no_centering's, also replayed,
    where full did not run); levels with neither are left out."""
    out: dict[str, float] = {}
    for lv in levels:
        for v in ("full", "no_centering"):
            c = table.get(cell_name(lv, v))
            if c is not None and c["mismatch_kl"] == c["mismatch_kl"]:
                out[lv] = c["mismatch_kl"]
                break
    return out


def tolerance(table: dict[str, dict[str, Any]], levels: list[str]) -> dict[str, Any]:
    """`full_tolerance_ratio` and its bounds (module docstring) from the cell table."""
    ref = table.get(REFERENCE)
    out: dict[str, Any] = {
        "onpolicy_final": ref["final_reward"] if ref else None,
        "full_drop_kl": None,
        "plain_grpo_drop_kl": None,
        "full_tolerance_ratio": None,
        "full_tolerance_lower_bound": None,
        "full_tolerance_upper_bound": None,
    }

    kls = level_kls(table, levels)
    out["level_kl"] = kls

    def points(variant: str) -> list[tuple[float, float]]:
        return [
            (kls[lv], table[cell_name(lv, variant)]["final_reward"])
            for lv in levels
            if lv in kls and cell_name(lv, variant) in table
        ]

    full, grpo = points("full"), points("plain_grpo")
    if ref is None or not full or not grpo:
        out["tolerance_note"] = "needs the on-policy reference and at least one level of full and plain_grpo"
        return out
    f_kl = drop_kl(full, FULL_KEEP * ref["final_reward"])
    g_kl = drop_kl(grpo, GRPO_KEEP * ref["final_reward"])
    out["full_drop_kl"], out["plain_grpo_drop_kl"] = f_kl, g_kl
    if f_kl is not None and g_kl is not None and g_kl > 0:
        out["full_tolerance_ratio"] = round(f_kl / g_kl, 3)
        out["tolerance_note"] = "both dropped"
    elif f_kl is None and g_kl is not None and g_kl > 0:
        out["full_tolerance_lower_bound"] = round(max(kl for kl, _ in full) / g_kl, 3)
        out["tolerance_note"] = f"full never fell below {FULL_KEEP} of on-policy: ratio >= lower bound"
    elif f_kl is not None and g_kl is None:
        out["full_tolerance_upper_bound"] = round(f_kl / max(kl for kl, _ in grpo), 3)
        out["tolerance_note"] = f"plain GRPO never fell below {GRPO_KEEP} of on-policy: ratio <= upper bound"
    else:
        out["tolerance_note"] = "neither dropped below its threshold at the levels measured"
    lowest = min(kls.values())
    if g_kl is not None and g_kl == lowest:
        out["tolerance_note"] += "; plain GRPO already dropped at the lowest level (its drop KL is at most that)"
    if f_kl is not None and f_kl == lowest:
        out["tolerance_note"] += "; full already dropped at the lowest level (its drop KL is at most that)"
    return out


def collapses_by_variant(table: dict[str, dict[str, Any]], levels: list[str], variants: list[str]) -> dict[str, Any]:
    """Per variant: total collapses over the sweep and collapsed runs per level."""
    out: dict[str, Any] = {}
    for v in variants:
        per = {lv: table[cell_name(lv, v)]["collapses"] for lv in levels if cell_name(lv, v) in table}
        out[v] = {"total": sum(per.values()), "per_level": per}
    if REFERENCE in table:
        out[REFERENCE] = {"total": table[REFERENCE]["collapses"], "per_level": {}}
    return out


def full_fewer_collapses(table: dict[str, dict[str, Any]], levels: list[str]) -> bool | None:
    """Whether full collapsed less often than plain GRPO at every level where either did
    (None when neither collapsed anywhere or a level lacks one of them)."""
    seen = False
    for lv in levels:
        f, g = table.get(cell_name(lv, "full")), table.get(cell_name(lv, "plain_grpo"))
        if f is None or g is None:
            continue
        if f["collapses"] or g["collapses"]:
            seen = True
            if f["collapses"] >= g["collapses"]:
                return False
    return True if seen else None


def markdown_table(table: dict[str, dict[str, Any]], levels: list[str], variants: list[str]) -> str:
    """One row per level (with its level KL); per variant `final (own KL, collapses/seeds)`."""
    kls = level_kls(table, levels)
    head = "| level | level KL | " + " | ".join(variants) + " |"
    lines = [head, "|---|---|" + "---|" * len(variants)]
    for lv in levels:
        row = [lv, f"{kls[lv]:.3g}" if lv in kls else ""]
        for v in variants:
            c = table.get(cell_name(lv, v))
            row.append(
                ""
                if c is None
                else f"{c['final_reward']:.3f} (KL {c['mismatch_kl']:.2g}, {c['collapses']}/{c['seeds']})"
            )
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(table: dict[str, dict[str, Any]], levels: list[str], variants: list[str], path: Any) -> bool:
    """Final reward against measured mismatch KL, one line per variant, as a PNG; False
    when matplotlib is not installed (nothing is written)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    kls = level_kls(table, levels)
    for v in variants:
        pts = sorted(
            (kls[lv], table[cell_name(lv, v)]["final_reward"])
            for lv in levels
            if lv in kls and kls[lv] > 0 and cell_name(lv, v) in table
        )
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=v)
    ref = table.get(REFERENCE)
    if ref is not None:
        ax.axhline(ref["final_reward"], color="black", linestyle="--", linewidth=1, label="onpolicy (BF16, sync)")
        ax.axhline(FULL_KEEP * ref["final_reward"], color="grey", linestyle=":", linewidth=1, label="95% / 80% of it")
        ax.axhline(GRPO_KEEP * ref["final_reward"], color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("level's mismatch KL (full recipe's k3 on the replayed support, mean over steps, seeds)")
    ax.set_ylabel("final reward (last 10 steps)")
    ax.set_title("guess_number: final reward against sampler mismatch")
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
