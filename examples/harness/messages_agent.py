"""The guess-the-number agent of ``agent.py``, written against Anthropic's Messages API
(``client.messages.create`` of the official ``anthropic`` client).

Each turn resends the conversation, the model's replies as the content blocks they came
in. Nothing in it knows about Flotilla: it talks to whatever ANTHROPIC_BASE_URL (or the
base URL it is given, without ``/v1``) serves, with ANTHROPIC_API_KEY as its key.

Run as Flotilla's environment with examples/harness/messages.toml
(``entrypoint = "examples/harness/messages_agent.py:play"``, in the environment actor) or
as a command (``python examples/harness/messages_agent.py {task}``: a process per episode,
which prints ``{"reward": x}`` as its last line; Flotilla sets ANTHROPIC_BASE_URL and
ANTHROPIC_API_KEY for it). The built-in
model's word tokenizer has only user and assistant turns, so the agent sends no
``system`` prompt and no tools (a checkpoint with a tool template takes both).
"""

from __future__ import annotations

import json
import os
import random
import sys

import anthropic

_http: anthropic.DefaultAsyncHttpxClient | None = None
"""One HTTP connection pool for every game this process plays."""


def guess(secret: int, reply: str) -> str:
    """The game's answer to the reply's first number."""
    words = [w for w in reply.split() if w.isdecimal()]
    if not words:
        return "invalid"
    n = int(words[0])
    return "correct" if n == secret else ("higher" if n < secret else "lower")


async def play(base_url: str, task: dict) -> dict:
    """One game; ``base_url`` is the OpenAI-style one (ending in ``/v1``) an entrypoint is
    given. Returns ``{"reward": 1.0}`` when the secret is found within the turns."""
    n, turns = int(task.get("n", 7)), int(task.get("max_turns", 3))
    secret = random.Random(task["seed"]).randrange(n)
    global _http
    if _http is None:
        _http = anthropic.DefaultAsyncHttpxClient()
    client = anthropic.AsyncAnthropic(
        base_url=base_url.removesuffix("/v1"),
        max_retries=0,
        http_client=_http,
        api_key=os.environ.get("ANTHROPIC_API_KEY", "flotilla"),
    )
    messages: list = [{"role": "user", "content": f"guess the number from 0 to {n - 1} in {turns} turns"}]
    for _ in range(turns):
        r = await client.messages.create(model="flotilla", max_tokens=1, messages=messages)
        reply = "".join(b.text for b in r.content if b.type == "text")
        answer = guess(secret, reply)
        if answer == "correct":
            return {"reward": 1.0}
        messages += [{"role": "assistant", "content": r.content}, {"role": "user", "content": answer}]
    return {"reward": 0.0}


if __name__ == "__main__":
    import asyncio

    base = os.environ["ANTHROPIC_BASE_URL"] + "/v1"
    print(json.dumps(asyncio.run(play(base, json.loads(sys.argv[1])))))
