"""One episode's conversation with the model: token capture, exact.

A ``Session`` turns chat requests (chat completions, and the Responses and Messages
APIs translated into them) into sampler requests and records what the sampler saw and
generated, the way built-in episodes do (``EpisodeBuilder``):

* The running conversation is a ``Conversation`` (``actors.chat``): its ids are
  only ever appended to.  A request whose messages start with the messages the
  session already holds (the harness sent back the history it was given, plus new
  user/tool/system turns) is extended by the ids of the new turns only; turns
  seen before are never re-tokenised, and the sampler receives the full id
  sequence (its prefix cache computes only the new part).
* Generated ids go into the trajectory with their support rows and policy
  versions (loss mask True); everything else is context (loss mask False).
* A request whose history does not extend the held one (the harness edited,
  truncated or re-ordered it, changed its tools, or the template cannot extend it
  append-only) starts a new *segment* rendered from its own messages, so nothing
  is trained on as if the model had seen a context it never saw.  The episode's
  trajectory is the last segment; earlier segments' tokens are not trained on and
  are counted (``segments``, ``dropped_generated``).
* Assistant messages are compared by what a template renders of them (role,
  content, tool-call names and JSON arguments), so the ids OpenAI clients give
  tool calls and the JSON spacing of arguments do not matter.

Requests of one session are served one at a time (a lock): a harness issuing
parallel calls in one session gets them in some order, each extending the last.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from actors.chat import ChatFormat, ChatTemplateError, Conversation
from actors.env._episode import EpisodeBuilder
from actors.gateway._schemas import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    GatewayError,
    chat_response,
    completion_response,
    logprob_entry,
    openai_message,
    template_message,
)
from actors.sampler import GenerateRequest, GenerateResult
from actors.types import SamplingParams, TaskSpec, Trajectory
from orchestrator.runtime import ActorDied

__all__ = ["Session", "SessionLimits", "Turn"]


@dataclass(frozen=True)
class SessionLimits:
    """How a session samples: the recipe's settings and the gateway's caps."""

    sampling: SamplingParams
    """The recipe's temperature/top-k/top-p (training needs the sampler's q at the trainer's T)."""
    max_seq_len: int
    """Context length: a turn's prompt + generation must fit."""
    max_new_tokens: int
    """Per-turn cap (a request's max_tokens may lower it)."""
    honor_sampling: bool = False
    """Use a request's temperature/top_p instead of the recipe's (breaks the recipe's
    importance ratios unless they match; for evaluation)."""


@dataclass
class _Segment:
    kind: str  # "chat" | "completion"
    builder: EpisodeBuilder
    messages: list[dict[str, Any]] = field(default_factory=list)
    """Chat: the messages the builder's ids render (the last one the parsed reply)."""
    last_reply: list[int] | None = None
    """Chat: ids of the reply that ends ``messages`` (closing it is the next turn's job)."""
    tools: list[dict[str, Any]] | None = None
    text: str = ""  # completions: prompt + generated text so far
    turns: int = 0


@dataclass
class _Plan:
    """What a request would add, computed before sampling and committed only after it
    succeeded: a failed or rejected request leaves the session as it was."""

    seg: _Segment | None  # the segment to extend; None: start ``fresh``
    context: list[int]  # ids to append before generating
    new_messages: list[dict[str, Any]] = field(default_factory=list)
    fresh: _Segment | None = None

    def prompt(self) -> list[int]:
        base = self.seg if self.seg is not None else self.fresh
        assert base is not None
        return base.builder.ids + self.context

    def commit(self, segments: list[_Segment]) -> _Segment:
        if self.seg is None:
            assert self.fresh is not None
            segments.append(self.fresh)
            return self.fresh
        self.seg.builder.add_context(self.context)
        self.seg.messages += self.new_messages
        return self.seg


def _same(held: dict[str, Any], sent: dict[str, Any]) -> bool:
    """Whether a harness sent back a held message unchanged (as a template renders it).
    Plain equality first: it settles every message but tool calls (whose ids and JSON
    spacing the client may change) at C speed, so matching a long history stays cheap."""
    return held == sent or _canon(held) == _canon(sent)


def _canon(m: dict[str, Any]) -> Any:
    """What a template renders of a message (for history matching)."""
    calls = [(c["function"]["name"], _json(c["function"].get("arguments"))) for c in m.get("tool_calls") or []]
    content = m.get("content") or ""
    return (m.get("role"), content.strip() if calls else content, calls)


def _json(v: Any) -> Any:
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError:
            return v
    return json.dumps(v, sort_keys=True)


@dataclass
class Turn:
    """One served chat turn, for a protocol module to answer in its own shape."""

    reply: dict[str, Any]
    """The parsed reply as the template reads it (text content, dict arguments)."""
    message: dict[str, Any]
    """The reply in OpenAI's shape (call ids, string arguments)."""
    finish: str
    """OpenAI's finish_reason: "stop", "length" or "tool_calls"."""
    prompt_tokens: int
    completion_tokens: int
    pieces: list[str]
    """The reply's text token by token (``token_pieces``; empty unless the request streams)."""
    logprobs: list[dict[str, Any]] | None
    stop: str | None
    """The stop string that ended the reply, if one did."""


class _TurnLock:
    """A session's lock: one request at a time. Uncontended (the usual case: a harness
    waits for each answer), taking it does not yield to trio's scheduler as
    ``trio.Lock.acquire`` does -- a turn's first await is then its sampler call, which
    checkpoints anyway. A second request in flight waits for the first as with a Lock."""

    def __init__(self) -> None:
        self._lock = trio.Lock()

    async def __aenter__(self) -> None:
        try:
            self._lock.acquire_nowait()
        except trio.WouldBlock:
            await self._lock.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self._lock.release()


@dataclass
class Session:
    """See the module docstring.  ``generate`` is the sampler call (one sampler rank)."""

    id: str
    task: TaskSpec
    fmt: ChatFormat
    generate: Callable[[GenerateRequest], Awaitable[GenerateResult]]
    limits: SessionLimits
    min_version: int
    model: str = "flotilla"
    reward: float | None = None
    """Set by ``POST /reward`` (the last one wins)."""
    transcript: list[dict[str, Any]] = field(default_factory=list)
    """The last request's messages plus the reply: what a grader reads."""
    segments: list[_Segment] = field(default_factory=list)
    pool: str = ""
    turns: int = 0
    closed: bool = False
    sampler_lost: bool = False
    """A sampler call of this session failed because the sampler died (the episode's failure
    is then the sampler's, not the harness's)."""
    sampler_seconds: float = 0.0
    """Time spent waiting on the sampler (the rest of a request's latency is the gateway's)."""
    last_sampler_s: float = 0.0
    """The last request's wait on the sampler (sent as the ``x-flotilla-sampler-ms`` header)."""
    responses: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Responses API: each response's conversation (input and output, instructions aside) by
    its id, for ``previous_response_id``."""
    started: float = field(default_factory=time.perf_counter)
    _lock: _TurnLock = field(default_factory=lambda: _TurnLock())

    # ------------------------------------------------------------------ chat
    async def chat(self, req: ChatRequest) -> tuple[dict[str, Any], list[str]]:
        """Serve one chat completion; returns (response, text pieces for streaming).

        Raises GatewayError (400) when the conversation cannot be rendered or does not
        fit the context, (409) when the session is closed, (502) when the sampler fails;
        the session is then unchanged.
        """
        t = await self.turn(req)
        return (
            chat_response(self.model, t.message, t.finish, t.prompt_tokens, t.completion_tokens, t.logprobs),
            t.pieces,
        )

    async def turn(self, req: ChatRequest) -> Turn:
        """Serve one chat turn: the path every chat-shaped protocol takes (chat completions,
        and the Responses and Messages APIs, translated into a ``ChatRequest``). Errors as
        ``chat``."""
        tools = req.template_tools()
        async with self._lock:
            self.check_open()
            plan, messages = self._plan_chat(req.messages, tools)
            result, kept, cut = await self._sample(plan.prompt(), req)
            seg = plan.commit(self.segments)
            self._record(seg, result, kept)
            ids = result.token_ids[:kept]
            reply = self.fmt.parse_reply(ids) if cut is None else {"role": "assistant", "content": cut[0]}
            seg.messages.append(reply)
            seg.last_reply = list(ids)
            message = openai_message(reply)
            finish = "tool_calls" if message.get("tool_calls") else "stop" if cut is not None else result.finish_reason
            self.transcript = [*messages, reply]
            pieces = token_pieces(self.fmt, ids) if req.stream else []
            logprobs = _logprobs(self.fmt, result, kept, req.top_logprobs or 0) if req.logprobs else None
            return Turn(
                reply, message, finish, len(seg.builder) - kept, kept, pieces, logprobs, None if cut is None else cut[1]
            )

    def _plan_chat(
        self, sent: list[ChatMessage], tools: list[dict[str, Any]] | None
    ) -> tuple[_Plan, list[dict[str, Any]]]:
        """How to serve ``sent``: extend the last segment or start one. Returns the plan
        and the messages in template form."""
        seg = self.segments[-1] if self.segments else None
        if seg is not None and seg.kind == "chat" and seg.tools == tools:
            k = len(seg.messages)
            if seg.messages == sent[:k]:  # the usual turn, compared at C speed
                messages, same = seg.messages + [template_message(m) for m in sent[k:]], True
            else:
                messages = [template_message(m) for m in sent]
                same = all(_same(a, b) for a, b in zip(seg.messages, messages, strict=False))
            new = messages[k:]
            if new and same and not any(m["role"] == "assistant" for m in new):
                try:
                    ids = self.fmt.render_new(seg.messages, new, generated=seg.last_reply, tools=tools, turn=k)
                except (ChatTemplateError, ValueError):
                    pass  # the template cannot extend this history append-only: new segment
                else:
                    return _Plan(seg, ids, new), messages
        else:
            messages = [template_message(m) for m in sent]
        try:
            conv = Conversation.from_messages(self.fmt, messages, tools)
        except (ChatTemplateError, ValueError) as e:
            raise GatewayError(400, f"messages: {e}", param="messages") from None
        fresh = _Segment("chat", EpisodeBuilder(conv.ids), messages=list(conv.messages), tools=tools)
        return _Plan(None, [], fresh=fresh), messages

    # ----------------------------------------------------------- completions
    async def complete(self, req: CompletionRequest) -> dict[str, Any]:
        """Serve one plain completion (text or ids prompt, no template).

        A text prompt that starts with the segment's text so far (prompt + generated)
        is extended by the tokens of the rest only (ids: by the ids past the held ones);
        anything else starts a segment.  Errors as ``chat``.
        """
        async with self._lock:
            self.check_open()
            seg = self.segments[-1] if self.segments else None
            if seg is not None and seg.kind != "completion":
                seg = None
            prompt = req.prompt
            if isinstance(prompt, list):
                ids = [int(i) for i in prompt]
                if (
                    seg is not None
                    and not seg.text
                    and len(ids) > len(seg.builder)
                    and ids[: len(seg.builder)] == seg.builder.ids
                ):
                    plan = _Plan(seg, ids[len(seg.builder) :])
                else:
                    plan = _Plan(None, [], fresh=self._new_completion(ids, ""))
            elif seg is not None and seg.text and prompt.startswith(seg.text) and len(prompt) > len(seg.text):
                plan = _Plan(seg, self.fmt.encode(prompt[len(seg.text) :]))
            else:
                plan = _Plan(None, [], fresh=self._new_completion(self.fmt.encode(prompt), prompt))
            if not plan.prompt():
                raise GatewayError(400, "prompt: empty", param="prompt")
            result, kept, cut = await self._sample(plan.prompt(), req)
            seg = plan.commit(self.segments)
            self._record(seg, result, kept)
            ids = result.token_ids[:kept]
            text = cut[0] if cut is not None else self.fmt.decode(ids)
            if isinstance(prompt, str):
                # The text the held ids stand for (a tokenizer that does not round-trip the
                # harness's text just makes its next prompt start a new segment).
                seg.text = self.fmt.decode(seg.builder.ids, skip_special=False)
            finish = "stop" if cut is not None else result.finish_reason
            self.transcript = [
                {"role": "user", "content": prompt if isinstance(prompt, str) else self.fmt.decode(prompt)},
                {"role": "assistant", "content": text},
            ]
            return completion_response(self.model, text, finish, len(seg.builder) - kept, kept)

    def _new_completion(self, ids: list[int], text: str) -> _Segment:
        for i, t in enumerate(ids):
            if not 0 <= t < self.fmt.vocab_size:
                raise GatewayError(400, f"prompt[{i}] = {t} is outside the vocabulary", param="prompt")
        return _Segment("completion", EpisodeBuilder(ids), text=text)

    # ---------------------------------------------------------------- sample
    async def _sample(
        self, prompt: list[int], req: ChatRequest | CompletionRequest
    ) -> tuple[GenerateResult, int, tuple[str, str] | None]:
        """One generate call on ``prompt``.  Returns (result, ids to keep -- the reply is cut
        after the token that completes a stop string --, (text before the stop string, that
        stop string) or None)."""
        lim = self.limits
        room = lim.max_seq_len - len(prompt)
        limit = req.limit() if isinstance(req, ChatRequest) else req.max_tokens
        max_new = min(limit or lim.max_new_tokens, lim.max_new_tokens, room)
        if max_new < 1:
            raise GatewayError(
                400,
                f"the conversation has {len(prompt)} tokens; the context is {lim.max_seq_len}, no room to generate",
                param="messages",
                code="context_length_exceeded",
            )
        s = lim.sampling
        temperature = req.temperature if lim.honor_sampling and req.temperature is not None else s.temperature
        top_p = req.top_p if lim.honor_sampling and req.top_p is not None else s.top_p
        # Built from checked values (the request was validated, the ids are the template's,
        # max_new >= 1): not validated again here, where it would walk the whole prompt on
        # every turn; the sampler validates what it receives.
        greq = GenerateRequest.model_construct(
            request_id=f"{self.id}/{self.turns}",
            prompt_ids=prompt,
            max_new_tokens=max_new,
            stop_token_ids=list(self.fmt.stop_ids),
            temperature=temperature,
            top_k=s.top_k,
            top_p=top_p,
            min_keep=s.min_keep,
            min_version=self.min_version,
            session_id=self.id,
        )
        t0 = time.perf_counter()
        try:
            result = await self.generate(greq)
        except trio.Cancelled:
            raise
        except Exception as e:
            self.sampler_lost = self.sampler_lost or isinstance(e, ActorDied)
            raise GatewayError(502, f"sampler failed: {type(e).__name__}: {e}", type="server_error") from e
        finally:
            self.last_sampler_s = time.perf_counter() - t0
            self.sampler_seconds += self.last_sampler_s
        if result.finish_reason == "abort":
            raise GatewayError(502, "sampler aborted the generation", type="server_error")
        self.turns += 1
        stops = req.stop_list()
        if stops:
            kept, cut = _cut_at_stop(self.fmt, result.token_ids, stops)
            return result, kept, cut
        return result, len(result.token_ids), None

    def _record(self, seg: _Segment, result: GenerateResult, kept: int) -> None:
        r = result
        if kept == len(r.token_ids):  # the usual case: no stop string cut the reply
            seg.builder.add_generated(r.token_ids, r.support_ids, r.support_offsets, r.support_logq, r.versions)
        else:
            end = int(r.support_offsets[kept])
            seg.builder.add_generated(
                r.token_ids[:kept],
                r.support_ids[:end],
                r.support_offsets[: kept + 1],
                r.support_logq[:end],
                r.versions[:kept],
            )
        self.pool = result.pool
        seg.turns += 1

    def check_open(self) -> None:
        if self.closed:
            raise GatewayError(409, f"session {self.id!r} is closed (its episode ended)", code="session_closed")

    # --------------------------------------------------------------- results
    @property
    def generated_tokens(self) -> int:
        return sum(int(sum(s.builder.mask)) for s in self.segments)

    def trajectory(self, reward: float, *, failed: bool = False, error: str | None = None) -> Trajectory:
        """The episode's trajectory: the last segment (see the module docstring)."""
        seg = self.segments[-1] if self.segments else _Segment("chat", EpisodeBuilder([]))
        traj = seg.builder.build(
            task=self.task,
            pool=self.pool,
            reward=reward,
            turns=seg.turns,
            seconds=time.perf_counter() - self.started,
            failed=failed,
            error=error,
        )
        traj.segments = max(1, len(self.segments))
        return traj

    def segment_stats(self) -> dict[str, int]:
        """segments, and generated tokens of earlier segments (not trained on)."""
        dropped = sum(int(sum(s.builder.mask)) for s in self.segments[:-1])
        return {"segments": len(self.segments), "dropped_generated": dropped}


def token_pieces(fmt: ChatFormat, ids: list[int]) -> list[str]:
    """The text each generated token adds, for streaming: ``""`` for a token that ends inside
    a multi-byte character (its text comes with the token that completes it). Decodes a few
    tokens of context each time, so a tokenizer that spaces words by context (SentencePiece,
    the word format) gives the same text as decoding the whole reply."""
    pieces, done = [], 0  # ids[:done] are accounted for
    for k in range(1, len(ids) + 1):
        start = max(0, done - 4)
        before, text = fmt.decode(ids[start:done]), fmt.decode(ids[start:k])
        if text.endswith("\ufffd") or not text.startswith(before):
            pieces.append("")
            continue
        pieces.append(text[len(before) :])
        done = k
    return pieces


def _logprobs(fmt: ChatFormat, r: GenerateResult, kept: int, top: int) -> list[dict[str, Any]]:
    """OpenAI's ``logprobs.content`` for the kept tokens: each token's log q (the sampler's
    distribution, as recorded for training) and the ``top`` most likely ids of its support."""
    offsets, ids, logq = r.support_offsets.tolist(), r.support_ids.tolist(), r.support_logq.tolist()
    out = []
    for t in range(kept):
        row = list(zip(ids[offsets[t] : offsets[t + 1]], logq[offsets[t] : offsets[t + 1]], strict=True))
        chosen = next((lq for i, lq in row if i == r.token_ids[t]), 0.0)
        best = sorted(row, key=lambda il: -il[1])[:top]
        out.append(
            logprob_entry(
                fmt.decode([r.token_ids[t]], skip_special=False),
                chosen,
                [(fmt.decode([i], skip_special=False), lq) for i, lq in best],
            )
        )
    return out


def _cut_at_stop(fmt: ChatFormat, ids: list[int], stops: list[str]) -> tuple[int, tuple[str, str] | None]:
    """(ids to keep, (text before the stop, the stop string)) for the first stop string in the
    decoded reply: the reply keeps the token that completed the stop string and nothing after it."""
    full = fmt.decode(ids)
    if not any(s in full for s in stops):
        return len(ids), None
    for k in range(1, len(ids) + 1):
        text = fmt.decode(ids[:k])
        hits = [(text.index(s), s) for s in stops if s in text]
        if hits:
            at, stop = min(hits)
            return k, (text[:at], stop)
    return len(ids), None
