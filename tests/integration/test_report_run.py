"""One short real run (trainer, two sampler pools, an env actor) with both metric sinks on, shared
by every test here: its report.html renders in headless Chromium, and the W&B offline log and
the TensorBoard event files hold what metrics.jsonl holds."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest

from orchestrator.entry.report import write_compare, write_report
from orchestrator.entry.runner import run
from orchestrator.state.config import load_config
from orchestrator.state.sinks import flatten
from tests.chromium import check_page, chromium_path
from tests.integration.conftest import read_jsonl, small_run_raw

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 4


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    raw = small_run_raw(tmp_path_factory.mktemp("report"), name="seen", steps=STEPS)
    raw["telemetry"] |= {"wandb": {"project": "flotilla-tests", "mode": "offline"}, "tensorboard": True}
    result = run(load_config(raw=raw), quiet=True)
    assert result.steps_done == STEPS
    return result.run_dir


def test_run_writes_report_html_and_every_chart_renders_in_chromium(run_dir, tmp_path):
    if chromium_path() is None:
        pytest.skip("chromium is not installed (.ci/run installs it)")
    html = run_dir / "report.html"
    assert html.is_file()
    check = check_page(html, tmp_path / "report.png", shot_height=1400)
    assert check.problems == []
    assert check.expected_charts == len(check.charts) == 12
    assert all(c["width"] > 100 and c["height"] > 100 for c in check.charts)
    png = check.screenshot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (1280, 1400)

    # A damaged copy: no traces, its metrics cut mid-line, no cost report. It still renders
    # what it has and names what it lacks; so does the comparison of both.
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(run_dir / "config.json", broken)
    text = (run_dir / "metrics.jsonl").read_text()
    (broken / "metrics.jsonl").write_text(text[: len(text) - 40])
    check = check_page(write_report(broken))
    assert check.problems == [] and len(check.charts) == 10  # all but the two waterfalls
    page = (broken / "report.html").read_text()
    assert "truncated" in page and "traces.jsonl is missing" in page and "cost_report.json is missing" in page
    check = check_page(write_compare([run_dir, broken], tmp_path / "cmp.html"))
    assert check.problems == [] and len(check.charts) == 4


def _wandb_records(path: Path) -> list[bytes]:
    """Records of a W&B `.wandb` file: a 7-byte header (":W&B", magic, version), then
    LevelDB-style 32 KiB blocks of chunks (crc32: 4, length: 2, type: 1 = full, 2 = first,
    3 = middle, 4 = last)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pos, partial = [], 7, b""
    block = 32 * 1024
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            break
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            partial = chunk
        elif kind == 3:
            partial += chunk
        elif kind == 4:
            records.append(partial + chunk)
    return records


def test_wandb_offline_log_holds_the_metrics_lines(run_dir):
    from wandb.proto import wandb_internal_pb2 as pb

    files = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    history: dict[int, dict[str, float]] = {}
    summary: dict[str, float] = {}
    for raw in _wandb_records(files[0]):
        rec = pb.Record()
        rec.ParseFromString(raw)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            history[int(items["step"])] = items
        elif kind == "summary":
            summary.update({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.summary.update})
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert sorted(history) == [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    for m in metrics:
        logged = history[m["step"]]
        for key, value in flatten(m).items():
            assert logged[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
        assert "pools/h100-fp8/tokens_per_s" in logged
    cost = json.loads((run_dir / "cost_report.json").read_text())
    assert summary["cost/totals/cost_usd"] == pytest.approx(cost["totals"]["cost_usd"])
    assert summary["cost/counterfactual/saving_pct"] == pytest.approx(cost["counterfactual"]["saving_pct"])


def test_tensorboard_event_files_hold_the_metrics_lines(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    tags = set(acc.Tags()["scalars"])
    expected = {k for m in metrics for k in flatten(m)}
    assert expected <= tags
    for key in expected:
        logged = {e.step: e.value for e in acc.Scalars(key)}
        for m in metrics:
            value = flatten(m).get(key)
            if value is not None:  # event files store float32
                assert logged[m["step"]] == pytest.approx(value, rel=1e-6, abs=1e-30), (key, m["step"])
    cost = json.loads((run_dir / "cost_report.json").read_text())
    assert acc.Scalars("cost/totals/cost_usd")[-1].value == pytest.approx(cost["totals"]["cost_usd"], rel=1e-6)
