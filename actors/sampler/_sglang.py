"""SGLang HTTP backend -- NEEDS A CUDA GPU AND IS UNTESTED HERE.  Not done; a sketch to finish on a GPU host.

SGLang runs only on CUDA GPUs (or AMX Xeons with a source build), and the
machine this project is developed on has neither, so nothing in this module
has ever talked to a real server.  It never imports ``sglang``: it speaks
HTTP (standard-library ``urllib`` in a worker thread) to a server the operator
launched, e.g.::

    python -m sglang.launch_server --model-path <ckpt dir> --port 30000 \
        --disable-radix-cache          # see "prefix cache" below

What it maps, following SGLang's public API:

* ``generate``: ``POST /generate`` with ``input_ids``, ``sampling_params``
  {temperature, top_k (finite: return_sampling_mask needs it), top_p,
  max_new_tokens, stop_token_ids}, ``return_logprob`` and
  ``return_sampling_mask``.  Per generated token ``meta_info`` carries
  ``output_token_sampling_mask`` (the kept ids) and
  ``output_token_sampling_logprobs``; a row is accepted only when it holds a
  log q for *every* kept id (some builds return only the sampled token's --
  then this backend raises, because the recipe needs the whole row).
* ``update_weights``: the snapshot is written as safetensors (+ config.json)
  to ``weights_dir`` and loaded with ``POST /update_weights_from_disk``
  {model_path, weight_version}, between ``/pause_generation`` {mode:
  "in_place"} and ``/continue_generation``, so running requests continue
  under the new weights as in the torch backend.  SGLang's
  ``update_weights_from_tensor`` is the in-process/colocated path; over HTTP
  its payload is pickled tensors, which Flotilla refuses on any wire.
  Block-FP8 snapshots keep the ``<name>_scale_inv`` naming SGLang's FP8
  checkpoints use.
* versions: every token of a response gets the ``weight_version`` SGLang
  reports for it (per-token splits inside one response are not parsed).

Prefix cache: SGLang's radix cache may reuse KV computed under older weights
for a new request's prompt; launch with ``--disable-radix-cache`` (or accept
that extra mismatch, which the recipe's importance weights absorb).
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import torch
import trio

from ._types import GenerateRequest, GenerateResult

__all__ = ["SGLangBackend", "parse_sglang_response"]


def parse_sglang_response(req: GenerateRequest, body: dict[str, Any], *, pool: str, seconds: float) -> GenerateResult:
    """Turn SGLang's ``/generate`` JSON into a ``GenerateResult`` (CSR support rows).

    Raises ValueError naming the first token whose support is missing, does
    not contain the token, or lacks per-id log-probabilities.
    """
    meta = body.get("meta_info") or {}
    tokens = [int(t) for t in body.get("output_ids") or []]
    masks = meta.get("output_token_sampling_mask")
    logprobs = meta.get("output_token_sampling_logprobs")
    if masks is None or logprobs is None:
        raise ValueError("SGLang response lacks output_token_sampling_mask/logprobs; "
                         "the server must support return_sampling_mask")
    if not len(masks) == len(logprobs) == len(tokens):
        raise ValueError(f"SGLang returned {len(tokens)} tokens, {len(masks)} masks, {len(logprobs)} logprob rows")
    ids: list[int] = []
    logq: list[float] = []
    offsets = [0]
    for t, (tok, mask, row) in enumerate(zip(tokens, masks, logprobs, strict=True)):
        if not isinstance(row, list) or len(row) != len(mask):
            raise ValueError(f"token {t}: SGLang gave no log q for each kept id (got {row!r}); "
                             "Flotilla needs the full renormalised row")
        if tok not in mask:
            raise ValueError(f"token {t}: sampled id {tok} is not in its sampling mask")
        ids += [int(i) for i in mask]
        logq += [float(x) for x in row]
        offsets.append(len(ids))
    reason = (meta.get("finish_reason") or {}).get("type", "length")
    finish = {"stop": "stop", "length": "length", "abort": "abort"}.get(reason, "length")
    version = int(meta.get("weight_version") or 0)
    return GenerateResult(
        request_id=req.request_id,
        token_ids=tokens,
        support_ids=torch.tensor(ids, dtype=torch.int32),
        support_offsets=torch.tensor(offsets, dtype=torch.int32),
        support_logq=torch.tensor(logq, dtype=torch.float32),
        versions=[version] * len(tokens),
        finish_reason=finish,
        pool=pool,
        prompt_tokens=int(meta.get("prompt_tokens", len(req.prompt_ids))),
        seconds=seconds,
    )


class SGLangBackend:
    """``GenerationBackend`` over an SGLang server's HTTP API (untested: needs a CUDA GPU).

    Args:
        url: server base URL, e.g. "http://127.0.0.1:30000".
        pool: pool name stamped on results.
        weights_dir: a directory the server can read, for weight snapshots.
        model_config: model config dict written next to the weights.
        timeout_s: per HTTP call.
    """

    name = "sglang"

    def __init__(self, url: str, *, pool: str, weights_dir: str, model_config: dict[str, Any],
                 timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.pool = pool
        self.weights_dir = Path(weights_dir)
        self.model_config = model_config
        self.timeout_s = timeout_s
        self._version = -1
        self._new_version = trio.Event()
        self._counters = {"tokens_generated": 0, "prompt_tokens": 0, "requests_finished": 0,
                          "busy_seconds": 0.0, "running": 0, "waiting": 0}

    @property
    def version(self) -> int:
        """Version of the last snapshot loaded through this backend."""
        return self._version

    def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        data = json.dumps(payload).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310 - operator's URL
            text = response.read().decode() or "{}"
        return json.loads(text)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Check the server answers (``GET /health`` via /get_model_info), then idle until cancelled."""
        await trio.to_thread.run_sync(lambda: urllib.request.urlopen(self.url + "/get_model_info", timeout=self.timeout_s).read())
        task_status.started()
        await trio.sleep_forever()

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        """POST /generate, once weights of at least ``req.min_version`` are loaded.

        Cancellation: abandons the HTTP call (the thread finishes in the
        background and its answer is dropped) and asks the server to abort.
        """
        while self._version < req.min_version:
            await self._new_version.wait()
        payload = {
            "rid": req.request_id,
            "input_ids": req.prompt_ids,
            "sampling_params": {
                "temperature": req.temperature, "top_p": req.top_p,
                "top_k": req.top_k if req.top_k > 0 else -1,
                "max_new_tokens": req.max_new_tokens, "stop_token_ids": req.stop_token_ids,
                **({"sampling_seed": req.seed} if req.seed is not None else {}),
            },
            "return_logprob": True,
            "return_sampling_mask": True,
        }
        t0 = time.perf_counter()
        self._counters["running"] += 1
        try:
            body = await trio.to_thread.run_sync(self._post, "/generate", payload, abandon_on_cancel=True)
        except trio.Cancelled:
            self.abort(req.request_id)
            raise
        finally:
            self._counters["running"] -= 1
        seconds = time.perf_counter() - t0
        res = parse_sglang_response(req, body, pool=self.pool, seconds=seconds)
        self._counters["tokens_generated"] += len(res.token_ids)
        self._counters["prompt_tokens"] += res.prompt_tokens
        self._counters["requests_finished"] += 1
        self._counters["busy_seconds"] += seconds  # wall time: the server overlaps requests
        return res

    async def update_weights(
        self, snapshot: Mapping[str, torch.Tensor], version: int, changed: Collection[str] | None = None
    ) -> None:
        """Write the snapshot and have the server load it in place between decode steps."""
        from safetensors.torch import save_file

        def write() -> str:
            target = self.weights_dir / f"v{version}"
            target.mkdir(parents=True, exist_ok=True)
            (target / "config.json").write_text(json.dumps(self.model_config))
            save_file({k: v.contiguous() for k, v in snapshot.items()}, str(target / "model.safetensors"))
            return str(target)

        path = await trio.to_thread.run_sync(write)
        await trio.to_thread.run_sync(self._post, "/pause_generation", {"mode": "in_place"})
        try:
            await trio.to_thread.run_sync(self._post, "/update_weights_from_disk", {
                "model_path": path, "weight_version": str(version), "flush_cache": False})
        finally:
            await trio.to_thread.run_sync(self._post, "/continue_generation", {})
        self._version = version
        self._new_version.set()
        self._new_version = trio.Event()

    def abort(self, request_id: str) -> bool:
        """Best effort ``POST /abort_request``; True when the server accepted it."""
        try:
            self._post("/abort_request", {"rid": request_id})
        except OSError:
            return False
        return True

    def end_session(self, session_id: str) -> bool:
        """Nothing to free: SGLang's radix cache shares prefixes across requests by itself."""
        return False

    def counters(self) -> dict[str, Any]:
        """Cumulative counters for ``SamplerStats`` (busy_seconds is request wall time)."""
        return dict(self._counters)
