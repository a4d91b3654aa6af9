"""A guess-the-number agent written only against the official ``openai`` client.

The agent holds a tool -- the game itself, ``guess(n)`` answering ``higher``,
``lower`` or ``correct`` -- and asks the model for one guess per turn: it calls the
tool with the model's reply and sends the tool's answer back as the next message.
Nothing in it knows about Flotilla: it talks to whatever OPENAI_BASE_URL (or the
base URL it is given) serves, so the same file runs against any OpenAI-compatible
server.

Two ways to run it as Flotilla's environment (examples/harness/config.toml):

* ``entrypoint = "examples/harness/agent.py:play"``: ``play(base_url, task)`` runs in
  the environment actor (no process per episode; what the config uses);
* ``command = "python examples/harness/agent.py {task}"``: one process per episode,
  which prints ``{"reward": x}`` as its last line.

The model is the tiny built-in one with the word tokenizer, which has no tool-call
format, so the *agent* calls the tool; a model with a chat template that supports
tools would get ``tools=[...]`` and call it itself (see docs/harness.md).
"""

from __future__ import annotations

import json
import os
import random
import sys

from openai import AsyncOpenAI, DefaultAsyncHttpxClient

_http: DefaultAsyncHttpxClient | None = None
"""One HTTP connection pool for every game this process plays: building a client costs
~50-100 ms (TLS setup), more than a whole game against a tiny model."""


def guess(secret: int, reply: str) -> str:
    """The tool: the game's answer to the reply's first number."""
    words = [w for w in reply.split() if w.isdecimal()]
    if not words:
        return "invalid"
    n = int(words[0])
    return "correct" if n == secret else ("higher" if n < secret else "lower")


async def play(base_url: str, task: dict) -> dict:
    """One game; returns ``{"reward": 1.0}`` when the secret is found within the turns."""
    n, turns = int(task.get("n", 7)), int(task.get("max_turns", 3))
    secret = random.Random(task["seed"]).randrange(n)
    global _http
    if _http is None:
        _http = DefaultAsyncHttpxClient()
    client = AsyncOpenAI(
        base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "flotilla"), max_retries=0, http_client=_http
    )
    messages = [{"role": "user", "content": f"guess the number from 0 to {n - 1} in {turns} turns"}]
    for _ in range(turns):
        r = await client.chat.completions.create(model="flotilla", messages=messages, max_tokens=1)
        reply = r.choices[0].message.content or ""
        answer = guess(secret, reply)
        if answer == "correct":
            return {"reward": 1.0}
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": answer}]
    return {"reward": 0.0}


if __name__ == "__main__":
    import asyncio

    result = asyncio.run(play(os.environ["OPENAI_BASE_URL"], json.loads(sys.argv[1])))
    print(json.dumps(result))
