"""The gateway's cost per turn, and what the sampler's prefix cache buys a multi-turn agent.

What: sessions driven by a separate client process (as a harness would be) against a
running gateway (Starlette on hypercorn's trio worker, in this process) backed by torch
``SamplerActor``s (their own processes, the tiny built-in model, the word tokenizer):

* overhead: per turn, one request at a time, the latency minus the time the request
  waited on the sampler (the ``x-flotilla-sampler-ms`` header the gateway sets), p50/p99,
  measured side by side in one run -- the turns of an ``openai``-client session and of
  four raw-HTTP sessions (one of them timing the app, two on the Responses and Messages
  endpoints) interleave, so all see the same machine:

  - ``overhead_p50_ms`` (the target): a minimal HTTP/1.1 client (a blocking keep-alive
    socket with TCP_NODELAY: write the request, read the status line, headers and body,
    parse the JSON). It counts everything the gateway does for a turn -- loopback TCP
    both ways, the server's HTTP parsing and writing, routing, validation, template and
    token bookkeeping, response JSON -- and next to nothing of the client's own;
  - ``openai_overhead_p50_ms``: the official ``openai`` client (``with_raw_response``,
    then ``parse()``). It adds that library's request building and response parsing
    (httpx, pydantic models), which a harness pays whatever server it talks to: not
    the gateway's cost, reported so nobody has to guess it;
  - ``chat_overhead_p50_ms`` (= ``overhead_p50_ms``), ``responses_overhead_p50_ms`` and
    ``messages_overhead_p50_ms``: the same raw client on ``/v1/chat/completions``,
    ``/v1/responses`` (the whole input resent each turn, as chat resends its messages)
    and ``/v1/messages``, one session each, interleaved with the others: what each
    protocol's translation costs over the chat path (the target: within 1.5x of chat);
  - ``app_overhead_p50_ms``: inside the ASGI app only (no HTTP parsing, no sockets),
    timed on a third interleaved raw-HTTP session served by a second server whose app is
    wrapped in a timer (the figures above run the app unwrapped); the rest of a turn is
    hypercorn's HTTP handling and the loopback sockets;

  and ``gateway_cpu_per_turn_ms``, the gateway process's CPU time over those turns per
  turn (app, servers, the sampler call's client side): on a shared machine wall times
  include waits for a CPU, CPU time does not;
* sessions: N concurrent sessions through the ``openai`` client, how many finished every
  turn without an error, and their overhead: with N requests in flight on one event loop
  (and one client loop) a turn also waits for the others' processing, so this is a
  queueing figure;
* multiturn_speedup: 8-turn conversations with a long first prompt (``--system``
  tokens: an agent's instructions and tool schemas) and ``--turn-tokens`` generated
  per turn, wall time with the sampler's prefix cache off / on. Both samplers are up
  together and the runs alternate (``--multi-reps`` each, medians), so machine load
  hits both alike. The cache-on sampler runs the conversations once more after it has
  served the concurrent sessions (``multiturn_reuse_after_many_s``): a sampler that has
  served many sessions must not be slower;
* conformance_clients_ok: ``flotilla run`` on a tiny byte-level BPE checkpoint (random
  init, a ChatML template with tools) whose harness is the five clients of
  ``tests/unit/gateway/clients.py`` in turn (raw httpx as OpenAI's reference writes it,
  ``openai`` sync and async, the Agents SDK, LangChain): the clients whose every episode
  succeeded (episodes are matched to clients by their prompt's seed, from the traces);
* random_bytes_episodes_failed: built-in episodes and gateway sessions (``--random-episodes``
  each) whose replies are random ids of a byte-level BPE model, checked id for id as the
  test suite checks them;
* failing_harness_stop_s: ``flotilla run`` whose harness always exits with an error, from
  the command's start to its exit (it must stop by itself, non-zero, naming the error).

Why: the gateway must cost the sampler next to nothing per turn, and an agent's
growing context must not be recomputed at every turn (issue 13's targets:
overhead_p50_ms <= 2.0 on hypercorn, 64 sessions none failing, multiturn_speedup >= 2,
every client trains, a failing harness stops within 30 s).

How:  python benchmarks/gateway.py            (64 sessions x 4 turns; 8 x 8 turns multi-turn, 3 reps)
      python benchmarks/gateway.py --quick    (64 x 2; 4 x 8 multi-turn, 1 rep; < 60 s unloaded)
The machine's load average is printed with the figures (other processes inflate them).
The last line printed is one JSON object with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from _runs import process_cpu_s


# ------------------------------------------------------------------------ client process
class _RawClient:
    """A minimal HTTP/1.1 keep-alive client: one blocking socket, no library."""

    def __init__(self, url: str) -> None:
        import socket

        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.file = self.sock.makefile("rb")

    def post(self, path: str, body: dict) -> tuple[dict, dict[str, str]]:
        data = json.dumps(body).encode()
        self.sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        status = self.file.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"raw client: {status!r}")
        headers = {}
        while (line := self.file.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode().partition(":")
            headers[k.strip().lower()] = v.strip()
        return json.loads(self.file.read(int(headers["content-length"]))), headers

    def close(self) -> None:
        self.file.close()
        self.sock.close()


_RAW_ROUTES = {  # probe kind: (route, request body from the messages and max tokens, reply text)
    "raw": (
        "chat/completions",
        lambda m, k: {"model": "flotilla", "messages": m, "max_tokens": k},
        lambda b: b["choices"][0]["message"]["content"] or "",
    ),
    # the whole input resent each turn, as chat resends its messages
    "raw_responses": (
        "responses",
        lambda m, k: {"model": "flotilla", "input": m, "max_output_tokens": k},
        lambda b: b["output"][0]["content"][0]["text"],
    ),
    "raw_messages": (
        "messages",
        lambda m, k: {"model": "flotilla", "messages": m, "max_tokens": k},
        lambda b: "".join(x["text"] for x in b["content"] if x["type"] == "text"),
    ),
}


async def _client_main(spec: dict) -> dict:
    import httpx
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    http = DefaultAsyncHttpxClient(limits=limits, timeout=600)
    lat, waits, failures = [], [], []

    async def session(sid: str, first: str) -> None:
        client = AsyncOpenAI(base_url=f"{spec['url']}/s/{sid}/v1", api_key=sid, max_retries=0, http_client=http)
        messages = [{"role": "user", "content": first}]
        try:
            for _ in range(spec["turns"]):
                t0 = time.perf_counter()
                raw = await client.chat.completions.with_raw_response.create(
                    model="flotilla", messages=messages, max_tokens=spec["max_tokens"]
                )
                reply = raw.parse()
                lat.append(time.perf_counter() - t0)
                waits.append(float(raw.headers["x-flotilla-sampler-ms"]) / 1e3)
                messages += [
                    {"role": "assistant", "content": reply.choices[0].message.content or ""},
                    {"role": "user", "content": spec["user"]},
                ]
        except Exception as e:
            failures.append(f"{type(e).__name__}: {e}")

    async def probe(sids: dict[str, str]) -> dict:
        """One session per kind -- raw HTTP to each server, the openai client to the
        default one -- their turns interleaved (the order rotating every turn)."""
        kinds = list(sids)
        client = AsyncOpenAI(
            base_url=f"{spec['urls']['openai']}/s/{sids['openai']}/v1",
            api_key=sids["openai"],
            max_retries=0,
            http_client=http,
        )
        raw_clients = {k: _RawClient(spec["urls"][k]) for k in kinds if k != "openai"}
        out: dict = {k: ([], []) for k in kinds}
        chats = {k: [{"role": "user", "content": spec["first"]}] for k in kinds}
        try:
            for t in range(spec["turns"]):
                for kind in kinds[t % len(kinds) :] + kinds[: t % len(kinds)]:
                    messages = chats[kind]
                    t0 = time.perf_counter()
                    if kind == "openai":
                        r = await client.chat.completions.with_raw_response.create(
                            model="flotilla", messages=messages, max_tokens=spec["max_tokens"]
                        )
                        text = r.parse().choices[0].message.content or ""
                        header = r.headers["x-flotilla-sampler-ms"]
                    else:
                        path, body, text_of = _RAW_ROUTES.get(kind, _RAW_ROUTES["raw"])
                        reply, headers = raw_clients[kind].post(
                            f"/s/{sids[kind]}/v1/{path}", body(messages, spec["max_tokens"])
                        )
                        text = text_of(reply)
                        header = headers["x-flotilla-sampler-ms"]
                    out[kind][0].append(time.perf_counter() - t0)
                    out[kind][1].append(float(header) / 1e3)
                    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": spec["user"]}]
        finally:
            for c in raw_clients.values():
                c.close()
        return out

    t0 = time.perf_counter()
    if spec.get("probe"):
        out = await probe(dict(zip(spec["probe"], spec["sessions"], strict=True)))
        await http.aclose()
        return {**out, "wall": time.perf_counter() - t0}
    await asyncio.gather(*(session(sid, spec["first"]) for sid in spec["sessions"]))
    wall = time.perf_counter() - t0
    await http.aclose()
    return {"latency": lat, "sampler": waits, "failures": failures, "wall": wall}


def _client(spec: dict) -> dict:
    """Run one phase's sessions in a fresh client process."""
    proc = subprocess.run(
        [sys.executable, __file__, "--client"],
        input=json.dumps(spec),
        text=True,
        capture_output=True,
        check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"client process failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------ gateway process
def _timed_app(app, out: list):
    """ASGI wrapper: per request, the app's own time minus its sampler wait."""

    async def wrapped(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)
        t0 = time.perf_counter()
        wait = [0.0]

        async def send_(msg):
            if msg["type"] == "http.response.start":
                for k, v in msg.get("headers", []):
                    if k == b"x-flotilla-sampler-ms":
                        wait[0] = float(v) / 1e3
            if msg["type"] == "http.response.body" and not msg.get("more_body"):
                out.append(time.perf_counter() - t0 - wait[0])
            await send(msg)

        await app(scope, receive, send_)

    return wrapped


def _actor_cpu(name: str) -> float:
    """CPU seconds (user + system) used so far by this process's actor child ``name``
    (found by its command line in /proc; NaN where there is no /proc). Unlike wall time,
    it does not grow when other jobs take the cores."""
    me = str(os.getpid())
    for d in Path("/proc").iterdir():
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            if (
                b"--name" in argv
                and argv[argv.index(b"--name") + 1] == name.encode()
                and argv[argv.index(b"--parent-pid") + 1] == me.encode()
            ):
                cpu = process_cpu_s(int(d.name))
                return float("nan") if cpu is None else cpu
        except (OSError, ValueError, IndexError):
            continue
    return float("nan")


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def _gateway_main(args) -> dict:
    import trio

    from actors.chat import WordChatFormat
    from actors.gateway import Gateway, SessionLimits
    from actors.gateway._app import serve_gateway
    from actors.models import default_model_config
    from actors.sampler import SamplerActor
    from actors.types import SamplingParams, TaskSpec
    from orchestrator.runtime import open_mesh

    fmt = WordChatFormat()
    cfg = default_model_config()
    cfg["max_position_embeddings"] = args.system + 8 * (args.turn_tokens + 40) + 64
    task = TaskSpec(task="bench", prompt_id="p", group_id="g")
    limits = SessionLimits(SamplingParams(), cfg["max_position_embeddings"], 64)
    first_short = "guess the number from 0 to 63 in 4 turns"
    first_long = " ".join(str(i % 64) for i in range(args.system))
    user = " ".join(["higher"] + [str(i % 64) for i in range(22)])  # 24 tokens with the turn markers
    app_times: list[float] = []
    computes: list[float] = []
    results: dict = {"multi_on": [], "multi_off": []}
    gw = Gateway(fmt)
    env = {"OMP_NUM_THREADS": "1"}

    samplers: dict = {}
    urls: dict[str, str] = {}

    async def phase(
        name: str, n: int, turns: int, first: str, max_tokens: int, user_turn: str = user, probe: tuple[str, ...] = ()
    ) -> dict:
        sampler = samplers[name]

        async def gen(req):
            res = await sampler.generate.call_one(req)
            computes.append(res.seconds)
            return res

        sessions = [gw.open_session(task, gen, limits, 0) for _ in range(n)]
        spec = {
            "url": gw.address,
            "urls": urls,
            "sessions": [s.id for s in sessions],
            "turns": turns,
            "probe": probe,
            "max_tokens": max_tokens,
            "first": first,
            "user": user_turn,
        }
        cpu0 = _actor_cpu(name)
        own0 = time.process_time()
        out = await trio.to_thread.run_sync(_client, spec)
        out["gateway_cpu"] = time.process_time() - own0
        out["sampler_cpu"] = _actor_cpu(name) - cpu0
        for s in sessions:
            gw.close_session(s)
            await sampler.end_session.call_one(s.id)
        out["segments"] = sum(len(s.segments) for s in sessions)
        return out

    def sampler_mesh(cache: bool):
        return open_mesh(
            SamplerActor,
            "bench",
            "fp32",
            cfg,
            "cpu",
            init_seed=0,
            max_batch=args.sessions,
            prefix_cache=cache,
            procs=1,
            name="sampler-on" if cache else "sampler-off",
            env=env,
        )

    async with trio.open_nursery() as nursery, sampler_mesh(True) as on, sampler_mesh(False) as off:
        samplers.update({"sampler-on": on[0], "sampler-off": off[0]})
        # The measured server runs the gateway's app as it is; the app's own time is taken on
        # a second server whose app is wrapped in a timer, so the timer's cost is in none of
        # the other figures.
        gw.address = await nursery.start(serve_gateway, gw.app)
        timed = await nursery.start(serve_gateway, _timed_app(gw.app, app_times))
        urls.update(
            {
                "raw": gw.address,
                "openai": gw.address,
                "raw_timed": timed,
                "raw_responses": gw.address,
                "raw_messages": gw.address,
            }
        )
        for name in samplers:
            await phase(name, 2, 2, first_short, 4)  # warm-up (imports, first forwards)
        # Alternating, so that the machine's load drifts over both alike.
        for _ in range(args.multi_reps):
            for key, name in (("multi_on", "sampler-on"), ("multi_off", "sampler-off")):
                results[key].append(await phase(name, args.multi_sessions, 8, first_long, args.turn_tokens))
        results["stats_on"] = await on[0].stats.call_one()
        results["stats_off"] = await off[0].stats.call_one()
        app_times.clear()
        computes.clear()
        kinds = ("raw", "openai", "raw_timed", "raw_responses", "raw_messages")
        results["probe"] = await phase(
            "sampler-on", len(kinds), args.probe_turns, first_short, 1, user_turn="higher", probe=kinds
        )
        results["app_times"] = list(app_times)
        results["computes"] = list(computes)
        results["overhead"] = await phase("sampler-on", args.sessions, args.turns, first_short, 4)
        results["multi_on_after"] = await phase("sampler-on", args.multi_sessions, 8, first_long, args.turn_tokens)
        nursery.cancel_scope.cancel()
    return results


# ------------------------------------------------------------------------ whole runs
ROOT = Path(__file__).resolve().parents[1]


def _module(path: Path):
    """A module of the test suite by its file (the conformance clients and the tokenizer's
    corpus live with the tests, which are not part of the installed package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _flotilla_run(config: Path, timeout: float) -> tuple[int, str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "run", str(config), "--quiet"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return done.returncode, done.stderr, time.monotonic() - t0


def _client_runs(steps: int) -> dict:
    """One run whose harness is the five conformance clients in turn; per client, its
    episodes and how many failed (a prompt's client follows from its seed, as in clients.py)."""
    import tempfile

    from actors.tiny import make_checkpoint, train_tokenizer

    CORPUS = _module(ROOT / "tests/unit/gateway/_actors.py").CORPUS
    CLIENTS = _module(ROOT / "tests/unit/gateway/clients.py").CLIENTS

    names = sorted(CLIENTS)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_checkpoint(
            Path(tmp) / "model",
            "qwen2",
            tokenizer=train_tokenizer(CORPUS, vocab_size=400),
            seed=0,
            max_position_embeddings=1024,
        )
        config = Path(tmp) / "clients.toml"
        config.write_text(f"""name = "clients"\nrun_root = "{tmp}"\nsteps = {steps}
[model]\npath = "{model}"\nmax_seq_len = 1024
[task]\nkind = "harness"\nname = "clients"\nentrypoint = "{ROOT / 'tests/unit/gateway/clients.py'}:play"
max_new_tokens = 16\nepisode_timeout_s = 120
[rollout]\nprompts_per_step = 5\ngroup_size = 2\nmax_buffered_groups = 1
[[pools]]\nname = "p"\ngpu = "cpu"\ndevice = "cpu"\nmax_concurrent_rollouts = 10
""")
        rc, err, _ = _flotilla_run(config, 900)
        if rc != 0:
            raise RuntimeError(f"the clients' run failed (exit {rc}): {err[-2000:]}")
        episodes = dict.fromkeys(names, 0)
        failed = dict.fromkeys(names, 0)
        for line in (Path(tmp) / "clients" / "traces.jsonl").read_text().splitlines():
            span = json.loads(line)
            a = span.get("attributes", {})
            if span.get("name") != "rollout" or "failed" not in a:
                continue  # cancelled at the run's end: no outcome
            name = names[(int(a["prompt_id"][1:])) % len(names)]  # seed = 1_000_003 * 0 + i
            episodes[name] += 1
            failed[name] += bool(a["failed"])
    return {"episodes": episodes, "failed": failed, "ok": [k for k in names if episodes[k] and not failed[k]]}


def _random_bytes(episodes: int) -> dict:
    """Built-in episodes and gateway sessions whose replies are random ids of a byte-level
    BPE model (invalid UTF-8, split characters, cuts, special ids, tool calls), checked as the
    test suite checks them (``tests/unit/actors/test_chat_generated_ids.py``)."""
    import trio

    mod = _module(ROOT / "tests/unit/actors/test_chat_generated_ids.py")
    fmt = mod.make_format()

    async def both() -> list[str]:
        built_in, _ = await mod.built_in_failures(fmt, episodes)
        gateway, _ = await mod.gateway_failures(fmt, episodes)
        return built_in + gateway

    failures = trio.run(both)
    return {"episodes": 2 * episodes, "failed": len(failures), "first": failures[:1]}


def _failing_run() -> dict:
    """A run whose harness always exits with an error: seconds until it stopped by itself."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "failing.toml"
        command = "python3 -c 'import sys; print(\"no API key configured\", file=sys.stderr); sys.exit(3)'"
        config.write_text(f"""name = "failing"\nrun_root = "{tmp}"\nsteps = 100
[task]\nkind = "harness"\nname = "failing"\ncommand = {json.dumps(command)}
[[pools]]\nname = "p"\ngpu = "cpu"\ndevice = "cpu"
""")
        rc, err, seconds = _flotilla_run(config, 300)
    line = next((x for x in err.splitlines() if x.startswith("flotilla: stopped:")), "")
    return {"rc": rc, "seconds": seconds, "line": line}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=64, help="concurrent sessions (overhead phase)")
    ap.add_argument("--turns", type=int, default=4, help="turns per concurrent session")
    ap.add_argument(
        "--probe-turns",
        type=int,
        default=50,
        help="turns of each probe session (raw HTTP to each server, openai client; overhead)",
    )
    ap.add_argument("--multi-sessions", type=int, default=8, help="concurrent 8-turn sessions (multi-turn)")
    ap.add_argument("--multi-reps", type=int, default=3, help="multi-turn runs per sampler (alternating)")
    ap.add_argument("--system", type=int, default=1024, help="multi-turn: tokens of the first prompt")
    ap.add_argument("--turn-tokens", type=int, default=8, help="multi-turn: tokens generated per turn")
    ap.add_argument(
        "--random-episodes", type=int, default=1000, help="random-id episodes, built in and through the gateway (each)"
    )
    ap.add_argument("--client-steps", type=int, default=4, help="steps of the run through the five clients")
    ap.add_argument("--quick", action="store_true", help="fewer turns and multi-turn sessions (< 60 s unloaded)")
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        print(json.dumps(asyncio.run(_client_main(json.loads(sys.stdin.read())))))
        return
    if args.quick:
        args.turns, args.multi_sessions, args.probe_turns, args.multi_reps = 2, 4, 30, 1
        args.client_steps = 2
        args.random_episodes = 200

    import torch
    import trio

    torch.set_num_threads(1)
    r = trio.run(_gateway_main, args)
    ov, probe = r["overhead"], r["probe"]
    clients = _client_runs(args.client_steps)
    stop = _failing_run()
    odd = _random_bytes(args.random_episodes)

    def minus_wait(pair) -> list[float]:
        return [lat - w for lat, w in zip(*pair, strict=True)]

    raw, oai = minus_wait(probe["raw"]), minus_wait(probe["openai"])
    resp, msgs = minus_wait(probe["raw_responses"]), minus_wait(probe["raw_messages"])
    conc = [lat - w for lat, w in zip(ov["latency"], ov["sampler"], strict=True)]
    app = r["app_times"]
    kinds = ("raw", "openai", "raw_timed", "raw_responses", "raw_messages")
    waits = [w for k in kinds for w in probe[k][1]]
    probe_turns = sum(len(probe[k][0]) for k in kinds)
    cpu_turn = probe["gateway_cpu"] / probe_turns
    ok = args.sessions - len(ov["failures"])
    on_wall = statistics.median(x["wall"] for x in r["multi_on"])
    off_wall = statistics.median(x["wall"] for x in r["multi_off"])
    after = r["multi_on_after"]["wall"]
    on_cpu = statistics.median(x["sampler_cpu"] for x in r["multi_on"])
    off_cpu = statistics.median(x["sampler_cpu"] for x in r["multi_off"])
    cpu_speedup = off_cpu / on_cpu if on_cpu > 0 else float("nan")
    after_cpu = r["multi_on_after"]["sampler_cpu"]
    speedup = off_wall / on_wall if on_wall > 0 else float("nan")
    # The part of a turn the prefix cache acts on: the time requests waited on the sampler.
    on_wait = statistics.median(sum(x["sampler"]) for x in r["multi_on"])
    off_wait = statistics.median(sum(x["sampler"]) for x in r["multi_off"])
    sampler_speedup = off_wait / on_wait if on_wait > 0 else float("nan")
    load = os.getloadavg()[0]

    def ms(xs: list[float]) -> str:
        return f"{_pct(xs, 0.5) * 1e3:.2f} / {_pct(xs, 0.99) * 1e3:.2f} ms"

    n_on = len(r["multi_on"])
    rows = [
        (
            "sampler wait p50",
            f"{statistics.median(waits) * 1e3:.2f} ms",
            f"of which computing {statistics.median(r['computes']) * 1e3:.2f} ms",
        ),
        ("overhead p50 / p99 (raw HTTP)", ms(raw), f"{len(raw)} turns: latency - sampler wait"),
        ("  through the openai client", ms(oai), f"{len(oai)} turns, interleaved"),
        (
            "  Responses API (raw HTTP)",
            ms(resp),
            (f"{len(resp)} turns, interleaved; {_pct(resp, 0.5) / _pct(raw, 0.5):.2f}x chat"),
        ),
        (
            "  Messages API (raw HTTP)",
            ms(msgs),
            (f"{len(msgs)} turns, interleaved; {_pct(msgs, 0.5) / _pct(raw, 0.5):.2f}x chat"),
        ),
        ("  inside the ASGI app", ms(app), f"{len(app)} turns of a 3rd session: no HTTP, no sockets"),
        ("gateway CPU per turn", f"{cpu_turn * 1e3:.2f} ms", "process time / probe turns"),
        ("concurrent sessions ok", f"{ok}/{args.sessions}", f"{args.turns} turns each, openai client"),
        ("  their overhead p50 / p99", ms(conc), f"{args.sessions} requests in flight"),
        (
            "  gateway CPU per turn",
            f"{ov['gateway_cpu'] / max(1, len(conc)) * 1e3:.2f} ms",
            "queued turns wait for each other's",
        ),
        (
            "8 turns, prefix cache on",
            f"{on_wall:.2f} s",
            f"median of {n_on}; {r['stats_on']['prompt_tokens']} prompt tokens in all",
        ),
        ("8 turns, prefix cache off", f"{off_wall:.2f} s", f"{r['stats_off']['prompt_tokens']} prompt tokens"),
        ("multi-turn speedup", f"{speedup:.2f}x", f"{args.multi_sessions} sessions, {args.system}-token prompt"),
        ("  in sampler wait alone", f"{sampler_speedup:.2f}x", "sum of the requests' sampler waits"),
        ("  in sampler CPU time", f"{cpu_speedup:.2f}x", "the samplers' processes"),
        ("8 turns, cache on, later", f"{after:.2f} s", f"after {args.sessions} sessions on that sampler"),
        ("  sampler CPU: first / later", f"{on_cpu:.2f} / {after_cpu:.2f} s", "the cache-on sampler's process"),
        (
            "clients trained, 0 failed",
            f"{len(clients['ok'])}/{len(clients['episodes'])}",
            ", ".join(f"{k} {clients['failed'][k]}/{n}" for k, n in sorted(clients["episodes"].items()))
            + " failed/episodes",
        ),
        ("random-id episodes failed", f"{odd['failed']}/{odd['episodes']}", "; ".join(odd["first"])[:60]),
        ("failing harness: run stops", f"{stop['seconds']:.1f} s", f"exit {stop['rc']}: {stop['line'][:60]}"),
        ("load average (1 min)", f"{load:.1f}", f"{os.cpu_count()} cores"),
    ]
    for name, value, note in rows:
        print(f"{name:30s} {value:>20s}   {note}")
    if ov["failures"]:
        print("failures:", ov["failures"][:3])
    print(
        json.dumps(
            {
                "benchmark": "gateway",
                "sessions": args.sessions,
                "sessions_ok": ok,
                "turns": args.turns,
                "overhead_p50_ms": round(_pct(raw, 0.5) * 1e3, 3),
                "overhead_p99_ms": round(_pct(raw, 0.99) * 1e3, 3),
                "overhead_measured_by": "raw HTTP/1.1 keep-alive client: latency - x-flotilla-sampler-ms",
                "server": "hypercorn",
                "chat_overhead_p50_ms": round(_pct(raw, 0.5) * 1e3, 3),
                "responses_overhead_p50_ms": round(_pct(resp, 0.5) * 1e3, 3),
                "responses_overhead_p99_ms": round(_pct(resp, 0.99) * 1e3, 3),
                "messages_overhead_p50_ms": round(_pct(msgs, 0.5) * 1e3, 3),
                "messages_overhead_p99_ms": round(_pct(msgs, 0.99) * 1e3, 3),
                "responses_vs_chat_overhead": round(_pct(resp, 0.5) / _pct(raw, 0.5), 2),
                "messages_vs_chat_overhead": round(_pct(msgs, 0.5) / _pct(raw, 0.5), 2),
                "openai_overhead_p50_ms": round(_pct(oai, 0.5) * 1e3, 3),
                "openai_overhead_p99_ms": round(_pct(oai, 0.99) * 1e3, 3),
                "app_overhead_p50_ms": round(_pct(app, 0.5) * 1e3, 3),
                "app_overhead_p99_ms": round(_pct(app, 0.99) * 1e3, 3),
                "gateway_cpu_per_turn_ms": round(cpu_turn * 1e3, 3),
                "probe_turns": args.probe_turns,
                "raw_latency_p50_ms": round(statistics.median(probe["raw"][0]) * 1e3, 3),
                "openai_latency_p50_ms": round(statistics.median(probe["openai"][0]) * 1e3, 3),
                "sampler_wait_p50_ms": round(statistics.median(waits) * 1e3, 3),
                "sampler_compute_p50_ms": round(statistics.median(r["computes"]) * 1e3, 3),
                "concurrent_overhead_p50_ms": round(_pct(conc, 0.5) * 1e3, 3),
                "concurrent_overhead_p99_ms": round(_pct(conc, 0.99) * 1e3, 3),
                # Where a concurrent turn's time goes: the gateway's own CPU per turn, times the
                # requests queued ahead of it on the one event loop, plus the sampler batching them.
                "concurrent_gateway_cpu_per_turn_ms": round(ov["gateway_cpu"] / max(1, len(conc)) * 1e3, 3),
                "concurrent_sampler_wait_p50_ms": round(_pct(ov["sampler"], 0.5) * 1e3, 3),
                "multiturn_sessions": args.multi_sessions,
                "multiturn_system_tokens": args.system,
                "multiturn_reps": n_on,
                "multiturn_reuse_s": round(on_wall, 3),
                "multiturn_recompute_s": round(off_wall, 3),
                "multiturn_speedup": round(speedup, 2),
                "multiturn_sampler_wait_speedup": round(sampler_speedup, 2),
                "multiturn_reuse_after_many_s": round(after, 3),
                "multiturn_reuse_sampler_wait_s": round(on_wait, 3),
                "multiturn_reuse_after_many_sampler_wait_s": round(sum(r["multi_on_after"]["sampler"]), 3),
                "multiturn_reuse_gateway_cpu_s": round(statistics.median(x["gateway_cpu"] for x in r["multi_on"]), 3),
                "multiturn_reuse_after_many_gateway_cpu_s": round(r["multi_on_after"]["gateway_cpu"], 3),
                "multiturn_reuse_sampler_cpu_s": round(on_cpu, 3),
                "multiturn_reuse_after_many_sampler_cpu_s": round(after_cpu, 3),
                "multiturn_recompute_sampler_cpu_s": round(off_cpu, 3),
                "multiturn_sampler_cpu_speedup": round(cpu_speedup, 2),
                "prefix_hits": r["stats_on"]["prefix_hits"],
                "segments_per_session": round(r["multi_on"][0]["segments"] / args.multi_sessions, 2),
                "conformance_clients": sorted(clients["episodes"]),
                "conformance_clients_ok": len(clients["ok"]),
                "conformance_episodes": sum(clients["episodes"].values()),
                "conformance_episodes_failed": sum(clients["failed"].values()),
                "failing_harness_stop_s": round(stop["seconds"], 1),
                "random_bytes_episodes": odd["episodes"],
                "random_bytes_episodes_failed": odd["failed"],
                "failing_harness_exit": stop["rc"],
                "load_avg_1m": round(load, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
