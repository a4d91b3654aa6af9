"""Generated ids are held as generated, whatever bytes they decode to.

A byte-level BPE tokenizer trained here (ByteLevel pre-tokenizer and decoder, ChatML
specials) with a ChatML template; a fake sampler answers with random ids: invalid
UTF-8, multi-byte characters split across tokens or cut at ``max_tokens``, the
template's special ids (``<|im_start|>``, ``<|endoftext|>``) mid-reply, the text
``<|im_end|>`` spelled with plain tokens, and tool calls.  1,000 multi-turn episodes
go through the built-in episode loop (``play_episode`` / ``Conversation``) and 1,000
through a gateway ``Session`` (every other turn streamed, the client sending back the
text it put together from the chunks); none may fail, and every trajectory must be exactly
the generated ids at their positions plus the template's ids around them (checked
against the template's rendering of the whole conversation at once).
"""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

import pytest
import torch

from actors.chat import HFChatFormat
from actors.env import Environment, StepOutcome, register_task
from actors.env._episode import EnvCalls, EpisodeLimits, play_episode
from actors.env._threads import EnvThreads
from actors.gateway import SessionLimits
from actors.gateway._schemas import ChatRequest, stream_chunks
from actors.gateway._session import Session
from actors.sampler import GenerateRequest, GenerateResult
from actors.tiny import CHATML_TEMPLATE
from actors.types import SamplingParams, TaskSpec, Trajectory
from orchestrator.runtime import span

EPISODES = 1000
MAX_NEW = 48
TURNS = 4
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "hello world, what is two plus two? the answer is four.",
    "ça va? très bien, merci. naïve café, déjà vu.",
    "日本語のテキスト、東京は晴れです。",
    "emoji 🙂🚀 and symbols ±∑ → ok",
    '<tool_call>\n{"name": "lookup", "arguments": {"q": "paris"}}\n</tool_call>',
] * 3
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "look a word up",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"q": "paris"}}\n</tool_call>'
PLACEHOLDER = "PLACEHOLDER{}END"


@pytest.fixture(scope="module")
def fmt() -> HFChatFormat:
    return make_format()


def make_format() -> HFChatFormat:
    """The byte-level BPE tokenizer with a ChatML template (trained here, nothing downloaded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(CORPUS, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHATML_TEMPLATE
    return HFChatFormat(tok)


class RandomSampler:
    """A fake sampler whose policy is a random number generator; records every call."""

    def __init__(self, fmt: HFChatFormat, seed: int) -> None:
        self.fmt, self.rng = fmt, random.Random(seed)
        self.calls: list[tuple[list[int], list[int]]] = []  # (prompt ids, generated ids)
        self.stop = fmt.stop_ids[0]
        self.specials = [fmt.tokenizer.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|endoftext|>")]
        self.plain = [i for i in range(fmt.vocab_size) if i not in {*fmt.stop_ids, *self.specials}]

    def reply(self, limit: int) -> list[int]:
        rng, enc = self.rng, self.fmt.encode
        kind = rng.random()
        if kind < 0.15:  # a tool call, sometimes after random ids
            ids = [rng.choice(self.plain) for _ in range(rng.choice([0, 0, 1, 2]))] + enc(CALL)
        elif kind < 0.25:  # the template's end-of-turn text spelled with plain tokens mid-reply
            ids = enc("ok <|") + enc("im_end|>") + enc("\n<|") + enc("im_start|>user")
        elif kind < 0.35:  # multi-byte characters, cut at the limit mid-character
            return enc("日本語🙂 ça va " * 8)[:limit]
        else:  # random ids: plain bytes and merges, specials mid-reply
            ids = []
            for _ in range(limit):
                r = rng.random()
                if r < 0.06:
                    ids.append(self.stop)
                    break
                ids.append(rng.choice(self.specials) if r < 0.12 else rng.choice(self.plain))
            return ids
        if rng.random() < 0.8:
            ids = ids + [self.stop]
        return ids[:limit]

    async def __call__(self, req: GenerateRequest) -> GenerateResult:
        ids = self.reply(req.max_new_tokens)
        assert ids and self.stop not in ids[:-1]
        self.calls.append((list(req.prompt_ids), ids))
        n = len(ids)
        return GenerateResult(
            request_id=req.request_id,
            token_ids=ids,
            support_ids=torch.tensor(ids, dtype=torch.int32),
            support_offsets=torch.arange(n + 1, dtype=torch.int32),
            support_logq=torch.zeros(n),
            versions=[3] * n,
            finish_reason="stop" if ids[-1] == self.stop else "length",
            pool="p",
            prompt_tokens=len(req.prompt_ids),
            seconds=0.0,
        )


def _opening(seed: int) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "answer briefly"},
        {"role": "user", "content": f"question {seed}: 東京は? ça va?"},
    ]


def _observation(message: dict[str, Any], turn: int) -> dict[str, Any]:
    if message.get("tool_calls"):
        return {"role": "tool", "name": "lookup", "content": f"result {turn}: 晴れ"}
    return {"role": "user", "content": f"turn {turn}: go on 🙂"}


@register_task("test_random_reply_ids")
class RandomReplies(Environment):
    """Plays TURNS turns: a tool result after a tool call, else a user turn."""

    max_turns = TURNS
    max_new_tokens = MAX_NEW
    tools = TOOLS

    def __init__(self, seed: int) -> None:
        self.seed, self.turn = seed, 0

    async def reset(self, task: TaskSpec) -> Any:
        return _opening(self.seed)

    async def step(self, action_text: str, action_ids: list[int], message: dict) -> StepOutcome:
        self.turn += 1
        return StepOutcome(observation=_observation(message, self.turn), reward=0.0)


def _expected(fmt: HFChatFormat, opening: list[dict[str, Any]], calls: list[tuple[list[int], list[int]]]) -> list[int]:
    """The template's rendering of the whole conversation at once, each reply's content a
    placeholder, with each reply's generated ids in its placeholder's place (the template's
    ``<|im_end|>`` after a reply dropped when the reply generated it)."""
    messages = list(opening)
    for k, (_, gen) in enumerate(calls[:-1]):
        messages += [{"role": "assistant", "content": PLACEHOLDER.format(k)}, _observation(fmt.parse_reply(gen), k + 1)]
    rest = fmt.render(messages, generation_prompt=True, tools=TOOLS)
    ids: list[int] = []
    for k, (_, gen) in enumerate(calls):
        head, _, rest = rest.partition(PLACEHOLDER.format(k)) if k < len(calls) - 1 else (rest, "", "")
        if k > 0 and calls[k - 1][1][-1] == fmt.stop_ids[0]:
            assert head.startswith("<|im_end|>"), head
            head = head.removeprefix("<|im_end|>")
        ids += fmt.encode(head) + gen
    return ids


def _count_kinds(fmt: HFChatFormat, calls: list[tuple[list[int], list[int]]], kinds: Counter[str]) -> None:
    """Tally what the replies hold, so the test shows it covered each case."""
    stop, specials = fmt.stop_ids[0], set(RandomSampler(fmt, 0).specials)
    for _, gen in calls:
        body = gen[:-1] if gen[-1] == stop else gen
        text = fmt.decode(body, skip_special=False)
        kinds["cut at max_tokens"] += gen[-1] != stop
        kinds["invalid UTF-8"] += "\ufffd" in text
        kinds["special ids mid-reply"] += any(i in specials for i in body)
        kinds["'<|im_end|>' as plain tokens"] += "<|im_end|>" in text
        kinds["tool calls"] += bool(fmt.parse_reply(gen).get("tool_calls"))


def _check(
    fmt: HFChatFormat, traj: Trajectory, calls: list[tuple[list[int], list[int]]], opening: list[dict[str, Any]]
) -> str | None:
    """None when ``traj`` holds exactly the sampler's ids plus the template's; else what differs."""
    if traj.failed:
        return traj.error
    tokens, mask = traj.tokens.tolist(), traj.loss_mask.tolist()
    if len(calls) != TURNS:
        return f"{len(calls)} turns played, want {TURNS}"
    for k, (prompt, gen) in enumerate(calls):
        at = len(prompt)
        if tokens[:at] != prompt or tokens[at : at + len(gen)] != gen or not all(mask[at : at + len(gen)]):
            return f"turn {k}: the trajectory does not hold the prompt and the generated ids"
    if [t for t, m in zip(tokens, mask, strict=True) if m] != [t for _, gen in calls for t in gen]:
        return "the loss mask is not exactly the generated ids"
    if tokens != _expected(fmt, opening, calls):
        return "the context ids differ from the template's rendering"
    return None


def _streamed(response: dict[str, Any], pieces: list[str]) -> dict[str, Any]:
    """The assistant message a streaming client puts together from the chunks: content
    deltas joined, tool-call deltas merged by their ``index`` (arguments come in pieces)."""
    content, by_index = "", {}
    for chunk in stream_chunks(response, pieces):
        for choice in chunk["choices"]:
            content += choice["delta"].get("content") or ""
            for d in choice["delta"].get("tool_calls") or []:
                call = by_index.setdefault(
                    d["index"], {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
                )
                call["id"] = d.get("id") or call["id"]
                call["function"]["name"] += d.get("function", {}).get("name") or ""
                call["function"]["arguments"] += d.get("function", {}).get("arguments") or ""
    calls = [by_index[i] for i in sorted(by_index)]
    return {"role": "assistant", "content": content or None, **({"tool_calls": calls} if calls else {})}


async def built_in_failures(fmt: HFChatFormat, episodes: int = EPISODES) -> tuple[list[str], Counter[str]]:
    """Play `episodes` built-in episodes with random reply ids: (what went wrong, the kinds of
    odd bytes seen). Also run by benchmarks/gateway.py (``random_bytes_episodes_failed``)."""
    failures: list[str] = []
    kinds: Counter[str] = Counter()
    threads = EnvThreads(2)
    for seed in range(episodes):
        sampler = RandomSampler(fmt, seed)
        traj = await play_episode(
            sampler,
            GenerateRequest,
            TaskSpec(task="test_random_reply_ids", prompt_id=f"p{seed}", group_id="g", params={"seed": seed}),
            SamplingParams(max_new_tokens=MAX_NEW),
            0,
            chat=fmt,
            limits=EpisodeLimits(10.0, 10.0, 4096),
            request_prefix=f"e{seed}",
            span=span,
            calls=EnvCalls(threads),
        )
        problem = _check(fmt, traj, sampler.calls, _opening(seed))
        if problem is not None:
            failures.append(f"episode {seed}: {problem}")
        _count_kinds(fmt, sampler.calls, kinds)
    return failures, kinds


async def test_built_in_episodes_hold_random_reply_ids_exactly(fmt: HFChatFormat) -> None:
    failures, kinds = await built_in_failures(fmt)
    assert not failures, f"{len(failures)} of {EPISODES} episodes failed; first: {failures[:3]}"
    assert min(kinds.values()) >= 50 and len(kinds) == 5, kinds


async def gateway_failures(fmt: HFChatFormat, episodes: int = EPISODES) -> tuple[list[str], Counter[str]]:
    """As `built_in_failures`, through gateway sessions (every other turn streamed)."""
    failures: list[str] = []
    kinds: Counter[str] = Counter()
    limits = SessionLimits(SamplingParams(), max_seq_len=4096, max_new_tokens=MAX_NEW)
    task = TaskSpec(task="t", prompt_id="p", group_id="g")
    for seed in range(episodes):
        sampler = RandomSampler(fmt, seed)
        session = Session(f"s{seed}", task, fmt, sampler, limits, 0)
        messages: list[dict[str, Any]] = _opening(seed)
        try:
            for turn in range(1, TURNS + 1):
                stream = turn % 2 == 0
                response, pieces = await session.chat(
                    ChatRequest.model_validate({"model": "m", "messages": messages, "tools": TOOLS, "stream": stream})
                )
                # The reply goes over the wire as JSON and comes back with the next request.
                reply = json.loads(
                    json.dumps(_streamed(response, pieces) if stream else response["choices"][0]["message"])
                )
                messages.append(reply)
                obs = _observation(reply, turn)
                if reply.get("tool_calls"):
                    obs["tool_call_id"] = reply["tool_calls"][0]["id"]
                messages.append(obs)
        except Exception as e:
            failures.append(f"session {seed}: {type(e).__name__}: {e}")
            continue
        problem = (
            f"{len(session.segments)} segments (want 1)"
            if len(session.segments) != 1
            else _check(fmt, session.trajectory(1.0), sampler.calls, _opening(seed))
        )
        if problem is not None:
            failures.append(f"session {seed}: {problem}")
        _count_kinds(fmt, sampler.calls, kinds)
    return failures, kinds


async def test_gateway_sessions_hold_random_reply_ids_exactly(fmt: HFChatFormat) -> None:
    failures, kinds = await gateway_failures(fmt)
    assert not failures, f"{len(failures)} of {EPISODES} sessions failed; first: {failures[:3]}"
    assert min(kinds.values()) >= 50 and len(kinds) == 5, kinds
