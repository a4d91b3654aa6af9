"""Tokenizer, chat turns, built-in tasks and trajectory bookkeeping (no processes)."""

from __future__ import annotations

import random

import pytest
import torch

from actors.env import Arithmetic, GuessNumber, StepOutcome, make_env, make_task_specs, registered_tasks
from actors.env._episode import EpisodeBuilder
from actors.env._tasks import first_int, guess_number_optimal
from actors.tokenizer import MAX_INT, VOCAB_SIZE, ChatTokens, build_tokenizer, default_chat_tokens
from actors.types import TaskSpec, Trajectory


@pytest.fixture(scope="module")
def chat() -> ChatTokens:
    return default_chat_tokens()


def test_vocabulary_small_and_integers_single_tokens(chat: ChatTokens) -> None:
    assert chat.vocab_size == VOCAB_SIZE == len(chat.tokenizer) < 128
    ids = chat.encode(" ".join(str(i) for i in range(MAX_INT + 1)), strict=True)
    assert ids == [chat.int_id(i) for i in range(MAX_INT + 1)]
    assert len(set(ids)) == MAX_INT + 1
    # the HF wrapper tokenises the same way
    assert chat.tokenizer("7 + 8", add_special_tokens=False)["input_ids"] == chat.encode("7 + 8")
    assert chat.encode("64") == [chat.unk_id]
    with pytest.raises(ValueError, match="'64'"):
        chat.encode("what is 64", strict=True)


def test_extra_words_and_bad_words() -> None:
    tok = build_tokenizer(["banana"])
    assert tok.convert_tokens_to_ids("banana") == VOCAB_SIZE
    chat = ChatTokens(extra_words=["banana"])
    assert chat.encode("banana 3", strict=True) == tok("banana 3")["input_ids"]
    assert chat.vocab_size == VOCAB_SIZE + 1 == len(chat.tokenizer)
    with pytest.raises(ValueError, match=r"extra_words\[0\]"):
        build_tokenizer(["higher"])
    with pytest.raises(ValueError, match=r"extra_words\[1\]"):
        build_tokenizer(["ok", "two words"])


def test_chat_turns_append_without_retokenising(chat: ChatTokens) -> None:
    p = chat.prompt("what is 1 + 2 ?")
    assert p[:2] == [chat.bos_id, chat.user_id] and p[-2:] == [chat.end_id, chat.assistant_id]
    assert chat.decode(p) == "what is 1 + 2 ?"
    assert chat.decode(p, skip_special=False).split()[0] == "<bos>"
    # a reply cut by length gets a closing <|end|>; one stopped on <|end|> does not
    assert chat.close_assistant([chat.int_id(3)]) == [chat.end_id]
    assert chat.close_assistant([chat.int_id(3), chat.end_id]) == []
    assert chat.user_turn([chat.int_id(5)]) == [chat.user_id, chat.int_id(5), chat.end_id, chat.assistant_id]
    with pytest.raises(ValueError, match="position 1"):
        chat.user_turn([1, 10_000])


def test_builtin_prompts_are_in_vocabulary(chat: ChatTokens) -> None:
    assert {"guess_number", "arithmetic"} <= set(registered_tasks())
    for spec in make_task_specs("guess_number", 3, 1) + make_task_specs("arithmetic", 3, 1):
        env = make_env(spec)
        chat.encode(env.reset(spec), strict=True)
        for obs in ("higher", "lower", "correct", "invalid", "wrong"):
            chat.encode(obs, strict=True)


def test_task_specs_group_prompts() -> None:
    specs = make_task_specs("arithmetic", 2, 3, seed=5)
    assert len(specs) == 6 and len({s.group_id for s in specs}) == 2
    assert specs[0].seed == specs[2].seed != specs[3].seed
    with pytest.raises(KeyError, match="nope"):
        make_env(TaskSpec(task="nope", prompt_id="p", group_id="g"))
    with pytest.raises(TypeError, match="bogus"):
        make_env(TaskSpec(task="arithmetic", prompt_id="p", group_id="g", params={"bogus": 1}))


def _play_guess(env: GuessNumber, spec: TaskSpec, chat: ChatTokens) -> tuple[float, int]:
    """Drive a guess_number env with the scripted binary search over real token ids."""
    ids = chat.prompt(env.reset(spec))
    reward, turns = 0.0, 0
    while True:
        reply = [chat.int_id(guess_number_optimal(ids, chat))]
        ids += reply
        turns += 1
        out = env.step(chat.decode(reply), reply)
        reward += out.reward
        if out.done:
            return reward, turns
        ids += chat.close_assistant(reply) + chat.user_turn(out.observation)


def test_guess_number_binary_search_always_wins(chat: ChatTokens) -> None:
    spec = TaskSpec(task="guess_number", prompt_id="p", group_id="g")
    for secret in range(15):
        reward, turns = _play_guess(GuessNumber(secret=secret), spec, chat)
        assert reward == 1.0 and turns <= 4, secret
    # n = 2^k - 1 is the largest binary search always solves; n = 31 needs 5 turns
    for secret in range(31):
        assert _play_guess(GuessNumber(n=31, max_turns=5, secret=secret), spec, chat)[0] == 1.0


def test_guess_number_rules() -> None:
    spec = TaskSpec(task="guess_number", prompt_id="p", group_id="g", seed=3)
    env = GuessNumber()
    env.reset(spec)
    assert env.secret == random.Random(3).randrange(15)
    s = env.secret
    below = (s - 1) if s > 0 else None
    if below is not None:
        assert env.step(f"{below}", []) == StepOutcome(observation="higher", reward=0.0, done=False)
    else:
        assert env.step("14", []).observation == "lower"
    # no integer in the reply: invalid, and the turn is used
    assert env.step("the", []).observation == "invalid" and env.turn == 2
    assert env.step(f"is {s} .", []).reward == 1.0
    # turns run out
    env2 = GuessNumber(max_turns=2, secret=0)
    env2.reset(spec)
    assert not env2.step("5", []).done and env2.step("5", []).done
    with pytest.raises(ValueError, match="n=65"):
        GuessNumber(n=65)


def test_uniform_random_guesser_wins_about_a_quarter() -> None:
    rng = random.Random(0)
    wins = 0
    for trial in range(2000):
        env = GuessNumber()
        env.reset(TaskSpec(task="guess_number", prompt_id="p", group_id="g", seed=trial))
        for _ in range(4):
            out = env.step(str(rng.randrange(15)), [])
            if out.done:
                wins += out.reward == 1.0
                break
    assert 0.19 < wins / 2000 < 0.30


def test_arithmetic_reward(chat: ChatTokens) -> None:
    for seed in range(50):
        spec = TaskSpec(task="arithmetic", prompt_id="p", group_id="g", seed=seed)
        env = make_env(spec)
        assert isinstance(env, Arithmetic)
        words = env.reset(spec).split()
        a, b = int(words[2]), int(words[4])
        assert a + b <= MAX_INT
        assert env.step(str(a + b), []) == StepOutcome(observation="correct", reward=1.0, done=True)
        assert env.step(f"{a + b + 1} {a + b}", []).reward == 0.0
        assert env.step("", []).reward == 0.0
    assert first_int("what 12 is 3") == 12 and first_int("none") is None


def test_builder_masks_and_csr(chat: ChatTokens) -> None:
    b = EpisodeBuilder(chat.prompt("hi"))
    b.add_generated(
        [7, 8],
        torch.tensor([7, 9, 8], dtype=torch.int32),
        torch.tensor([0, 2, 3], dtype=torch.int32),
        torch.tensor([-0.1, -2.3, 0.0]),
        [4, 5],
    )
    b.add_context(chat.user_turn("higher"))
    b.add_generated(
        [10],
        torch.tensor([10, 11], dtype=torch.int32),
        torch.tensor([0, 2], dtype=torch.int32),
        torch.tensor([-0.5, -0.9]),
        [5],
    )
    spec = TaskSpec(task="t", prompt_id="p", group_id="g")
    t = b.build(task=spec, pool="cpu", reward=1.0, turns=2, seconds=0.1)
    assert t.loss_mask.sum() == 3 and t.tokens[t.loss_mask].tolist() == [7, 8, 10]
    assert t.support_offsets.tolist() == [0, 2, 3, 5]
    assert t.support_ids.tolist() == [7, 9, 8, 10, 11] and t.versions.tolist() == [4, 5, 5]
    assert t.staleness(7) == 3
    with pytest.raises(ValueError, match="versions"):
        b.add_generated(
            [1], torch.tensor([1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0.0]), []
        )


def test_trajectory_validation_names_the_field() -> None:
    good = dict(
        task="t",
        prompt_id="p",
        group_id="g",
        pool="x",
        tokens=torch.tensor([1, 2, 3]),
        loss_mask=torch.tensor([False, True, True]),
        support_ids=torch.tensor([2, 3], dtype=torch.int32),
        support_offsets=torch.tensor([0, 1, 2], dtype=torch.int32),
        support_logq=torch.zeros(2),
        versions=torch.tensor([0, 0], dtype=torch.int32),
        reward=1.0,
        turns=1,
        seconds=0.0,
    )
    Trajectory(**good)
    for field, bad, msg in [
        ("loss_mask", torch.tensor([True, True]), "loss_mask"),
        ("support_offsets", torch.tensor([0, 2], dtype=torch.int32), "support_offsets"),
        ("versions", torch.tensor([0], dtype=torch.int32), "versions"),
        ("tokens", torch.tensor([1, 2, 3], dtype=torch.int32), "tokens"),
        ("support_logq", torch.zeros(3), "support_logq"),
    ]:
        with pytest.raises(ValueError, match=msg):
            Trajectory(**{**good, field: bad})


def test_arithmetic_pairs_are_uniform_so_no_answer_dominates() -> None:
    env = Arithmetic(max_sum=5)
    counts: dict[tuple[int, int], int] = {}
    for seed in range(21 * 400):
        env.reset(TaskSpec(task="arithmetic", prompt_id="p", group_id="g", seed=seed))
        counts[(env.a, env.b)] = counts.get((env.a, env.b), 0) + 1
    assert sorted(counts) == sorted((a, s - a) for s in range(6) for a in range(s + 1))
    assert min(counts.values()) > 300 and max(counts.values()) < 500  # 400 each on average
    fives = sum(n for (a, b), n in counts.items() if a + b == 5) / (21 * 400)
    assert 0.25 < fives < 0.33  # 6 of 21 pairs, not the 41% of drawing a, then b
