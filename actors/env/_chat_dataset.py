"""``chat_dataset``: the built-in single-turn task over dataset rows.

Each row (``[task] dataset``) has ``messages`` (a chat: system/user turns) or ``prompt``
(one user turn), and ``answer``.  The model answers once; the reward compares the
reply (its text, specials dropped, stripped) with the answer:

* ``reward = "exact"`` (default): 1.0 when the reply equals ``str(answer)`` (stripped);
* ``reward = "regex"``: 1.0 when ``answer`` (a regular expression) matches the whole
  stripped reply (``re.fullmatch``);
* ``reward = "module:function"``: ``function(reply, answer) -> float``, imported the
  way ``[task] modules`` are (a dotted module or a ``.py`` path).

``reward`` and ``max_new_tokens`` usually come from ``[task] params``; the row's
columns are merged over them.  Columns other than these are accepted and ignored
(ids, sources, metadata).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from actors.env._interface import Environment, StepOutcome, register_task
from actors.env._modules import resolve_callable
from actors.types import TaskSpec

__all__ = ["ChatDataset"]


@functools.cache
def _reward_fn(ref: str) -> Callable[..., Any]:
    return resolve_callable(ref)


@register_task("chat_dataset")
class ChatDataset(Environment):
    """One dataset row, one reply, one reward (see the module docstring)."""

    max_turns = 1

    def __init__(
        self,
        answer: Any = None,
        prompt: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        reward: str = "exact",
        max_new_tokens: int | None = None,
        **_columns: Any,
    ) -> None:
        if (prompt is None) == (messages is None):
            raise ValueError("chat_dataset: a row needs exactly one of 'prompt' or 'messages'")
        if answer is None:
            raise ValueError("chat_dataset: a row needs an 'answer'")
        if messages is not None:
            if not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
                raise ValueError("chat_dataset: 'messages' must be a non-empty list of {role, content} objects")
            if messages[-1].get("role") == "assistant":
                raise ValueError("chat_dataset: 'messages' must not end with an assistant turn")
        if reward == "regex":
            try:
                self._pattern = re.compile(str(answer))
            except re.error as e:
                raise ValueError(f"chat_dataset: answer {answer!r} is not a regex: {e}") from None
        elif reward != "exact":
            self._fn = _reward_fn(reward)  # TaskModuleError names a bad reference
        if max_new_tokens is not None and max_new_tokens < 1:
            raise ValueError(f"chat_dataset: max_new_tokens={max_new_tokens} must be >= 1")
        self.answer, self.reward = answer, reward
        self.max_new_tokens = max_new_tokens
        self._first: Any = [dict(m) for m in messages] if messages is not None else {"role": "user", "content": prompt}

    def reset(self, task: TaskSpec) -> Any:
        return self._first

    def score(self, reply: str) -> float:
        """The reward of ``reply`` under this row's rule."""
        text = reply.strip()
        if self.reward == "exact":
            return 1.0 if text == str(self.answer).strip() else 0.0
        if self.reward == "regex":
            return 1.0 if self._pattern.fullmatch(text) else 0.0
        return float(self._fn(text, self.answer))

    def step(self, action_text: str, action_ids: list[int]) -> StepOutcome:
        return StepOutcome(observation="", reward=self.score(action_text), done=True)
