"""verifiers environments defined here, over small in-memory datasets (nothing downloaded).

``load_single``: a ``vf.SingleTurnEnv`` whose rubric rewards the exact answer.
``load_multi``: a ``vf.MultiTurnEnv`` that answers each wrong reply with "try again" and ends
on the right one (or after ``max_turns``); its rubric rewards a final right answer, halved
when it took more than one turn. Loaded by path (``.../vf_envs.py:load_single``) or, with
this folder on sys.path, by id (``vf.load_environment("vf_envs")`` calls ``load_environment``).
"""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset

ROWS = {"question": ["What is 2+3?", "What is 4+4?", "Name the colour of the sky."], "answer": ["5", "8", "blue"]}


def _last_reply(completion) -> str:
    for m in reversed(completion):
        role = m["role"] if isinstance(m, dict) else m.role
        if role == "assistant":
            content = m["content"] if isinstance(m, dict) else m.content
            return (content or "").strip()
    return ""


def exact(completion, answer, **kwargs) -> float:
    return 1.0 if _last_reply(completion) == answer else 0.0


def load_single(**kwargs) -> vf.Environment:
    return vf.SingleTurnEnv(
        dataset=Dataset.from_dict(ROWS),
        system_prompt="Answer with one word.",
        rubric=vf.Rubric(funcs=[exact]),
        **kwargs,
    )


class TryAgain(vf.MultiTurnEnv):
    @vf.stop
    async def answered(self, state) -> bool:
        traj = state["trajectory"]
        return bool(traj) and _last_reply(traj[-1]["completion"]) == state["answer"]

    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "try again"}]


def turns_weighted(completion, answer, state, **kwargs) -> float:
    if _last_reply(completion) != answer:
        return 0.0
    return 1.0 if len(state["trajectory"]) == 1 else 0.5


def load_multi(max_turns: int = 3, **kwargs) -> vf.Environment:
    return TryAgain(
        dataset=Dataset.from_dict(ROWS), max_turns=max_turns, rubric=vf.Rubric(funcs=[turns_weighted]), **kwargs
    )


def load_environment(kind: str = "single", **kwargs) -> vf.Environment:
    return load_single(**kwargs) if kind == "single" else load_multi(**kwargs)
