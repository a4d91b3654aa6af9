"""A PROTOCOL STUB of SGLang's native HTTP API -- not SGLang, and no substitute for it.

It answers the endpoints Flotilla's SGLang backend uses, with the request and answer
shapes SGLang's documentation gives (docs "SGLang Native APIs" and "SGLang for RL
Systems"): ``GET /health``, ``POST /generate`` (``return_sampling_mask`` rows in
``meta_info``), ``/pause_generation`` {mode}, ``/update_weights_from_disk`` {model_path,
weight_version, flush_cache, ...}, ``/continue_generation``, ``/abort_request`` {rid}. Its
"model" is arithmetic: token i of a request is ``(sum(input_ids) + i) % vocab`` and its kept set
is that id and the next ``min(top_k, 3) - 1`` ids with fixed probabilities (ids modulo
``--vocab``, 97 by default). What it checks
is the protocol (order of calls, fields, versions, aborts), the way a real server would
refuse them (an update while requests run unpaused, a mask without a finite top_k).

``GET /stub_log`` (stub only, not SGLang) returns the calls it received, for tests.

Run like SGLang's launcher: ``python -m tests.unit.actors.sglang_stub --model-path DIR
--host 127.0.0.1 --port 30000 [--token-delay 0.01]``.
"""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

VOCAB = 97
_PROBS = (0.6, 0.3, 0.1)


class StubState:
    def __init__(self, token_delay: float, vocab: int = VOCAB) -> None:
        self.token_delay = token_delay
        self.vocab = vocab
        self.lock = threading.Condition()
        self.paused: str | None = None
        self.weight_version = "default"
        self.running: set[str] = set()
        self.aborted: set[str] = set()
        self.log: list[dict[str, Any]] = []

    def record(self, path: str, body: Any) -> None:
        with self.lock:
            self.log.append({"path": path, "body": body, "t": time.time()})


def _generate(state: StubState, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    sp = body.get("sampling_params") or {}
    top_k = int(sp.get("top_k", -1))
    if body.get("return_sampling_mask") and top_k <= 0:
        return 400, {"error": "return_sampling_mask requires a finite top_k"}
    rid = str(body.get("rid"))
    ids = body["input_ids"]
    k = max(1, min(top_k, len(_PROBS)))
    norm = sum(_PROBS[:k])
    out: list[int] = []
    masks: list[list[int]] = []
    logps: list[list[float]] = []
    finish: dict[str, Any] = {"type": "length", "length": int(sp.get("max_new_tokens", 16))}
    with state.lock:
        state.running.add(rid)
    try:
        for i in range(int(sp.get("max_new_tokens", 16))):
            with state.lock:
                while state.paused is not None and rid not in state.aborted:
                    state.lock.wait(0.05)
                if rid in state.aborted:
                    finish = {"type": "abort", "message": "Abort before finishing"}
                    break
            time.sleep(state.token_delay)
            tok = (sum(ids) + i) % state.vocab
            out.append(tok)
            masks.append([(tok + j) % state.vocab for j in range(k)])
            logps.append([math.log(p / norm) for p in _PROBS[:k]])
            if tok in (sp.get("stop_token_ids") or []):
                finish = {"type": "stop", "matched": tok}
                break
    finally:
        with state.lock:
            state.running.discard(rid)
            state.aborted.discard(rid)
    return 200, {
        "text": "",
        "output_ids": out,
        "meta_info": {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "completion_tokens": len(out),
            "weight_version": state.weight_version,
            "output_token_sampling_mask": masks,
            "output_token_sampling_logprobs": logps,
        },
    }


def _update_from_disk(state: StubState, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    path = Path(body["model_path"])
    files = sorted(path.glob("*.safetensors"))
    if not files:
        return 200, {"success": False, "message": f"no safetensors in {path}"}
    with state.lock:
        if state.running and state.paused is None and not body.get("abort_all_requests"):
            return 200, {"success": False, "message": "requests are running; pause first"}
        if state.paused == "in_place" and body.get("flush_cache", True):
            return 200, {"success": False, "message": "cannot flush the cache while paused in place"}
        n = len(state.running)
        state.weight_version = str(body.get("weight_version") or state.weight_version)
    from safetensors import safe_open

    with safe_open(str(files[0]), "pt") as f:  # a real load reads the tensors; the stub counts them
        count = len(list(f.keys()))
    return 200, {"success": True, "message": f"loaded {count} tensors", "num_paused_requests": n}


def make_handler(state: StubState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # quiet
            pass

        def _send(self, code: int, obj: Any) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, {})
            elif self.path == "/stub_log":
                with state.lock:
                    self._send(200, list(state.log))
            else:
                self._send(404, {"error": self.path})

        def do_POST(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n)
            if len(raw) < n:  # the client closed mid-body (a cancelled call): never arrived
                self.close_connection = True
                return
            body = json.loads(raw or b"{}")
            state.record(self.path, body)
            if self.path == "/generate":
                self._send(*_generate(state, body))
            elif self.path == "/pause_generation":
                with state.lock:
                    state.paused = body.get("mode", "abort")
                self._send(200, {})
            elif self.path == "/continue_generation":
                with state.lock:
                    state.paused = None
                    state.lock.notify_all()
                self._send(200, {})
            elif self.path == "/update_weights_from_disk":
                self._send(*_update_from_disk(state, body))
            elif self.path == "/abort_request":
                with state.lock:
                    if body.get("abort_all"):
                        state.aborted |= state.running
                    elif body.get("rid") in state.running:
                        state.aborted.add(body["rid"])
                    state.lock.notify_all()
                self._send(200, {})
            else:
                self._send(404, {"error": self.path})

    return Handler


def start_stub(port: int = 0, token_delay: float = 0.0, vocab: int = VOCAB) -> tuple[ThreadingHTTPServer, StubState]:
    """Serve in a daemon thread of this process; returns the server (``server_port``) and state."""
    state = StubState(token_delay, vocab)
    server = ThreadingHTTPServer(("127.0.0.1", port), make_handler(state))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, state


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--token-delay", type=float, default=0.0)
    p.add_argument("--vocab", type=int, default=VOCAB)
    args = p.parse_args(argv)
    state = StubState(args.token_delay, args.vocab)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(state))
    server.daemon_threads = True
    print(f"stub listening on {args.host}:{args.port} (model {args.model_path})", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
