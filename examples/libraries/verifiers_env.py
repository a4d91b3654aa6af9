"""A verifiers environment for the example: a multi-turn ``vf.MultiTurnEnv`` over a small
in-memory dataset (nothing downloaded). A wrong reply gets "try again"; the rollout stops on
the right answer or after ``max_turns``; the rubric rewards a right final answer, less when it
took more turns. ``[task] name = "examples/libraries/verifiers_env.py:load_environment"``
(or, installed as a package, its environment id).
"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset


def _rows(n: int) -> dict[str, list[str]]:
    pairs = [(a, b) for a in range(10) for b in range(10)][:n]
    return {"question": [f"What is {a} + {b}?" for a, b in pairs], "answer": [str(a + b) for a, b in pairs]}


def _last_reply(completion) -> str:
    for m in reversed(completion):
        if (m["role"] if isinstance(m, dict) else m.role) == "assistant":
            return ((m["content"] if isinstance(m, dict) else m.content) or "").strip()
    return ""


class TryAgain(vf.MultiTurnEnv):
    @vf.stop
    async def answered(self, state) -> bool:
        traj = state["trajectory"]
        return bool(traj) and _last_reply(traj[-1]["completion"]) == state["answer"]

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "try again"}]


def correct_soon(completion, answer, state, **kwargs) -> float:
    if _last_reply(completion) != answer:
        return 0.0
    return 1.0 / len(state["trajectory"])


def load_environment(num_examples: int = 50, max_turns: int = 3) -> vf.Environment:
    return TryAgain(
        dataset=Dataset.from_dict(_rows(num_examples)),
        max_turns=max_turns,
        system_prompt="Answer with the number only.",
        rubric=vf.Rubric(funcs=[correct_soon]),
    )
