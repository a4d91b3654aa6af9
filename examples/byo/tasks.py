"""A user task outside the Flotilla package: name the opposite of a word.

Loaded by ``[task] modules = ["examples/byo/tasks.py"]`` in every environment process.
Each dataset row (``{"word": ..., "answer": ...}``) becomes this task's constructor
arguments through ``TaskSpec.params``.
"""

from __future__ import annotations

import re

from actors.env import Environment, StepOutcome, register_task

_WORD = re.compile(r"[a-z]+")


def score(reply: str, answer: str) -> float:
    """1.0 when the reply's first word is the answer, 0.25 when the answer appears later.

    Also usable as ``reward = "examples/byo/tasks.py:score"`` of the built-in
    ``chat_dataset`` task.
    """
    words = _WORD.findall(reply.lower())
    if not words:
        return 0.0
    if words[0] == answer:
        return 1.0
    return 0.25 if answer in words else 0.0


@register_task("opposite")
class Opposite(Environment):
    """One turn: the system asks for one word, the user names a word, the reward is
    ``score(reply, answer)``."""

    max_turns = 1

    def __init__(self, word: str, answer: str, max_new_tokens: int = 4) -> None:
        if not word or not answer:
            raise ValueError("opposite: a row needs a non-empty 'word' and 'answer'")
        self.word, self.answer, self.max_new_tokens = word, answer, max_new_tokens

    def reset(self, task):
        return [
            {"role": "system", "content": "Answer with one word."},
            {"role": "user", "content": f"The opposite of {self.word} is"},
        ]

    def step(self, action_text: str, action_ids: list[int]) -> StepOutcome:
        return StepOutcome(observation="", reward=score(action_text, self.answer), done=True)
