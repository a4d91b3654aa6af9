"""SGLang backend: a sampler rank driving one SGLang server over its HTTP API (httpx, async).

NEVER RUN AGAINST A REAL SGLANG SERVER: SGLang needs a CUDA GPU and this project's
machine has none. The tests drive this module against a *protocol stub*
(``tests/unit/actors/sglang_stub.py``), a small HTTP server that answers the endpoints below
the way SGLang's documentation specifies; that checks the protocol, not SGLang.
``scripts/gpu_check.sh`` runs a real server when sglang is installed.

A pool either *connects* (``urls``, one running server per GPU) or *launches*
(``launch``: this rank starts ``python -m sglang.launch_server`` on its GPU, see
``_sglang_server``). Launch servers with ``--disable-radix-cache`` unless the extra
mismatch of prefixes cached under older weights is acceptable.

What it maps, following SGLang's documented native API:

* ``generate``: ``POST /generate`` with ``rid``, ``input_ids``, ``sampling_params``
  {temperature, top_p, top_k (finite: the sampling mask needs it), max_new_tokens,
  stop_token_ids, sampling_seed}, ``return_logprob`` and ``return_sampling_mask``.
  ``meta_info.output_token_sampling_mask`` (kept ids per token) and
  ``output_token_sampling_logprobs`` (their renormalised log q) become the CSR support
  rows the recipe replays, unchanged; a row without a log q for every kept id is refused.
* versions: each token is stamped with the version loaded when the request was sent. A
  weight update during the request may have produced later tokens with newer weights;
  stamping the older version over-counts staleness, never under-counts it.
* ``update_weights``: the snapshot is written as safetensors (+ config.json) to
  ``weights_dir/v<version>``; then ``POST /pause_generation`` {mode},
  ``POST /update_weights_from_disk`` {model_path, weight_version, flush_cache},
  ``POST /continue_generation``. ``mode = "retract"`` (default) moves running requests
  back to the queue and flushes the KV cache, so they continue under the new weights;
  ``"in_place"`` keeps their KV (then no flush). ``update_weights_from_tensor`` is not
  used: over HTTP its payload is pickled tensors, which Flotilla refuses on any wire.
  Block-FP8 snapshots keep the ``<name>_scale_inv`` naming of SGLang's FP8 checkpoints.
* ``abort`` and cancellation: ``POST /abort_request`` {rid}, sent from the backend's own
  task so that neither blocks the event loop; the aborted ``/generate`` returns its
  partial output with finish_reason "abort".
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import httpx
import torch
import trio

from ._sglang_server import serve_sglang, wait_healthy
from ._types import GenerateRequest, GenerateResult

__all__ = ["SGLangBackend", "parse_sglang_response"]


def parse_sglang_response(
    req: GenerateRequest, body: dict[str, Any], *, pool: str, seconds: float, version: int | None = None
) -> GenerateResult:
    """Turn SGLang's ``/generate`` JSON into a ``GenerateResult`` (CSR support rows).

    ``version`` stamps every token (default: the server's ``weight_version``). Greedy
    requests (temperature 0) record S = {y}, log q = 0 without needing a mask. Raises
    ValueError naming the first token whose support is missing, does not contain the
    token, or lacks per-id log-probabilities.
    """
    meta = body.get("meta_info") or {}
    tokens = [int(t) for t in body.get("output_ids") or []]
    if req.temperature == 0:
        masks: Any = [[t] for t in tokens]
        logprobs: Any = [[0.0] for _ in tokens]
    else:
        masks = meta.get("output_token_sampling_mask")
        logprobs = meta.get("output_token_sampling_logprobs")
    if masks is None or logprobs is None:
        raise ValueError(
            "SGLang response lacks output_token_sampling_mask/logprobs; the server must support return_sampling_mask"
        )
    if not len(masks) == len(logprobs) == len(tokens):
        raise ValueError(f"SGLang returned {len(tokens)} tokens, {len(masks)} masks, {len(logprobs)} logprob rows")
    ids: list[int] = []
    logq: list[float] = []
    offsets = [0]
    for t, (tok, mask, row) in enumerate(zip(tokens, masks, logprobs, strict=True)):
        if not isinstance(row, list) or len(row) != len(mask):
            raise ValueError(
                f"token {t}: SGLang gave no log q for each kept id (got {row!r}); "
                "Flotilla needs the full renormalised row"
            )
        if tok not in mask:
            raise ValueError(f"token {t}: sampled id {tok} is not in its sampling mask")
        ids += [int(i) for i in mask]
        logq += [float(x) for x in row]
        offsets.append(len(ids))
    reason = (meta.get("finish_reason") or {}).get("type", "length")
    finish = {"stop": "stop", "length": "length", "abort": "abort"}.get(reason, "length")
    if version is None:
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
    """``GenerationBackend`` over one SGLang server (see the module docstring).

    Args:
        pool: pool name stamped on results.
        model_config: model config dict, or a checkpoint directory whose config.json is
            copied next to each weight snapshot.
        url: a running server's base URL (connect mode), or None with ``launch``.
        launch: ``hardware.SGLangLaunch`` as a dict; this rank starts its own server.
        port: launch mode: the server's port.
        gpu: launch mode: the CUDA device the server gets (``CUDA_VISIBLE_DEVICES``).
        rank: this sampler's rank in its pool (names its directory under ``weights_dir``).
        weights_dir: where snapshots are written (None: a temporary directory, removed
            when the backend stops).
        pause_mode: ``/pause_generation`` mode around an update ("retract" or "in_place").
        timeout_s: one ``/generate`` call's limit; control calls get ``control_timeout_s``.
    """

    name = "sglang"

    def __init__(
        self,
        *,
        pool: str,
        model_config: dict[str, Any] | str,
        url: str | None = None,
        launch: dict[str, Any] | None = None,
        port: int = 30000,
        gpu: int | None = None,
        rank: int = 0,
        weights_dir: str | None = None,
        pause_mode: str = "retract",
        timeout_s: float = 600.0,
        control_timeout_s: float = 60.0,
    ) -> None:
        if (url is None) == (launch is None):
            raise ValueError("SGLangBackend needs exactly one of url (connect) and launch (start a server)")
        if pause_mode not in ("retract", "in_place"):
            raise ValueError(f"pause_mode must be 'retract' or 'in_place', got {pause_mode!r}")
        self.pool = pool
        self.url = (url or f"http://127.0.0.1:{port}").rstrip("/")
        self.launch, self.port, self.gpu, self.rank = launch, port, gpu, rank
        self.model_config = model_config
        self._weights_root = weights_dir
        self.weights_dir: Path | None = None
        self.pause_mode = pause_mode
        self.timeout_s, self.control_timeout_s = timeout_s, control_timeout_s
        self._client: httpx.AsyncClient | None = None
        self._nursery: trio.Nursery | None = None
        self._version = -1
        self._new_version = trio.Event()
        self._inflight: set[str] = set()
        self._loaded: Path | None = None
        self._counters = {
            "tokens_generated": 0,
            "prompt_tokens": 0,
            "requests_finished": 0,
            "busy_seconds": 0.0,
            "running": 0,
            "waiting": 0,
        }

    @property
    def version(self) -> int:
        """Version of the last snapshot the server loaded through this backend (-1 before any)."""
        return self._version

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the HTTP client, launch the server (or check the given one), serve until cancelled.

        Start-up fails (RuntimeError naming the URL) when the server is not healthy in time:
        ``launch.health_timeout_s`` for a launched one, ``control_timeout_s`` for a given one.
        A given server is sent ``/continue_generation`` first, in case an earlier owner died
        while it was paused. Cancellation stops a launched server (process group, no orphans)
        and removes a temporary weights directory.
        """
        tmp = None
        if self._weights_root is None:
            tmp = tempfile.mkdtemp(prefix=f"flotilla-sglang-{self.pool}-")
            self.weights_dir = Path(tmp)
        else:
            self.weights_dir = Path(self._weights_root).expanduser() / f"{self.pool}-{self.rank}"  # noqa: ASYNC240 - no I/O
            self.weights_dir.mkdir(parents=True, exist_ok=True)
        try:
            async with httpx.AsyncClient(timeout=self.control_timeout_s) as client:
                try:
                    async with trio.open_nursery() as nursery:
                        self._client, self._nursery = client, nursery
                        if self.launch is not None:
                            await nursery.start(serve_sglang, self.launch, self.port, self.gpu, client)
                        else:
                            await wait_healthy(client, self.url, self.control_timeout_s)
                            # a previous owner (a sampler that died mid-update) may have left it
                            # paused; every request would then wait forever
                            await self._post("/continue_generation", {})
                        task_status.started()
                        await trio.sleep_forever()
                except BaseExceptionGroup as group:  # show the server's own error, unwrapped
                    if len(group.exceptions) == 1 and isinstance(group.exceptions[0], RuntimeError):
                        raise group.exceptions[0] from None
                    raise
        finally:
            self._client = self._nursery = None
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)

    async def _post(self, path: str, payload: dict[str, Any], timeout: float | None = None) -> Any:
        """POST JSON and return the decoded answer; RuntimeError naming URL and status otherwise."""
        if self._client is None:
            raise RuntimeError(f"SGLang backend of pool {self.pool!r} is not running")
        try:
            r = await self._client.post(self.url + path, json=payload, timeout=timeout or self.control_timeout_s)
        except httpx.HTTPError as exc:
            raise RuntimeError(f"{self.url}{path}: {type(exc).__name__}: {exc}") from None
        if r.status_code != 200:
            raise RuntimeError(f"{self.url}{path}: HTTP {r.status_code}: {r.text[:300]}")
        return r.json() if r.content else {}

    async def generate(self, req: GenerateRequest) -> GenerateResult:
        """POST /generate once weights of at least ``req.min_version`` are loaded.

        Raises ValueError for a request SGLang cannot record supports for (top_k 0 with
        sampling, or ``min_keep > 1`` with ``top_p < 1``: SGLang's top-p has no minimum
        support size, so the recorded rows would not be the set asked for) or a malformed
        answer, RuntimeError for an HTTP failure. Cancellation closes the HTTP request at
        once and sends ``/abort_request`` from the backend's task; the event loop is never
        blocked.
        """
        if req.temperature > 0 and req.top_k <= 0:
            raise ValueError(f"request {req.request_id!r}: SGLang's sampling mask needs a finite top_k")
        if req.temperature > 0 and req.min_keep > 1 and req.top_p < 1.0:
            raise ValueError(
                f"request {req.request_id!r}: min_keep={req.min_keep} with top_p={req.top_p} is not "
                "supported by the SGLang backend (its top-p has no min_tokens_to_keep); set "
                "recipe.min_keep = 1 or recipe.top_p = 1 for SGLang pools"
            )
        while self._version < req.min_version:
            self._counters["waiting"] += 1
            try:
                await self._new_version.wait()
            finally:
                self._counters["waiting"] -= 1
        payload = {
            "rid": req.request_id,
            "input_ids": req.prompt_ids,
            "sampling_params": {
                "temperature": req.temperature,
                "top_p": req.top_p,
                "top_k": req.top_k if req.top_k > 0 else -1,
                "max_new_tokens": req.max_new_tokens,
                "stop_token_ids": req.stop_token_ids,
                **({"sampling_seed": req.seed} if req.seed is not None else {}),
            },
            "return_logprob": True,
            "return_sampling_mask": True,
        }
        version = self._version
        t0 = time.perf_counter()
        self._counters["running"] += 1
        self._inflight.add(req.request_id)
        done = False
        try:
            body = await self._post("/generate", payload, timeout=self.timeout_s)
            done = True
        finally:
            self._counters["running"] -= 1
            self._inflight.discard(req.request_id)
            if not done and self._nursery is not None:
                self._nursery.start_soon(self._send_abort, req.request_id)
        if isinstance(body, list):  # a batch answer to a single request: take its only item
            body = body[0]
        seconds = time.perf_counter() - t0
        res = parse_sglang_response(req, body, pool=self.pool, seconds=seconds, version=version)
        self._counters["tokens_generated"] += len(res.token_ids)
        self._counters["prompt_tokens"] += res.prompt_tokens
        self._counters["requests_finished"] += 1
        self._counters["busy_seconds"] += seconds  # wall time: the server overlaps requests
        return res

    async def _send_abort(self, request_id: str) -> None:
        try:
            await self._post("/abort_request", {"rid": request_id})
        except RuntimeError:
            pass  # best effort: the server may have finished the request already

    def abort(self, request_id: str) -> bool:
        """Ask the server to end a request early (sent asynchronously); False if not in flight.

        Its ``generate`` then returns the partial output with finish_reason "abort".
        """
        if request_id not in self._inflight or self._nursery is None:
            return False
        self._nursery.start_soon(self._send_abort, request_id)
        return True

    async def update_weights(
        self, snapshot: Mapping[str, torch.Tensor], version: int, changed: Collection[str] | None = None
    ) -> None:
        """Write the snapshot, then pause, load it from disk with its version, continue.

        ``changed`` is ignored: ``update_weights_from_disk`` loads whole checkpoints.
        Raises RuntimeError when the server refuses the update (its message included);
        generation is continued in every case, and the previous snapshot stays on disk.
        """
        assert self.weights_dir is not None, "update_weights before run() started"
        target = self.weights_dir / f"v{version}"
        await trio.to_thread.run_sync(self._write, snapshot, target)
        retract = self.pause_mode == "retract"
        await self._post("/pause_generation", {"mode": self.pause_mode})
        try:
            answer = await self._post(
                "/update_weights_from_disk",
                {
                    "model_path": str(target),
                    "weight_version": str(version),
                    "flush_cache": retract,
                    "abort_all_requests": False,
                },
                timeout=self.timeout_s,
            )
            if isinstance(answer, dict) and answer.get("success") is False:
                raise RuntimeError(f"{self.url} refused weights v{version}: {answer.get('message')}")
        finally:
            with trio.CancelScope(shield=True):
                await self._post("/continue_generation", {})
        previous, self._loaded = self._loaded, target
        if previous is not None and previous != target:
            await trio.to_thread.run_sync(lambda: shutil.rmtree(previous, ignore_errors=True))
        self._version = version
        self._new_version.set()
        self._new_version = trio.Event()

    def _write(self, snapshot: Mapping[str, torch.Tensor], target: Path) -> None:
        from safetensors.torch import save_file

        target.mkdir(parents=True, exist_ok=True)
        if isinstance(self.model_config, dict):
            (target / "config.json").write_text(json.dumps(self.model_config))
        elif (Path(self.model_config) / "config.json").is_file():
            shutil.copy(Path(self.model_config) / "config.json", target / "config.json")
        tmp = target / "model.safetensors.tmp"
        save_file({k: v.contiguous() for k, v in snapshot.items()}, str(tmp), metadata={"format": "pt"})
        tmp.replace(target / "model.safetensors")

    def end_session(self, session_id: str) -> bool:
        """Nothing to free: SGLang's radix cache shares prefixes across requests by itself."""
        return False

    def counters(self) -> dict[str, Any]:
        """Cumulative counters for ``SamplerStats`` (busy_seconds is request wall time)."""
        return dict(self._counters)
