"""Trace sampling: decided at the root, followed across processes; kept kinds; the file cap."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from orchestrator.runtime import ActorError, configure_tracing, open_mesh, span, spans_not_written
from orchestrator.runtime._tracing import current_traceparent

from ._actors import Relay

ENV = (
    "FLOTILLA_TRACE_FILE",
    "FLOTILLA_SERVICE_NAME",
    "FLOTILLA_TRACE_SAMPLE",
    "FLOTILLA_TRACE_ALWAYS",
    "FLOTILLA_TRACE_TAIL",
    "FLOTILLA_TRACE_MAX_BYTES",
)


@pytest.fixture(autouse=True)
def _restore(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # configure_tracing exports its settings; monkeypatch puts the environment back, and the
    # process's tracing goes back to writing every span (other tests in this process expect it).
    for name in ENV:
        monkeypatch.setenv(name, "")
    yield
    configure_tracing(tmp_path / "after.jsonl", "test")


def _spans(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def test_sampling_is_decided_at_the_root_and_followed_in_the_actor_process(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    configure_tracing(path, "test-controller", sample=0.5)
    roots = []
    with trio.fail_after(60):
        async with open_mesh(Relay, name="relay") as mesh:
            for i in range(40):
                with span("root", i=i) as s:
                    await mesh[0].traced_child.call_one(f"call-{i}")
                roots.append(s.get_span_context())
    spans = _spans(path)
    written_roots = {s["trace_id"] for s in spans if s["name"] == "root"}
    children = {s["trace_id"]: s for s in spans if s["name"] == "relay.inner"}
    sampled = {f"{c.trace_id:032x}" for c in roots if c.trace_flags.sampled}
    # ratio 0.5 over 40 traces: both kinds occur (all alike has odds 2^-39)
    assert 0 < len(sampled) < 40
    assert written_roots == sampled
    # the actor process wrote a span exactly for the traces its caller sampled
    assert set(children) == sampled
    assert all(c["service"] == "relay[0]" for c in children.values())


async def test_always_kept_kinds_are_written_at_ratio_zero_in_every_process(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    configure_tracing(path, "test-controller", sample=0.0, always={"train_step", "relay.inner"}, tail={"rollout"})
    with trio.fail_after(60):
        async with open_mesh(Relay, name="relay") as mesh:
            # a child of a kept span follows it
            with span("train_step", version=1), span("train_step.part"):
                pass
            with span("rollout", n=1) as ok:
                with span("env.step"):
                    pass
                ok.set_attribute("failed", False)
            with span("rollout", n=2) as bad:
                with span("env.step"):
                    pass
                bad.set_attribute("failed", True)
            with pytest.raises(RuntimeError), span("rollout", n=3):
                raise RuntimeError("episode broke")
            with span("unsampled.root"):
                await mesh[0].traced_child.call_one("always")  # kept in the actor by name
                await mesh[0].traced_child.call_one("again")
    spans = _spans(path)
    names = sorted(s["name"] for s in spans)
    assert names == ["relay.inner", "relay.inner", "rollout", "rollout", "train_step", "train_step.part"]
    rollouts = {s["attributes"]["n"]: s for s in spans if s["name"] == "rollout"}
    assert set(rollouts) == {2, 3}  # the failed ones; their children were never recorded
    assert all(s["sampled"] is False for s in rollouts.values())
    assert {s["service"] for s in spans if s["name"] == "relay.inner"} == {"relay[0]"}
    step = next(s for s in spans if s["name"] == "train_step")
    assert "sampled" not in step
    assert step["attributes"] == {"version": 1}


def test_the_cap_stops_writing_and_counts_what_it_left_out(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    configure_tracing(path, "capped", max_bytes=2_000)
    for i in range(60):
        with span("work", i=i, padding="x" * 40):
            pass
    configure_tracing(tmp_path / "other.jsonl", "capped")  # re-targeting writes the final count
    written = _spans(path)
    assert path.stat().st_size <= 2_000
    assert 0 < len(written) < 60
    assert [s["attributes"]["i"] for s in written] == list(range(len(written)))
    assert spans_not_written(path) == 60 - len(written)
    assert spans_not_written(tmp_path / "other.jsonl") == 0


def test_bad_rules_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="sample ratio"):
        configure_tracing(tmp_path / "x.jsonl", "t", sample=1.5)
    with pytest.raises(ValueError, match="at least 1 byte"):
        configure_tracing(tmp_path / "x.jsonl", "t", max_bytes=0)


def test_children_of_an_unsampled_trace_are_not_made_but_kept_kinds_are(tmp_path: Path) -> None:
    from opentelemetry import trace

    path = tmp_path / "spans.jsonl"
    configure_tracing(path, "unsampled", sample=0.0, always=["publish"], tail=["rollout"])
    with pytest.raises(ValueError), span("rollout", task="t") as root:  # outside the sample
        with span("env.step", turn=1) as child:
            assert not child.is_recording()
            # OpenTelemetry's own context is left as it was: nothing is made outside the sample
            assert not trace.get_current_span().get_span_context().is_valid
            assert child.get_span_context().trace_id == root.get_span_context().trace_id
            child.set_attribute("reward", 1.0)  # harmless
            with span("publish", version=3):  # always kept, even here
                pass
        root.set_attribute("reward", 0.0)
        raise ValueError("episode failed")  # a failed tail span outside the sample is kept
    with span("rollout", task="fine") as ok:
        ok.set_attribute("failed", False)  # outside the sample and not failed: not written
    with span("rollout", task="soft") as soft:
        soft.set_attribute("failed", True)  # failed without raising: written
    configure_tracing(tmp_path / "other.jsonl", "unsampled")
    spans = {(s["name"], s["attributes"].get("task")): s for s in _spans(path)}
    assert sorted(spans) == [("publish", None), ("rollout", "soft"), ("rollout", "t")]
    failed = spans[("rollout", "t")]
    assert failed["attributes"]["reward"] == 0.0 and "episode failed" in json.dumps(failed)
    # written under the trace id its children were given (and calls carried)
    assert failed["trace_id"] == f"{root.get_span_context().trace_id:032x}"


async def test_a_trace_outside_the_sample_is_followed_across_a_call(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    configure_tracing(path, "test-controller", sample=0.0, always={"relay.kept"}, tail={"rollout"})
    with trio.fail_after(60):
        async with open_mesh(Relay, name="relay") as mesh:
            with span("rollout", n=1) as root:  # outside the sample
                ctx = root.get_span_context()
                assert current_traceparent() == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-00"
                with span("generate") as quiet:
                    assert current_traceparent() == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-00"
                    assert quiet.get_span_context() == ctx and not quiet.is_recording()
                    with pytest.raises(ActorError, match="episode broke"):
                        await mesh[0].failing_episode.call_one("remote")
                root.set_attribute("failed", True)
            assert current_traceparent() is None
    spans = _spans(path)
    names = sorted((s["service"], s["name"]) for s in spans)
    # the kept kind and its child in the actor; neither step; both failed rollouts
    assert names == [
        ("relay[0]", "relay.kept"),
        ("relay[0]", "relay.kept.part"),
        ("relay[0]", "rollout"),
        ("test-controller", "rollout"),
    ]
    by = {(s["service"], s["name"]): s for s in spans}
    trace_id = f"{ctx.trace_id:032x}"
    assert {s["trace_id"] for s in spans} == {trace_id}  # one trace, across the call
    assert by[("relay[0]", "rollout")]["parent_span_id"] == f"{ctx.span_id:016x}"
    assert by[("relay[0]", "relay.kept.part")]["parent_span_id"] == by[("relay[0]", "relay.kept")]["span_id"]
    assert by[("relay[0]", "rollout")]["sampled"] is False and "episode broke" in json.dumps(
        by[("relay[0]", "rollout")]
    )


def _python(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FLOTILLA_TRACE", "OTEL_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_process_that_does_not_trace_makes_no_spans_and_never_imports_opentelemetry() -> None:
    code = (
        "import sys\n"
        "from orchestrator.runtime import span, traced\n"
        "from orchestrator.runtime._tracing import current_traceparent\n"
        "@traced\n"
        "def work():\n"
        "    return current_traceparent()\n"
        "with span('outer', a=1) as s:\n"
        "    s.set_attribute('b', 2)\n"
        "    print(s.is_recording(), work(), 'opentelemetry.trace' in sys.modules)\n"
    )
    assert _python(code) == "False None False"


def test_spans_go_to_an_opentelemetry_provider_the_program_installed_itself() -> None:
    code = (
        "from opentelemetry import trace\n"
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "from opentelemetry.sdk.trace.export import SimpleSpanProcessor\n"
        "from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter\n"
        "from orchestrator.runtime import span\n"
        "mem = InMemorySpanExporter()\n"
        "provider = TracerProvider()\n"
        "provider.add_span_processor(SimpleSpanProcessor(mem))\n"
        "trace.set_tracer_provider(provider)\n"
        "with span('mine', k=1), span('child'):\n"
        "    pass\n"
        "got = {s.name: s for s in mem.get_finished_spans()}\n"
        "print(sorted(got), got['child'].parent.span_id == got['mine'].context.span_id, dict(got['mine'].attributes))\n"
    )
    assert _python(code) == "['child', 'mine'] True {'k': 1}"


def test_a_tail_kinds_roots_are_sampled_at_the_configured_rate(tmp_path: Path) -> None:
    path = tmp_path / "spans.jsonl"
    configure_tracing(path, "rate", sample=0.5, tail=["rollout"])
    for i in range(400):
        with span("rollout", i=i), span("env.step"):  # a sampled root keeps its child too
            pass
    configure_tracing(tmp_path / "other.jsonl", "rate")
    spans = _spans(path)
    roots = [s for s in spans if s["name"] == "rollout"]
    assert 140 < len(roots) < 260, len(roots)  # 200 expected; 6 standard deviations either way
    assert sum(s["name"] == "env.step" for s in spans) == len(roots)
    assert all("sampled" not in s for s in roots)


def test_a_trace_file_that_cannot_be_written_never_fails_the_traced_work(tmp_path: Path, capfd) -> None:
    gone = tmp_path / "gone"
    configure_tracing(gone / "traces.jsonl", "lost", always=["weights.apply"])  # its directory does not exist
    for _ in range(3):
        with span("weights.apply", version=1) as s:  # kept, and unwritable: the block still runs
            s.set_attribute("ok", True)
    assert "cannot write" in capfd.readouterr().err
    assert not gone.exists()
