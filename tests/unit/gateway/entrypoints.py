"""In-process harnesses (``entrypoint``) for the gateway tests, written against the openai client."""

from __future__ import annotations

from openai import AsyncOpenAI


async def three_turns(base_url: str, task: dict) -> dict:
    """Three chat turns echoing the history back; the reward is the completion tokens the
    server reported, so the test can compare it with the trajectory."""
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    try:
        messages = [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": task["question"]},
        ]
        total = 0
        for turn in range(3):
            r = await client.chat.completions.create(model="m", messages=messages, max_tokens=6)
            total += r.usage.completion_tokens
            messages += [
                {"role": "assistant", "content": r.choices[0].message.content or ""},
                {"role": "user", "content": f"and turn {turn}?"},
            ]
        return {"reward": float(total)}
    finally:
        await client.close()
