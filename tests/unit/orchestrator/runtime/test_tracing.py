"""W3C trace context: the caller's span is the parent of the span opened in the actor."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import trio

from orchestrator.runtime import configure_tracing, open_mesh, span, traced

from ._actors import Relay


@traced
def _local_work() -> int:
    return 7


async def test_remote_span_is_child_of_caller_span(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # configure_tracing exports FLOTILLA_TRACE_FILE; monkeypatch restores it afterwards
    monkeypatch.setenv("FLOTILLA_TRACE_FILE", "")
    monkeypatch.setenv("FLOTILLA_SERVICE_NAME", "")
    path = tmp_path / "spans.jsonl"
    configure_tracing(path, "test-controller")
    with trio.fail_after(30):
        async with open_mesh(Relay, name="relay") as mesh:
            with span("controller.step", step=3) as caller:
                assert _local_work() == 7
                await mesh[0].traced_child.call_one("hello")
            ctx = caller.get_span_context()
    spans = [json.loads(line) for line in path.read_text().splitlines()]
    by_name = {s["name"]: s for s in spans}
    outer, inner, local = by_name["controller.step"], by_name["relay.inner"], by_name["_local_work"]
    assert outer["trace_id"] == f"{ctx.trace_id:032x}"
    assert outer["span_id"] == f"{ctx.span_id:016x}"
    assert outer["attributes"] == {"step": 3}
    assert outer["pid"] == os.getpid()
    assert local["parent_span_id"] == outer["span_id"]
    assert inner["trace_id"] == outer["trace_id"]
    assert inner["parent_span_id"] == outer["span_id"]
    assert inner["pid"] != os.getpid()
    assert inner["service"] == "relay[0]"
    assert inner["attributes"] == {"label": "hello"}
