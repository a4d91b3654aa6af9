"""A template that rewrites history: Qwen3's, which drops the reasoning of assistant turns
before the last user query.

The sampler is only ever trained on ids it generated, in the context it was given: where
the template's rendering of the next turn no longer starts with what the sampler saw, a
new segment starts, prompted with the template's rendering of the whole history, and the
trajectory is the last segment.  Multi-step tool calls keep their reasoning (Qwen3 keeps
it after the last user query), so they stay one segment.  Checked through the built-in
episode loop and a gateway session, with replies that think, call tools, skip thinking
and are cut at the length limit.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
import torch

from actors.chat import ChatTemplateError, Conversation, HFChatFormat
from actors.env import Environment, StepOutcome, register_task
from actors.env._episode import EnvCalls, EpisodeLimits, play_episode
from actors.env._threads import EnvThreads
from actors.gateway import SessionLimits
from actors.gateway._schemas import ChatRequest
from actors.gateway._session import Session
from actors.sampler import GenerateRequest, GenerateResult
from actors.tiny import train_tokenizer
from actors.types import SamplingParams, TaskSpec, Trajectory
from orchestrator.runtime import span

# Qwen3's chat template (as in Qwen/Qwen3-*'s tokenizer_config.json): an assistant turn
# after the last user query is rendered with its <think> block (always when it is the
# last message); every earlier one without.
QWEN3_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

CORPUS = [
    "<think>\nthe user asks for the weather; call the tool\n</think>\n\n",
    '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "it is sunny in Paris. and tomorrow? rain, then sun. thanks!",
] * 4
TOOLS = [
    {
        "type": "function",
        "function": {"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
    }
]
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
EPISODES = 200
TURNS = 5
MAX_NEW = 64


@pytest.fixture(scope="module")
def fmt() -> HFChatFormat:
    return HFChatFormat(train_tokenizer(CORPUS, vocab_size=400, chat_template=QWEN3_TEMPLATE))


def _opening(seed: int) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"weather in Paris? ({seed})"}]


def _observation(message: dict[str, Any], turn: int) -> dict[str, Any]:
    if message.get("tool_calls"):
        return {"role": "tool", "name": "weather", "content": f"sunny {turn}"}
    return {"role": "user", "content": f"and tomorrow? ({turn})"}


def _rewrites(reply: dict[str, Any], observation: dict[str, Any]) -> bool:
    """Whether Qwen3's template renders ``reply`` differently once ``observation`` follows:
    a user query moves the last query past it (its reasoning is dropped, even an empty
    block); a tool result keeps its reasoning, when it has any."""
    content = reply.get("content") or ""
    reasoning = (
        content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n") if "</think>" in content else ""
    )
    return observation["role"] == "user" or not reasoning


class ThinkingSampler:
    """A fake sampler that thinks (or not), calls the tool or answers, and is sometimes
    cut at the limit; records every call."""

    def __init__(self, fmt: HFChatFormat, seed: int, *, tools_only: bool = False) -> None:
        self.fmt, self.rng, self.tools_only = fmt, random.Random(seed), tools_only
        self.calls: list[tuple[list[int], list[int]]] = []

    def reply(self, limit: int) -> list[int]:
        rng, enc = self.rng, self.fmt.encode
        if self.tools_only:  # multi-step tool use, thinking before each call
            return enc(f"<think>\nstep {len(self.calls)}: call the tool\n</think>\n\n{CALL}") + [self.fmt.stop_ids[0]]
        think = rng.choice(
            [
                "<think>\nthe user asks; call the tool\n</think>\n\n",
                "<think>\nsunny, says the tool\n</think>\n\n",
                "<think>\n\n</think>\n\n",
                "",
            ]
        )
        ids = enc(think + (CALL if rng.random() < 0.5 else "it is sunny in Paris."))
        if rng.random() < 0.15:  # cut at the length limit, maybe inside the thinking
            return ids[: max(1, min(limit, rng.randint(1, len(ids))))]
        return (ids + [self.fmt.stop_ids[0]])[:limit]

    async def __call__(self, req: GenerateRequest) -> GenerateResult:
        ids = self.reply(req.max_new_tokens)
        self.calls.append((list(req.prompt_ids), ids))
        n = len(ids)
        return GenerateResult(
            request_id=req.request_id,
            token_ids=ids,
            support_ids=torch.tensor(ids, dtype=torch.int32),
            support_offsets=torch.arange(n + 1, dtype=torch.int32),
            support_logq=torch.zeros(n),
            versions=[1] * n,
            finish_reason="stop" if ids[-1] in self.fmt.stop_ids else "length",
            pool="p",
            prompt_tokens=len(req.prompt_ids),
            seconds=0.0,
        )


@register_task("test_qwen3_thinking")
class ThinkingTool(Environment):
    max_turns = TURNS
    max_new_tokens = MAX_NEW
    tools = TOOLS

    def __init__(self, seed: int) -> None:
        self.seed, self.turn = seed, 0

    async def reset(self, task: TaskSpec) -> Any:
        return _opening(self.seed)

    async def step(self, action_text: str, action_ids: list[int], message: dict) -> StepOutcome:
        self.turn += 1
        return StepOutcome(observation=_observation(message, self.turn), reward=1.0)


def _check(
    fmt: HFChatFormat, traj: Trajectory, calls: list[tuple[list[int], list[int]]], opening: list[dict[str, Any]]
) -> str | None:
    """None when ``traj`` is the last segment exactly, with the segment count Qwen3's
    template implies; else what differs."""
    if traj.failed:
        return traj.error
    messages, starts = list(opening), [0]  # index of each segment's first call
    for k, (_, gen) in enumerate(calls[:-1]):
        reply = fmt.parse_reply(gen)
        obs = _observation(reply, k + 1)
        if _rewrites(reply, obs):
            starts.append(k + 1)
        messages += [reply, obs]
    if traj.segments != len(starts):
        return f"{traj.segments} segments, want {len(starts)}"
    first = starts[-1]
    tokens, mask = traj.tokens.tolist(), traj.loss_mask.tolist()
    # The segment's first prompt is the template's rendering of the whole history so far.
    history = messages[: len(opening) + 2 * first]
    prompt0 = calls[first][0]
    if prompt0 != fmt.encode(fmt.render(history, generation_prompt=True, tools=TOOLS)):
        return "the segment does not start with the template's rendering of the history"
    if (
        first > 0
        and messages[len(opening) + 2 * first - 1]["role"] == "user"
        and "\n</think>" in fmt.decode(prompt0, skip_special=False)
    ):
        return "the history before a new user query still holds reasoning"
    # Every generated id of the segment at its place, the loss mask on those and no others.
    want_mask = [False] * len(tokens)
    for prompt, gen in calls[first:]:
        at = len(prompt)
        if tokens[:at] != prompt or tokens[at : at + len(gen)] != gen:
            return "the trajectory does not hold the segment's prompts and generated ids"
        want_mask[at : at + len(gen)] = [True] * len(gen)
    if mask != want_mask or len(tokens) != len(calls[-1][0]) + len(calls[-1][1]):
        return "the loss mask is not exactly the segment's generated ids"
    return None


def test_reasoning_before_the_last_query_is_dropped_and_named(fmt: HFChatFormat) -> None:
    convo = Conversation(fmt, tools=TOOLS)
    convo.add(_opening(0))
    thought = fmt.encode("<think>\nthe user asks; call the tool\n</think>\n\n" + CALL) + [fmt.stop_ids[0]]
    convo.add_reply(thought)
    held = list(convo.ids)
    # A tool result keeps the reasoning (multi-step tool use): append-only.
    new = convo.add({"role": "tool", "name": "weather", "content": "sunny"})
    assert convo.ids == held + new
    assert fmt.decode(new, skip_special=False) == (
        "\n<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    convo.add_reply(fmt.encode("<think>\nsunny, says the tool\n</think>\n\nit is sunny.") + [fmt.stop_ids[0]])
    # A new user query drops both turns' reasoning from the rendering: named, not appended.
    with pytest.raises(ChatTemplateError, match=r"turn 5 \(user\).*not prefix-preserving"):
        convo.add("and tomorrow?")


async def test_built_in_episodes_with_thinking_train_only_on_generated_ids(fmt: HFChatFormat) -> None:
    failures, segments = [], []
    threads = EnvThreads(2)
    for seed in range(EPISODES):
        sampler = ThinkingSampler(fmt, seed)
        traj = await play_episode(
            sampler,
            GenerateRequest,
            TaskSpec(task="test_qwen3_thinking", prompt_id=f"p{seed}", group_id="g", params={"seed": seed}),
            SamplingParams(max_new_tokens=MAX_NEW),
            0,
            chat=fmt,
            limits=EpisodeLimits(10.0, 10.0, 4096),
            request_prefix=f"e{seed}",
            span=span,
            calls=EnvCalls(threads),
        )
        segments.append(traj.segments)
        problem = _check(fmt, traj, sampler.calls, _opening(seed))
        if problem is not None:
            failures.append(f"episode {seed}: {problem}")
    assert not failures, f"{len(failures)} of {EPISODES} episodes wrong; first: {failures[:3]}"
    assert max(segments) == TURNS and len(set(segments)) >= 3, segments
    # Multi-step tool use with reasoning is append-only: one segment, every reply trained.
    sampler = ThinkingSampler(fmt, 0, tools_only=True)
    traj = await play_episode(
        sampler,
        GenerateRequest,
        TaskSpec(task="test_qwen3_thinking", prompt_id="p", group_id="g", params={"seed": 0}),
        SamplingParams(max_new_tokens=MAX_NEW),
        0,
        chat=fmt,
        limits=EpisodeLimits(10.0, 10.0, 4096),
        request_prefix="tools",
        span=span,
        calls=EnvCalls(threads),
    )
    assert _check(fmt, traj, sampler.calls, _opening(0)) is None
    assert traj.segments == 1 and traj.num_generated == sum(len(g) for _, g in sampler.calls)


async def test_gateway_sessions_with_thinking_train_only_on_generated_ids(fmt: HFChatFormat) -> None:
    failures, segments = [], []
    limits = SessionLimits(SamplingParams(), max_seq_len=4096, max_new_tokens=MAX_NEW)
    for seed in range(EPISODES):
        sampler = ThinkingSampler(fmt, seed)
        session = Session(f"s{seed}", TaskSpec(task="t", prompt_id="p", group_id="g"), fmt, sampler, limits, 0)
        messages = _opening(seed)
        for turn in range(1, TURNS + 1):
            response, _ = await session.chat(
                ChatRequest.model_validate({"model": "m", "messages": messages, "tools": TOOLS})
            )
            reply = json.loads(json.dumps(response["choices"][0]["message"]))
            obs = _observation(reply, turn)
            if reply.get("tool_calls"):
                obs["tool_call_id"] = reply["tool_calls"][0]["id"]
            messages += [reply, obs]
        traj = session.trajectory(1.0)
        segments.append(traj.segments)
        problem = _check(fmt, traj, sampler.calls, _opening(seed))
        if problem is not None:
            failures.append(f"session {seed}: {problem}")
    assert not failures, f"{len(failures)} of {EPISODES} sessions wrong; first: {failures[:3]}"
    assert max(segments) == TURNS and len(set(segments)) >= 3, segments
