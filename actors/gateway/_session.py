"""One episode's conversation with the model: token capture, exact.

A ``Session`` turns OpenAI requests into sampler requests and records what the
sampler saw and generated, the way built-in episodes do (``EpisodeBuilder``):

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
from actors.gateway._render import conversation_from
from actors.gateway._schemas import (
    ChatRequest,
    CompletionRequest,
    GatewayError,
    chat_response,
    completion_response,
    openai_message,
)
from actors.sampler import GenerateRequest, GenerateResult
from actors.types import SamplingParams, TaskSpec, Trajectory

__all__ = ["Session", "SessionLimits"]


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
    kind: str                       # "chat" | "completion"
    builder: EpisodeBuilder
    conv: Conversation | None = None
    tools: list[dict[str, Any]] | None = None
    text: str = ""                  # completions: prompt + generated text so far
    turns: int = 0


def _canon(m: dict[str, Any]) -> Any:
    """What a template renders of a message (for history matching)."""
    calls = [(c["function"]["name"], _json(c["function"].get("arguments")))
             for c in m.get("tool_calls") or []]
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
    started: float = field(default_factory=time.perf_counter)
    _lock: trio.Lock = field(default_factory=trio.Lock)

    # ------------------------------------------------------------------ chat
    async def chat(self, req: ChatRequest) -> tuple[dict[str, Any], list[str]]:
        """Serve one chat completion; returns (response, text pieces for streaming).

        Raises GatewayError (400) when the conversation cannot be rendered or does not
        fit the context, (409) when the session is closed, (502) when the sampler fails.
        """
        messages = [m.template_message() for m in req.messages]
        tools = req.template_tools()
        async with self._lock:
            self._check_open()
            seg = self._chat_segment(messages, tools)
            assert seg.conv is not None
            result, kept, cut_text = await self._sample(seg, req)
            reply = seg.conv.add_reply(result.token_ids[:kept])
            if cut_text is not None:
                reply = {"role": "assistant", "content": cut_text}
                seg.conv.messages[-1] = reply
            message = openai_message(reply)
            finish = ("tool_calls" if message.get("tool_calls")
                      else "stop" if cut_text is not None else result.finish_reason)
            self.transcript = [*messages, reply]
            pieces = [self.fmt.decode([t]) for t in result.token_ids[:kept]]
            return (chat_response(self.model, message, finish, len(seg.builder) - kept, kept), pieces)

    def _chat_segment(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> _Segment:
        seg = self.segments[-1] if self.segments else None
        if seg is not None and seg.kind == "chat" and seg.tools == tools and seg.conv is not None:
            held = seg.conv.messages
            k = len(held)
            new = messages[k:]
            if (new and all(_canon(a) == _canon(b) for a, b in zip(held, messages, strict=False))
                    and not any(m["role"] == "assistant" for m in new)):
                try:
                    ids = seg.conv.add(new)
                except (ChatTemplateError, ValueError):
                    pass   # the template cannot extend this history append-only: new segment
                else:
                    seg.builder.add_context(ids)
                    return seg
        try:
            conv = conversation_from(self.fmt, messages, tools)
        except (ChatTemplateError, ValueError) as e:
            raise GatewayError(400, f"messages: {e}", param="messages") from None
        seg = _Segment("chat", EpisodeBuilder(conv.ids), conv=conv, tools=tools)
        self.segments.append(seg)
        return seg

    # ----------------------------------------------------------- completions
    async def complete(self, req: CompletionRequest) -> dict[str, Any]:
        """Serve one plain completion (text or ids prompt, no template).

        A text prompt that starts with the segment's text so far (prompt + generated)
        is extended by the tokens of the rest only; anything else starts a segment.
        """
        async with self._lock:
            self._check_open()
            seg = self.segments[-1] if self.segments else None
            if isinstance(req.prompt, list):
                ids = [int(i) for i in req.prompt]
                if seg is not None and seg.kind == "completion" and ids[:len(seg.builder)] == seg.builder.ids \
                        and len(ids) > len(seg.builder):
                    seg.builder.add_context(ids[len(seg.builder):])
                else:
                    seg = self._new_completion(ids, "")
            elif (seg is not None and seg.kind == "completion" and seg.text
                    and req.prompt.startswith(seg.text) and len(req.prompt) > len(seg.text)):
                seg.builder.add_context(self.fmt.encode(req.prompt[len(seg.text):]))
                seg.text = req.prompt
            else:
                seg = self._new_completion(self.fmt.encode(req.prompt), req.prompt)
            if not seg.builder.ids:
                raise GatewayError(400, "prompt: empty", param="prompt")
            result, kept, cut_text = await self._sample(seg, req)
            text = cut_text if cut_text is not None else self.fmt.decode(result.token_ids[:kept])
            if seg.text or not isinstance(req.prompt, list):
                seg.text += self.fmt.decode(result.token_ids[:kept], skip_special=False)
            finish = "stop" if cut_text is not None else result.finish_reason
            self.transcript = [{"role": "user", "content": req.prompt if isinstance(req.prompt, str)
                                else self.fmt.decode(req.prompt)}, {"role": "assistant", "content": text}]
            return completion_response(self.model, text, finish, len(seg.builder) - kept, kept)

    def _new_completion(self, ids: list[int], text: str) -> _Segment:
        for i, t in enumerate(ids):
            if not 0 <= t < self.fmt.vocab_size:
                raise GatewayError(400, f"prompt[{i}] = {t} is outside the vocabulary", param="prompt")
        seg = _Segment("completion", EpisodeBuilder(ids), text=text)
        self.segments.append(seg)
        return seg

    # ---------------------------------------------------------------- sample
    async def _sample(self, seg: _Segment, req: ChatRequest | CompletionRequest
                      ) -> tuple[GenerateResult, int, str | None]:
        """One generate call on the segment's ids; appends the generated ids (cut at a stop
        string) to the builder.  Returns (result, ids kept, text before the stop string or None)."""
        lim = self.limits
        room = lim.max_seq_len - len(seg.builder)
        limit = req.limit() if isinstance(req, ChatRequest) else req.max_tokens
        max_new = min(limit or lim.max_new_tokens, lim.max_new_tokens, room)
        if max_new < 1:
            raise GatewayError(400, f"the conversation has {len(seg.builder)} tokens; the context is "
                               f"{lim.max_seq_len}, no room to generate", param="messages",
                               code="context_length_exceeded")
        s = lim.sampling
        temperature = req.temperature if lim.honor_sampling and req.temperature is not None else s.temperature
        top_p = req.top_p if lim.honor_sampling and req.top_p is not None else s.top_p
        greq = GenerateRequest(
            request_id=f"{self.id}/{self.turns}", prompt_ids=list(seg.builder.ids), max_new_tokens=max_new,
            stop_token_ids=self.fmt.stop_ids, temperature=temperature, top_k=s.top_k, top_p=top_p,
            min_version=self.min_version, session_id=self.id)
        try:
            result = await self.generate(greq)
        except trio.Cancelled:
            raise
        except Exception as e:  # noqa: BLE001 - the harness gets a 502, the episode a failure
            raise GatewayError(502, f"sampler failed: {type(e).__name__}: {e}", type="server_error") from e
        if result.finish_reason == "abort":
            raise GatewayError(502, "sampler aborted the generation", type="server_error")
        self.pool = result.pool
        kept, cut_text = len(result.token_ids), None
        stops = req.stop_list()
        if stops:
            kept, cut_text = _cut_at_stop(self.fmt, result.token_ids, stops)
        off = result.support_offsets
        end = int(off[kept])
        seg.builder.add_generated(result.token_ids[:kept], result.support_ids[:end], off[:kept + 1],
                                  result.support_logq[:end], result.versions[:kept])
        self.turns += 1
        seg.turns += 1
        return result, kept, cut_text

    def _check_open(self) -> None:
        if self.closed:
            raise GatewayError(409, f"session {self.id!r} is closed (its episode ended)",
                               code="session_closed")

    # --------------------------------------------------------------- results
    @property
    def generated_tokens(self) -> int:
        return sum(int(sum(s.builder.mask)) for s in self.segments)

    def trajectory(self, reward: float, *, failed: bool = False, error: str | None = None) -> Trajectory:
        """The episode's trajectory: the last segment (see the module docstring)."""
        seg = self.segments[-1] if self.segments else _Segment("chat", EpisodeBuilder([]))
        return seg.builder.build(task=self.task, pool=self.pool, reward=reward, turns=seg.turns,
                                 seconds=time.perf_counter() - self.started, failed=failed, error=error)

    def segment_stats(self) -> dict[str, int]:
        """segments, and generated tokens of earlier segments (not trained on)."""
        dropped = sum(int(sum(s.builder.mask)) for s in self.segments[:-1])
        return {"segments": len(self.segments), "dropped_generated": dropped}


def _cut_at_stop(fmt: ChatFormat, ids: list[int], stops: list[str]) -> tuple[int, str | None]:
    """(ids to keep, text before the stop) for the first stop string in the decoded reply:
    the reply keeps the token that completed the stop string and nothing after it."""
    full = fmt.decode(ids)
    if not any(s in full for s in stops):
        return len(ids), None
    for k in range(1, len(ids) + 1):
        text = fmt.decode(ids[:k])
        hits = [text.index(s) for s in stops if s in text]
        if hits:
            return k, text[:min(hits)]
    return len(ids), None
