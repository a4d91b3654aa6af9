"""The small built-in tasks ``sum_mod``, ``reverse`` and ``sort``: prompts, answers and rewards."""

from __future__ import annotations

import collections
import random

import pytest

from actors.env import Reverse, Sort, StepOutcome, SumMod, make_env, make_task_specs, registered_tasks
from actors.tokenizer import default_chat_tokens
from actors.types import TaskSpec


def _spec(task: str, seed: int, **params: object) -> TaskSpec:
    return TaskSpec(task=task, prompt_id="p", group_id="g", seed=seed, params=dict(params))


def test_registered_and_prompts_in_vocabulary() -> None:
    assert {"sum_mod", "reverse", "sort"} <= set(registered_tasks())
    chat = default_chat_tokens()
    specs = [s for task in ("sum_mod", "reverse", "sort") for s in make_task_specs(task, 20, 1)]
    for spec in specs:
        env = make_env(spec)
        chat.encode(env.reset(spec), strict=True)  # raises on a word outside the vocabulary


def test_sum_mod_reward_and_uniform_answers() -> None:
    answers = collections.Counter()
    for seed in range(400):
        spec = _spec("sum_mod", seed)
        env = make_env(spec)
        assert isinstance(env, SumMod)
        words = env.reset(spec).split()
        assert words[:2] == ["what", "is"] and words[3] == "+" and words[5:] == ["mod", "10", "?"]
        a, b = int(words[2]), int(words[4])
        assert 0 <= a < 10 and 0 <= b < 10
        right = (a + b) % 10
        answers[right] += 1
        assert env.step(str(right), []) == StepOutcome(observation="correct", reward=1.0, done=True)
        assert env.step(str(a + b) if a + b >= 10 else str((right + 1) % 10), []).reward == 0.0
        assert env.step(f"the {right}", []).reward == 1.0  # the first integer word counts
        assert env.step("", []).reward == 0.0
    assert set(answers) == set(range(10)) and max(answers.values()) < 3 * min(answers.values())
    env = SumMod(modulus=7)
    env.reset(_spec("sum_mod", 3))
    assert env.a < 7 and env.b < 7 and env.step(str((env.a + env.b) % 7), []).reward == 1.0
    with pytest.raises(ValueError, match="modulus=1"):
        SumMod(modulus=1)


def test_reverse_reward_counts_positions() -> None:
    spec = _spec("reverse", 11)
    env = make_env(spec)
    assert isinstance(env, Reverse) and env.max_new_tokens == 3
    words = env.reset(spec).split()
    assert words[0] == "reverse" and len(words) == 4
    seq = [int(w) for w in words[1:]]
    rng = random.Random(11)
    assert seq == [rng.randrange(5) for _ in range(3)]
    rev = seq[::-1]
    full = env.step(" ".join(map(str, rev)), [])
    assert full == StepOutcome(observation="correct", reward=1.0, done=True)
    # one position wrong: 2/3; a missing word is wrong; words past the length do not count
    wrong0 = [(rev[0] + 1) % 5, *rev[1:]]
    assert env.step(" ".join(map(str, wrong0)), []).reward == pytest.approx(2 / 3)
    assert env.step(" ".join(map(str, rev[:2])), []).reward == pytest.approx(2 / 3)
    assert env.step(" ".join(map(str, rev)) + " 9 9", []).reward == 1.0
    # a non-integer word takes its position: "the" is wrong at 0, the rest stay in place
    assert env.step("the " + " ".join(map(str, rev[1:])), []).reward == pytest.approx(2 / 3)
    assert env.step("", []) == StepOutcome(observation="wrong", reward=0.0, done=True)


def test_reverse_parameters() -> None:
    env = Reverse(length=5, values=10)
    spec = _spec("reverse", 2)
    seq = [int(w) for w in env.reset(spec).split()[1:]]
    assert len(seq) == 5 and env.max_new_tokens == 5
    assert env.step(" ".join(map(str, seq[::-1])), []).reward == 1.0
    assert env.score(" ".join(map(str, seq))) == sum(a == b for a, b in zip(seq, seq[::-1], strict=True)) / 5
    for bad, match in [({"length": 0}, "length=0"), ({"values": 1}, "values=1"), ({"max_new_tokens": 2}, "max_new")]:
        with pytest.raises(ValueError, match=match):
            Reverse(**bad)


def test_sort_reward_counts_positions_against_the_sorted_sequence() -> None:
    spec = _spec("sort", 11)
    env = make_env(spec)
    assert isinstance(env, Sort) and env.max_new_tokens == 3
    words = env.reset(spec).split()
    assert words[0] == "sort" and len(words) == 4
    rng = random.Random(11)
    seq = [rng.randrange(5) for _ in range(3)]  # the same draw as reverse's
    assert [int(w) for w in words[1:]] == seq
    want = sorted(seq)
    assert env.step(" ".join(map(str, want)), []) == StepOutcome(observation="correct", reward=1.0, done=True)
    assert env.step(" ".join(map(str, want[:2])), []).reward == pytest.approx(2 / 3)
    # a descending reply is right only where it meets the ascending one
    descending = want[::-1]
    right = sum(a == b for a, b in zip(descending, want, strict=True))
    assert env.score(" ".join(map(str, descending))) == pytest.approx(right / 3)
    with pytest.raises(ValueError, match="sort: values=1"):
        Sort(values=1)


def test_sort_prompts_cover_unsorted_sequences() -> None:
    seqs = []
    for seed in range(200):
        env = Sort()
        seqs.append([int(w) for w in env.reset(_spec("sort", seed)).split()[1:]])
    assert sum(s != sorted(s) for s in seqs) > 100  # most prompts need reordering
    assert all(0 <= x < 5 for s in seqs for x in s)
