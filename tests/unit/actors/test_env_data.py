"""Task modules from files, dataset rows as task parameters, and the chat_dataset task."""

from __future__ import annotations

import json
import textwrap

import pytest

from actors.env import (
    ChatDataset,
    DatasetError,
    TaskDataset,
    TaskModuleError,
    import_task_modules,
    make_env,
    registered_tasks,
    resolve_callable,
)
from actors.types import TaskSpec

USER_TASKS = '''
from actors.env import Environment, StepOutcome, register_task

@register_task("{name}")
class Echo(Environment):
    max_turns = 1

    def __init__(self, word):
        self.word = word

    def reset(self, task):
        return "say " + self.word

    def step(self, action_text, action_ids):
        return StepOutcome(observation="", reward=float(action_text == self.word), done=True)

def half(reply, answer):
    return 0.5 if answer in reply else 0.0
'''


def _write_rows(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_task_file_outside_the_package_registers_its_task(tmp_path) -> None:
    f = tmp_path / "my_tasks.py"
    f.write_text(USER_TASKS.format(name="file_echo"))
    import_task_modules([str(f), str(f)])  # a second import is harmless
    assert "file_echo" in registered_tasks()
    env = make_env(TaskSpec(task="file_echo", prompt_id="p", group_id="g", params={"word": "hi"}))
    assert env.reset(None) == "say hi" and env.step("hi", []).reward == 1.0
    assert resolve_callable(f"{f}:half")("a b", "b") == 0.5


def test_task_module_errors_are_one_line(tmp_path) -> None:
    bad = tmp_path / "broken.py"
    bad.write_text("import not_a_module_anywhere\n")
    with pytest.raises(
        TaskModuleError,
        match=r"^task module '.*broken.py' failed to import: "
        r"ModuleNotFoundError: No module named",
    ) as e:
        import_task_modules([str(bad)])
    assert "\n" not in str(e.value)
    with pytest.raises(TaskModuleError, match="FileNotFoundError: no such file"):
        import_task_modules([str(tmp_path / "missing.py")])
    with pytest.raises(TaskModuleError, match="'no_such_pkg.tasks' failed to import"):
        import_task_modules(["no_such_pkg.tasks"])
    with pytest.raises(TaskModuleError, match="has no function 'nope'"):
        resolve_callable("json:nope")
    with pytest.raises(TaskModuleError, match="not of the form 'module:function'"):
        resolve_callable("json")


def test_rows_shuffle_per_epoch_and_depend_on_the_prompt_index_only(tmp_path) -> None:
    _write_rows(tmp_path / "d.jsonl", [{"q": i} for i in range(10)])
    ds = TaskDataset.load(tmp_path / "d.jsonl")
    assert len(ds) == 10 and ds.rows[3] == {"q": 3}
    epoch0 = [ds.params(i, seed=1)["q"] for i in range(10)]
    epoch1 = [ds.params(i, seed=1)["q"] for i in range(10, 20)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))  # every row once per epoch
    assert epoch0 != epoch1 and epoch0 != list(range(10))  # reshuffled each epoch
    assert [ds.params(i, seed=2)["q"] for i in range(10)] != epoch0  # the run's seed matters
    # A resumed run (a fresh process) continues at the same row for the same prompt index.
    again = TaskDataset.load(tmp_path / "d.jsonl")
    assert [again.params(i, seed=1)["q"] for i in range(13, 20)] == epoch1[3:]


def test_parquet_and_bad_files(tmp_path) -> None:
    import datasets

    datasets.Dataset.from_list([{"prompt": "a", "answer": "b"}]).to_parquet(tmp_path / "d.parquet")
    assert TaskDataset.load(tmp_path / "d.parquet").rows == [{"prompt": "a", "answer": "b"}]
    with pytest.raises(DatasetError, match="no such file"):
        TaskDataset.load(tmp_path / "none.jsonl")
    with pytest.raises(DatasetError, match="unknown file type '.csv'"):
        TaskDataset.load(tmp_path / "d.csv")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n\n{not json\n{"prompt": "c"}\n')
    with pytest.raises(DatasetError, match=r"bad\.jsonl:3: not valid JSON: .*the line: \{not json\)$"):
        TaskDataset.load(tmp_path / "bad.jsonl")  # the file's line, blank lines counted
    (tmp_path / "list.jsonl").write_text('{"prompt": "a"}\n[1, 2]\n')
    with pytest.raises(DatasetError, match=r"list\.jsonl:2: a row must be a JSON object, got list"):
        TaskDataset.load(tmp_path / "list.jsonl")
    (tmp_path / "arr.json").write_text('[\n {"prompt": "a"},\n {"prompt": \n]\n')
    with pytest.raises(DatasetError, match=r"arr\.json:4: not valid JSON"):
        TaskDataset.load(tmp_path / "arr.json")
    (tmp_path / "long.jsonl").write_text('{"prompt": "' + "x" * 100_000 + '\n')
    with pytest.raises(DatasetError) as e:
        TaskDataset.load(tmp_path / "long.jsonl")
    assert "long.jsonl:1: not valid JSON" in str(e.value) and len(str(e.value)) < 600


def test_chat_dataset_rewards(tmp_path) -> None:
    exact = ChatDataset(prompt="2+2?", answer=4)
    assert exact.reset(None) == {"role": "user", "content": "2+2?"}
    assert exact.step(" 4 ", []).reward == 1.0 and exact.step("four", []).reward == 0.0
    rx = ChatDataset(
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "a colour?"}],
        answer=r"(red|blue)\.?",
        reward="regex",
        source="ignored column",
    )
    assert rx.step("blue.", []).reward == 1.0 and rx.step("the blue", []).reward == 0.0
    assert rx.reset(None)[0]["role"] == "system"
    f = tmp_path / "rewards.py"
    f.write_text(USER_TASKS.format(name="reward_host"))
    fn = ChatDataset(prompt="x", answer="b", reward=f"{f}:half")
    assert fn.step("a b c", []).reward == 0.5
    with pytest.raises(ValueError, match="exactly one of 'prompt' or 'messages'"):
        ChatDataset(answer="x")
    with pytest.raises(ValueError, match="needs an 'answer'"):
        ChatDataset(prompt="x")
    with pytest.raises(ValueError, match="is not a regex"):
        ChatDataset(prompt="x", answer="(", reward="regex")
    with pytest.raises(TaskModuleError, match="has no function 'missing'"):
        ChatDataset(prompt="x", answer="y", reward=f"{f}:missing")


def test_env_actor_config_imports_file_modules(tmp_path) -> None:
    from actors.env import EnvActor, EnvConfig

    f = tmp_path / "actor_tasks.py"
    f.write_text(textwrap.dedent(USER_TASKS.format(name="actor_echo")))
    assert "actor_echo" not in registered_tasks()
    EnvActor(EnvConfig(task_modules=[str(f)]))
    assert "actor_echo" in registered_tasks()
