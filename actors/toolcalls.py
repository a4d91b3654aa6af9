"""Tool calls in generated text, by the model family's convention.

A chat template tells which convention its family was trained on (``tool_style``);
``parse_tool_calls`` splits a generated reply into its content and its calls in the
OpenAI shape (``{"type": "function", "function": {"name", "arguments"}}``).
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["parse_tool_calls", "tool_style"]

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def _call(name: Any, arguments: Any) -> dict[str, Any]:
    if not isinstance(name, str):
        raise ValueError(f"tool call name must be a string, got {name!r}")
    if not isinstance(arguments, dict):
        arguments = {} if arguments is None else arguments
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def parse_tool_calls(text: str, style: str) -> tuple[str, list[dict[str, Any]]]:
    """Split generated ``text`` into (content, tool calls) by the family's ``style``.

    Styles: ``"hermes"`` (Qwen2.5/Qwen3: ``<tool_call>{"name", "arguments"}</tool_call>``
    blocks), ``"mistral"`` (``[TOOL_CALLS]`` then a JSON list), ``"llama3"`` (the whole
    reply is ``{"name", "parameters"}`` JSON, optionally after ``<|python_tag|>``),
    ``"none"``.  A block that is not valid JSON stays in the content (the model's
    mistake is the environment's to judge), never raises.
    """
    calls: list[dict[str, Any]] = []
    if style == "hermes":

        def take(m: re.Match[str]) -> str:
            try:
                obj = json.loads(m.group(1))
                calls.append(_call(obj.get("name"), obj.get("arguments", obj.get("parameters"))))
                return ""
            except (ValueError, AttributeError):
                return m.group(0)

        content = _HERMES.sub(take, text)
        return (content.strip() if calls else content), calls
    if style == "mistral" and "[TOOL_CALLS]" in text:
        head, _, tail = text.partition("[TOOL_CALLS]")
        try:
            objs = json.loads(tail.strip())
            objs = objs if isinstance(objs, list) else [objs]
            calls = [_call(o.get("name"), o.get("arguments")) for o in objs]
            return head.strip(), calls
        except (ValueError, AttributeError):
            return text, []
    if style == "llama3":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if body.startswith("{"):
            try:
                obj = json.loads(body)
                if isinstance(obj, dict) and "name" in obj:
                    return "", [_call(obj["name"], obj.get("parameters", obj.get("arguments")))]
            except ValueError:
                pass
    return text, calls


def tool_style(template: str) -> str:
    """The tool-call convention a chat template uses, for ``parse_tool_calls``."""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or '"parameters"' in template:
        return "llama3"
    return "none"
