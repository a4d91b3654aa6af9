"""report.html and the comparison page from run directories built here (no actors): every
section drawn from complete files; damaged or missing files named on the page; the CLI."""

from __future__ import annotations

import functools
import io
import json
import operator
import random
import subprocess
import sys
from pathlib import Path

import pytest

from hardware import CostLedger
from orchestrator.entry.live import LiveProgress, make_progress, sparkline
from orchestrator.entry.report import load_run, render_report, write_compare, write_report
from orchestrator.entry.report._charts import cost_series, rolling_mean
from orchestrator.state.config import load_config
from orchestrator.state.progress import Progress
from orchestrator.state.sinks import flatten

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "examples" / "guess_number.toml"
POOLS = ("b200-bf16", "h100-fp8")


def _metrics(steps: int, rng: random.Random) -> list[dict]:
    rows, busy, toks, dropped = [], {p: 0.0 for p in POOLS}, {p: 0 for p in POOLS}, 0
    for step in range(1, steps + 1):
        pools = {}
        for p in POOLS:
            busy[p] += rng.uniform(0.1, 0.5)
            toks[p] += rng.randint(50, 150)
            pools[p] = {
                "busy_s": busy[p],
                "tokens": toks[p],
                "tokens_per_s": rng.uniform(100, 400),
                "rollouts": 8,
                "staleness_mean": rng.uniform(0, 2),
                "staleness_max": rng.randint(0, 2),
                "mismatch_kl": rng.uniform(0, 0.01),
                "masked_fraction": rng.uniform(0, 0.05),
                "requests": 10,
                "prefill_batches": 3,
            }
        dropped += rng.randint(0, 1)
        rows.append(
            {
                "step": step,
                "version": step,
                "wall_s": 0.5 * step,
                "reward_mean": rng.random(),
                "rollouts": 16,
                "staleness_mean": rng.uniform(0, 2),
                "staleness_max": 2,
                "dropped_stale": dropped,
                "dropped_failed": 0,
                "dropped_total": dropped,
                "loss": rng.uniform(-0.1, 0.1),
                "grad_norm": rng.uniform(0.1, 1),
                "mismatch_kl": rng.uniform(0, 0.01),
                "masked_fraction": rng.uniform(0, 0.05),
                "mean_weight": rng.uniform(0.99, 1.01),
                "entropy": rng.uniform(2, 4),
                "train_s": 0.2,
                "cost_usd": 0.0,
                "pools": pools,
            }
        )
    return rows


def _span(name, service, trace, span, parent, start, end, **attrs) -> str:
    return json.dumps(
        {
            "name": name,
            "trace_id": trace,
            "span_id": span,
            "parent_span_id": parent,
            "start_ns": start,
            "end_ns": end,
            "attributes": attrs,
            "service": service,
            "pid": 1,
        }
    )


def _traces(n: int, rng: random.Random) -> tuple[list[str], dict[str, int]]:
    """n rollout traces (controller → env → generate → sampler.generate); their durations."""
    lines, durations = [_span("startup", "controller", "t-start", "s0", None, 1_000, 2_000, pools=2)], {}
    for i in range(n):
        trace, t0 = f"{i:032x}", 10_000_000 * (i + 1)
        dur = rng.randint(1_000_000, 9_000_000)
        durations[trace] = dur
        pool = POOLS[i % 2]
        lines += [
            _span(
                "sampler.generate", f"sampler-{pool}[0]", trace, f"{i}c", f"{i}g", t0 + 300, t0 + dur // 2, pool=pool
            ),
            _span("generate", "env[0]", trace, f"{i}g", f"{i}e", t0 + 200, t0 + dur // 2 + 100, pool=pool, turn=0),
            _span("rollout", "env[0]", trace, f"{i}e", f"{i}r", t0 + 100, t0 + dur - 100, pool=pool),
            _span(
                "rollout",
                "controller",
                trace,
                f"{i}r",
                None,
                t0,
                t0 + dur,
                pool=pool,
                staleness=i % 3,
                tokens=3,
                reward=1.0,
                policy_version=0,
            ),
        ]
    lines.append(
        _span("rollout.dropped", "controller", "t-drop", "sd", None, 5, 6, pool=POOLS[1], reason="stale", staleness=3)
    )
    return lines, durations


def make_run(
    root: Path, name: str = "synthetic", steps: int = 30, traces: bool = True, cost: bool = True, seed: int = 0
) -> tuple[Path, dict[str, int]]:
    rng = random.Random(seed)
    run_dir = root / name
    run_dir.mkdir(parents=True)
    cfg = load_config(DEMO, [f'name="{name}"', f"steps={max(steps, 1)}"])
    (run_dir / "config.json").write_text(cfg.resolved_json())
    rows = _metrics(steps, rng)
    ledger = CostLedger(cfg.pools)
    for r in rows:  # what the controller records, step by step
        for p in POOLS:
            prev = rows[r["step"] - 2]["pools"][p] if r["step"] > 1 else {"busy_s": 0.0, "tokens": 0}
            ledger.record_busy(p, seconds=r["pools"][p]["busy_s"] - prev["busy_s"])
            ledger.record_rollout(p, tokens=r["pools"][p]["tokens"] - prev["tokens"], staleness=1)
        r["cost_usd"] = ledger.report().totals.cost_usd
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    durations: dict[str, int] = {}
    if traces:
        lines, durations = _traces(12, rng)
        (run_dir / "traces.jsonl").write_text("\n".join(lines) + "\n")
    if cost and rows:
        ledger.report().write(run_dir)
    return run_dir, durations


def _charts(html: str) -> int:
    return html.count('class="plotly-graph-div"')


def test_complete_run_dir_draws_every_chart_and_picks_the_slowest_and_median_rollout(tmp_path):
    run_dir, durations = make_run(tmp_path)
    data = load_run(run_dir)
    # Only the model checkpoint is absent from a directory written without a trainer.
    assert [m for m in data.missing if "checkpoint" not in m] == []
    html = render_report(data)
    assert _charts(html) == 12 == int(html.split('name="flotilla-charts" content="')[1].split('"')[0])
    ranked = sorted(durations, key=durations.get)
    slow_root, slow_spans = data.waterfalls["slowest"]
    assert slow_root.trace_id == ranked[-1] and len(slow_spans) == 4
    assert data.waterfalls["median"][0].trace_id == ranked[len(ranked) // 2]
    assert f"Slowest rollout ({durations[ranked[-1]] / 1e6:.1f} ms)" in html
    assert "finished: 30 of 30 steps" in html
    assert sorted(functools.reduce(operator.iadd, data.rollout_staleness.values(), [])) == sorted(
        i % 3 for i in range(12)
    )
    assert data.dropped_staleness == {"h100-fp8": [3]}
    assert "https://" not in html.split("<body>")[1].split("<script")[0]  # head lines: no links out


def test_eval_lines_are_drawn_against_step_and_wall_time(tmp_path):
    run_dir, _ = make_run(tmp_path, steps=12)
    rows = read_jsonl_lines(run_dir / "metrics.jsonl")
    # As the controller writes them: an evaluation of step k lands after step k+1's line.
    out = []
    for r in rows:
        out.append(r)
        if r["step"] % 5 == 1 and r["step"] > 1:
            out.append(
                {
                    "step": r["step"] - 1,
                    "eval_reward": r["step"] / 20,
                    "eval_version": r["step"] - 1,
                    "eval_s": 0.1,
                    "eval_episodes": 8,
                    "eval_failed": 0,
                }
            )
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in out))
    data = load_run(run_dir)
    assert [r["step"] for r in data.metrics] == list(range(1, 13))
    assert [(e["step"], e["wall_total_s"]) for e in data.evals] == [(5, 2.5), (10, 5.0)]
    html = render_report(data)
    assert html.count('"name":"eval reward (held out)"') == 2
    assert '"x":[5,10],"y":[0.3,0.55]' in html and '"x":[2.5,5.0],"y":[0.3,0.55]' in html


def read_jsonl_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_cost_curves_end_at_the_cost_reports_figures(tmp_path):
    run_dir, _ = make_run(tmp_path)
    data = load_run(run_dir)
    per_pool, counterfactual, _ = cost_series(data)
    report = {p["pool"]: p["cost_usd"] for p in data.cost["pools"]}
    for p in POOLS:
        assert per_pool[p][-1] == pytest.approx(report[p])
        assert per_pool[p] == sorted(per_pool[p])  # cumulative
    assert counterfactual[-1] == pytest.approx(data.cost["counterfactual"]["cost_usd"])
    # The stacked total follows the ledger's own running cost at every step.
    totals = [sum(v) for v in zip(*per_pool.values(), strict=False)]
    assert totals == pytest.approx([r["cost_usd"] for r in data.metrics], rel=1e-9)


def test_truncated_last_metrics_line_is_left_out_and_named(tmp_path):
    run_dir, _ = make_run(tmp_path, steps=12)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 13, "reward_mean": 0.')
    with open(run_dir / "traces.jsonl", "a") as f:
        f.write('{"name": "rollout", "service": "controller", "trace_id": "ab", "attributes": {"staleness": 1}}\n')
        f.write('{"name": "rollout", "service": "controller", "trace_id": "cd", "span_id": "')
    path = write_report(run_dir)
    html = path.read_text()
    data = load_run(run_dir)
    assert [r["step"] for r in data.metrics] == list(range(1, 13))
    assert "the last line (13) is truncated" in html
    assert "traces.jsonl: 2 line(s) are not valid spans" in html
    assert len(data.waterfalls) == 2
    assert _charts(html) == 12


def test_sampled_traces_say_their_rate_and_a_failed_rollout_outside_the_sample_is_counted_not_drawn(tmp_path):
    run_dir, durations = make_run(tmp_path)  # the demo's config: the default trace_sample
    rate = load_config(DEMO).telemetry.trace_sample
    assert 0 < rate < 1
    slowest = max(durations.values())
    # a failed rollout outside the sample: its controller span alone, longer than any traced one
    with open(run_dir / "traces.jsonl", "a") as f:
        line = json.loads(_span("rollout", "controller", "f" * 32, "ff", None, 0, 10 * slowest, pool=POOLS[0]))
        line["attributes"].update(failed=True, staleness=9, tokens=0, reward=0.0)
        f.write(json.dumps({**line, "sampled": False}) + "\n")
    not_written = run_dir / "traces.jsonl.not_written"
    not_written.mkdir()
    (not_written / "env[0].123").write_text("5")
    (not_written / "controller.7").write_text("2")
    data = load_run(run_dir)
    assert data.trace_sample == rate and data.sampled_rollouts == 12
    assert data.failed_unsampled == 1 and data.traces_not_written == 7
    assert 9 not in functools.reduce(operator.iadd, data.rollout_staleness.values(), [])
    assert data.waterfalls["slowest"][0].trace_id != "f" * 32
    html = render_report(data)
    assert f"trace_sample {rate:.3g}: 12 rollouts traced" in html
    assert "1 failed rollouts outside the sample" in html and "7 spans not written" in html
    assert f"traced: {rate:.3g} of rollouts" in html  # the staleness chart's title
    assert "of the 12 traced rollouts" in html  # the waterfalls' captions


def test_missing_traces_gives_a_report_that_says_so(tmp_path):
    run_dir, _ = make_run(tmp_path, traces=False)
    html = write_report(run_dir).read_text()
    assert "traces.jsonl is missing" in html
    assert "No slowest rollout trace" in html and "No median rollout trace" in html
    assert "per-step maximum (no traces.jsonl" in html  # staleness falls back to metrics
    assert _charts(html) == 10


def test_zero_steps_gives_a_report_that_says_so(tmp_path):
    run_dir, _ = make_run(tmp_path, steps=0, traces=False, cost=False)
    data = load_run(run_dir)
    html = write_report(run_dir).read_text()
    assert data.metrics == [] and "incomplete at step 0 of 1" in html
    assert "metrics.jsonl has no training steps" in html
    assert "cost_report.json is missing" in html
    assert "No steps recorded: no reward curve." in html
    assert _charts(html) == 0


def test_a_directory_with_nothing_in_it_still_reports(tmp_path):
    (tmp_path / "empty").mkdir()
    html = write_report(tmp_path / "empty").read_text()
    for name in (
        "config.json is missing",
        "metrics.jsonl is missing",
        "traces.jsonl is missing",
        "cost_report.json is missing",
    ):
        assert name in html
    with pytest.raises(FileNotFoundError, match="not a directory"):
        write_report(tmp_path / "nowhere")


def test_compare_overlays_every_run(tmp_path):
    a, _ = make_run(tmp_path, "async-run", seed=1)
    b, _ = make_run(tmp_path, "sync-run", steps=20, seed=2)
    c, _ = make_run(tmp_path, "broken", steps=0, traces=False, cost=False)
    html = write_compare([a, b, c], tmp_path / "cmp.html").read_text()
    assert _charts(html) == 4
    for name in ("async-run", "sync-run"):
        assert html.count(f'"name":"{name}"') == 4  # reward x2, cost, staleness
    assert "broken: metrics.jsonl has no training steps" in html


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", *args], cwd=ROOT, text=True, capture_output=True, timeout=120
    )


def test_cli_report_and_compare(tmp_path, capsys):
    from orchestrator.entry.cli import main

    run_dir, _ = make_run(tmp_path, steps=5, cost=False)
    out = _cli("report", str(run_dir))  # the real entry point, once
    assert out.returncode == 0, out.stderr
    assert (run_dir / "report.html").is_file()
    assert "missing: cost_report.json is missing" in out.stdout
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert main(["compare", str(run_dir), str(run_dir), "-o", str(tmp_path / "c.html")]) == 0
    assert _charts((tmp_path / "c.html").read_text()) == 4
    capsys.readouterr()
    assert main(["compare", str(run_dir), str(tmp_path / "nope")]) == 2
    assert "nope is not a run directory" in capsys.readouterr().err


def test_rolling_mean_and_sparkline():
    assert rolling_mean([1.0, None, 3.0], window=2) == [1.0, 1.0, 2.0]
    assert rolling_mean([float(i) for i in range(12)])[-1] == pytest.approx(sum(range(2, 12)) / 10)
    line = sparkline([0.0, 0.5, 1.0])
    assert line[0] == "▁" and line[-1] == "█" and len(line) == 3
    assert sparkline([0.3] * 5) == "▁" * 5


def test_flatten_nests_pools_and_drops_non_numbers():
    rec = {"step": 3, "reward_mean": 0.5, "pools": {"a": {"tokens": 7, "staleness_mean": None}}, "ok": True, "s": "x"}
    assert flatten(rec) == {"step": 3.0, "reward_mean": 0.5, "pools/a/tokens": 7.0, "ok": 1.0}


def test_progress_is_plain_lines_off_a_terminal_and_live_on_one():
    from rich.console import Console

    assert type(make_progress(10, stream=io.StringIO())) is Progress
    buf = io.StringIO()
    live = LiveProgress(10, console=Console(file=buf, force_terminal=True, width=110))
    live.message("flotilla: starting")
    for row in _metrics(3, random.Random(0)):
        live.step(row)
    live.close()
    text = buf.getvalue()
    assert "flotilla: starting" in text
    assert "step 3/10" in text and "ETA" in text
    assert "b200-bf16" in text and "h100-fp8" in text and "$0.0000" in text
    assert live.eta() is not None and live.eta() >= 0
