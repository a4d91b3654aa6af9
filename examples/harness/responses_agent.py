"""The guess-the-number agent of ``agent.py``, written against OpenAI's Responses API
(``client.responses.create`` of the official ``openai`` client).

Each turn sends only the game's answer and names the previous response
(``previous_response_id``): the server holds the conversation. Nothing in it knows about
Flotilla: it talks to whatever OPENAI_BASE_URL (or the base URL it is given) serves.

Run as Flotilla's environment with examples/harness/responses.toml
(``entrypoint = "examples/harness/responses_agent.py:play"``) or as a command
(``python examples/harness/responses_agent.py {task}``, printing ``{"reward": x}``).
The built-in model's word tokenizer has only user and assistant turns, so the agent
sends no ``instructions`` and no tools (a checkpoint with a tool template takes both).
"""

from __future__ import annotations

import json
import os
import random
import sys

from openai import AsyncOpenAI, DefaultAsyncHttpxClient

_http: DefaultAsyncHttpxClient | None = None
"""One HTTP connection pool for every game this process plays."""


def guess(secret: int, reply: str) -> str:
    """The game's answer to the reply's first number."""
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
    text, previous = f"guess the number from 0 to {n - 1} in {turns} turns", None
    for _ in range(turns):
        r = await client.responses.create(
            model="flotilla", input=text, previous_response_id=previous, max_output_tokens=1
        )
        answer = guess(secret, r.output_text)
        if answer == "correct":
            return {"reward": 1.0}
        text, previous = answer, r.id
    return {"reward": 0.0}


if __name__ == "__main__":
    import asyncio

    result = asyncio.run(play(os.environ["OPENAI_BASE_URL"], json.loads(sys.argv[1])))
    print(json.dumps(result))
