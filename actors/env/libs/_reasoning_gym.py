"""``[task] kind = "reasoning_gym"``: a reasoning-gym procedural dataset as a single-turn task.

Each prompt is one generated item: ``reasoning_gym.create_dataset(name, seed=task.seed,
size=1, **params)[0]``, so the prompt's seed picks the item (episodes of one GRPO group
share it; evaluation seeds give items training never saw). The reply's answer -- the text
inside the last ``<answer>...</answer>`` (reasoning-gym's convention, ``answer_tag``), or
the whole reply with ``answer_tag = ""`` -- is scored by the dataset's own
``score_answer(answer, entry)``; that score is the episode's reward.

Params are the generator's config fields (``min_terms``, ``max_animals``, ...) plus two of
Flotilla's: ``system_prompt`` (a key of ``reasoning_gym.utils.SYSTEM_PROMPTS`` such as
``"default"``, or literal text; empty: none) and ``answer_tag``. Datasets are cached per
process by (name, seed, params): a group's episodes build one.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from actors.env._interface import Environment, Observation, StepOutcome
from actors.types import TaskSpec

__all__ = ["ReasoningGymTask"]

_OWN = ("system_prompt", "answer_tag")


@functools.lru_cache(maxsize=64)
def _dataset(name: str, seed: int, params_json: str) -> Any:
    import reasoning_gym

    return reasoning_gym.create_dataset(name, seed=seed, size=1, **json.loads(params_json))


def _split(name: str, params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(Flotilla's own params, the generator's); raises ValueError/TypeError for bad ones."""
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise ValueError(
            f"reasoning_gym has no dataset {name!r} (it has {len(DATASETS)}: {', '.join(sorted(DATASETS)[:8])}, ...)"
        )
    for key in ("seed", "size"):
        if key in params:
            raise ValueError(
                f"reasoning_gym: params.{key} is set by Flotilla (each prompt's seed "
                f"picks one generated item); remove it"
            )
    own = {k: params[k] for k in _OWN if k in params}
    gen = {k: v for k, v in params.items() if k not in _OWN}
    for k, v in own.items():
        if not isinstance(v, str):
            raise TypeError(f"reasoning_gym: params.{k} must be a string, got {v!r}")
    return own, gen


class ReasoningGymTask(Environment):
    """One reasoning-gym item per episode, rewarded by the dataset's scorer (module docstring)."""

    max_turns = 1

    def __init__(self, dataset: str, **params: Any) -> None:
        own, gen = _split(dataset, params)
        self.name = dataset
        self.system_prompt = own.get("system_prompt", "")
        self.answer_tag = own.get("answer_tag", "answer")
        self.params_json = json.dumps(gen, sort_keys=True)
        if self.system_prompt:
            from reasoning_gym.utils import SYSTEM_PROMPTS

            self.system_prompt = SYSTEM_PROMPTS.get(self.system_prompt, self.system_prompt)
        self.dataset: Any = None
        self.entry: dict[str, Any] = {}

    @classmethod
    def validate_params(cls, dataset: str, params: dict[str, Any]) -> None:
        """The dataset exists and its generator accepts ``params`` (one item is generated)."""
        _, gen = _split(dataset, params)
        try:
            _dataset(dataset, 0, json.dumps(gen, sort_keys=True))[0]
        except (TypeError, ValueError, AssertionError) as e:
            raise ValueError(f"its generator says {type(e).__name__}: {e}") from None

    def reset(self, task: TaskSpec) -> Observation:
        self.dataset = _dataset(self.name, task.seed % 2**32, self.params_json)
        self.entry = self.dataset[0]
        question = {"role": "user", "content": str(self.entry["question"])}
        if self.system_prompt:
            return [{"role": "system", "content": self.system_prompt}, question]
        return [question]

    def answer(self, reply: str) -> str | None:
        """What the scorer is given for ``reply`` (None: no answer tag in it)."""
        if not self.answer_tag:
            return reply.strip()
        from reasoning_gym.utils import extract_answer

        return extract_answer(reply, tag_name=self.answer_tag)

    def step(self, action_text: str, action_ids: list[int]) -> StepOutcome:
        score = self.dataset.score_answer(self.answer(action_text), self.entry)
        return StepOutcome(observation="", reward=float(score), done=True)
