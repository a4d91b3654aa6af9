"""Episodes rendered by a real chat template: multi-turn with tool calls, append-only ids,
loss mask on generated ids only, and a template that rewrites history starting a new segment."""

from __future__ import annotations

import math
from typing import Any

import torch

from actors.chat import HFChatFormat
from actors.env import Environment, StepOutcome, register_task
from actors.env._episode import EnvCalls, EpisodeLimits, play_episode
from actors.env._threads import EnvThreads
from actors.sampler import GenerateRequest, GenerateResult
from actors.tiny import train_tokenizer
from actors.types import SamplingParams, TaskSpec
from orchestrator.runtime import span

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CORPUS = [
    "what is the weather in Paris? it is sunny.",
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
] * 4


@register_task("test_weather_tool")
class WeatherTool(Environment):
    """Turn 1: the model should call get_weather; the tool answers; turn 2: the answer."""

    max_turns = 3
    tools = TOOLS

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def reset(self, task: TaskSpec) -> Any:
        return [
            {"role": "system", "content": "use tools"},
            {"role": "user", "content": "what is the weather in Paris?"},
        ]

    def step(self, action_text: str, action_ids: list[int], message: dict) -> StepOutcome:
        calls = message.get("tool_calls") or []
        if calls:
            city = calls[0]["function"]["arguments"]["city"]
            return StepOutcome(observation={"role": "tool", "name": "get_weather", "content": f"sunny in {city}"})
        return StepOutcome(observation="", reward=float("sunny" in message["content"]), done=True)


def _scripted(fmt: HFChatFormat, replies: list[str]):
    requests: list[GenerateRequest] = []

    async def generate(req: GenerateRequest) -> GenerateResult:
        requests.append(req)
        ids = fmt.encode(replies[len(requests) - 1]) + [fmt.stop_ids[0]]
        n = len(ids)
        return GenerateResult(
            request_id=req.request_id,
            token_ids=ids,
            support_ids=torch.tensor(ids, dtype=torch.int32),
            support_offsets=torch.arange(n + 1, dtype=torch.int32),
            support_logq=torch.zeros(n),
            versions=[5] * n,
            finish_reason="stop",
            pool="p",
            prompt_tokens=len(req.prompt_ids),
            seconds=0.0,
        )

    return generate, requests


async def _play(fmt: HFChatFormat, replies: list[str]):
    generate, requests = _scripted(fmt, replies)
    traj = await play_episode(
        generate,
        GenerateRequest,
        TaskSpec(task="test_weather_tool", prompt_id="p", group_id="g"),
        SamplingParams(max_new_tokens=48),
        0,
        chat=fmt,
        limits=EpisodeLimits(5.0, 5.0, 512),
        request_prefix="t",
        span=span,
        calls=EnvCalls(EnvThreads(2)),
    )
    return traj, requests


async def test_tool_call_episode_is_append_only_and_masks_only_generated_ids() -> None:
    fmt = HFChatFormat(train_tokenizer(CORPUS, vocab_size=320))
    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    traj, requests = await _play(fmt, [call, "it is sunny"])
    assert not traj.failed, traj.error
    assert traj.reward == 1.0 and traj.turns == 2
    # Each request's prompt extends the previous request's prompt + its generated reply.
    first, second = requests[0].prompt_ids, requests[1].prompt_ids
    gen1 = fmt.encode(call) + [fmt.stop_ids[0]]
    assert second[: len(first) + len(gen1)] == first + gen1
    text = fmt.decode(second[len(first) + len(gen1) :], skip_special=False)
    assert text == (
        "\n<|im_start|>user\n<tool_response>\nsunny in Paris\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert "<tools>" in fmt.decode(first, skip_special=False)
    # The loss mask is exactly the two generated replies; everything else is context.
    tokens, mask = traj.tokens.tolist(), traj.loss_mask.tolist()
    generated = [t for t, m in zip(tokens, mask, strict=True) if m]
    assert generated == gen1 + fmt.encode("it is sunny") + [fmt.stop_ids[0]]
    assert tokens[: len(second)] == second
    assert math.isclose(float(traj.support_logq.sum()), 0.0)


async def test_a_template_that_rewrites_history_starts_a_new_segment() -> None:
    # This template drops earlier assistant turns entirely, so the turn after the tool
    # result cannot be appended: it is prompted with the template's rendering of the
    # whole history, and the trajectory is that segment (the first reply is not trained on).
    drops = (
        "{#- tool calls: <tool_call>{json}</tool_call> #}{%- for m in messages %}{%- if not (m.role == 'assistant' and not loop.last) %}"
        "{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' }}"
        "{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    fmt = HFChatFormat(train_tokenizer(CORPUS, vocab_size=320, chat_template=drops))
    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    traj, requests = await _play(fmt, [call, "sunny"])
    assert not traj.failed, traj.error
    assert traj.segments == 2 and traj.reward == 1.0
    second = requests[1].prompt_ids
    assert fmt.decode(second, skip_special=False) == (
        "<|im_start|>system\nuse tools<|im_end|>\n<|im_start|>user\nwhat is the weather in Paris?<|im_end|>\n"
        "<|im_start|>tool\nsunny in Paris<|im_end|>\n<|im_start|>assistant\n"
    )
    gen2 = fmt.encode("sunny") + [fmt.stop_ids[0]]
    assert traj.tokens.tolist() == second + gen2
    assert traj.loss_mask.tolist() == [False] * len(second) + [True] * len(gen2)
