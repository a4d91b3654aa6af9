"""The gateway's cost per turn, and what the sampler's prefix cache buys a multi-turn agent.

What: N concurrent sessions driven through the official ``openai`` client (in a
separate client process, as a harness would be) against a running gateway
(hypercorn + Starlette on trio, in this process) backed by a torch ``SamplerActor``
(its own process, the tiny built-in model, the word tokenizer):

* overhead: per turn, the latency the client sees minus the time the request
  waited on the sampler (the ``x-flotilla-sampler-ms`` header the gateway sets),
  p50/p99, over ``--probe-turns`` turns of one session at a time: the per-turn cost
  of the gateway (HTTP on both sides, the client library, routing, validation,
  template, token bookkeeping, JSON); also the same inside the ASGI app alone;
* sessions: N concurrent sessions, how many finished every turn without an error,
  and their overhead: with N requests in flight on one event loop (and one client
  loop) a turn also waits for the others' processing, so this is a queueing figure;
* multiturn_speedup: 8-turn conversations with a long first prompt (``--system``
  tokens: an agent's instructions and tool schemas) and ``--turn-tokens`` generated
  per turn, wall time with the sampler's prefix cache off / on (and the same ratio of
  the time requests waited on the sampler, the part the cache acts on).

Why: the gateway must cost the sampler next to nothing per turn, and an agent's
growing context must not be recomputed at every turn (issue 13's targets:
overhead_p50_ms <= 1.0, 64 sessions none failing, multiturn_speedup >= 2).

How:  python benchmarks/gateway.py            (64 sessions x 4 turns; 8 x 8 turns multi-turn)
      python benchmarks/gateway.py --quick    (64 x 2; 4 x 8 multi-turn; < 60 s unloaded)
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# ------------------------------------------------------------------------ client process
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
            for t in range(spec["turns"]):
                t0 = time.perf_counter()
                raw = await client.chat.completions.with_raw_response.create(
                    model="flotilla", messages=messages, max_tokens=spec["max_tokens"])
                reply = raw.parse()
                lat.append(time.perf_counter() - t0)
                waits.append(float(raw.headers["x-flotilla-sampler-ms"]) / 1e3)
                messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                             {"role": "user", "content": spec["user"]}]
        except Exception as e:  # noqa: BLE001 - counted and reported
            failures.append(f"{type(e).__name__}: {e}")

    t0 = time.perf_counter()
    await asyncio.gather(*(session(sid, spec["first"]) for sid in spec["sessions"]))
    wall = time.perf_counter() - t0
    await http.aclose()
    return {"latency": lat, "sampler": waits, "failures": failures, "wall": wall}


def _client(spec: dict) -> dict:
    """Run one phase's sessions in a fresh client process."""
    proc = subprocess.run([sys.executable, __file__, "--client"], input=json.dumps(spec), text=True,
                          capture_output=True, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})
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
    user = " ".join(["higher"] + [str(i % 64) for i in range(22)])   # 24 tokens with the turn markers
    app_times: list[float] = []
    results: dict = {}
    gw = Gateway(fmt)
    env = {"OMP_NUM_THREADS": "1"}
    async with trio.open_nursery() as nursery:
        gw.address = await nursery.start(serve_gateway, _timed_app(gw.app, app_times))

        async def phase(sampler, n: int, turns: int, first: str, max_tokens: int, user_turn: str = user) -> dict:
            async def gen(req):
                return await sampler.generate.call_one(req)
            sessions = [gw.open_session(task, gen, limits, 0) for _ in range(n)]
            spec = {"url": gw.address, "sessions": [s.id for s in sessions], "turns": turns,
                    "max_tokens": max_tokens, "first": first, "user": user_turn}
            out = await trio.to_thread.run_sync(_client, spec)
            for s in sessions:
                gw.close_session(s)
                await sampler.end_session.call_one(s.id)
            out["segments"] = sum(len(s.segments) for s in sessions)
            return out

        for cache in (True, False):
            async with open_mesh(SamplerActor, "bench", "fp32", cfg, "cpu", init_seed=0, max_batch=args.sessions,
                                 prefix_cache=cache, procs=1, name="sampler", env=env) as mesh:
                sampler = mesh[0]
                await phase(sampler, 2, 2, first_short, 4)   # warm-up (imports, first forwards)
                # The multi-turn runs first on both samplers, so both have the same history.
                results["multi_on" if cache else "multi_off"] = await phase(
                    sampler, args.multi_sessions, 8, first_long, args.turn_tokens)
                results["stats_on" if cache else "stats_off"] = await sampler.stats.call_one()
                if cache:
                    app_times.clear()
                    results["probe"] = await phase(sampler, 1, args.probe_turns, first_short, 1,
                                                   user_turn="higher")
                    results["app_times"] = list(app_times)
                    results["overhead"] = await phase(sampler, args.sessions, args.turns, first_short, 4)
        nursery.cancel_scope.cancel()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=64, help="concurrent sessions (overhead phase)")
    ap.add_argument("--turns", type=int, default=4, help="turns per concurrent session")
    ap.add_argument("--probe-turns", type=int, default=50, help="turns of one session, one at a time (overhead)")
    ap.add_argument("--multi-sessions", type=int, default=8, help="concurrent 8-turn sessions (multi-turn)")
    ap.add_argument("--system", type=int, default=1024, help="multi-turn: tokens of the first prompt")
    ap.add_argument("--turn-tokens", type=int, default=8, help="multi-turn: tokens generated per turn")
    ap.add_argument("--quick", action="store_true", help="fewer turns and multi-turn sessions (< 60 s unloaded)")
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        print(json.dumps(asyncio.run(_client_main(json.loads(sys.stdin.read())))))
        return
    if args.quick:
        args.turns, args.multi_sessions, args.probe_turns = 2, 4, 30

    import torch
    import trio

    torch.set_num_threads(1)
    r = trio.run(_gateway_main, args)
    ov, probe = r["overhead"], r["probe"]
    over = [lat - w for lat, w in zip(probe["latency"], probe["sampler"], strict=True)]
    conc = [lat - w for lat, w in zip(ov["latency"], ov["sampler"], strict=True)]
    app = r["app_times"]
    ok = args.sessions - len(ov["failures"])
    on, off = r["multi_on"], r["multi_off"]
    speedup = off["wall"] / on["wall"] if on["wall"] > 0 else float("nan")
    # The part of a turn the prefix cache acts on: the time requests waited on the sampler.
    sampler_speedup = sum(off["sampler"]) / sum(on["sampler"]) if on["sampler"] else float("nan")
    load = os.getloadavg()[0]
    rows = [
        ("turn latency p50 (client)", f"{statistics.median(probe['latency']) * 1e3:.2f} ms",
         f"{args.probe_turns} turns, one at a time"),
        ("sampler wait p50", f"{statistics.median(probe['sampler']) * 1e3:.2f} ms", ""),
        ("overhead p50 / p99", f"{_pct(over, 0.5) * 1e3:.2f} / {_pct(over, 0.99) * 1e3:.2f} ms",
         "client latency - sampler wait"),
        ("app overhead p50 / p99", f"{_pct(app, 0.5) * 1e3:.2f} / {_pct(app, 0.99) * 1e3:.2f} ms",
         "inside the ASGI app"),
        ("concurrent sessions ok", f"{ok}/{args.sessions}", f"{args.turns} turns each"),
        ("  their overhead p50 / p99", f"{_pct(conc, 0.5) * 1e3:.1f} / {_pct(conc, 0.99) * 1e3:.1f} ms",
         f"{args.sessions} requests in flight"),
        ("8 turns, prefix cache on", f"{on['wall']:.2f} s", f"{r['stats_on']['prompt_tokens']} prompt tokens"),
        ("8 turns, prefix cache off", f"{off['wall']:.2f} s", f"{r['stats_off']['prompt_tokens']} prompt tokens"),
        ("multi-turn speedup", f"{speedup:.2f}x", f"{args.multi_sessions} sessions, {args.system}-token prompt"),
        ("  in sampler wait alone", f"{sampler_speedup:.2f}x", "sum of the requests' sampler waits"),
        ("load average (1 min)", f"{load:.1f}", f"{os.cpu_count()} cores"),
    ]
    for name, value, note in rows:
        print(f"{name:28s} {value:>18s}   {note}")
    if ov["failures"]:
        print("failures:", ov["failures"][:3])
    print(json.dumps({
        "benchmark": "gateway",
        "sessions": args.sessions,
        "sessions_ok": ok,
        "turns": args.turns,
        "overhead_p50_ms": round(_pct(over, 0.5) * 1e3, 3),
        "overhead_p99_ms": round(_pct(over, 0.99) * 1e3, 3),
        "app_overhead_p50_ms": round(_pct(app, 0.5) * 1e3, 3),
        "app_overhead_p99_ms": round(_pct(app, 0.99) * 1e3, 3),
        "probe_turns": args.probe_turns,
        "latency_p50_ms": round(statistics.median(probe["latency"]) * 1e3, 3),
        "sampler_wait_p50_ms": round(statistics.median(probe["sampler"]) * 1e3, 3),
        "concurrent_overhead_p50_ms": round(_pct(conc, 0.5) * 1e3, 3),
        "concurrent_overhead_p99_ms": round(_pct(conc, 0.99) * 1e3, 3),
        "multiturn_sessions": args.multi_sessions,
        "multiturn_system_tokens": args.system,
        "multiturn_reuse_s": round(on["wall"], 3),
        "multiturn_recompute_s": round(off["wall"], 3),
        "multiturn_speedup": round(speedup, 2),
        "multiturn_sampler_wait_speedup": round(sampler_speedup, 2),
        "prefix_hits": r["stats_on"]["prefix_hits"],
        "segments_per_session": round(on["segments"] / args.multi_sessions, 2),
        "load_avg_1m": round(load, 2),
    }))


if __name__ == "__main__":
    main()
