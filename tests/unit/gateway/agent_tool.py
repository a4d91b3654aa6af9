"""A harness written only against the official openai client: ask, call the tool the
model asks for, send its result back, read the answer (streamed), print the reward."""

import json
import sys

from openai import OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]


def main() -> None:
    task = json.loads(sys.argv[1])
    client = OpenAI(max_retries=0)  # OPENAI_BASE_URL / OPENAI_API_KEY come from the gateway
    messages = [{"role": "user", "content": task["question"]}]
    first = client.chat.completions.create(model="flotilla", messages=messages, tools=TOOLS, max_tokens=64)
    msg = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls", first
    messages.append(msg.model_dump(exclude_none=True))
    for call in msg.tool_calls:
        args = json.loads(call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})
    text = ""
    for chunk in client.chat.completions.create(
        model="flotilla", messages=messages, tools=TOOLS, max_tokens=64, stream=True
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    if task.get("rewrite"):
        # Rewrite history: drop the tool exchange and ask again (a new segment).
        messages = [messages[0], {"role": "user", "content": "Again?"}]
        text = (
            client.chat.completions.create(model="flotilla", messages=messages, tools=TOOLS, max_tokens=64)
            .choices[0]
            .message.content
            or ""
        )
    print("the agent says:", text)
    print(json.dumps({"reward": 1.0 if "5" in text else 0.0}))


if __name__ == "__main__":
    main()
