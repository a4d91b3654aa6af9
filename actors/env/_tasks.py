"""Built-in tasks: ``guess_number`` (multi-turn), ``arithmetic``, ``sum_mod`` and
``reverse`` (single turn).

Both are small enough for a tiny random-init model to learn on CPU, with
rewards that are easy to check by hand. Their words are in the default
vocabulary (``actors.tokenizer.TASK_WORDS``), so nothing becomes <unk>.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from actors.env._interface import Environment, StepOutcome, register_task
from actors.tokenizer import MAX_INT, ChatTokens
from actors.types import TaskSpec

__all__ = ["Arithmetic", "GuessNumber", "Reverse", "SumMod", "first_int", "guess_number_optimal", "int_words"]


def first_int(text: str) -> int | None:
    """The first whitespace-separated word of ``text`` that is a non-negative integer."""
    for w in text.split():
        if w.isdecimal():
            return int(w)
    return None


def int_words(text: str) -> list[int | None]:
    """Every whitespace-separated word of ``text``: its integer value, or None for a word
    that is not a non-negative integer."""
    return [int(w) if w.isdecimal() else None for w in text.split()]


@register_task("guess_number")
class GuessNumber(Environment):
    """Guess a secret in 0..n−1 in at most ``max_turns`` guesses, told higher/lower.

    The prompt is ``guess the number from 0 to {n-1} in {max_turns} turns``. Each
    reply's first integer word is the guess; a reply without one is an invalid
    guess that still uses a turn (observation ``invalid``). Observations after a
    wrong guess: ``higher`` (the secret is larger) or ``lower``. Reward 1.0 on the
    correct guess (the episode ends), else 0.0; the episode also ends when the
    turns are used up.

    Defaults n=15, max_turns=4: a binary search covers 2⁴−1 = 15 values, so it
    always wins, while a uniform random guesser wins ≈ 0.24–0.27. One token per
    action by default (``max_new_tokens=1``).

    The secret comes from ``task.seed`` (``random.Random(seed).randrange(n)``), or
    is ``secret`` when given (tests and evaluation sweep all secrets this way).
    """

    blocking = False  # pure computation: runs on the env actor's loop, no thread hop

    def __init__(self, n: int = 15, max_turns: int = 4, max_new_tokens: int = 1, secret: int | None = None) -> None:
        if not 2 <= n <= MAX_INT + 1:
            raise ValueError(f"guess_number: n={n} must be in 2..{MAX_INT + 1} (every number is one token)")
        if max_turns < 1 or max_new_tokens < 1:
            raise ValueError(f"guess_number: max_turns={max_turns} and max_new_tokens={max_new_tokens} must be >= 1")
        if secret is not None and not 0 <= secret < n:
            raise ValueError(f"guess_number: secret={secret} outside 0..{n - 1}")
        self.n, self.max_turns, self.max_new_tokens = n, max_turns, max_new_tokens
        self._fixed_secret = secret
        self.secret = -1
        self.turn = 0

    def reset(self, task: TaskSpec) -> str:
        self.secret = (
            self._fixed_secret if self._fixed_secret is not None else random.Random(task.seed).randrange(self.n)
        )
        self.turn = 0
        return f"guess the number from 0 to {self.n - 1} in {self.max_turns} turns"

    def step(self, action_text: str, action_ids: list[int]) -> StepOutcome:
        self.turn += 1
        guess = first_int(action_text)
        if guess == self.secret:
            return StepOutcome(observation="correct", reward=1.0, done=True)
        obs = "invalid" if guess is None else ("higher" if guess < self.secret else "lower")
        return StepOutcome(observation=obs, reward=0.0, done=self.turn >= self.max_turns)


@register_task("arithmetic")
class Arithmetic(Environment):
    """``what is a + b ?`` with non-negative ints, a + b ≤ ``max_sum`` (≤ 63).

    Single turn; reward 1.0 when the reply's first integer word is the sum, else 0.
    ``task.seed`` picks the pair (a, b) uniformly among all pairs with a + b ≤ max_sum,
    so no one answer dominates (drawing a first and then b would make a + b = max_sum
    the answer of 41% of the prompts at max_sum = 5). One token per answer by default
    (``max_new_tokens=1``).
    """

    blocking = False  # pure computation: runs on the env actor's loop, no thread hop

    max_turns = 1

    def __init__(self, max_sum: int = MAX_INT, max_new_tokens: int = 1) -> None:
        if not 0 <= max_sum <= MAX_INT:
            raise ValueError(f"arithmetic: max_sum={max_sum} must be in 0..{MAX_INT}")
        if max_new_tokens < 1:
            raise ValueError(f"arithmetic: max_new_tokens={max_new_tokens} must be >= 1")
        self.max_sum, self.max_new_tokens = max_sum, max_new_tokens
        self.a = self.b = 0

    def reset(self, task: TaskSpec) -> str:
        # the k-th pair in (sum, a) order, k uniform over the (max_sum + 1)(max_sum + 2) / 2 pairs
        k = random.Random(task.seed).randrange((self.max_sum + 1) * (self.max_sum + 2) // 2)
        total = (math.isqrt(8 * k + 1) - 1) // 2  # the largest s with s(s + 1)/2 <= k
        self.a = k - total * (total + 1) // 2
        self.b = total - self.a
        return f"what is {self.a} + {self.b} ?"

    def step(self, action_text: str, action_ids: list[int]) -> StepOutcome:
        ok = first_int(action_text) == self.a + self.b
        return StepOutcome(observation="correct" if ok else "wrong", reward=1.0 if ok else 0.0, done=True)


@register_task("sum_mod")
class SumMod(Environment):
    """``what is a + b mod m ?`` with digits a, b in 0..m−1 (default m = 10).

    Single turn; reward 1.0 when the reply's first integer word is (a + b) mod m, else 0.
    ``task.seed`` picks the pair uniformly among the m² pairs, so every answer is equally
    common (each residue has m pairs). One token per answer by default.
    """

    blocking = False  # pure computation: runs on the env actor's loop, no thread hop

    max_turns = 1

    def __init__(self, modulus: int = 10, max_new_tokens: int = 1) -> None:
        if not 2 <= modulus <= MAX_INT + 1:
            raise ValueError(f"sum_mod: modulus={modulus} must be in 2..{MAX_INT + 1} (every number is one token)")
        if max_new_tokens < 1:
            raise ValueError(f"sum_mod: max_new_tokens={max_new_tokens} must be >= 1")
        self.modulus, self.max_new_tokens = modulus, max_new_tokens
        self.a = self.b = 0

    def reset(self, task: TaskSpec) -> str:
        k = random.Random(task.seed).randrange(self.modulus * self.modulus)
        self.a, self.b = divmod(k, self.modulus)
        return f"what is {self.a} + {self.b} mod {self.modulus} ?"

    def answer(self) -> int:
        return (self.a + self.b) % self.modulus

    def step(self, action_text: str, action_ids: list[int]) -> StepOutcome:
        ok = first_int(action_text) == self.answer()
        return StepOutcome(observation="correct" if ok else "wrong", reward=1.0 if ok else 0.0, done=True)


@register_task("reverse")
class Reverse(Environment):
    """``reverse x1 x2 ... xk``: reply with the k numbers in reverse order.

    The numbers are drawn from 0..values−1 (default k = ``length`` = 3, values = 5) by
    ``task.seed``. Single turn, ``length`` tokens per reply by default. Reward: the
    fraction of the k positions whose word is right (the reply's first k words against
    the reversed sequence; a missing or non-integer word is wrong), so a reply with one
    position right already earns 1/k: partial credit gives GRPO a signal before whole
    reversals are found.
    """

    blocking = False  # pure computation: runs on the env actor's loop, no thread hop

    max_turns = 1

    def __init__(self, length: int = 3, values: int = 5, max_new_tokens: int | None = None) -> None:
        task = type(self).__name__.lower()  # reverse, sort
        if not 1 <= length <= 16:
            raise ValueError(f"{task}: length={length} must be in 1..16")
        if not 2 <= values <= MAX_INT + 1:
            raise ValueError(f"{task}: values={values} must be in 2..{MAX_INT + 1} (every number is one token)")
        if max_new_tokens is not None and max_new_tokens < length:
            raise ValueError(f"{task}: max_new_tokens={max_new_tokens} must be >= length={length}")
        self.length, self.values = length, values
        self.max_new_tokens = max_new_tokens if max_new_tokens is not None else length
        self.sequence: list[int] = []

    def reset(self, task: TaskSpec) -> str:
        rng = random.Random(task.seed)
        self.sequence = [rng.randrange(self.values) for _ in range(self.length)]
        return "reverse " + " ".join(str(x) for x in self.sequence)

    def answer(self) -> list[int]:
        return self.sequence[::-1]

    def score(self, action_text: str) -> float:
        """Fraction of positions right (see the class docstring)."""
        words = int_words(action_text)[: self.length]
        right = sum(1 for w, x in zip(words, self.answer(), strict=False) if w == x)
        return right / self.length

    def step(self, action_text: str, action_ids: list[int]) -> StepOutcome:
        reward = self.score(action_text)
        return StepOutcome(observation="correct" if reward == 1.0 else "wrong", reward=reward, done=True)


@register_task("sort")
class Sort(Reverse):
    """``sort x1 x2 ... xk``: reply with the k numbers in ascending order.

    As ``reverse`` (numbers from 0..values−1 drawn by ``task.seed``, one token per
    number, reward the fraction of the k positions right), with the sorted sequence as
    the answer: each position depends on every number of the prompt, not on one.
    """

    def reset(self, task: TaskSpec) -> str:
        return "sort" + super().reset(task).removeprefix("reverse")

    def answer(self) -> list[int]:
        return sorted(self.sequence)


def guess_number_optimal(ids: Sequence[int], chat: ChatTokens) -> int:
    """The binary-search guess for a ``guess_number`` conversation so far.

    ``ids`` is the running sequence ending with ``<|assistant|>`` (what a sampler
    is asked to continue). The bounds come from the prompt (``from lo to hi``)
    and are narrowed by every earlier guess and its ``higher``/``lower`` answer.
    A scripted optimal policy: with n ≤ 2^max_turns − 1 it always wins.
    """
    words = chat.decode(ids, skip_special=False).split()
    turns: list[tuple[str, list[str]]] = []  # (role, words) in order
    for w in words:
        if w == "<|user|>":
            turns.append(("user", []))
        elif w == "<|assistant|>":
            turns.append(("assistant", []))
        elif w not in ("<bos>", "<|end|>", "<eos>") and turns:
            turns[-1][1].append(w)
    if not turns or turns[0][0] != "user" or "from" not in turns[0][1]:
        raise ValueError("not a guess_number conversation: the first user turn has no 'from lo to hi'")
    prompt = turns[0][1]
    i = prompt.index("from")
    lo, hi = int(prompt[i + 1]), int(prompt[i + 3])
    for (role, reply), (_, answer) in zip(turns[1::2], turns[2::2], strict=False):
        guess = first_int(" ".join(reply))
        if role != "assistant" or guess is None or not answer:
            continue
        if answer[0] == "higher":
            lo = max(lo, guess + 1)
        elif answer[0] == "lower":
            hi = min(hi, guess - 1)
    return (lo + hi) // 2
