"""Purpose-built actors and environments for the EnvActor tests.

``ScriptedSampler`` is a real actor with the sampler's ``generate`` endpoint (same
request/result types) whose policy is a script instead of a model: a fake, not a
mock. Its support rows always contain the chosen token plus two neighbours, with
a proper log q, and each token is tagged with the sampler's version.

The environments registered here misbehave on purpose (raise, hang, return
garbage); EnvActors load them with ``EnvConfig(task_modules=[__name__])``.
"""

from __future__ import annotations

import math
import threading

import torch
import trio

from actors.env import Environment, StepOutcome, first_int, guess_number_optimal, register_task
from actors.sampler import GenerateRequest, GenerateResult
from actors.tokenizer import default_chat_tokens
from actors.types import TaskSpec
from orchestrator.runtime import Actor, endpoint, span

__all__ = ["ScriptedSampler"]


class ScriptedSampler(Actor):
    """``policy``: "auto" (binary search on guess_number prompts, the right sum on
    arithmetic prompts, else "words"), "words" (always "the"). The sum is followed
    by ``<|end|>`` when more than one token is allowed."""

    def __init__(self, policy: str = "auto", version: int = 3, pool: str = "scripted") -> None:
        self.policy, self.version, self.pool = policy, version, pool
        self.chat = default_chat_tokens()
        self.requests: list[GenerateRequest] = []

    def _reply(self, req: GenerateRequest) -> list[int]:
        chat = self.chat
        prompt = chat.decode(req.prompt_ids[:16])
        if self.policy == "auto" and prompt.startswith("guess the number from"):
            return [chat.int_id(guess_number_optimal(req.prompt_ids, chat))]
        if self.policy == "auto" and prompt.startswith("what is") and "+" in prompt:
            words = chat.decode(req.prompt_ids).split()
            total = int(words[2]) + int(words[4])  # "what is a + b ?"
            return [chat.int_id(total), chat.end_id][: req.max_new_tokens]
        return chat.encode("the")[: req.max_new_tokens]

    @endpoint
    async def generate(self, req: GenerateRequest) -> GenerateResult:
        self.requests.append(req)
        with span("scripted.generate"):  # joins the caller's trace across processes
            tokens = self._reply(req)
        ids, logq = [], []
        for y in tokens:
            row = [y, (y + 1) % self.chat.vocab_size, (y + 2) % self.chat.vocab_size]
            ids += row
            logq += [math.log(0.8), math.log(0.15), math.log(0.05)]
        return GenerateResult(
            request_id=req.request_id,
            token_ids=tokens,
            support_ids=torch.tensor(ids, dtype=torch.int32),
            support_offsets=torch.arange(0, 3 * len(tokens) + 1, 3, dtype=torch.int32),
            support_logq=torch.tensor(logq, dtype=torch.float32),
            versions=[self.version] * len(tokens),
            finish_reason="stop" if tokens and tokens[-1] in req.stop_token_ids else "length",
            pool=self.pool,
            prompt_tokens=len(req.prompt_ids),
            seconds=0.0,
        )

    @endpoint
    def set_policy(self, policy: str) -> None:
        self.policy = policy

    @endpoint
    def seen(self) -> list[GenerateRequest]:
        """The requests received so far."""
        return self.requests


@register_task("test_explode")
class Explode(Environment):
    """Raises inside ``step`` on the second turn."""

    max_turns = 4

    def reset(self, task: TaskSpec) -> str:
        return "guess the number"

    def step(self, action_text: str, action_ids: list[int]) -> StepOutcome:
        if getattr(self, "stepped", False):
            raise RuntimeError("boom in the user environment")
        self.stepped = True
        return StepOutcome(observation="higher")


@register_task("test_hang_async")
class HangAsync(Environment):
    """An async step that never returns."""

    max_turns = 2

    def reset(self, task: TaskSpec) -> str:
        return "what is"

    async def step(self, action_text: str, action_ids: list[int]) -> StepOutcome:
        await trio.sleep_forever()
        raise AssertionError("unreachable")


_never = threading.Event()


@register_task("test_hang_blocking")
class HangBlocking(Environment):
    """A plain ``reset`` that blocks its thread forever (run in a worker thread)."""

    def reset(self, task: TaskSpec) -> str:
        _never.wait()
        return "unreachable"

    def step(self, action_text: str, action_ids: list[int]) -> StepOutcome:
        return StepOutcome(observation="", done=True)


@register_task("test_garbage")
class Garbage(Environment):
    """``step`` returns something that is not a StepOutcome."""

    def reset(self, task: TaskSpec) -> list[int]:
        chat = default_chat_tokens()
        return [chat.int_id(1), chat.int_id(2)]  # a token observation

    def step(self, action_text: str, action_ids: list[int]) -> StepOutcome:
        return 42  # type: ignore[return-value]


@register_task("test_tokens")
class TokenObservations(Environment):
    """Two turns with token-id observations; reward is the first reply's integer / 10."""

    max_turns = 2

    def reset(self, task: TaskSpec) -> list[int]:
        self.turn = 0
        return default_chat_tokens().encode("what is 2 + 3 ?")

    async def step(self, action_text: str, action_ids: list[int]) -> StepOutcome:
        self.turn += 1
        n = first_int(action_text)
        return StepOutcome(observation=[default_chat_tokens().int_id(9)], reward=(n or 0) / 10, done=self.turn == 2)


_stuck = threading.Event()


@register_task("test_stuck_reset")
class StuckReset(Environment):
    """A plain ``reset`` stuck forever (its thread never returns)."""

    def reset(self, task: TaskSpec) -> str:
        _stuck.wait()
        return "unreachable"

    def step(self, action_text: str, action_ids: list[int]) -> StepOutcome:
        return StepOutcome(observation="", done=True)


@register_task("test_blocks_loop")
class BlocksLoop(Environment):
    """An ``async`` step that calls blocking code: it freezes the actor's event loop."""

    def reset(self, task: TaskSpec) -> str:
        return "what is"

    async def step(self, action_text: str, action_ids: list[int]) -> StepOutcome:
        import time

        time.sleep(float(task_seconds))
        return StepOutcome(observation="", reward=1.0, done=True)


task_seconds = 1.5


@register_task("test_validated")
class Validated(Environment):
    """Checks its params in a classmethod (its constructor would be expensive)."""

    def __init__(self, level: int = 1) -> None:
        raise AssertionError("check_task must not construct an environment with validate_params")

    @classmethod
    def validate_params(cls, params: dict) -> None:
        if not 1 <= params.get("level", 1) <= 3:
            raise ValueError(f"level must be in 1..3, got {params.get('level')}")
